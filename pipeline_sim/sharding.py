"""Data parallelism on JAX's own sharding: a ``data`` mesh axis over every device of every host.

An emulated pipeline step is one SPMD program: shard every micro-batch along its batch axis over a
1-D ``Mesh`` of the devices (``shard_batches``), replicate the pipeline state (``replicate``) or
shard it (``fsdp``), and ``jax.jit`` partitions the computation, the gradient all-reduce included.
On one device nothing changes. Arrays are assembled with ``jax.make_array_from_callback`` from a
value every process holds whole (batches are a pure function of seed and step), so the same code
runs on one host or on several after ``jax.distributed.initialize()``: each process supplies only
the shards of its own devices.
"""

from __future__ import annotations

from collections.abc import Sequence

import jax
import numpy as np
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

DATA = "data"


def data_mesh(devices: Sequence[jax.Device] | None = None) -> Mesh:
  """A 1-D mesh with axis ``"data"`` over ``devices`` (default: every device of every process)."""
  devices = list(jax.devices() if devices is None else devices)
  return Mesh(np.asarray(devices), (DATA,))


def _put(x, sharding):
  """``x`` (the same whole value in every process) as a global array with ``sharding``."""
  host = np.asarray(x)
  return jax.make_array_from_callback(host.shape, sharding, lambda index: host[index])


def replicate(tree, mesh: Mesh):
  """``tree`` placed whole on every device of ``mesh``."""
  return jax.tree.map(lambda x: _put(x, NamedSharding(mesh, P())), tree)


def fsdp(tree, mesh: Mesh):
  """``tree`` sharded along ``data`` (fully sharded data parallelism): each leaf split on its largest
  axis that the device count divides, a leaf with no such axis replicated. ``jit`` then gathers
  each weight where a step needs it and keeps the state (weights, optimizer states, rings) at
  about 1/D of its size per device."""
  def put(x):
    spec = [None] * x.ndim
    axes = [a for a in sorted(range(x.ndim), key=lambda a: -x.shape[a]) if x.shape[a] % mesh.size == 0]
    if axes and mesh.size > 1:
      spec[axes[0]] = DATA
    return _put(x, NamedSharding(mesh, P(*spec)))

  return jax.tree.map(put, tree)


def shard_batches(batches, mesh: Mesh, batch_axis: int = 1):
  """Arrays with a batch axis (default axis 1: ``(steps, batch, ...)`` chunks) split over ``data``.

  Raises:
    ValueError: the batch size is not divisible by the number of devices.
  """
  def put(x):
    if x.shape[batch_axis] % mesh.size:
      raise ValueError(f"batch size {x.shape[batch_axis]} is not divisible by the {mesh.size} devices "
                       "of the data mesh")
    spec = [None] * x.ndim
    spec[batch_axis] = DATA
    return _put(x, NamedSharding(mesh, P(*spec)))

  return jax.tree.map(put, batches)

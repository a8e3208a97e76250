"""Data parallelism on JAX's own sharding: a ``data`` mesh axis over the local devices.

An emulated pipeline step is one SPMD program: shard every micro-batch along its batch axis over a
1-D ``Mesh`` of the devices (``shard_batches``), replicate the pipeline state (``replicate``), and
``jax.jit`` partitions the computation, the gradient all-reduce included. On one device nothing
changes.
"""

from __future__ import annotations

from collections.abc import Sequence

import jax
import numpy as np
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

DATA = "data"


def data_mesh(devices: Sequence[jax.Device] | None = None) -> Mesh:
  """A 1-D mesh with axis ``"data"`` over ``devices`` (default: every local device)."""
  devices = list(jax.local_devices() if devices is None else devices)
  return Mesh(np.asarray(devices), (DATA,))


def replicate(tree, mesh: Mesh):
  """``tree`` placed whole on every device of ``mesh``."""
  return jax.device_put(tree, NamedSharding(mesh, P()))


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
    return jax.device_put(x, NamedSharding(mesh, P(*spec)))

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
    return jax.device_put(x, NamedSharding(mesh, P(*spec)))

  return jax.tree.map(put, batches)

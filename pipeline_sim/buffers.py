"""Ring buffers of pytrees: weight versions (stashing) and gradient FIFOs (stale gradients).

A buffer of depth ``d`` stores each leaf as a ``(d, *leaf.shape)`` array; version ``n`` lives in
slot ``n % d``. Reads and writes are ``dynamic_index``/``dynamic_update`` on the leading axis, so
a donated buffer is updated in place.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp


def ring_init(tree, depth: int):
  """A buffer whose ``depth`` slots all hold ``tree`` (so versions ``n < 0`` read as version 0)."""
  return jax.tree.map(lambda x: jnp.repeat(jnp.asarray(x)[None], depth, axis=0), tree)


def ring_read(buffer, slot):
  return jax.tree.map(lambda b: jax.lax.dynamic_index_in_dim(b, slot, 0, keepdims=False), buffer)


def ring_write(buffer, slot, tree):
  return jax.tree.map(
      lambda b, x: jax.lax.dynamic_update_index_in_dim(b, x.astype(b.dtype), slot, 0), buffer, tree)


def tree_bytes(tree) -> int:
  return sum(x.size * x.dtype.itemsize for x in jax.tree.leaves(tree))

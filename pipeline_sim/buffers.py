"""Ring buffers of pytrees: weight versions (stashing) and gradient FIFOs (stale gradients), and
the check that a donated state is not reused.

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



class Consuming:
  """``jax.jit(fn, donate_argnums=0)`` that refuses, by name, a state an earlier call consumed:
  each call donates its state (the buffers are updated in place), so only the state it returned is
  live. ``lower`` is the jitted function's."""

  def __init__(self, fn, where: str):
    self._jit, self._where = jax.jit(fn, donate_argnums=0), where

  def __call__(self, state, *args):
    if any(isinstance(x, jax.Array) and x.is_deleted() for x in jax.tree.leaves(state)):
      raise ValueError(f"{self._where}: this state was consumed by an earlier call (its buffers are "
                       "donated and updated in place); pass the state that call returned")
    return self._jit(state, *args)

  def lower(self, *args, **kwargs):
    return self._jit.lower(*args, **kwargs)

  def _cache_size(self) -> int:  # compiled programs so far (the tests' one-compile checks)
    return self._jit._cache_size()

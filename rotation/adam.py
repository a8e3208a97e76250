"""Adam as the paper writes it, the default inner optimizer of basis rotation."""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
import optax

from rotation.options import check_decay, check_dtype, compute_dtype
from rotation.plan import check_float_leaves


def scale_by_adam(b1: float = 0.9, b2: float = 0.999, eps: float = 1e-8, eps_root: float = 0.0,
                  mu_dtype: Any | None = None) -> optax.GradientTransformation:
  """Adam with the paper's bias correction, ``sqrt(1 - b2^t) / (1 - b1^t) * mu / (sqrt(nu + eps_root)
  + eps)``.

  This differs from ``optax.scale_by_adam`` (``mu_hat / (sqrt(nu_hat + eps_root) + eps)``) only in
  where ``eps`` sits relative to the bias correction: the paper's is optax's with ``eps`` scaled by
  ``sqrt(1 - b2^t)`` at step t, which optax's constant ``eps`` cannot express, so it is written out
  here. ``nu`` is kept in the gradient's (float32 or wider) dtype, ``mu`` in ``mu_dtype`` (default:
  the same); the state is ``optax.ScaleByAdamState`` (fields ``mu``, ``nu``).
  """
  check_decay("b1", b1)
  check_decay("b2", b2)
  mu_dtype = check_dtype("mu_dtype", mu_dtype)

  def init_fn(params):
    check_float_leaves(params)
    mu = jax.tree.map(lambda p: jnp.zeros_like(p, dtype=mu_dtype or compute_dtype(p)), params)
    nu = jax.tree.map(lambda p: jnp.zeros_like(p, dtype=compute_dtype(p)), params)
    return optax.ScaleByAdamState(jnp.zeros([], jnp.int32), mu, nu)

  def update_fn(updates, state, params=None):
    del params
    count = optax.safe_int32_increment(state.count)
    mu = jax.tree.map(lambda m, g: b1 * m.astype(compute_dtype(g)) + (1 - b1) * g, state.mu, updates)
    nu = jax.tree.map(lambda v, g: b2 * v + (1 - b2) * g * g, state.nu, updates)
    t = count.astype(jnp.float32)
    scale = jnp.sqrt(1 - b2**t) / (1 - b1**t)
    new = jax.tree.map(lambda g, m, v: (scale * m / (jnp.sqrt(v + eps_root) + eps)).astype(g.dtype),
                       updates, mu, nu)
    mu = jax.tree.map(lambda m, old: m.astype(old.dtype), mu, state.mu)
    return new, optax.ScaleByAdamState(count, mu, nu)

  return optax.GradientTransformation(init_fn, update_fn)

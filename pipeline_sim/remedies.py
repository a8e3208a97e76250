"""Delay compensation (DC-ASGD) as an optax wrapper around any optimizer.

Zheng et al., "Asynchronous Stochastic Gradient Descent with Delay Compensation", ICML 2017: a
gradient ``g`` computed at stale weights ``w_stale`` is corrected towards the current weights ``w``
with a diagonal approximation of the Hessian by the gradient's outer product,

    g_dc = g + lambda * g * g * (w - w_stale)                     (DC-ASGD-c, constant lambda)
    g_dc = g + lambda * g * g * (w - w_stale) / (sqrt(v) + eps)   (DC-ASGD-a, adaptive)

with ``v`` an exponential mean square of ``g`` (``v <- m v + (1 - m) g^2``, updated before use), and
then handed to the inner optimizer. The stale weights arrive as the extra argument
``stale_params`` of ``update`` (optax's extra-args convention); ``pipeline_sim.Pipeline`` passes the
weights each stage's gradient was computed at (the stash, or the predicted weights). Weight
prediction, the other remedy, is ``Pipeline(predict=...)``.
"""

from __future__ import annotations

from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import optax


class DelayCompensationState(NamedTuple):
  """State of ``dc_asgd``."""

  mean_square: Any  # the adaptive form's ``v``, shaped like the parameters; ``optax.EmptyState()`` else
  inner: Any  # the inner optimizer's state


def dc_asgd(inner: optax.GradientTransformation, lam: float, mean_square_decay: float | None = None,
            eps: float = 1e-7) -> optax.GradientTransformationExtraArgs:
  """``inner`` fed delay-compensated gradients (module docstring).

  Args:
    inner: any optax transformation (AdamW, Muon, basis rotation, a chain).
    lam: the compensation strength ``lambda >= 0``; 0 is ``inner`` exactly.
    mean_square_decay: ``None`` for the constant form; the decay ``m`` in ``[0, 1)`` of the
      adaptive form's mean square.
    eps: added to ``sqrt(v)`` in the adaptive form.

  ``update(grads, state, params, *, stale_params, **extra)`` needs ``params`` and ``stale_params``
  (the weights ``grads`` were computed at); the other extra arguments go to ``inner``.
  """
  for name, value in (("lam", lam), ("eps", eps)):
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not value >= 0 \
        or value == float("inf"):
      raise ValueError(f"dc_asgd: {name} must be a finite number >= 0, got {value!r}")
  if mean_square_decay is not None and not (isinstance(mean_square_decay, (int, float))
                                            and 0 <= mean_square_decay < 1):
    raise ValueError(f"dc_asgd: mean_square_decay must be None or in [0, 1), got {mean_square_decay!r}")
  inner = optax.with_extra_args_support(inner)

  def init(params):
    v = (jax.tree.map(jnp.zeros_like, params) if mean_square_decay is not None else optax.EmptyState())
    return DelayCompensationState(v, inner.init(params))

  def update(grads, state, params=None, *, stale_params=None, **extra):
    if params is None or stale_params is None:
      raise ValueError("dc_asgd needs the current weights (params) and the weights the gradients were "
                       "computed at (stale_params=...): run it in pipeline_sim.Pipeline with mode "
                       "'weight_stashing' or 'no_stashing', or pass stale_params yourself")
    v = state.mean_square
    if mean_square_decay is None:
      scale = jax.tree.map(lambda g: jnp.asarray(lam, g.dtype), grads)
    else:
      m = mean_square_decay
      v = jax.tree.map(lambda v_, g: m * v_ + (1 - m) * g * g, v, grads)
      scale = jax.tree.map(lambda v_, g: (lam / (jnp.sqrt(v_) + eps)).astype(g.dtype), v, grads)
    corrected = jax.tree.map(lambda g, c, w, w0: g + c * g * g * (w - w0).astype(g.dtype),
                             grads, scale, params, stale_params)
    updates, inner_state = inner.update(corrected, state.inner, params, **extra)
    return updates, DelayCompensationState(v, inner_state)

  return optax.GradientTransformationExtraArgs(init, update)

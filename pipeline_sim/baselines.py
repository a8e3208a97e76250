"""The paper's baselines as optax transformations (docs/algorithms.md section 4), usable anywhere.

- ``pipedream``: AdamW (b = (0.9, 0.999), wd 0.01); with weight stashing this is PipeDream, at
  P = 1 the synchronous baseline.
- ``pipedream_lr``: PipeDream with PipeMare's per-stage learning-rate rescheduling
  ``lr_k(t) = lr(t) / tau_k ** (1 - min(t / T_c, 1))`` (unchanged where ``tau_k = 0``).
- ``nesterov``: what Ajanthan et al. (2025) run: PyTorch-style NAdam with decoupled weight decay,
  the momentum-decay schedule ``mu_t = b1 (1 - 0.5 * 0.96 ** (t * psi))`` and the running product of
  ``mu`` in the bias correction (optax's ``nadamw`` is a different formula).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import NamedTuple

import jax
import jax.numpy as jnp
import optax

from pipeline_sim.delays import StageOptimizers


def pipedream(learning_rate: optax.ScalarOrSchedule, b1: float = 0.9, b2: float = 0.999,
              eps: float = 1e-8, weight_decay: float = 0.01) -> optax.GradientTransformation:
  """AdamW with PipeDream's settings (the staleness comes from the pipeline, not from here)."""
  return optax.adamw(learning_rate, b1, b2, eps, weight_decay=weight_decay)


def pipemare_lr_schedule(schedule: optax.ScalarOrSchedule, delay: int,
                         transition_steps: int) -> optax.Schedule:
  """``lr(t) / delay ** (1 - min(t / T_c, 1))``; ``lr(t)`` itself when ``delay == 0``."""
  if delay < 0 or transition_steps < 1:
    raise ValueError(f"need delay >= 0 and transition_steps >= 1, got {delay}, {transition_steps}")
  base = schedule if callable(schedule) else (lambda t: schedule)
  if delay == 0:
    return base

  def lr(t):
    frac = jnp.minimum(jnp.asarray(t, jnp.float32) / transition_steps, 1.0)
    return base(t) / jnp.asarray(float(delay)) ** (1.0 - frac)

  return lr


def pipedream_lr(learning_rate: optax.ScalarOrSchedule, delay: int, transition_steps: int,
                 b1: float = 0.9, b2: float = 0.999, eps: float = 1e-8,
                 weight_decay: float = 0.01) -> optax.GradientTransformation:
  """AdamW for one stage of delay ``delay`` with PipeMare's learning-rate rescheduling."""
  return pipedream(pipemare_lr_schedule(learning_rate, delay, transition_steps), b1, b2, eps,
                   weight_decay)


class ScaleByNadamTorchState(NamedTuple):
  """State of ``scale_by_nadam_torch``."""

  count: jax.Array  # int32 (): steps taken.
  mu_product: jax.Array  # float32 (): running product of the momentum coefficients mu_1..mu_t.
  mu: optax.Updates  # first moment (PyTorch's exp_avg), float32, shaped like the params.
  nu: optax.Updates  # second moment (exp_avg_sq), float32, shaped like the params.


def scale_by_nadam_torch(b1: float = 0.99, b2: float = 0.999, eps: float = 1e-8,
                         momentum_decay: float = 0.004) -> optax.GradientTransformation:
  """PyTorch's NAdam direction (to be scaled by ``-lr``).

  ``mu_t = b1 (1 - 0.5 * 0.96 ** (t psi))``, ``P_t = prod_{s <= t} mu_s``,
  ``d = (1 - mu_t) / (1 - P_t) * g / D + mu_{t+1} / (1 - P_t mu_{t+1}) * m / D`` with
  ``D = sqrt(v / (1 - b2^t)) + eps``.

  References:
    torch.optim.NAdam; Dozat, Incorporating Nesterov Momentum into Adam, 2016.
  """

  def init_fn(params):
    zeros = lambda p: jnp.zeros(p.shape, jnp.float32)
    return ScaleByNadamTorchState(jnp.zeros([], jnp.int32), jnp.ones([], jnp.float32),
                                  jax.tree.map(zeros, params), jax.tree.map(zeros, params))

  def update_fn(updates, state, params=None):
    del params
    count = optax.safe_int32_increment(state.count)
    t = count.astype(jnp.float32)
    mu_t = b1 * (1 - 0.5 * 0.96 ** (t * momentum_decay))
    mu_next = b1 * (1 - 0.5 * 0.96 ** ((t + 1) * momentum_decay))
    prod = state.mu_product * mu_t
    m = jax.tree.map(lambda m, g: b1 * m + (1 - b1) * g, state.mu, updates)
    v = jax.tree.map(lambda v, g: b2 * v + (1 - b2) * g * g, state.nu, updates)
    c_grad, c_mom = (1 - mu_t) / (1 - prod), mu_next / (1 - prod * mu_next)
    bc2 = 1 - b2**t

    def direction(g, m, v):
      denom = jnp.sqrt(v / bc2) + eps
      return ((c_grad * g + c_mom * m) / denom).astype(g.dtype)

    return jax.tree.map(direction, updates, m, v), ScaleByNadamTorchState(count, prod, m, v)

  return optax.GradientTransformation(init_fn, update_fn)


def nesterov(learning_rate: optax.ScalarOrSchedule, b1: float = 0.99, b2: float = 0.999,
             eps: float = 1e-8, weight_decay: float = 0.01,
             momentum_decay: float = 0.004) -> optax.GradientTransformation:
  """The Nesterov baseline: PyTorch NAdam with decoupled weight decay (``decoupled_weight_decay``)."""
  return optax.chain(scale_by_nadam_torch(b1, b2, eps, momentum_decay),
                     optax.add_decayed_weights(weight_decay),
                     optax.scale_by_learning_rate(learning_rate))


def nesterov_stage_b1(base: float, delay: int, num_stages: int) -> float:
  """Optional per-stage momentum ``b1_k = b + tau_k (0.99 - b) / P``."""
  return base + delay * (0.99 - base) / num_stages


def per_stage(make: Callable[[int], optax.GradientTransformation], num_stages: int,
              clip_norm: float | None = None, delays=None):
  """One optimizer per stage, ``make(k)``, optionally behind per-stage gradient-norm clipping.

  ``delays``: the stage delays ``make`` built them for (``stage_delays(P, schedule)``), recorded in
  the ``StageOptimizers`` returned, so that a pipeline with another schedule refuses them."""
  opts = [make(k) for k in range(num_stages)]
  if clip_norm is not None:
    opts = [optax.chain(optax.clip_by_global_norm(clip_norm), o) for o in opts]
  if delays is None:
    return opts
  if len(delays) != num_stages:
    raise ValueError(f"got {len(delays)} stage delays {tuple(delays)} for {num_stages} stages")
  return StageOptimizers(opts, delays)

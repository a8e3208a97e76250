"""Methods of the study: per-stage optax optimizers for every baseline and rotation variant."""

from __future__ import annotations

import dataclasses

import jax
import optax

import pipeline_sim as ps
import rotation
from experiments.harness import model as model_lib


@dataclasses.dataclass(frozen=True)
class Method:
  """How one method builds its optimizer for pipeline stage k.

  Attributes:
    kind: ``adamw``, ``pipemare`` (PipeDream-LR), ``nadam`` (Nesterov), ``muon`` or ``rotation``.
    source, geometry: rotation variant (docs/algorithms.md section 2).
    refresh_every: uniform basis refresh period.
    allocation: stage-aware refresh allocation (``uniform``, ``proportional``, ``reverse``).
    first_order_step: first-order unilateral refresh, ``paper`` or ``power``.
    bases: ``estimated`` (the paper's) or ``random`` (Adam in fixed Haar-random orthogonal bases,
      drawn per stage from the run's seed): an ablation of the mechanism.
    freeze_after: last step with a basis refresh (``None``: all run long): a frozen eigenbasis.
    stage_lr: rotation with PipeDream-LR's (PipeMare's) per-stage learning-rate correction.
    stage_b1: Nesterov with per-stage momentum ``b1_k = 0.9 + tau_k (0.99 - 0.9) / P``.
  """

  kind: str
  source: str = "second"
  geometry: str = "bilateral"
  refresh_every: int = 10
  allocation: str = "uniform"
  first_order_step: str = "paper"
  bases: str = "estimated"
  freeze_after: int | None = None
  stage_lr: bool = False
  stage_b1: bool = False


METHODS = {
    "pipedream": Method("adamw"),
    "pipedream-lr": Method("pipemare"),
    "nesterov": Method("nadam"),
    "rotation": Method("rotation"),  # second-order source, bilateral (the paper's default)
    "rotation-2nd-uni": Method("rotation", geometry="unilateral"),
    "rotation-1st-bi": Method("rotation", source="first"),
    "rotation-1st-uni": Method("rotation", source="first", geometry="unilateral"),  # the paper's step
    "rotation-1st-uni-power": Method("rotation", source="first", geometry="unilateral",
                                     first_order_step="power"),
    "rotation-sa": Method("rotation", allocation="proportional"),
    "rotation-sa-reverse": Method("rotation", allocation="reverse"),
    "rotation-T100": Method("rotation", refresh_every=100),
    # Basis ablations (issue: the mechanism): Adam in a random fixed basis, and the eigenbasis
    # estimated over the first 100 steps (10 refreshes) and then frozen.
    "rotation-random": Method("rotation", bases="random"),
    "rotation-frozen": Method("rotation", freeze_after=100),
    # The paper's appendix comparisons: rotation with the stage-wise rate correction, and Nesterov
    # with more momentum on the more delayed stages (meant for the no-stashing case).
    "rotation-lr": Method("rotation", stage_lr=True),
    "nesterov-stage": Method("nadam", stage_b1=True),
    # Muon (optax.contrib.muon) on the kernels rotation rotates, its Adam (Nesterov) elsewhere; consistent RMS
    # scaling (0.2) gives its updates AdamW's size, so that the two share a learning-rate scale.
    "muon": Method("muon"),
}


BASELINES = ("pipedream", "pipedream-lr", "nesterov")  # the asynchronous baselines of the study
VARIANTS = ("rotation", "rotation-2nd-uni", "rotation-1st-bi", "rotation-1st-uni")  # the 2 x 2 taxonomy
ALLOCATIONS = ("rotation", "rotation-sa", "rotation-sa-reverse")  # uniform, proportional, reverse refresh
BASES = ("rotation-random", "rotation-frozen", "rotation")  # random, frozen, refreshed bases


def check_method(name: str) -> Method:
  if name not in METHODS:
    raise ValueError(f"unknown method {name!r}; choose from {sorted(METHODS)}")
  return METHODS[name]


def schedule(config) -> optax.Schedule:
  """Linear warm-up from ``config.warmup_start`` over ``config.warmup_fraction`` of the steps, then
  cosine decay to ``config.final_lr_fraction`` of the peak ``config.lr`` (the paper's schedule)."""
  warmup = config.warmup_steps if config.warmup_steps is not None else int(config.steps *
                                                                           config.warmup_fraction)
  warmup = max(1, warmup)
  return optax.warmup_cosine_decay_schedule(config.warmup_start, config.lr, warmup,
                                            max(config.steps, warmup + 1),
                                            config.final_lr_fraction * config.lr)


def stage_optimizers(config) -> list[optax.GradientTransformation]:
  """One optimizer per stage for ``config`` (an ``experiments.harness.runs.RunConfig``), each behind
  per-stage gradient clipping at ``config.clip_norm``."""
  method = check_method(config.method)
  lr, wd, num_stages = schedule(config), config.weight_decay, config.stages
  delays = ps.stage_delays(num_stages, config.schedule)
  period = config.refresh_every or method.refresh_every
  periods = rotation.stage_aware_refresh(delays, period, method.allocation)

  b2 = config.b2
  b1 = lambda own: own if config.b1 is None else config.b1  # the method's own unless set

  def make(k):
    transition = max(1, int(config.pipemare_fraction * config.steps))
    if method.kind == "adamw":
      return ps.pipedream(lr, b1=b1(0.9), b2=b2, weight_decay=wd)
    if method.kind == "pipemare":
      return ps.pipedream_lr(lr, delays[k], transition, b1=b1(0.9), b2=b2, weight_decay=wd)
    if method.kind == "nadam":
      own = ps.nesterov_stage_b1(0.9, delays[k], num_stages) if method.stage_b1 else 0.99
      return ps.nesterov(lr, b1=b1(own), b2=b2, weight_decay=wd)
    if method.kind == "muon":
      dims = lambda params: jax.tree.map(
          lambda m: optax.contrib.MuonDimensionNumbers() if m else None, model_lib.rotation_mask(params))
      return optax.contrib.muon(lr, beta=b1(0.95), weight_decay=wd, adam_b1=b1(0.9), adam_b2=b2,
                                adam_weight_decay=wd, muon_weight_dimension_numbers=dims,
                                consistent_rms=0.2)
    bases = (jax.random.fold_in(jax.random.key(config.seed), k) if method.bases == "random" else None)
    rate = ps.pipemare_lr_schedule(lr, delays[k], transition) if method.stage_lr else lr
    return rotation.basis_rotation(rate, b1=b1(0.9), b2=b2, shampoo_beta=config.shampoo_beta,
                                   weight_decay=wd, source=method.source,
                                   geometry=method.geometry, refresh_every=periods[k],
                                   first_order_step=method.first_order_step,
                                   weight_dimension_numbers=model_lib.rotation_dims,
                                   block_size=None, max_precond_dim=10_000, bases=bases,
                                   freeze_after=method.freeze_after)

  return ps.per_stage(make, num_stages, clip_norm=config.clip_norm)

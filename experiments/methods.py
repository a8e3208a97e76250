"""Methods of the study: per-stage optax optimizers for every baseline and rotation variant."""

from __future__ import annotations

import dataclasses

import optax

import pipeline_sim as ps
import rotation
from experiments import model as M


@dataclasses.dataclass(frozen=True)
class Method:
  """How one method builds its optimizer for pipeline stage k.

  Attributes:
    kind: ``adamw``, ``pipemare`` (PipeDream-LR), ``nadam`` (Nesterov) or ``rotation``.
    source, geometry: rotation variant (SPEC section 2).
    refresh_every: uniform basis refresh period.
    allocation: stage-aware refresh allocation (``uniform``, ``proportional``, ``reverse``).
  """

  kind: str
  source: str = "second"
  geometry: str = "bilateral"
  refresh_every: int = 10
  allocation: str = "uniform"


METHODS = {
    "pipedream": Method("adamw"),
    "pipedream-lr": Method("pipemare"),
    "nesterov": Method("nadam"),
    "rotation": Method("rotation"),  # second-order source, bilateral (the paper's default)
    "rotation-2nd-uni": Method("rotation", geometry="unilateral"),
    "rotation-1st-bi": Method("rotation", source="first"),
    "rotation-1st-uni": Method("rotation", source="first", geometry="unilateral"),
    "rotation-sa": Method("rotation", allocation="proportional"),
    "rotation-sa-reverse": Method("rotation", allocation="reverse"),
    "rotation-T100": Method("rotation", refresh_every=100),
}


def check_method(name: str) -> Method:
  if name not in METHODS:
    raise ValueError(f"unknown method {name!r}; choose from {sorted(METHODS)}")
  return METHODS[name]


def schedule(peak: float, steps: int, warmup_fraction: float) -> optax.Schedule:
  """Linear warm-up from 1e-7, then cosine decay to 0.1 x peak (SPEC section 2)."""
  warmup = max(1, int(steps * warmup_fraction))
  return optax.warmup_cosine_decay_schedule(1e-7, peak, warmup, max(steps, warmup + 1), 0.1 * peak)


def stage_optimizers(name: str, peak_lr: float, num_stages: int, steps: int,
                     warmup_fraction: float = 0.05, pipemare_fraction: float = 0.25,
                     clip_norm: float = 1.0, weight_decay: float = 0.01):
  """One optimizer per stage, each behind per-stage gradient clipping at ``clip_norm``."""
  method = check_method(name)
  lr = schedule(peak_lr, steps, warmup_fraction)
  delays = ps.stage_delays(num_stages)
  periods = rotation.stage_aware_refresh(delays, method.refresh_every, method.allocation)

  def make(k):
    if method.kind == "adamw":
      return ps.pipedream(lr, weight_decay=weight_decay)
    if method.kind == "pipemare":
      return ps.pipedream_lr(lr, delays[k], max(1, int(pipemare_fraction * steps)),
                             weight_decay=weight_decay)
    if method.kind == "nadam":
      return ps.nesterov(lr, weight_decay=weight_decay)
    return rotation.basis_rotation(lr, weight_decay=weight_decay, source=method.source,
                                   geometry=method.geometry, refresh_every=periods[k],
                                   mask=M.rotation_mask)

  return ps.per_stage(make, num_stages, clip_norm=clip_norm)

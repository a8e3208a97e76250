"""Methods of the study: per-stage optax optimizers for every baseline and rotation variant."""

from __future__ import annotations

import dataclasses
import hashlib
import json
from typing import Any

import jax
import optax

import pipeline_sim as ps
import rotation
from experiments.harness import learning_rates
from experiments.harness import model as model_lib
from rotation.options import statistics_decay


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
    memory: ``uniform`` (every stage's statistics decay the run's ``shampoo_beta``, default ``b2``)
      or ``stage`` (``rotation.stage_aware_decay`` of the stages' delays from that base: a
      staleness-aware statistics memory).
    shampoo_beta: the statistics decay of a rotation method that fixes one (``None``: the run's
      ``shampoo_beta``, default ``b2``); the run's ``shampoo_beta``, when given, still wins.
    remedy: ``None``, ``predict`` (weight prediction, ``Pipeline(predict=...)`` at the run's
      ``predict_scale``) or ``dc`` (``pipeline_sim.dc_asgd`` around the optimizer at the run's
      ``dc_lambda``, adaptive form): the field's staleness remedies on top of the method.
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
  memory: str = "uniform"
  shampoo_beta: float | None = None
  remedy: str | None = None


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
    # Beyond the paper: each stage's statistics memory shortened by its delay (base memory / (1 + tau_k)).
    "rotation-stage-decay": Method("rotation", memory="stage"),
    # The uniform statistics decay the protocol's rule chose from the estimation-lag study at
    # T = 2,400 (docs/results/lag), fixed before any run of this method.
    "rotation-fast": Method("rotation", shampoo_beta=0.95),
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


# The field's staleness remedies on the optimizers the remedies study compares: "<method>+predict"
# (weight prediction) and "<method>+dc" (delay compensation); emulated pipelines only.
REMEDIES = ("predict", "dc")
REMEDY_BASES = ("pipedream", "muon", "rotation")
METHODS.update({f"{base}+{remedy}": dataclasses.replace(METHODS[base], remedy=remedy)
                for base in REMEDY_BASES for remedy in REMEDIES})
PREDICT_SCALE = 1.0  # default predict_scale: extrapolate over the whole delay at the last step's rate
DC_LAMBDA, DC_DECAY = 1.0, 0.95  # default dc_lambda; the adaptive form's mean-square decay (the paper's)

BASELINES = ("pipedream", "pipedream-lr", "nesterov")  # the asynchronous baselines of the study
VARIANTS = ("rotation", "rotation-2nd-uni", "rotation-1st-bi", "rotation-1st-uni")  # the 2 x 2 taxonomy
ALLOCATION_METHODS = ("rotation", "rotation-sa", "rotation-sa-reverse")  # uniform, proportional, reverse
BASES = ("rotation-random", "rotation-frozen", "rotation")  # random, frozen, refreshed bases


# The constants each kind's builder uses, part of what a method name means (``definition``).
KIND_CONSTANTS = {
    "adamw": {"b1": 0.9},
    "pipemare": {"b1": 0.9},
    "nadam": {"b1": 0.99, "stage_b1_base": 0.9},
    "muon": {"beta": 0.95, "adam_b1": 0.9, "consistent_rms": 0.2},
    "rotation": {"b1": 0.9, "block_size": None, "max_precond_dim": 10_000},
}
REMEDY_CONSTANTS = {"predict": {"predict_scale": PREDICT_SCALE},
                    "dc": {"dc_lambda": DC_LAMBDA, "dc_decay": DC_DECAY}}


def definition(name: str) -> dict:
  """What the method ``name`` means, resolved: its ``Method``'s fields with its kind's constants
  (and its remedy's), as plain values. A run's identity holds it wherever it is not the meaning the
  name had when the published runs were made (``PUBLISHED``)."""
  m = check_method(name)
  return {**dataclasses.asdict(m), **KIND_CONSTANTS[m.kind], **REMEDY_CONSTANTS.get(m.remedy, {})}


def digest(name: str) -> str:
  return hashlib.sha256(json.dumps(definition(name), sort_keys=True).encode()).hexdigest()[:16]


# What every method name meant when the committed runs were trained (``digest`` of its definition, on
# December 7 2026). Never edit an entry: a method whose definition no longer matches its digest here
# (an edited method) puts its whole definition into its runs' identities, so that its runs get new
# folders and no finished run is reused under another meaning; a method added later has no entry
# and always does. Runs of the names below, as defined below, keep the identities they were
# published with.
PUBLISHED = {
    "pipedream": "b6b98247517884d3", "pipedream-lr": "5594aa8eba588de2", "nesterov": "3fdf1a22dcad5aa7",
    "rotation": "dcfb420f4c6cb375", "rotation-2nd-uni": "f16f3ce76f1c5b63",
    "rotation-1st-bi": "bdae833c42af2e10", "rotation-1st-uni": "92f69f7a3ae7dc40",
    "rotation-1st-uni-power": "22878059c02a9f83", "rotation-sa": "a0fa3e67e4ebcaf3",
    "rotation-sa-reverse": "2af244f47a4016c2", "rotation-T100": "4b0ea7a4b7d72f53",
    "rotation-stage-decay": "7e2965c0633b6dc8", "rotation-fast": "f8b8c8b56802ab37",
    "rotation-random": "9ddfe3d21cec547e", "rotation-frozen": "bc7da5ed065c2134",
    "rotation-lr": "a01f97eee21ac86a", "nesterov-stage": "237119035985db29", "muon": "087bec3c68d9baff",
    "pipedream+predict": "5fca38bc7d0cad87", "pipedream+dc": "d4b740f02cff2c24",
    "muon+predict": "2ccaf0b792490251", "muon+dc": "77b2acedb59cd18b",
    "rotation+predict": "8f7c9a2ed14548e4", "rotation+dc": "9014401751da1d62",
}


def reference(name: str) -> str:
  """The method whose P = 1 run stands for ``name``'s: a method whose only change acts on the delay
  has nothing to act on at P = 1. A staleness remedy's (``<optimizer>+predict``, ``<optimizer>+dc``)
  is its optimizer's run (mathematically the same run; compiled as another program, it agrees to
  round-off only); a staleness-aware memory's (``memory="stage"``: an undelayed stage keeps the base
  decay) is the same method with the uniform memory, ``rotation-stage-decay``'s ``rotation``'s."""
  method = check_method(name)
  if method.remedy:
    return name.partition("+")[0]
  if method.memory == "stage":
    uniform = dataclasses.replace(method, memory="uniform")
    return next((n for n, m in METHODS.items() if m == uniform), name)
  return name


def check_method(name: str) -> Method:
  if name not in METHODS:
    raise ValueError(f"unknown method {name!r}; choose from {sorted(METHODS)}")
  return METHODS[name]


def run_optimizers(config) -> ps.StageOptimizers:
  """One optimizer per stage for ``config`` (an ``experiments.harness.runs.RunConfig``), each behind
  per-stage gradient clipping at ``config.clip_norm``: the method's kind's builder (``BUILDERS``)
  for each stage, built for the delays of the run's schedule (a pipeline of another refuses them)."""
  method = check_method(config.method)
  delays = ps.stage_delays(config.stages, config.schedule)
  stage = BuildContext(config, method, learning_rates.warmup_cosine(config), delays)
  build = BUILDERS[method.kind]
  if method.remedy == "dc":
    lam = DC_LAMBDA if config.dc_lambda is None else config.dc_lambda
    return ps.per_stage(lambda k: ps.dc_asgd(build(stage, k), lam, DC_DECAY), config.stages,
                        clip_norm=config.clip_norm, delays=delays)
  return ps.per_stage(lambda k: build(stage, k), config.stages, clip_norm=config.clip_norm, delays=delays)


def predict_scale(config) -> float | None:
  """The ``Pipeline(predict=...)`` scale of a run: ``None`` unless its method predicts."""
  if check_method(config.method).remedy != "predict":
    return None
  return PREDICT_SCALE if config.predict_scale is None else config.predict_scale


@dataclasses.dataclass(frozen=True)
class BuildContext:
  """What every builder reads: the run's config, its method, its learning-rate schedule and the
  stages' delays."""

  config: Any
  method: Method
  lr: optax.Schedule
  delays: tuple

  def b1(self, own: float) -> float:
    """The method's own first-moment decay unless the run sets one for every method."""
    return own if self.config.b1 is None else self.config.b1

  @property
  def transition(self) -> int:  # PipeDream-LR's T_c in steps
    return max(1, int(self.config.pipemare_fraction * self.config.steps))


def _adamw(s: BuildContext, k: int):
  own = KIND_CONSTANTS["adamw"]
  return ps.pipedream(s.lr, b1=s.b1(own["b1"]), b2=s.config.b2, weight_decay=s.config.weight_decay)


def _pipemare(s: BuildContext, k: int):
  own = KIND_CONSTANTS["pipemare"]
  return ps.pipedream_lr(s.lr, s.delays[k], s.transition, b1=s.b1(own["b1"]), b2=s.config.b2,
                         weight_decay=s.config.weight_decay)


def _nadam(s: BuildContext, k: int):
  own = KIND_CONSTANTS["nadam"]
  b1 = (ps.nesterov_stage_b1(own["stage_b1_base"], s.delays[k], s.config.stages) if s.method.stage_b1
        else own["b1"])
  return ps.nesterov(s.lr, b1=s.b1(b1), b2=s.config.b2, weight_decay=s.config.weight_decay)


def _muon(s: BuildContext, k: int):
  own, wd = KIND_CONSTANTS["muon"], s.config.weight_decay
  dims = lambda params: jax.tree.map(
      lambda m: optax.contrib.MuonDimensionNumbers() if m else None, model_lib.rotation_mask(params))
  return optax.contrib.muon(s.lr, beta=s.b1(own["beta"]), weight_decay=wd, adam_b1=s.b1(own["adam_b1"]),
                            adam_b2=s.config.b2, adam_weight_decay=wd, muon_weight_dimension_numbers=dims,
                            consistent_rms=own["consistent_rms"])


def _rotation(s: BuildContext, k: int):
  c, m = s.config, s.method
  periods = rotation.stage_aware_refresh(s.delays, c.refresh_every or m.refresh_every, m.allocation)
  bases = jax.random.fold_in(jax.random.key(c.seed), k) if m.bases == "random" else None
  rate = ps.pipemare_lr_schedule(s.lr, s.delays[k], s.transition) if m.stage_lr else s.lr
  shampoo_beta = m.shampoo_beta if c.shampoo_beta is None else c.shampoo_beta
  if m.memory == "stage":  # a number per stage, from the library's own resolution of the default
    shampoo_beta = rotation.stage_aware_decay(s.delays, statistics_decay(shampoo_beta, c.b2))[k]
  own = KIND_CONSTANTS["rotation"]
  return rotation.basis_rotation(rate, b1=s.b1(own["b1"]), b2=c.b2, shampoo_beta=shampoo_beta,
                                 weight_decay=c.weight_decay, source=m.source, geometry=m.geometry,
                                 refresh_every=periods[k], first_order_step=m.first_order_step,
                                 weight_dimension_numbers=model_lib.rotation_dims,
                                 block_size=own["block_size"], max_precond_dim=own["max_precond_dim"],
                                 ablation=rotation.Ablation(bases, m.freeze_after))


# The registry of kinds: a new method is an entry of METHODS (a Method of an existing kind) or a new
# kind here, ``(BuildContext, stage index) -> optax.GradientTransformation``.
BUILDERS = {"adamw": _adamw, "pipemare": _pipemare, "nadam": _nadam, "muon": _muon, "rotation": _rotation}

"""Methods of the study: the names of the optimizer values (``experiments.harness.optimizers``) the
study runs (``METHODS``, ``spec``), how a run's value is written in its name and identity
(``settings``, ``record``), and a run's per-stage optax optimizers (``run_optimizers``)."""

from __future__ import annotations

import dataclasses
import hashlib
import json

import pipeline_sim as ps
from experiments.harness import learning_rates
from experiments.harness.optimizers import (
  AdamW,
  Context,
  DelayCompensation,
  Muon,
  Nesterov,
  Predict,
  Rotation,
  Spec,
  describe,
  value_of,
)

_VALUES = {
    "pipedream": AdamW(),
    "pipedream-lr": AdamW(stage_lr=True),
    "nesterov": Nesterov(),
    "rotation": Rotation(),  # second-order source, bilateral (the paper's default)
    "rotation-2nd-uni": Rotation(geometry="unilateral"),
    "rotation-1st-bi": Rotation(source="first"),
    "rotation-1st-uni": Rotation(source="first", geometry="unilateral"),  # the paper's step
    "rotation-1st-uni-power": Rotation(source="first", geometry="unilateral", first_order_step="power"),
    "rotation-sa": Rotation(allocation="proportional"),
    "rotation-sa-reverse": Rotation(allocation="reverse"),
    "rotation-T100": Rotation(refresh_every=100),
    # Beyond the paper: each stage's statistics memory shortened by its delay (base memory / (1 + tau_k)).
    "rotation-stage-decay": Rotation(memory="stage"),
    # The uniform statistics decay the protocol's rule chose from the estimation-lag study at
    # T = 2,400 (docs/results/lag), fixed before any run of this method.
    "rotation-fast": Rotation(shampoo_beta=0.95),
    # Basis ablations (issue: the mechanism): Adam in a random fixed basis, and the eigenbasis
    # estimated over the first 100 steps (10 refreshes) and then frozen.
    "rotation-random": Rotation(bases="random"),
    "rotation-frozen": Rotation(freeze_after=100),
    # The paper's appendix comparisons: rotation with the stage-wise rate correction, and Nesterov
    # with more momentum on the more delayed stages (meant for the no-stashing case).
    "rotation-lr": Rotation(stage_lr=True),
    "nesterov-stage": Nesterov(stage_b1=0.9),
    "muon": Muon(),
}


# The field's staleness remedies on the optimizers the remedies study compares: "<method>+predict"
# (weight prediction) and "<method>+dc" (delay compensation); emulated pipelines only.
REMEDIES = ("predict", "dc")
REMEDY_BASES = ("pipedream", "muon", "rotation")
_WRAPPERS = {"predict": Predict, "dc": DelayCompensation}
_VALUES.update({f"{base}+{remedy}": _WRAPPERS[remedy](optimizer=_VALUES[base])
                for base in REMEDY_BASES for remedy in REMEDIES})
# Each value named by its key: the label of its runs (``Spec.name``).
METHODS = {name: dataclasses.replace(value, name=name) for name, value in _VALUES.items()}
PREDICT_SCALE, DC_LAMBDA = Predict.scale, DelayCompensation.lam  # the remedies' default settings

BASELINES = ("pipedream", "pipedream-lr", "nesterov")  # the asynchronous baselines of the study
VARIANTS = ("rotation", "rotation-2nd-uni", "rotation-1st-bi", "rotation-1st-uni")  # the 2 x 2 taxonomy
ALLOCATION_METHODS = ("rotation", "rotation-sa", "rotation-sa-reverse")  # uniform, proportional, reverse
BASES = ("rotation-random", "rotation-frozen", "rotation")  # random, frozen, refreshed bases


def definition(name: str) -> dict:
  """What the method ``name`` means, resolved: its value as plain data (``optimizers.describe``). A
  run's identity holds it wherever it is not the meaning the name had when the published runs were
  made (``PUBLISHED``)."""
  return describe(check_method(name))


def digest(name: str) -> str:
  return hashlib.sha256(json.dumps(definition(name), sort_keys=True).encode()).hexdigest()[:16]


# What every method name meant when the committed runs were trained (``digest`` of its definition;
# written again on December 7 2026 when the methods became values, ``experiments.harness.optimizers``:
# every method's optimizers updated as before to the bit, docs/names.md). Never edit an entry: a
# method whose definition no longer matches its digest here (an edited method) puts its whole
# definition into its runs' identities, so that its runs get new folders and no finished run is
# reused under another meaning; a method added later has no entry and always does. Runs of the
# names below, as defined below, keep the identities they were published with.
PUBLISHED = {
    "pipedream": "30ec06bfae084b02", "pipedream-lr": "5723b402cd73277d", "nesterov": "830790c3940b2750",
    "rotation": "b5bd5a4573553220", "rotation-2nd-uni": "a4cfa0d7c1a96ab7",
    "rotation-1st-bi": "cb4edcfb343d2c1d", "rotation-1st-uni": "c4e3454211664fa9",
    "rotation-1st-uni-power": "0af14d89c9568af6", "rotation-sa": "df4b9d9db68f9828",
    "rotation-sa-reverse": "e28ac0a2d732793b", "rotation-T100": "2a3f0fe3f675fdc0",
    "rotation-stage-decay": "ddf4d4ea9ef31a12", "rotation-fast": "894dcc155b2cf5e3",
    "rotation-random": "27f39df4e89b8308", "rotation-frozen": "f25831b432435242",
    "rotation-lr": "1304181398dc22b3", "nesterov-stage": "b8574c785ed8f3f6", "muon": "5142b05d6e358498",
    "pipedream+predict": "346e0aa695d95ef0", "pipedream+dc": "e74f9a9cd1c0b029",
    "muon+predict": "4d8ce0b51585f00f", "muon+dc": "b8fe5bad3707bf73",
    "rotation+predict": "a0e85519040ba590", "rotation+dc": "ea289b7c8da173de",
}


def reference(name: str) -> str:
  """The method whose P = 1 run stands for ``name``'s: a method whose only change acts on the delay
  has nothing to act on at P = 1. A staleness remedy's (``<optimizer>+predict``, ``<optimizer>+dc``)
  is its optimizer's run (mathematically the same run; compiled as another program, it agrees to
  round-off only); a staleness-aware memory's (``memory="stage"``: an undelayed stage keeps the base
  decay) is the same method with the uniform memory, ``rotation-stage-decay``'s ``rotation``'s."""
  value = check_method(name)
  if value.remedy:
    return name.partition("+")[0]
  if getattr(value, "memory", None) == "stage":
    uniform = describe(dataclasses.replace(value, memory="uniform"))
    return next((n for n, m in METHODS.items() if describe(m) == uniform), name)
  return name


def check_method(name: str) -> Spec:
  """The method's value, named ``name`` (an entry added to ``METHODS`` unnamed is named here)."""
  if name not in METHODS:
    raise ValueError(f"unknown method {name!r}; choose from {sorted(METHODS)}")
  value = METHODS[name]
  return value if value.name == name else dataclasses.replace(value, name=name)


# What a run setting that a method does not take means, for the error that names both (any other:
# "<setting>=<value> does not reach method <name>").
_NOT_TAKEN = {
    "shampoo_beta": "shampoo_beta is the decay of rotation's statistics; method {method!r} has none",
    "refresh_every": "refresh_every is rotation's basis refresh period; method {method!r} has none",
    "predict_scale": "predict_scale={value!r} needs a '+predict' method (method {method!r})",
    "dc_lambda": "dc_lambda={value!r} needs a '+dc' method (method {method!r})",
}


def spec(method: str, **settings) -> Spec:
  """The method's value with the run settings ``settings`` (``optimizers.SETTINGS``; ``None``:
  the method's own) applied, each checked once: a ``ValueError`` naming the setting and the method."""
  try:
    return check_method(method).overridden(**settings)
  except KeyError as e:
    name = e.args[0]
    text = _NOT_TAKEN.get(name, "{name}={value!r} does not reach method {method!r}")
    raise ValueError(text.format(name=name, method=method, value=settings[name])) from None


def settings(value: Spec) -> dict | None:
  """The run settings that make ``value`` from the method it is named for (``Spec.settings_from``:
  ``None`` where they agree), or ``None`` for a value no method's settings make (one built by hand)."""
  return value.settings_from(check_method(value.name)) if value.name in METHODS else None


def published(value: Spec) -> bool:
  """Whether ``value`` is a method's, with run settings applied, as the method meant when the
  published runs were made (``PUBLISHED``): then its method's name and settings identify its runs,
  as they did every published run's; else its identity holds the whole value."""
  return settings(value) is not None and PUBLISHED.get(value.name) == digest(value.name)


# How every run recorded its optimizer before the optimizer was a value: the method's name and these
# settings (``None``: the method's own; b2 always as a number). The run name and identity of every
# committed run are written from them.
RECORDED = {"b2": 0.999, "b1": None, "shampoo_beta": None, "refresh_every": None, "predict_scale": None,
            "dc_lambda": None}


def record(value: Spec) -> dict:
  """A run's optimizer as it is recorded in its config: ``method`` (its label), the run settings
  (``RECORDED``'s, and any later one that is set) and ``optimizer``, the whole value
  (``describe``, with its ``name``), from which ``recorded`` rebuilds it."""
  own = settings(value) or {}
  out = {"method": value.label, **RECORDED, **{k: v for k, v in own.items() if v is not None}}
  out["b2"] = value.setting("b2") if value.takes("b2") else RECORDED["b2"]
  return {**out, "optimizer": {"name": value.name, **describe(value)}}


def recorded(config: dict) -> Spec:
  """The optimizer of a recorded config (``record``): its whole value where it was recorded, else
  (runs recorded before) its method's with the recorded settings applied."""
  if "optimizer" in config:
    return value_of(config["optimizer"])
  name = config.get("method", "pipedream")
  value = check_method(name)
  return spec(name, **{k: config.get(k) for k in value.run_settings()})


def run_optimizers(config) -> ps.StageOptimizers:
  """One optimizer per stage for ``config`` (an ``experiments.harness.runs.RunConfig``), each behind
  per-stage gradient clipping at ``config.clip_norm``: its value's ``build`` for each stage, for the
  delays of the run's schedule (a pipeline of another refuses them)."""
  value = config.optimizer
  delays = ps.stage_delays(config.stages, config.schedule)
  context = Context(learning_rates.warmup_cosine(config), delays, config.weight_decay, config.seed,
                    max(1, int(config.pipemare_fraction * config.steps)))
  return ps.per_stage(lambda k: value.build(context, k), config.stages, clip_norm=config.clip_norm,
                      delays=delays)


def predict_scale(config) -> float | None:
  """The ``Pipeline(predict=...)`` scale of a run: ``None`` unless its method predicts."""
  value = config.optimizer
  return value.scale if value.remedy == "predict" else None

"""The study's optimizers as values: one frozen dataclass per kind, each checking its ranges once,
when it is constructed, with ``build(context, k)`` returning pipeline stage k's
``optax.GradientTransformation``.

``experiments.harness.methods.METHODS`` names the values the study runs; a run holds its optimizer
as a value (``RunConfig.optimizer``): a method's, with the run's settings applied (``overridden``:
the sweep's ``--b1``, ``--b2``, ``--shampoo-beta``, ``--refresh-every``, ``--predict-scale``,
``--dc-lambda``), and records it as plain data (``describe``, read back by ``value_of``). A new method
is one entry of ``METHODS``; a new knob is a ``knob`` field of its kind and a flag row
(``experiments.sweep.flags``).
"""

from __future__ import annotations

import abc
import dataclasses
import math
from typing import ClassVar

import jax
import optax

import pipeline_sim as ps
import rotation
from experiments.harness import model as model_lib
from rotation.options import FIRST_ORDER_STEPS, GEOMETRIES, SOURCES, check_decay, statistics_decay

MEMORIES = ("uniform", "stage")
BASES = ("estimated", "random")

# The published run settings' forms in run names (``None``: in the run's identity only), in the
# order names write them: those of the names every committed run was published under. A later
# setting is written ``-<setting><value>`` after them (``name_format``).
NAME_FORMATS = {"b2": "-b2_{:g}", "b1": "-b1_{:g}", "shampoo_beta": "-sb{:g}", "refresh_every": None,
                "predict_scale": "-ps{:g}", "dc_lambda": "-dc{:g}"}
SETTING = "setting"  # a field's metadata key: the run setting that sets it
ALWAYS = "always"  # a field's metadata key: its setting is written even at the method's value
LATER = "added_later"  # a field's metadata key: added after runs were recorded (``describe``)


def name_format(setting: str) -> str | None:
  """How run names write the run setting ``setting`` (``NAME_FORMATS``)."""
  return NAME_FORMATS.get(setting, f"-{setting}{{}}")


def knob(setting: str, default, always: bool = False, later: bool = False):
  """A field that the run setting ``setting`` (the sweep's flag of that name) sets; the fields of
  several kinds, or two of one kind (Muon's momenta), may answer to one setting. ``always``: the setting
  is part of every run's name and identity, its method's own value too (a remedy's strength, which
  its study varies). ``later``: a field added after runs were recorded, left out of ``describe``
  while at its default (which must mean what the kind did before it), so that it changes no
  recorded method's meaning."""
  return dataclasses.field(default=default, metadata={SETTING: setting, ALWAYS: always, LATER: later})


def added_later(default):
  """A field that no run setting sets, added after runs were recorded (``knob``'s ``later``)."""
  return dataclasses.field(default=default, metadata={LATER: True})


@dataclasses.dataclass(frozen=True)
class Context:
  """What every stage's optimizer is built from beside its value: the run's learning-rate
  schedule, the stages' delays (the pipeline's schedule's), the run's weight decay and seed, and
  PipeDream-LR's transition ``T_c`` in steps."""

  lr: optax.Schedule
  delays: tuple
  weight_decay: float
  seed: int
  transition: int


def _unit(name: str, value, low_open: bool = False) -> None:
  """``value`` in [0, 1) (``low_open``: (0, 1))."""
  ok = isinstance(value, (int, float)) and not isinstance(value, bool) and (
      0 < value < 1 if low_open else 0 <= value < 1)
  if not ok:
    raise ValueError(f"{name} must be in {'(0, 1)' if low_open else '[0, 1)'}, got {value!r}")


def _choice(name: str, value, choices) -> None:
  if value not in choices:
    raise ValueError(f"unknown {name} {value!r}; choose from {choices}")


def _scale(name: str, value) -> None:
  number = isinstance(value, (int, float)) and not isinstance(value, bool)
  if not number or not (value >= 0 and math.isfinite(value)):
    raise ValueError(f"{name}={value!r} needs a finite value >= 0")


@dataclasses.dataclass(frozen=True)
class Spec(abc.ABC):
  """What every kind has: ``KIND`` (its name in a run's record), ``remedy`` (the staleness remedy a
  wrapper adds, else ``None``), ``base`` (the optimizer under any remedy), its ``knob`` fields (the
  run settings it takes) and ``name``: the method it was made from (``methods.METHODS``), the label
  of its runs; it keeps it when a run's settings are applied, and ``describe`` leaves it out (it
  names the value, it is not part of what it does)."""

  KIND: ClassVar[str] = ""
  remedy: ClassVar[str | None] = None
  name: str = dataclasses.field(default="", kw_only=True)

  @property
  def base(self) -> Spec:
    return self

  @property
  def label(self) -> str:
    """What a run of this value is called: its method's name, else its kind's."""
    return self.name or self.KIND

  def _own_knobs(self, setting: str) -> tuple:
    """The fields of this value itself that the run setting ``setting`` sets."""
    return tuple(f for f in dataclasses.fields(self) if f.metadata.get(SETTING) == setting)

  def _holder(self, setting: str) -> Spec:
    """The value whose fields ``setting`` sets: this one (a remedy: else the optimizer it wraps)."""
    return self

  def _knobs(self, setting: str) -> tuple:
    return self._holder(setting)._own_knobs(setting)

  def always(self, setting: str) -> bool:
    """Whether ``setting`` is written even at its method's value (``knob``)."""
    return any(f.metadata.get(ALWAYS) for f in self._knobs(setting))

  def takes(self, setting: str) -> bool:
    """Whether the run setting ``setting`` reaches this optimizer."""
    return bool(self._knobs(setting))

  def run_settings(self) -> tuple:
    """The run settings this optimizer takes, in ``SETTINGS``' order (a kind's own after them)."""
    return _ordered(f.metadata[SETTING] for f in dataclasses.fields(self) if SETTING in f.metadata)

  def setting_values(self, setting: str) -> tuple:
    """The values of every field that the run setting ``setting`` sets (Muon's ``b1``: two)."""
    holder = self._holder(setting)
    return tuple(getattr(holder, f.name) for f in holder._own_knobs(setting))

  def setting(self, setting: str):
    """The value of the run setting ``setting`` in this optimizer (``None``: it takes none)."""
    values = self.setting_values(setting)
    return values[0] if values else None

  def overridden(self, **settings) -> Spec:
    """This value with the run's settings that are not ``None`` applied; a setting it does not
    take is a ``KeyError`` naming it."""
    changes = {}
    for name, value in settings.items():
      if value is None:
        continue
      if not self.takes(name):
        raise KeyError(name)
      changes.update(dict.fromkeys((f.name for f in self._knobs(name)), value))
    return dataclasses.replace(self, **changes) if changes else self

  def settings_from(self, method: Spec) -> dict | None:
    """The run settings that make ``method`` this value (each ``None`` where they agree), or
    ``None`` where no settings do."""
    same = lambda s: self.setting_values(s) == method.setting_values(s) and not self.always(s)
    settings = {s: None if same(s) else self.setting(s) for s in self.run_settings()}
    return settings if method.overridden(**settings) == self else None

  @abc.abstractmethod
  def build(self, context: Context, k: int) -> optax.GradientTransformation:
    """Pipeline stage k's optimizer."""


@dataclasses.dataclass(frozen=True)
class AdamW(Spec):
  """PipeDream's AdamW; ``stage_lr``: PipeDream-LR (PipeMare's per-stage learning-rate correction,
  ``pipeline_sim.pipedream_lr``)."""

  KIND: ClassVar[str] = "adamw"
  b1: float = knob("b1", 0.9)
  b2: float = knob("b2", 0.999)
  stage_lr: bool = False

  def __post_init__(self):
    _unit("b1", self.b1)
    _unit("b2", self.b2, low_open=True)

  def build(self, context: Context, k: int):
    c = context
    if self.stage_lr:
      return ps.pipedream_lr(c.lr, c.delays[k], c.transition, b1=self.b1, b2=self.b2,
                             weight_decay=c.weight_decay)
    return ps.pipedream(c.lr, b1=self.b1, b2=self.b2, weight_decay=c.weight_decay)


@dataclasses.dataclass(frozen=True)
class Nesterov(Spec):
  """The Nesterov baseline (PyTorch NAdam, ``pipeline_sim.nesterov``); ``stage_b1``: the base of
  the per-stage momentum ``b1_k = base + tau_k (0.99 - base) / P`` (``None``: ``b1`` at every
  stage). A run's ``b1`` sets every stage's momentum."""

  KIND: ClassVar[str] = "nesterov"
  b1: float = knob("b1", 0.99)
  b2: float = knob("b2", 0.999)
  stage_b1: float | None = None

  def overridden(self, **settings) -> Spec:
    out = super().overridden(**settings)
    return out if settings.get("b1") is None else dataclasses.replace(out, stage_b1=None)

  def __post_init__(self):
    _unit("b1", self.b1)
    _unit("b2", self.b2, low_open=True)
    if self.stage_b1 is not None:
      _unit("stage_b1", self.stage_b1)

  def build(self, context: Context, k: int):
    c = context
    b1 = self.b1 if self.stage_b1 is None else ps.nesterov_stage_b1(self.stage_b1, c.delays[k], len(c.delays))
    return ps.nesterov(c.lr, b1=b1, b2=self.b2, weight_decay=c.weight_decay)


@dataclasses.dataclass(frozen=True)
class Muon(Spec):
  """Muon (``optax.contrib.muon``) on the kernels rotation rotates, its AdamW elsewhere; consistent
  RMS scaling gives its updates AdamW's size, so that the two share a learning-rate scale. A run's
  ``b1`` sets both momenta."""

  KIND: ClassVar[str] = "muon"
  beta: float = knob("b1", 0.95)
  adam_b1: float = knob("b1", 0.9)
  b2: float = knob("b2", 0.999)
  consistent_rms: float = 0.2

  def __post_init__(self):
    _unit("beta", self.beta)
    _unit("adam_b1", self.adam_b1)
    _unit("b2", self.b2, low_open=True)

  def build(self, context: Context, k: int):
    wd = context.weight_decay
    dims = lambda params: jax.tree.map(
        lambda m: optax.contrib.MuonDimensionNumbers() if m else None, model_lib.rotation_mask(params))
    return optax.contrib.muon(context.lr, beta=self.beta, weight_decay=wd, adam_b1=self.adam_b1,
                              adam_b2=self.b2, adam_weight_decay=wd, muon_weight_dimension_numbers=dims,
                              consistent_rms=self.consistent_rms)


@dataclasses.dataclass(frozen=True)
class Rotation(Spec):
  """Basis rotation (``rotation.basis_rotation``; docs/algorithms.md section 2).

  Attributes:
    b1, b2: its moments' decays.
    shampoo_beta: the decay of its ``L``, ``R`` statistics; ``None`` follows ``b2``
      (``statistics_decay``, resolved by ``rotation.options.statistics_decay``).
    source, geometry, first_order_step: the variant (the paper's 2 x 2 taxonomy).
    refresh_every: the basis refresh period; ``allocation``: the stage-aware rule
      (``rotation.stage_aware_refresh``: ``uniform``, ``proportional``, ``reverse``).
    bases: ``estimated`` (the paper's) or ``random`` (Adam in fixed Haar-random orthogonal bases,
      drawn per stage from the run's seed): an ablation of the mechanism.
    freeze_after: the last step with a refresh (``None``: all run long): a frozen eigenbasis.
    stage_lr: with PipeDream-LR's per-stage learning-rate correction.
    memory: ``uniform`` (every stage's statistics decay ``statistics_decay``) or ``stage``
      (``rotation.stage_aware_decay`` of the stages' delays from it).
    block_size, max_precond_dim: the library's blocking of long sides.
  """

  KIND: ClassVar[str] = "rotation"
  b1: float = knob("b1", 0.9)
  b2: float = knob("b2", 0.999)
  shampoo_beta: float | None = knob("shampoo_beta", None)
  source: str = "second"
  geometry: str = "bilateral"
  first_order_step: str = "paper"
  refresh_every: int = knob("refresh_every", 10)
  allocation: str = "uniform"
  bases: str = "estimated"
  freeze_after: int | None = None
  stage_lr: bool = False
  memory: str = "uniform"
  block_size: int | None = None
  max_precond_dim: int = 10_000

  def __post_init__(self):
    _unit("b1", self.b1)
    _unit("b2", self.b2, low_open=True)
    if self.shampoo_beta is not None:
      check_decay("shampoo_beta", self.shampoo_beta)  # the library's range, [0, 1)
    _choice("source", self.source, SOURCES)
    _choice("geometry", self.geometry, GEOMETRIES)
    _choice("first_order_step", self.first_order_step, FIRST_ORDER_STEPS)
    _choice("allocation", self.allocation, rotation.ALLOCATIONS)
    _choice("bases", self.bases, BASES)
    _choice("memory", self.memory, MEMORIES)
    period = self.refresh_every
    if isinstance(period, bool) or not isinstance(period, int) or period < 1:
      raise ValueError(f"refresh_every must be an int >= 1, got {self.refresh_every!r}")

  @property
  def statistics_decay(self) -> float:
    return statistics_decay(self.shampoo_beta, self.b2)

  def build(self, context: Context, k: int):
    c = context
    periods = rotation.stage_aware_refresh(c.delays, self.refresh_every, self.allocation)
    bases = jax.random.fold_in(jax.random.key(c.seed), k) if self.bases == "random" else None
    rate = ps.pipemare_lr_schedule(c.lr, c.delays[k], c.transition) if self.stage_lr else c.lr
    decay = self.shampoo_beta  # None: the library follows b2 (as statistics_decay)
    if self.memory == "stage":  # a number per stage
      decay = rotation.stage_aware_decay(c.delays, self.statistics_decay)[k]
    return rotation.basis_rotation(rate, b1=self.b1, b2=self.b2, shampoo_beta=decay,
                                   weight_decay=c.weight_decay, source=self.source, geometry=self.geometry,
                                   refresh_every=periods[k], first_order_step=self.first_order_step,
                                   weight_dimension_numbers=model_lib.rotation_dims,
                                   block_size=self.block_size, max_precond_dim=self.max_precond_dim,
                                   ablation=rotation.Ablation(bases, self.freeze_after))


@dataclasses.dataclass(frozen=True)
class _Remedy(Spec):
  """A staleness remedy around another optimizer: the run settings it does not take go to it."""

  optimizer: Spec

  def __post_init__(self):
    if not isinstance(self.optimizer, Spec):
      raise ValueError(f"a staleness remedy wraps an optimizer value, got optimizer={self.optimizer!r}")

  @property
  def base(self) -> Spec:
    return self.optimizer.base

  def _holder(self, setting: str) -> Spec:
    return self if self._own_knobs(setting) else self.optimizer._holder(setting)

  def run_settings(self) -> tuple:
    return _ordered((*Spec.run_settings(self), *self.optimizer.run_settings()))

  def overridden(self, **settings) -> Spec:
    own = {k: v for k, v in settings.items() if self._own_knobs(k)}
    inner = self.optimizer.overridden(**{k: v for k, v in settings.items() if k not in own})
    return dataclasses.replace(super().overridden(**own), optimizer=inner)


@dataclasses.dataclass(frozen=True)
class Predict(_Remedy):
  """Weight prediction (``Pipeline(predict=scale)``, emulated pipelines only) over ``optimizer``:
  the pipeline extrapolates the stashed weights; the optimizer is the one it wraps."""

  KIND: ClassVar[str] = "predict"
  remedy: ClassVar[str] = "predict"
  # 1: extrapolate over the whole delay at the last step's rate
  scale: float = knob("predict_scale", 1.0, always=True)

  def __post_init__(self):
    super().__post_init__()
    _scale("predict_scale", self.scale)

  def build(self, context: Context, k: int):
    return self.optimizer.build(context, k)


@dataclasses.dataclass(frozen=True)
class DelayCompensation(_Remedy):
  """DC-ASGD's delay compensation (``pipeline_sim.dc_asgd``, adaptive form) around ``optimizer``."""

  KIND: ClassVar[str] = "dc"
  remedy: ClassVar[str] = "dc"
  lam: float = knob("dc_lambda", 1.0, always=True)
  decay: float = 0.95  # the adaptive form's mean-square decay (the paper's)

  def __post_init__(self):
    super().__post_init__()
    _scale("dc_lambda", self.lam)
    _unit("decay", self.decay)

  @property
  def scale(self) -> float:
    """Its one setting, lambda (as ``Predict.scale`` is prediction's)."""
    return self.lam

  def build(self, context: Context, k: int):
    return ps.dc_asgd(self.optimizer.build(context, k), self.lam, self.decay)


KINDS = {kind.KIND: kind for kind in (AdamW, Nesterov, Muon, Rotation, Predict, DelayCompensation)}
# Every run setting some kind takes (``knob``), the published ones first, in ``NAME_FORMATS``' order.
_KNOBS = [f.metadata[SETTING] for kind in KINDS.values() for f in dataclasses.fields(kind)
          if SETTING in f.metadata]
SETTINGS = tuple(dict.fromkeys([*NAME_FORMATS, *_KNOBS]))


def _ordered(settings) -> tuple:
  """``settings`` once each, in ``SETTINGS``' order, any other after them."""
  settings = set(settings)
  return tuple(s for s in SETTINGS if s in settings) + tuple(sorted(settings - set(SETTINGS)))


def describe(spec: Spec) -> dict:
  """A value as plain data: its kind and its fields, a wrapped optimizer described alike; ``name``
  and the fields added later that are at their default are left out (``knob``)."""
  out = {"kind": spec.KIND}
  for f in dataclasses.fields(spec):
    value = getattr(spec, f.name)
    if f.name == "name" or (f.metadata.get(LATER) and value == f.default):
      continue
    out[f.name] = describe(value) if isinstance(value, Spec) else value
  return out


def value_of(described: dict) -> Spec:
  """The value that ``describe`` wrote (with ``name``, where it holds one)."""
  fields = dict(described)
  kind = fields.pop("kind", None)
  if kind not in KINDS:
    raise ValueError(f"unknown optimizer kind {kind!r}; choose from {sorted(KINDS)}")
  if "optimizer" in fields:
    fields["optimizer"] = value_of(fields["optimizer"])
  return KINDS[kind](**fields)

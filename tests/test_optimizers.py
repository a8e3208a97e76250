"""experiments/harness/optimizers.py: a run's optimizer is a value that checks itself once, takes
the run's settings by name and records what it means."""

import dataclasses
import json

import pytest

from experiments.harness import methods
from experiments.harness import optimizers as opt
from experiments.harness.config import RunConfig, optimizer_of, record, recorded
from experiments.harness.methods import spec


@pytest.mark.parametrize("make,match", [
    (lambda: opt.AdamW(b1=1.0), r"b1 must be in \[0, 1\), got 1.0"),
    (lambda: opt.AdamW(b2=0.0), r"b2 must be in \(0, 1\), got 0.0"),
    (lambda: opt.Nesterov(stage_b1=-0.1), r"stage_b1 must be in \[0, 1\)"),
    (lambda: opt.Muon(beta=1.5), r"beta must be in \[0, 1\), got 1.5"),
    (lambda: opt.Rotation(shampoo_beta=1.0), r"shampoo_beta must be in \[0, 1\), got 1.0"),
    (lambda: opt.Rotation(source="third"), "unknown source 'third'"),
    (lambda: opt.Rotation(allocation="even"), "unknown allocation 'even'"),
    (lambda: opt.Rotation(refresh_every=0), "refresh_every must be an int >= 1, got 0"),
    (lambda: opt.Predict(opt.AdamW(), scale=-1.0), r"predict_scale=-1.0 needs a finite value >= 0"),
    (lambda: opt.DelayCompensation(opt.AdamW(), lam=float("inf")), r"dc_lambda=inf needs a finite value"),
    (lambda: opt.Predict("pipedream"), "wraps an optimizer value, got optimizer='pipedream'"),
])
def test_each_value_checks_its_ranges_when_constructed(make, match):
  with pytest.raises(ValueError, match=match):
    make()


def test_the_runs_settings_go_to_the_fields_they_mean():
  assert opt.Muon().overridden(b1=0.5, b2=0.99) == opt.Muon(beta=0.5, adam_b1=0.5, b2=0.99)
  # a run's b1 is every stage's momentum: the per-stage rule gives way
  assert opt.Nesterov(stage_b1=0.9).overridden(b1=0.8) == opt.Nesterov(b1=0.8, stage_b1=None)
  assert opt.Nesterov(stage_b1=0.9).overridden(b1=None, b2=0.99) == opt.Nesterov(b2=0.99, stage_b1=0.9)
  wrapped = opt.DelayCompensation(opt.Rotation()).overridden(dc_lambda=0.5, shampoo_beta=0.9)
  assert wrapped == opt.DelayCompensation(opt.Rotation(shampoo_beta=0.9), lam=0.5)
  assert wrapped.base == opt.Rotation(shampoo_beta=0.9) and wrapped.remedy == "dc"
  with pytest.raises(KeyError, match="shampoo_beta"):
    opt.AdamW().overridden(shampoo_beta=0.9)


def test_a_methods_value_resolves_its_defaults_once_and_names_what_it_cannot_take():
  decay = lambda method, **settings: spec(method, **settings).statistics_decay
  assert decay("rotation") == 0.999 and decay("rotation", b2=0.99) == 0.99  # follows b2
  assert decay("rotation-fast", b2=0.99) == 0.95 and decay("rotation-fast", shampoo_beta=0.9) == 0.9
  assert spec("muon+predict", predict_scale=0.5) == opt.Predict(opt.Muon(), scale=0.5, name="muon+predict")
  for method, kw, match in (("pipedream", dict(refresh_every=5), "refresh_every is rotation's basis refresh "
                             "period; method 'pipedream' has none"),
                            ("muon", dict(shampoo_beta=0.9), "method 'muon' has none"),
                            ("rotation+dc", dict(predict_scale=1.0), r"needs a '\+predict' method"),
                            ("adam", {}, "unknown method 'adam'")):
    with pytest.raises(ValueError, match=match):
      spec(method, **kw)
  with pytest.raises(ValueError, match="optimizer must be an optimizer value.*got 'rotation'"):
    RunConfig(optimizer="rotation")


def test_a_run_records_its_value_and_reads_it_back():
  """``record`` writes the method's name, its settings and the whole value; ``recorded`` rebuilds
  the value from it, and a run recorded before (name and settings only) from its method."""
  values = (spec("muon+predict", predict_scale=0.5), spec("nesterov-stage", b1=0.9),
            spec("rotation", b2=0.99), opt.Rotation(geometry="unilateral", block_size=64),
            spec("pipedream+dc", dc_lambda=1.0), spec("muon", b1=0.95))
  for value in values:
    config = RunConfig(optimizer=value, stages=4)
    stored = json.loads(json.dumps(record(config)))
    assert recorded(stored) == config and optimizer_of(stored) == value
    assert stored["method"] == value.label
    assert stored["optimizer"] == {"name": value.name, **opt.describe(value)}
    if value.name:  # a method's: as runs were recorded before the value, name and settings only
      before = {k: v for k, v in stored.items() if k != "optimizer"}
      assert recorded(before) == config
  assert record(RunConfig(optimizer=values[0]))["predict_scale"] == 0.5
  assert record(RunConfig(optimizer=values[1]))["b1"] == 0.9
  assert record(RunConfig(optimizer=values[2]))["b2"] == 0.99
  # Muon's b1 sets two momenta: 0.95 is its own first one, not its second, so the setting shows
  muon = RunConfig(optimizer=values[-1])
  assert record(muon)["b1"] == 0.95 and "-b1_0.95_" in muon.name


def test_a_run_records_its_method_as_plain_data():
  described = opt.describe(methods.METHODS["rotation+dc"])
  assert described["kind"] == "dc" and described["optimizer"]["kind"] == "rotation"
  assert described["optimizer"]["refresh_every"] == 10 and described["lam"] == 1.0
  assert methods.definition("nesterov-stage") == {"kind": "nesterov", "b1": 0.99, "b2": 0.999,
                                                  "stage_b1": 0.9}


def test_a_new_method_is_one_entry(monkeypatch):
  monkeypatch.setitem(methods.METHODS, "rotation-unilateral-fast",
                      opt.Rotation(geometry="unilateral", shampoo_beta=0.95))
  config = RunConfig(optimizer=spec("rotation-unilateral-fast", b1=0.8), stages=2)
  config.validate()
  assert len(methods.run_optimizers(config)) == 2
  assert "-b1_0.8_weight_stashing_rotation-unilateral-fast_P2_" in config.name


def test_a_field_added_later_keeps_every_recorded_meaning_at_its_default():
  @dataclasses.dataclass(frozen=True)
  class Later(opt.Rotation):
    damping: float = opt.added_later(0.0)

  assert opt.describe(Later()) == opt.describe(opt.Rotation())  # so no method's digest moves
  assert opt.describe(Later(damping=1e-3))["damping"] == 1e-3


def test_a_new_knob_is_one_field_and_its_runs_are_named_and_identified_by_it(monkeypatch):
  """A kind's new ``knob`` (with its flag row, tests/test_flags.py) is a run setting of every method
  of that kind: applied by name, written in run names after the published settings, and part of
  the identity (a method not published holds its whole value there)."""
  from experiments.harness.config import identity, run_name

  @dataclasses.dataclass(frozen=True)
  class Damped(opt.Rotation):
    damping: float = opt.knob("damping", 0.0, later=True)

  monkeypatch.setitem(methods.METHODS, "rotation-damped", Damped())
  damped = spec("rotation-damped", damping=0.5, b1=0.8)
  assert damped.damping == 0.5 and damped.b1 == 0.8 and damped.run_settings()[-1] == "damping"
  config = RunConfig(optimizer=damped, stages=4)
  assert "-b1_0.8-damping0.5_weight_stashing_rotation-damped_P4_" in config.name
  assert identity(config, "sha", 256)["optimizer"]["damping"] == 0.5
  undamped = RunConfig(optimizer=spec("rotation-damped", b1=0.8), stages=4)
  assert run_name(config, "sha", 256) != run_name(undamped, "sha", 256)
  with pytest.raises(ValueError, match="damping=0.5 does not reach method 'rotation'"):
    spec("rotation", damping=0.5)

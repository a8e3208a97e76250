"""experiments/harness/optimizers.py: a run's optimizer is a value that checks itself once, takes
the run's settings by name and records what it means."""

import dataclasses

import pytest

from experiments.harness import methods
from experiments.harness import optimizers as opt
from experiments.harness.config import RunConfig, optimizer_of


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


def test_a_runs_optimizer_resolves_its_defaults_once_and_names_what_it_cannot_take():
  assert RunConfig(method="rotation").optimizer.statistics_decay == 0.999  # follows b2
  assert RunConfig(method="rotation", b2=0.99).optimizer.statistics_decay == 0.99
  assert RunConfig(method="rotation-fast", b2=0.99).optimizer.statistics_decay == 0.95  # its own
  assert RunConfig(method="rotation-fast", shampoo_beta=0.9).optimizer.statistics_decay == 0.9  # the run's
  recorded = dataclasses.asdict(RunConfig(method="muon+predict", predict_scale=0.5))
  assert optimizer_of(recorded) == opt.Predict(opt.Muon(), scale=0.5)
  for kw, match in ((dict(method="pipedream", refresh_every=5), "refresh_every is rotation's basis refresh "
                     "period; method 'pipedream' has none"),
                    (dict(method="muon", shampoo_beta=0.9), "method 'muon' has none"),
                    (dict(method="rotation+dc", predict_scale=1.0), r"needs a '\+predict' method")):
    with pytest.raises(ValueError, match=match):
      RunConfig(**kw).validate()


def test_a_run_records_its_method_as_plain_data():
  described = opt.describe(methods.METHODS["rotation+dc"])
  assert described["kind"] == "dc" and described["optimizer"]["kind"] == "rotation"
  assert described["optimizer"]["refresh_every"] == 10 and described["lam"] == 1.0
  assert methods.definition("nesterov-stage") == {"kind": "nesterov", "b1": 0.99, "b2": 0.999,
                                                  "stage_b1": 0.9}


def test_a_new_method_is_one_entry(monkeypatch):
  monkeypatch.setitem(methods.METHODS, "rotation-unilateral-fast",
                      opt.Rotation(geometry="unilateral", shampoo_beta=0.95))
  config = RunConfig(method="rotation-unilateral-fast", stages=2)
  config.validate()
  assert len(methods.run_optimizers(config)) == 2
  assert "_rotation-unilateral-fast_P2_" in config.name

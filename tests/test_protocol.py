"""The protocol study's pieces: its settings share the sweep's runs, its rate choice, its summary."""


import numpy as np
import pytest

from experiments.harness import data as data_lib
from experiments.harness.config import run_name
from experiments.report import metrics, tables
from experiments.studies import protocol
from experiments.sweep import command as sweep
from experiments.sweep import presets


def _curve(slowdown, steps=1200):
  """A noise-free curve whose every target is reached ``slowdown`` times later (from 5.5 to 2.0)."""
  t = np.arange(1, steps + 1, dtype=float) / slowdown
  return 2.0 + 3.0 * np.exp(-t / 150.0) + 0.5 / (1 + t / 40.0)


def _result(method, stages, seed, curve, val=2.0, status="finished"):
  return {"config": {"method": method, "stages": stages, "seed": seed}, "losses": list(curve),
          "status": status, "val_losses": [5.0, val]}


def test_settings_are_the_sweeps_runs():
  # --warmup-delays K in the sweep and the protocol's "K tau_max" setting name the same run folders,
  # so either reuses the other's finished runs; b2 likewise.
  args = protocol.parse_args(["--warmup-delays", "4", "--b2", "0.99"])
  preset = presets.PRESETS["cpu"]
  study = protocol.settings(args, preset)
  assert [over for over, _ in study.values()] == [{}, {"warmup_steps": 60}, {"b2": 0.99}]
  ds = data_lib.Dataset(np.zeros(10, np.uint8), np.zeros(10, np.uint8), 256, "x", "0" * 64)
  for (over, _), flags in ((study["warm-up 4 tau_max (60 steps)"], ["--warmup-delays", "4"]),
                           (study["b2 0.99"], ["--b2", "0.99"])):
    plan = sweep.make_plan(sweep.parse_args(["--methods", "rotation", "--stages", "16"] + flags))
    mine = preset.config("rotation", 16, 0, **over)
    theirs = next(c for c in plan.main if c.stages == 16)
    assert run_name(mine, ds.sha256, 256) == run_name(theirs, ds.sha256, 256)


def test_rate_choice_is_the_lowest_seed_mean_validation_loss_and_flags_the_edge():
  res = lambda *vals: [_result("m", 1, s, [1.0], val=v) for s, v in enumerate(vals)]
  assert protocol.choose({1e-3: res(2.0, 2.2), 2e-3: res(1.9, 2.0), 4e-3: res(2.5, 1.5)}) == (2e-3, True)
  assert protocol.choose({1e-3: res(2.0, 2.0), 2e-3: res(1.9, 1.9), 4e-3: res(1.8, 1.8)}) == (4e-3, False)
  diverged = res(1.0, 1.0)
  diverged[1]["status"] = "diverged"  # a diverged seed makes the rate's mean infinite
  assert protocol.choose({1e-3: res(2.0, 2.0), 2e-3: diverged, 4e-3: res(2.1, 2.1)}) == (1e-3, False)


def test_summary_recovers_known_slowdowns_gain_and_plateau_exit():
  results = []
  for seed in (0, 1):
    results += [_result("pipedream", 1, seed, _curve(1.0)), _result("pipedream", 16, seed, _curve(4.0)),
                _result("rotation", 1, seed, _curve(0.5)), _result("rotation", 16, seed, _curve(1.0))]
  s = protocol.summarize(results, 16, window=60, level=3.0)
  for slowdown, got in ((4.0, s["pipedream"]["slowdown_levels"]), (2.0, s["rotation"]["slowdown_levels"])):
    assert len(got) == 2 and all(abs(x / slowdown - 1) < 0.03 for x in got), got
  # rotation's advantage: 2x at P = 1, 4x at P = 16 -> a staleness gain of 2
  assert all(abs(g / 2.0 - 1) < 0.03 for g in s["rotation"]["staleness_gain"]), s["rotation"]
  exit_1, exit_16 = s["pipedream"]["plateau_1"][0], s["pipedream"]["plateau_top"][0]
  smoothed = metrics.smooth(_curve(1.0), 60)
  assert abs(exit_16 / exit_1 - 4.0) < 0.05 and smoothed[exit_1 - 1] <= 3.0 < smoothed[exit_1 - 2]
  assert tables.spread([1.0, 3.0]) == "2.00 [1.00, 3.00]" and tables.spread([None, 1.0]) == "never"


def test_bad_arguments_are_one_line_errors():
  preset = presets.PRESETS["cpu"]
  with pytest.raises(ValueError, match=r"--equal-lr 0.005 is not on pipedream's grid"):
    protocol._validate(protocol.parse_args(["--equal-lr", "5e-3"]), preset)
  with pytest.raises(ValueError, match="--warmup-delays must be > 0, got 0"):
    protocol._validate(protocol.parse_args(["--warmup-delays", "0"]), preset)
  with pytest.raises(ValueError, match="--top must be >= 2, got 1"):
    protocol._validate(protocol.parse_args(["--top", "1"]), preset)


def test_every_planned_run_is_checked_before_anything_is_written(tmp_path):
  out = tmp_path / "protocol"  # a bad seed of the b2 study, which would train after the warm-up's runs
  with pytest.raises(ValueError, match="seed must be >= 0, got -1"):
    protocol.main(["--preset", "smoke", "--top", "2", "--b2-seeds", "-1", "--out", str(out)])
  assert not out.exists()


def test_a_file_as_publish_folder_fails_before_anything_is_written(tmp_path):
  (tmp_path / "file").write_text("")
  with pytest.raises(ValueError, match="--publish .* is a file, not a folder"):
    protocol.main(["--preset", "smoke", "--top", "2", "--publish", str(tmp_path / "file"),
                   "--out", str(tmp_path / "protocol")])
  assert not (tmp_path / "protocol").exists()

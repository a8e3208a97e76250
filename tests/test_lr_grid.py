"""The learning-rate grid study (experiments/studies/lr_grid.py) on synthetic runs whose final
validation loss is a known parabola in log2(rate)."""

import json
import math

import numpy as np
import pytest

from experiments.report import curves
from experiments.studies import lr_grid

RATES = (1e-3, 2e-3, 3e-3, 6e-3, 1e-2)


def _run(method, stages, lr, seed, best, steps=250, **setting):
  val = 2.0 + 0.1 * (math.log2(lr) - math.log2(best)) ** 2 + 0.01 * seed + 0.3 * (stages > 1)
  config = {"method": method, "stages": stages, "lr": lr, "seed": seed, "steps": steps, "b2": 0.999,
            **setting}
  return {"group": "main", "name": f"{method}_P{stages}_lr{lr}_s{seed}_{sorted(setting.items())}",
          "status": "finished", "config": config, "losses": list(np.linspace(5, 2, steps)),
          "val_steps": [0, steps], "val_losses": [5.5, val]}


def _write(path, runs, command):
  path.mkdir()
  curves.write(path / curves.FILE, {"window": 21, "preset": "t", "command": command}, runs)
  return path


def test_optimum_edges_the_shared_rule_and_a_rebuild(tmp_path):
  best = {("pipedream", 1): 3e-3, ("pipedream", 16): 1e-3, ("rotation", 1): 6e-3, ("rotation", 16): 2e-3}
  runs = [_run(m, p, lr, s, b) for (m, p), b in best.items() for lr in RATES for s in (0, 1)]
  runs += [_run("pipedream-lr", 16, lr, s, 6e-3) for lr in RATES for s in (0, 1)]
  runs += [_run("pipedream-lr", 1, 3e-3, s, 3e-3) for s in (0, 1)]  # its own P = 1 at one rate
  runs += [_run("rotation", 1, 3e-3, s, 6e-3, shampoo_beta=0.9) for s in (0, 1)]  # another setting
  half = len(runs) // 2
  a, b = _write(tmp_path / "a", runs[:half], "sweep a"), _write(tmp_path / "b", runs[half - 3:], "sweep b")
  out = tmp_path / "out"
  summary = lr_grid.main([str(a), str(b), "--out", str(out)])
  # the gap read at the shared rate and at each P's optimum, by hand from the parabola
  gap = {(g["method"], g["reading"]): g for g in summary["readings"]["gaps"]}
  np.testing.assert_allclose(gap[("pipedream", "shared")]["gap"], [0.3 + 0.1 * math.log2(3) ** 2] * 2)
  np.testing.assert_allclose(gap[("pipedream", "tuned")]["gap"], [0.3] * 2)
  assert gap[("pipedream", "tuned")]["rates"] == [3e-3, 1e-3]
  rot_shared = 0.3 + 0.1 * math.log2(1.5) ** 2 - 0.1  # P = 16 off its optimum by 1.5x, P = 1 by 2x
  np.testing.assert_allclose(gap[("rotation", "shared")]["gap"], [rot_shared] * 2)
  np.testing.assert_allclose(gap[("pipedream-lr", "shared")]["gap"], [0.4] * 2)  # P = 1: pipedream's
  gain = {g["reading"]: g["per_seed"] for g in summary["readings"]["gains"] if g["method"] == "rotation"}
  np.testing.assert_allclose(gain["shared"], [0.4 / rot_shared] * 2)  # PipeDream-LR's gap the smallest
  np.testing.assert_allclose(gain["tuned"], [1.0] * 2)
  rows = {(r["method"], r["P"]): r for r in summary["rows"]}
  for key, b_ in best.items():
    assert rows[key]["best"] == b_
  assert rows[("pipedream", 16)]["edge"] == "low" and not rows[("pipedream", 16)]["interior"]
  assert rows[("rotation", 1)]["interior"] and rows[("pipedream", 1)]["interior"]
  # PipeDream-LR at P = 1 is PipeDream's run (no delay, no correction)
  assert rows[("pipedream-lr", 1)]["mean"] == rows[("pipedream", 1)]["mean"]
  assert rows[("pipedream-lr", 16)]["best"] == 6e-3
  want = 2.0 + 0.1 * (math.log2(1e-2) - math.log2(6e-3)) ** 2 + 0.005
  assert rows[("rotation", 1)]["mean"][RATES.index(1e-2)] == pytest.approx(want, abs=1e-5)
  assert summary["left_out"] == 2
  rule = summary["shared_rate"]
  assert rule["keeps"] is True and rule["grid_steps_to_optimum"] == {"pipedream": 0, "pipedream-lr": 0,
                                                                    "rotation": 1}
  assert summary["sweeps"] == ["sweep a", "sweep b"]
  report = (out / "report.md").read_text()
  assert "| pipedream | 16 |" in report and "no (low edge: widen)" in report and "**kept**" in report
  assert json.loads((out / "summary.json").read_text()) == json.loads(json.dumps(summary))
  assert (out / "lr.png").stat().st_size > 0
  again = lr_grid.main([str(out), "--out", str(out)])  # the compacted curves alone rebuild the study
  assert again["rows"] == summary["rows"] and (out / "report.md").read_text() == report


def test_the_shared_rate_changes_when_an_optimum_is_two_steps_away(tmp_path):
  runs = [_run("nesterov", 1, lr, s, 1e-2) for lr in RATES + (2e-2,) for s in (0, 1)]  # widened past 1e-2
  summary = lr_grid.main([str(_write(tmp_path / "a", runs, "s")), "--out", str(tmp_path / "o")])
  (row,) = summary["rows"]
  assert row["best"] == 1e-2 and row["interior"]
  assert summary["shared_rate"] == {"shared": 3e-3, "keeps": False, "grid_steps_to_optimum": {"nesterov": 2}}
  assert "**changed**" in (tmp_path / "o" / "report.md").read_text()


def test_a_missing_seed_or_a_diverged_run_has_no_mean_and_an_edge_is_undecided(tmp_path):
  runs = [_run("muon", 1, lr, s, 1e-3) for lr in RATES for s in (0, 1)]
  runs[-1]["status"] = "diverged"  # 1e-2, seed 1
  runs = [r for r in runs if not (r["config"]["lr"] == 2e-3 and r["config"]["seed"] == 0)]
  summary = lr_grid.main([str(_write(tmp_path / "a", runs, "s")), "--out", str(tmp_path / "o")])
  (row,) = summary["rows"]
  assert row["mean"][RATES.index(1e-2)] is None and row["mean"][RATES.index(2e-3)] is None
  assert row["best"] == 1e-3 and row["edge"] == "low"
  assert summary["shared_rate"]["keeps"] is None


def test_the_same_run_differing_between_sources_is_refused(tmp_path):
  run = _run("muon", 1, 3e-3, 0, 3e-3)
  other = json.loads(json.dumps(run))
  other["val_losses"][-1] += 0.5
  other["losses"][5] += 1.0
  with pytest.raises(ValueError, match="differs between the files"):
    lr_grid.main([str(_write(tmp_path / "a", [run], "s")), str(_write(tmp_path / "b", [other], "t")),
                  "--out", str(tmp_path / "o")])


def test_an_optimum_is_interior_only_between_rates_that_have_a_mean(tmp_path):
  runs = [_run("nesterov", 1, lr, s, 3e-3) for lr in RATES for s in (0, 1)
          if not (lr < 3e-3 and s == 1)]  # 1e-3 and 2e-3 still lack seed 1
  (row,) = lr_grid.main([str(_write(tmp_path / "a", runs, "s")), "--out", str(tmp_path / "o")])["rows"]
  assert row["best"] == 3e-3 and row["edge"] == "low" and not row["interior"]
  one = [_run("nesterov", 1, 3e-3, s, 3e-3) for s in (0, 1)]
  (row,) = lr_grid.main([str(_write(tmp_path / "b", one, "s")), "--out", str(tmp_path / "p")])["rows"]
  assert row["edge"] == "both" and "no (one rate so far)" in (tmp_path / "p" / "report.md").read_text()

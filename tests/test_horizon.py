"""The horizon study (experiments/studies/horizon.py) from curves files of synthetic runs at two lengths."""

import json

import numpy as np
import scipy.stats

from experiments.report import curves
from experiments.studies import horizon


def _run(method, stages, stretch, seed, steps):
  t = np.arange(1, steps + 1) / stretch * (600 / steps)  # the same shape at every length
  losses = list(2.0 + 3.0 * np.exp(-t / 100) + 0.5 / (1 + t / 30))
  return {"group": "main", "name": f"{method}_P{stages}_n{steps}_s{seed}", "status": "finished",
          "config": {"method": method, "stages": stages, "seed": seed, "steps": steps},
          "losses": losses, "val_steps": [], "val_losses": [], "host": {"cpu": "test", "cores": 2}}


def _study(path, steps, rot_slowdown, seeds=(0, 1, 2)):
  runs = []
  for s in seeds:
    j = 1 + 0.03 * (s - 1)
    runs += [_run("pipedream", 1, 1.0, s, steps), _run("pipedream", 8, 4.0 * j, s, steps),
             _run("rotation", 1, 1.0, s, steps), _run("rotation", 8, rot_slowdown * j, s, steps)]
  path.mkdir()
  curves.write(path / curves.FILE, {"window": max(1, steps // 20), "preset": "t", "command": "c"}, runs)
  return path


def test_the_gain_per_horizon_with_its_interval_and_verdict(tmp_path):
  short = _study(tmp_path / "short", 600, rot_slowdown=8.0)  # rotation slows down twice as much
  long = _study(tmp_path / "long", 1200, rot_slowdown=2.0, seeds=(0,))  # twice as little, one seed
  summary = horizon.main([str(short), str(long), "--out", str(tmp_path / "out")])
  got = {g["T"]: g for g in summary["gain_vs_horizon"]}
  assert abs(got[600]["gain"]["mean"] - 0.5) < 0.05 and got[600]["verdict"] == "refuted"
  assert got[600]["gain"]["ci95"][1] < 1.0 and got[600]["seeds"] == 3 and got[600]["P"] == "8"
  assert len(got[600]["per_seed"]) == 3 and max(abs(g - 0.5) for g in got[600]["per_seed"]) < 0.05
  assert np.isclose(np.mean(got[600]["per_seed"]), got[600]["gain"]["mean"])
  assert abs(got[1200]["gain"]["mean"] - 2.0) < 0.1 and got[1200]["gain"]["ci95"] is None
  assert got[1200]["verdict"] == "inconclusive"  # one seed: no interval
  assert json.loads((tmp_path / "out" / "summary.json").read_text()) == summary
  assert (tmp_path / "out" / "horizon.png").stat().st_size > 0
  assert "| 600 | 8 | 86 | 3 |" in (tmp_path / "out" / "report.md").read_text()
  # each method's headline slowdown per seed, for the figure: its own runs' seeds
  slow = got[600]["slowdowns_per_seed"]
  assert sorted(slow) == ["pipedream", "rotation"] and len(slow["rotation"]) == 3
  for method, want in (("pipedream", 4.0), ("rotation", 8.0)):
    assert max(abs(v / (want * (1 + 0.03 * (s - 1))) - 1) for s, v in enumerate(slow[method])) < 0.05
  assert len(got[1200]["slowdowns_per_seed"]["rotation"]) == 1


def test_beside_each_verdict_leave_one_out_the_fresh_seeds_and_muons_control(tmp_path, monkeypatch):
  runs = []
  for s in (0, 1, 2, 3):
    j = 1 + 0.05 * (s - 1.5)
    runs += [_run("pipedream", 1, 1.0, s, 600), _run("pipedream", 8, 4.0 * j, s, 600),
             _run("rotation", 1, 1.0, s, 600), _run("rotation", 8, 2.0 * j, s, 600)]
    if s < 2:  # Muon's runs on two seeds only: it slows down 1.6x
      runs += [_run("muon", 1, 1.0, s, 600), _run("muon", 8, 1.6 * j, s, 600)]
  (tmp_path / "a").mkdir()
  curves.write(tmp_path / "a" / curves.FILE, {"window": 30, "preset": "t", "command": "c"}, runs)
  monkeypatch.setattr(horizon, "SEEN_BEFORE_PROTOCOL", {600: (0, 1)})
  monkeypatch.setattr(horizon, "EXPLORATORY", {600: "exploratory (a test)"})
  got = horizon.main([str(tmp_path / "a"), "--out", str(tmp_path / "out")])["gain_vs_horizon"][0]
  gains = dict(zip(got["seed_ids"], got["per_seed"]))
  assert got["seed_ids"] == [0, 1, 2, 3] and all(abs(g - 2.0) < 0.1 for g in gains.values())
  # leave one seed out, by hand: the one-sample t test of the other three log gains
  for row in got["leave_one_out"]:
    rest = np.log([g for s, g in gains.items() if s != row["left_out"]])
    assert np.isclose(row["mean"], np.exp(rest.mean()))
    assert np.isclose(row["p"], scipy.stats.ttest_1samp(rest, 0.0).pvalue)
  fresh = np.log([gains[2], gains[3]])
  assert got["after_protocol"]["seeds"] == [2, 3]
  assert np.isclose(got["after_protocol"]["p"], scipy.stats.ttest_1samp(fresh, 0.0).pvalue)
  # Muon's gain over the same baseline (PipeDream slows down 4x, Muon 1.6x) and rotation's over it
  muon = {int(k): v for k, v in got["muon_gain"]["per_seed"].items()}
  assert sorted(muon) == [0, 1] and all(abs(v - 2.5) < 0.15 for v in muon.values())
  ratio = {int(k): v for k, v in got["rotation_over_muon"].items()}
  assert all(np.isclose(ratio[s], gains[s] / muon[s]) for s in (0, 1))
  report = (tmp_path / "out" / "report.md").read_text()
  assert "**exploratory (a test)**" in report and "seeds [2, 3]:" in report

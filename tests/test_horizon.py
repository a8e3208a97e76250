"""The horizon study (experiments/studies/horizon.py) from curves files of synthetic runs at two lengths."""

import json

import numpy as np

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

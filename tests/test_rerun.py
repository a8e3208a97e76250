"""The rerun check (experiments/studies/rerun.py) on synthetic curves with known differences."""

import json

import numpy as np
import pytest

from experiments.report import curves
from experiments.studies import rerun


def _run(method, seed, val, losses, lr=3e-3, cpu="old cpu", **extra):
  config = {"method": method, "stages": 16, "seed": seed, "lr": lr, "steps": len(losses), **extra}
  return {"group": "main", "name": f"{method}_s{seed}_lr{lr}_{sorted(extra.items())}", "status": "finished",
          "config": config, "losses": list(losses), "val_steps": [0, len(losses)], "val_losses": [5.0, val],
          "seconds": 10.0, "code": {"commit": "abc" if cpu == "old cpu" else "def"},
          "host": {"cpu": cpu, "cores": 2}}


def _write(path, runs):
  path.mkdir()
  curves.write(path / curves.FILE, {"window": 4, "preset": "t", "command": "sweep"}, runs)
  return path


def test_a_rerun_is_paired_by_config_and_its_differences_are_exact(tmp_path):
  base = np.linspace(5.0, 2.0, 40)
  moved = base.copy()
  moved[6:] += 0.01  # differs from step 7 on
  old = _write(tmp_path / "old", [_run("pipedream", 0, 2.0, base), _run("rotation", 0, 1.8, base),
                                  _run("rotation", 0, 1.7, base, b1=0.95)])
  new = _write(tmp_path / "new", [_run("pipedream", 0, 2.0, base, cpu="new cpu"),
                                  _run("rotation", 0, 1.81, moved, cpu="new cpu"),
                                  _run("muon", 0, 1.7, base, cpu="new cpu"),  # no committed twin
                                  _run("rotation", 0, 1.7, base, cpu="new cpu", b1=0.95, b2=0.999)])
  summary = rerun.main([str(new), "--against", str(old), "--out", str(tmp_path / "out")])
  assert summary["aggregate"]["pairs"] == 3 and summary["aggregate"]["unmatched"] == 1
  assert summary["aggregate"]["identical"] == 2
  moved_pair = [p for p in summary["pairs"] if not p["identical"]][0]
  assert moved_pair["method"] == "rotation" and moved_pair["first_difference_step"] == 7
  assert moved_pair["final_val_difference"] == pytest.approx(0.01)
  smoothed = moved_pair["final_smoothed"]
  assert smoothed["rerun"] - smoothed["committed"] == pytest.approx(0.01)
  assert summary["aggregate"]["abs_final_val_difference"]["max"] == pytest.approx(0.01)
  assert summary["aggregate"]["abs_final_val_difference_by_P"]["16"]["median"] == pytest.approx(0.0)
  assert summary["provenance"]["rerun"] == {"hosts": [{"cpu": "new cpu", "cores": 2}], "commits": ["def"]}
  assert summary["provenance"]["committed"]["hosts"] == [{"cpu": "old cpu", "cores": 2}]
  report = (tmp_path / "out" / "report.md").read_text()
  assert "- CPUs: rerun new cpu (2 cores); committed old cpu (2 cores)" in report
  assert "| rotation | 16 | 0.003 | 0 | 1.80000 | 1.81000 | +0.01000 |" in report
  assert json.loads((tmp_path / "out" / "summary.json").read_text()) == json.loads(json.dumps(summary))
  with pytest.raises(ValueError, match="no run of .* has a twin"):
    rerun.main([str(old), "--against", str(_write(tmp_path / "other", [_run("muon", 3, 1.0, base)])),
                "--out", str(tmp_path / "x")])

"""The 2BW study (experiments/studies/pipedream_2bw.py) from curves files of synthetic runs whose
final-loss gap to P = 1 is known: each run at P is its P = 1 curve plus a constant offset."""

import json

import numpy as np
import pytest

from experiments.report import curves
from experiments.studies import pipedream_2bw as schedules

STEPS = 600


def _run(method, stages, seed, offset=0.0, schedule=None, b1=None):
  t = np.arange(1, STEPS + 1)
  losses = 2.0 + 3.0 * np.exp(-t / (100 + 10 * seed)) + 0.5 / (1 + t / 30) + offset
  config = {"method": method, "stages": stages, "seed": seed, "steps": STEPS}
  config.update({"schedule": schedule} if schedule else {})
  config.update({"b1": b1} if b1 is not None else {})
  name = f"{method}_P{stages}_{schedule}_{b1}_s{seed}"
  return {"group": "main", "name": name, "status": "finished", "config": config,
          "losses": list(losses), "val_steps": [STEPS], "val_losses": [float(losses[-1]) + 0.5],
          "host": {"cpu": "test", "cores": 2}}


def _write(path, runs):
  path.mkdir()
  curves.write(path / curves.FILE, {"window": 30, "preset": "t", "command": "c"}, runs)
  return str(path)


# gap at P = 8 per (schedule, method, b1): offset + 0.01 * seed (so over seeds 0-2: offset + 0.01)
OFFSETS = {("1f1b", "pipedream", None): 0.80, ("1f1b", "muon", None): 0.70, ("1f1b", "rotation", None): 0.60,
           ("2bw", "pipedream", None): 0.25, ("2bw", "muon", None): 0.03, ("2bw", "rotation", None): 0.09,
           ("2bw", "pipedream", 0.98): 0.10, ("2bw", "rotation", 0.98): 0.20}


def test_gaps_per_schedule_both_papers_claims_and_momentum(tmp_path):
  one, two = [], []
  for s in (0, 1, 2):
    for method in ("pipedream", "muon", "rotation"):
      one.append(_run(method, 1, s))  # P = 1: the same run for both schedules, in both sources
    one.append(_run("pipedream-lr", 8, s, 0.9))  # no P = 1 run: no row
    for (schedule, method, b1), offset in OFFSETS.items():
      (one if schedule == "1f1b" else two).append(_run(method, 8, s, offset + 0.01 * s, schedule, b1))
    two += [_run(m, 1, s, b1=0.98) for m in ("pipedream", "rotation")] + [_run("pipedream", 1, s)]
  a, b = _write(tmp_path / "a", one), _write(tmp_path / "b", two)
  out = tmp_path / "out"
  summary = schedules.main([b, "--refer", a, "--out", str(out)])
  gaps = {(g["schedule"], g["method"], g["b1"]): g for g in summary["gaps"]}
  assert ("1f1b", "pipedream-lr", None) not in gaps
  for (schedule, method, b1), offset in OFFSETS.items():
    g = gaps[(schedule, method, b1)]
    assert abs(g["gap"]["mean"] - (offset + 0.01)) < 1e-6, (schedule, method, g)
    assert g["seeds"] == 3 and g["P"] == "8"
  verdicts = {c["claim"]: c["verdict"] for c in summary["claims"]}
  muon = [v for c, v in verdicts.items() if c.startswith("Muon degrades less")]
  assert muon == ["reproduced", "reproduced"]  # 2BW: 0.22 apart; 1F1B: 0.10 apart
  momentum = {c.split(": ")[1].split(",")[0]: v for c, v in verdicts.items()
              if c.startswith("higher momentum")}
  assert momentum == {"pipedream": "reproduced", "rotation": "refuted"}  # gap 0.25 -> 0.10; 0.09 -> 0.20
  assert verdicts["an error-feedback correction recovers 50-90% of the remaining gap"] == "inconclusive"
  assert json.loads((out / "summary.json").read_text()) == summary
  report = (out / "report.md").read_text()
  gap = "+0.040 [+0.030, +0.050], CI +0.015 to +0.065"
  assert f"| 2BW | 8 | muon | 3 | {gap} | {gap} |" in report  # training and validation
  assert "| pipedream | 0.98 | +0.110" in report and (out / "gaps.png").stat().st_size > 0
  glance = report.split("## Both papers' claims at a glance")[1].split("## ")[0]
  assert "| claim | 1F1B, P = 8 | 2BW, P = 8 |" in glance
  muon_row = next(line for line in glance.splitlines() if line.startswith("| Muon degrades less"))
  assert muon_row.count("**reproduced**") == 2 and "+0.100 (" in muon_row  # 1F1B: 0.81 - 0.71
  adamw_momentum = next(line for line in glance.splitlines() if "AdamW's gap" in line)
  assert adamw_momentum.split(" | ")[1:] == ["", "**reproduced** +0.150 (+0.150 to +0.150) |"]
  # --out keeps every run but those of --refer; from it (and the same --refer) the study rebuilds
  kept = {r["name"] for r in curves.read(out)["runs"]}
  assert kept == {r["name"] for r in two} - {r["name"] for r in one}
  again = schedules.main([str(out), "--refer", a, "--out", str(out)])
  assert {k: v for k, v in again.items() if k != "command"} == {k: v for k, v in summary.items()
                                                                   if k != "command"}
  assert {r["name"] for r in curves.read(out)["runs"]} == kept


def test_sources_of_different_windows_are_refused(tmp_path):
  a = _write(tmp_path / "a", [_run("pipedream", 1, 0), _run("pipedream", 8, 0, 0.1, "2bw")])
  path = tmp_path / "b"
  path.mkdir()
  curves.write(path / curves.FILE, {"window": 99, "preset": "t", "command": "c"}, [_run("rotation", 1, 0)])
  with pytest.raises(ValueError, match=r"smooths with window 99, the first file with 30"):
    schedules.main([a, "--refer", str(path), "--out", str(tmp_path / "out")])

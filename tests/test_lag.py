"""The estimation-lag study (experiments/studies/lag.py) on synthetic rotation runs with known
slowdowns per statistics decay."""

import json

import numpy as np
import pytest

from experiments.report import curves
from experiments.studies import lag


def _run(decay, stages, stretch, seed, val, steps=600):
  t = np.arange(1, steps + 1) / stretch
  losses = list(2.0 + 3.0 * np.exp(-t / 100) + 0.5 / (1 + t / 30))
  beta = None if decay == 0.999 else decay  # the paper's decay: shampoo_beta follows b2
  return {"group": "main", "name": f"rotation_sb{decay}_P{stages}_s{seed}", "status": "finished",
          "config": {"method": "rotation", "stages": stages, "seed": seed, "steps": steps, "b2": 0.999,
                     "shampoo_beta": beta},
          "losses": losses, "val_steps": [steps], "val_losses": [val], "host": {"cpu": "test", "cores": 2}}


def _sweep(path, decay, slowdown, val_shift, seeds=(0, 1, 2, 3)):
  runs = []
  for s in seeds:
    j = 1 + 0.04 * (s - 1.5)
    runs += [_run(decay, 1, 1.0, s, 1.8 + 0.01 * s + val_shift),
             _run(decay, 8, slowdown * j, s, 2.2 + 0.01 * s)]
  path.mkdir()
  curves.write(path / curves.FILE, {"window": 30, "preset": "t", "command": f"sweep {decay}"}, runs)
  return path


def test_slowdown_per_decay_claims_and_the_protocols_choice(tmp_path):
  sources = [_sweep(tmp_path / "a", 0.999, 6.0, 0.0),
             _sweep(tmp_path / "b", 0.99, 4.0, 0.0),
             _sweep(tmp_path / "c", 0.9, 2.0, 0.3)]  # the fastest, but worse at P = 1: not eligible
  out = tmp_path / "out"
  summary = lag.main([str(s) for s in sources] + ["--out", str(out)])
  got = {d["decay"]: d for d in summary["decays"]}
  assert sorted(got) == [0.9, 0.99, 0.999] and all(d["seeds"] == [0, 1, 2, 3] for d in got.values())
  for decay, slowdown in ((0.999, 6.0), (0.99, 4.0), (0.9, 2.0)):
    g = np.exp(np.mean(np.log(got[decay]["per_seed"])))
    assert got[decay]["slowdown"]["mean"] == pytest.approx(g) and abs(g / slowdown - 1) < 0.05
  assert got[0.9]["eligibility"].startswith("not eligible: P = 1 validation loss worse")
  assert summary["chosen"] == 0.99  # the lowest slowdown among the eligible
  verdicts = {c["claim"].split(" slows")[0]: c for c in summary["claims"]}
  assert verdicts["statistics decay 0.9"]["verdict"] == "reproduced"
  assert verdicts["statistics decay 0.99"]["verdict"] == "reproduced"
  assert (verdicts["statistics decay 0.9"]["family"], verdicts["statistics decay 0.9"]["scale"]) == (2, "log")
  assert abs(verdicts["statistics decay 0.99"]["mean"] - 1.5) < 0.05  # 6 / 4
  assert json.loads((out / "summary.json").read_text()) == summary
  report = (out / "report.md").read_text()
  assert "| 0.99 | 100 | 4 |" in report and "**chosen**" in report and (out / "lag.png").stat().st_size
  again = lag.main([str(out), "--out", str(out)])  # the merged curves alone rebuild the study
  assert again == summary and (out / "report.md").read_text() == report


def test_without_the_reference_decay_nothing_is_claimed_or_chosen(tmp_path):
  summary = lag.main([str(_sweep(tmp_path / "b", 0.99, 4.0, 0.0)), "--out", str(tmp_path / "out")])
  assert summary["claims"] == [] and summary["chosen"] is None
  with pytest.raises(ValueError, match="no rotation runs"):
    path = tmp_path / "empty"
    path.mkdir()
    curves.write(path / curves.FILE, {"window": 30, "command": "c"}, [])
    lag.main([str(path), "--out", str(tmp_path / "o2")])


def test_refer_reads_runs_published_elsewhere_without_copying_them(tmp_path):
  main = _sweep(tmp_path / "main", 0.999, 6.0, 0.0)  # the main study's runs, published there
  lagged = _sweep(tmp_path / "b", 0.99, 4.0, 0.0)
  out = tmp_path / "out"
  summary = lag.main([str(lagged), "--refer", str(main), "--out", str(out)])
  assert summary["command"] == f"python -m experiments.studies.lag {out} --refer {main} --out {out}"
  kept = {r["name"] for r in curves.read(out)["runs"]}
  assert kept == {r["name"] for r in curves.read(lagged)["runs"]}  # none of main's
  assert summary["chosen"] == 0.99 and [c["verdict"] for c in summary["claims"]] == ["reproduced"]
  report = (out / "report.md").read_text()
  again = lag.main([str(out), "--refer", str(main), "--out", str(out)])  # --out and --refer rebuild it
  assert again == summary and (out / "report.md").read_text() == report


def test_a_long_horizons_report_tests_the_fixed_decay_and_chooses_nothing(tmp_path):
  sources = [_sweep(tmp_path / "a", 0.999, 6.0, 0.0), _sweep(tmp_path / "b", 0.95, 2.0, 0.3)]
  out = tmp_path / "out"
  summary = lag.main([str(s) for s in sources] + ["--fixed", "0.95", "--out", str(out)])
  assert summary["chosen"] is None and summary["fixed"] == 0.95 and "--fixed 0.95" in summary["command"]
  got = {d["decay"]: d["eligibility"] for d in summary["decays"]}
  assert got[0.999] == "the reference" and got[0.95].startswith("P = 1 validation loss minus 0.999's +0.3000")
  assert [c["verdict"] for c in summary["claims"]] == ["reproduced"]  # 6 / 2, the same claim as ever
  report = (out / "report.md").read_text()
  assert "**chosen**" not in report and "fixed in advance" in report and "P = 1 against 0.999 |" in report
  alone = lag.main([str(sources[1]), "--fixed", "0.95", "--out", str(tmp_path / "o1")])  # no 0.999 runs
  assert alone["claims"] == [] and alone["decays"][0]["eligibility"] is None
  with pytest.raises(ValueError, match="--fixed 0.9: no rotation runs"):
    lag.main([str(s) for s in sources] + ["--fixed", "0.9", "--out", str(tmp_path / "o2")])

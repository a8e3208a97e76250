"""The staleness-aware memory study (experiments/studies/memory.py) on synthetic runs with known
slowdowns and final losses, at two horizons of different smoothing windows."""

import json

import numpy as np
import pytest

from experiments.report import curves
from experiments.studies import memory

STRETCH = {"rotation": 4.0, "rotation-fast": 3.0, "rotation-stage-decay": 2.0, "nesterov": 5.0, "muon": 3.5}
FINAL = {"rotation": 2.30, "rotation-fast": 2.25, "rotation-stage-decay": 2.20, "nesterov": 2.40,
         "muon": 2.28}


def _run(method, stages, seed, steps, schedule="1f1b"):
  j = 1 + 0.03 * (seed - 1.5)
  stretch = 1.0 if stages == 1 else STRETCH[method] * j * (1.0 if stages == 8 else 0.5)
  t = np.arange(1, steps + 1) / stretch * (600 / steps)
  losses = [round(float(v), 5) for v in 2.0 + 3.0 * np.exp(-t / 100) + 0.5 / (1 + t / 30)]
  val = 1.9 if stages == 1 else FINAL[method] + 0.01 * seed
  return {"group": "main", "name": f"{method}_{schedule}_P{stages}_n{steps}_s{seed}", "status": "finished",
          "config": {"method": method, "stages": stages, "seed": seed, "steps": steps, "schedule": schedule},
          "losses": losses, "val_steps": [steps], "val_losses": [val], "host": {"cpu": "test", "cores": 2}}


def _sweep(path, steps, schedules=("1f1b", "2bw"), seeds=(0, 1, 2, 3)):
  runs = [_run(m, 1, s, steps) for m in STRETCH for s in seeds]
  runs += [_run(m, p, s, steps, sch) for sch in schedules for m in STRETCH for p in (4, 8) for s in seeds]
  path.mkdir()
  curves.write(path / curves.FILE, {"window": steps // 20, "command": f"sweep {steps}"}, runs)
  return path


def test_the_subject_slows_down_least_and_ends_lowest_per_schedule_and_horizon(tmp_path):
  short, long = _sweep(tmp_path / "short", 600), _sweep(tmp_path / "long", 1200, schedules=("1f1b",))
  out = tmp_path / "out"
  summary = memory.main([str(short), str(long), "--out", str(out)])
  got = {(g["schedule"], g["T"]): g for g in summary["groups"]}
  assert sorted(got) == [("1f1b", 600), ("1f1b", 1200), ("2bw", 600)]
  g = got[("1f1b", 600)]
  assert g["P"] == 8 and g["seeds"] == [0, 1, 2, 3] and g["methods"] == list(memory.METHODS)
  for m, want in STRETCH.items():  # slowdowns at P = 8 (and half of them at P = 4)
    assert np.allclose(g["slowdown"][m]["8"], [want * (1 + 0.03 * (s - 1.5)) for s in range(4)], rtol=0.06)
  assert g["final_val"]["muon"]["8"] == pytest.approx([2.28 + 0.01 * s for s in range(4)])
  assert g["least"] == pytest.approx([3.0 / 2.0] * 4, rel=0.06)  # rotation-fast's over the subject's
  assert g["lowest"] == pytest.approx([0.05] * 4)  # rotation-fast's 2.25 minus the subject's 2.20
  verdicts = [c["verdict"] for c in summary["claims"]]
  assert len(verdicts) == 6 and set(verdicts) == {"reproduced"}
  assert all(c["family"] == 6 for c in summary["claims"])  # one Holm family over the report
  assert summary["claims_fast"] == []  # amendment 6 judges rotation-fast at T = 9,600 only
  assert g["fast_least"] == pytest.approx([2.0 / 3.0] * 4, rel=0.06)  # the subject's 2.0 over its 3.0
  assert json.loads((out / "summary.json").read_text()) == summary
  report = (out / "report.md").read_text()
  assert "## 2BW, T = 600 (seeds [0, 1, 2, 3])" in report and "staleness-aware rotation ends lowest" in report
  again = memory.main([str(out), "--out", str(out)])  # the stored block-mean curves alone rebuild it
  assert again == summary and (out / "report.md").read_text() == report
  for r in curves.read(out)["runs"]:  # 240 block means per run at every T (2 and 5 steps here)
    c = r["config"]
    x, block = np.asarray(_run(c["method"], c["stages"], c["seed"], c["steps"])["losses"]), c["steps"] // 240
    means = [round(float(x[i:i + block].mean()), 4) for i in range(0, len(x), block)]
    np.testing.assert_allclose(r["losses"], np.repeat(means, block)[:len(x)], atol=1.5e-4)  # 4 decimals


def test_a_slower_subject_is_refuted_and_missing_runs_claim_nothing(tmp_path, monkeypatch):
  monkeypatch.setitem(STRETCH, "rotation-stage-decay", 6.0)  # now the slowest, and ending highest
  monkeypatch.setitem(FINAL, "rotation-stage-decay", 2.5)
  summary = memory.main([str(_sweep(tmp_path / "s", 600, schedules=("1f1b",))), "--out", str(tmp_path / "o")])
  assert [c["verdict"] for c in summary["claims"]] == ["refuted", "refuted"]
  runs = [_run(m, p, s, 600) for m in ("rotation", "nesterov") for p in (1, 8) for s in (0, 1)]
  (tmp_path / "n").mkdir()
  curves.write(tmp_path / "n" / curves.FILE, {"window": 30, "command": "c"}, runs)
  assert memory.main([str(tmp_path / "n"), "--out", str(tmp_path / "o2")])["claims"] == []


def test_the_uniform_short_memory_is_judged_only_where_amendment_6_says_in_a_family_of_its_own(
    tmp_path, monkeypatch):
  monkeypatch.setattr(memory, "FAST_JUDGED_AT", (1200,))
  short, long = _sweep(tmp_path / "short", 600), _sweep(tmp_path / "long", 1200, schedules=("1f1b",))
  summary = memory.main([str(short), str(long), "--out", str(tmp_path / "out")])
  fast = summary["claims_fast"]
  assert [c["claim"] for c in fast] == [
      "the uniform short memory (rotation-fast) slows down least of every method, Muon included "
      "(1f1b, T = 1200, P = 8)",
      "the uniform short memory (rotation-fast) ends lowest (1f1b, T = 1200, P = 8)"]
  # the stage-aware rule (stretch 2.0, final 2.20) beats it (3.0, 2.25) in every seed
  assert [c["verdict"] for c in fast] == ["refuted", "refuted"] and all(c["family"] == 2 for c in fast)
  assert fast[1]["mean"] == pytest.approx(-0.05)
  # amendment 3's family is untouched by the second one
  assert len(summary["claims"]) == 6 and all(c["family"] == 6 for c in summary["claims"])
  report = (tmp_path / "out" / "report.md").read_text()
  described = report.split("## The uniform short memory (rotation-fast), described")[1]
  assert "| 1f1b, 600, 8 | 0.67 [" in described and "| 2bw, 600, 8 | 0.67 [" in described
  assert "1f1b, 1200, 8 |" not in described.split("## ")[0]  # judged there, so not merely described
  assert "## The uniform short memory's claims (amendment 6), checked" in report


def test_runs_of_the_long_horizon_merge_into_a_published_study_of_both(tmp_path):
  # The queue's watcher: the published study (both T, the file's window the short T's) plus a newer
  # publish of the long T's finished runs, whose own file smooths with the long T's window.
  short, long = _sweep(tmp_path / "short", 600), _sweep(tmp_path / "long", 1200, seeds=(0, 1, 2))
  out = tmp_path / "out"
  memory.main([str(short), str(long), "--out", str(out)])
  more = _sweep(tmp_path / "more", 1200, seeds=(0, 1, 2, 3))  # seed 3 finished since
  summary = memory.main([str(out), str(more), "--out", str(out)])
  seeds = {(g["schedule"], g["T"]): g["seeds"] for g in summary["groups"]}
  assert seeds[("1f1b", 1200)] == [0, 1, 2, 3] and seeds[("1f1b", 600)] == [0, 1, 2, 3]
  assert curves.read(out)["meta"]["windows"] == {"600": 30, "1200": 60}
  odd = _sweep(tmp_path / "odd", 1200, seeds=(0,))  # a file that really smooths otherwise
  data = curves.read(odd)
  curves.write(odd / curves.FILE, {**data["meta"], "window": 99}, data["runs"])
  with pytest.raises(ValueError, match="window 99"):
    memory.main([str(out), str(odd), "--out", str(tmp_path / "o2")])


def test_each_P_is_judged_on_its_own_seeds_so_the_claims_need_no_P_4_run(tmp_path):
  # The T = 9,600 queue trains the claims' runs (P = 1 and the largest P) before P = 4's.
  runs = [_run(m, 1, s, 600) for m in STRETCH for s in range(4)]
  runs += [_run(m, 8, s, 600) for m in STRETCH for s in range(4)]
  runs += [_run(m, 4, s, 600) for m in STRETCH for s in (0, 1)] + [_run("muon", 4, 2, 600)]
  (tmp_path / "s").mkdir()
  curves.write(tmp_path / "s" / curves.FILE, {"window": 30, "command": "c"}, runs)
  summary = memory.main([str(tmp_path / "s"), "--out", str(tmp_path / "o")])
  g = summary["groups"][0]
  assert g["seeds_by_P"] == {"1": [0, 1, 2, 3], "4": [0, 1], "8": [0, 1, 2, 3]} and g["seeds"] == [0, 1, 2, 3]
  assert len(g["least"]) == len(g["lowest"]) == 4 and len(g["slowdown"]["muon"]["4"]) == 2
  assert g["final_val"]["muon"]["8"] == pytest.approx([2.28 + 0.01 * s for s in range(4)])
  assert np.allclose(g["slowdown"]["muon"]["4"], [1.75 * (1 + 0.03 * (s - 1.5)) for s in (0, 1)], rtol=0.06)
  assert [c["verdict"] for c in summary["claims"]] == ["reproduced", "reproduced"]
  report = (tmp_path / "o" / "report.md").read_text()
  assert "(seeds P = 1: [0, 1, 2, 3], P = 4: [0, 1], P = 8: [0, 1, 2, 3]; the claims on P = 8's)" in report
  runs = [r for r in runs if r["config"]["stages"] != 4 or r["config"]["method"] != "nesterov"]
  curves.write(tmp_path / "s" / curves.FILE, {"window": 30, "command": "c"}, runs)  # a P with no seed
  memory.main([str(tmp_path / "s"), "--out", str(tmp_path / "o")])
  row = next(x for x in (tmp_path / "o" / "report.md").read_text().splitlines() if x.startswith("| muon |"))
  assert row.split(" | ")[1] == "no seed yet" and row.split(" | ")[4] == "no seed yet" and "never" not in row


def test_without_its_own_p1_runs_the_subject_takes_rotations_and_the_study_is_unchanged(tmp_path):
  full = _sweep(tmp_path / "full", 600, schedules=("1f1b",))
  data = curves.read(full)
  (tmp_path / "lean").mkdir()
  own_p1 = lambda r: (r["config"]["method"], r["config"]["stages"]) == (memory.SUBJECT, 1)
  curves.write(tmp_path / "lean" / curves.FILE, data["meta"], [r for r in data["runs"] if not own_p1(r)])
  want = memory.main([str(full), "--out", str(tmp_path / "o1")])
  got = memory.main([str(tmp_path / "lean"), "--out", str(tmp_path / "o2")])
  assert got["groups"] == want["groups"] and got["claims"] == want["claims"]
  assert got["groups"][0]["final_val"][memory.SUBJECT]["1"] == pytest.approx([1.9] * 4)

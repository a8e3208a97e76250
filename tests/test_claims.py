"""Three verdicts (experiments/report/claims.py) on synthetic per-seed values and curves with known
answers."""

import numpy as np
import pytest
import scipy.stats

from experiments.report import claims, metrics
from experiments.report.tables import curves_by, seed_tables

WINDOW = 30


def test_the_three_verdicts_follow_the_interval():
  assert claims.judge([1.5, 1.6, 1.7], 1.0)[0] == "reproduced"
  assert claims.judge([0.5, 0.6, 0.7], 1.0)[0] == "refuted"
  assert claims.judge([0.5, 0.6, 0.7], 1.0, side=-1)[0] == "reproduced"  # the paper says below
  verdict, iv, why = claims.judge([1.11, 0.51, 0.81], 1.0)  # the staleness gains
  assert verdict == "inconclusive" and iv["ci95"][0] < 1.0 < iv["ci95"][1]
  n = int(why.split("about ")[1].split(" seeds")[0])
  sd, gap = np.std([1.11, 0.51, 0.81], ddof=1), abs(0.81 - 1.0)
  assert scipy.stats.t.ppf(0.975, n - 1) * sd / np.sqrt(n) < gap  # n seeds would clear it ...
  assert scipy.stats.t.ppf(0.975, n - 2) * sd / np.sqrt(n - 1) >= gap  # ... n - 1 would not
  assert claims.judge([2.0], 1.0) == ("inconclusive", metrics.interval([2.0]), "one seed, no interval")
  verdict, _, why = claims.judge([1.5, "rotation diverged"], 1.0)
  assert verdict == "inconclusive" and why == "1 of 2 seeds without a number: rotation diverged"
  assert claims.judge([], 1.0)[0] == "inconclusive"


def _run(method, stages, stretch, seed=0, end=2.0, n=600, status="finished", mode="weight_stashing"):
  """A run whose loss reaches every level ``stretch`` times later than the reference curve."""
  t = np.arange(1, n + 1) / stretch
  losses = end + 3.0 * np.exp(-t / 100) + 0.5 / (1 + t / 30)
  if status == "diverged":
    losses[n // 2:] = np.nan
  return {"config": {"method": method, "stages": stages, "seed": seed, "mode": mode},
          "status": status, "losses": list(losses)}


def _study(rot_slowdown, base_slowdown, seeds=(0, 1, 2), jitter=0.05):
  """Rotation and the three baselines at P = 1 and 8; rotation 1.2x faster at P = 1; per seed the
  slowdowns vary by ``jitter``."""
  runs = []
  for s in seeds:
    j = 1 + jitter * (s - 1)
    for m in ("pipedream", "pipedream-lr", "nesterov"):
      runs += [_run(m, 1, 1.0, s), _run(m, 8, base_slowdown * j, s)]
    runs += [_run("rotation", 1, 1 / 1.2, s), _run("rotation", 8, rot_slowdown * j / 1.2, s)]
  return runs


def _verdicts(runs):
  got = claims.main_claims(seed_tables(curves_by(runs), WINDOW))
  return {c.claim.split(" (")[0].split(" from P")[0].split(" at P")[0]: c for c in got}


def test_main_claims_reproduced_refuted_and_inconclusive():
  got = _verdicts(_study(rot_slowdown=2.0, base_slowdown=4.0))
  assert got["rotation slows down least"].verdict == "reproduced"
  assert got["rotation's lead over the best baseline grows with staleness"].verdict == "reproduced"
  assert got["rotation needs fewer iterations than the best baseline"].verdict == "reproduced"
  gain = float(got["rotation's lead over the best baseline grows with staleness"].evidence.split()[0])
  assert abs(gain - 2.0) < 0.1
  got = _verdicts(_study(rot_slowdown=4.0, base_slowdown=2.0))
  assert got["rotation slows down least"].verdict == "refuted"
  assert got["rotation's lead over the best baseline grows with staleness"].verdict == "refuted"
  # equal slowdowns, seeds scattered around them: no side
  runs = _study(rot_slowdown=3.0, base_slowdown=3.0, seeds=(0,), jitter=0) + _study(
      rot_slowdown=3.3, base_slowdown=3.0, seeds=(1,), jitter=0) + _study(
      rot_slowdown=2.7, base_slowdown=3.0, seeds=(2,), jitter=0)
  got = _verdicts(runs)
  assert got["rotation slows down least"].verdict == "inconclusive"
  assert "interval contains the threshold" in got["rotation slows down least"].why


def test_a_diverged_rotation_is_inconclusive_with_its_reason_and_a_diverged_baseline_is_slowest():
  runs = _study(rot_slowdown=2.0, base_slowdown=4.0)
  runs = [r for r in runs if not (r["config"]["method"] == "rotation" and r["config"]["stages"] == 8
                                  and r["config"]["seed"] == 1)]
  runs.append(_run("rotation", 8, 2.0, seed=1, status="diverged"))
  got = _verdicts(runs)
  assert got["rotation slows down least"].verdict == "inconclusive"
  assert got["rotation slows down least"].why.startswith("1 of 3 seeds without a number: rotation diverged")
  assert got["rotation needs fewer iterations than the best baseline"].why.endswith("rotation diverged")
  runs = _study(rot_slowdown=2.0, base_slowdown=4.0)
  runs = [r for r in runs if not (r["config"]["method"] == "nesterov" and r["config"]["stages"] == 8)]
  runs += [_run("nesterov", 8, 1.0, seed=s, status="diverged") for s in (0, 1, 2)]
  assert _verdicts(runs)["rotation slows down least"].verdict == "reproduced"


def test_a_subset_of_baselines_is_named_in_the_claim():
  runs = [r for r in _study(2.0, 4.0) if r["config"]["method"] in ("pipedream", "rotation")]
  got = claims.main_claims(seed_tables(curves_by(runs), WINDOW))
  assert all("(baselines in this report: pipedream)" in c.claim for c in got)


def test_ablation_claims_get_three_verdicts():
  variants = [_run(m, p, (s if p == 8 else 1.0), seed)
              for seed in (0, 1, 2)
              for m, s in zip(("rotation", "rotation-2nd-uni", "rotation-1st-bi", "rotation-1st-uni"),
                              (1.5 + 0.05 * seed, 2.0, 2.5, 3.0))
              for p in (1, 8)]
  got = claims.ablation_claims({"variants": variants}, WINDOW, [])
  assert [c.verdict for c in got] == ["reproduced"]
  main = _study(2.0, 4.0)
  main_tables = seed_tables(curves_by(main), WINDOW)
  worse = {"pipedream": 0.5, "pipedream-lr": 0.6, "nesterov": 0.4, "rotation": 0.1}  # without stashing
  degrade = [{**r, "config": {**r["config"], "mode": "no_stashing"},
              "losses": list(np.add(r["losses"], worse[r["config"]["method"]] * (r["config"]["stages"] > 1)
                                    + 0.01 * r["config"]["seed"]))} for r in main]
  got = claims.ablation_claims({"no-stashing": degrade}, WINDOW, main_tables)
  assert got[0].verdict == "reproduced", got[0]


@pytest.mark.parametrize("plumbing", [True, False])
def test_a_plumbing_check_gets_no_verdicts(plumbing):
  lines = claims.section([claims.Claim("c", "p", "e", "reproduced")], plumbing=plumbing)
  text = "\n".join(lines)
  assert ("reproduced" in text) != plumbing and ("plumbing check" in text) == plumbing


def test_a_p1_only_study_claims_nothing_about_staleness():
  runs = [_run(m, 1, 1.0) for m in ("pipedream", "rotation")]
  got = claims.main_claims(seed_tables(curves_by(runs), WINDOW))
  assert [(c.evidence, c.verdict, c.why) for c in got] == [
      ("this sweep ran P = 1 only", "inconclusive", "not measured")]


def test_muon_against_adamw_gap_claim():
  runs = []
  for s in (0, 1, 2):
    runs += [_run("pipedream", 1, 1.0, s), _run("pipedream", 8, 1.0, s, end=2.3 + 0.01 * s),
             _run("muon", 1, 1.0, s), _run("muon", 8, 1.0, s, end=2.02),
             _run("rotation", 1, 1.0, s), _run("rotation", 8, 1.0, s, end=2.1)]
  got = [c for c in claims.main_claims(seed_tables(curves_by(runs), WINDOW)) if "Muon" in c.claim]
  assert len(got) == 1 and got[0].verdict == "reproduced"
  assert got[0].evidence.startswith("AdamW's gap minus Muon's: +0.29")

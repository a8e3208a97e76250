"""The claims table of the report (experiments/report.py) on synthetic curves with known verdicts."""

import re

import numpy as np
import pytest

from experiments import report

STEPS, WINDOW = 200, 5


def result(method, stages, end, seed=0, status="finished", mode="weight_stashing"):
  """A run whose loss falls linearly from 4 to ``end`` (``NaN`` from the middle if diverged)."""
  losses = np.linspace(4.0, end, STEPS)
  if status == "diverged":
    losses[STEPS // 2:] = np.nan
  return {"config": {"method": method, "stages": stages, "seed": seed, "mode": mode},
          "status": status, "losses": losses.tolist()}


def claims(tmp_path, main, groups=None):
  ctx = report.Context(tmp_path, WINDOW, main, [])
  tables = report.seed_tables(report.curves_by(main), WINDOW)
  lines = report.claims_section(ctx, tables, groups or {})
  return {line.split(" | ")[0].lstrip("| "): line.split(" | ")[-1].rstrip(" |") for line in lines
          if line.startswith("| ") and " | " in line}


def main_study(rot_end, seed=0, baselines=(2.0, 2.1, 2.2)):
  runs = [result(m, 1, 1.0, seed) for m in ("pipedream", "pipedream-lr", "nesterov", "rotation")]
  runs += [result(m, 4, e, seed) for m, e in zip(("pipedream", "pipedream-lr", "nesterov"), baselines)]
  return runs + [result("rotation", 4, rot_end, seed)]


def test_a_target_never_reached_is_not_reproduced_with_its_reason(tmp_path):
  got = claims(tmp_path, main_study(rot_end=2.5))
  fewer = got["rotation needs fewer iterations than the best baseline at P = 4"]
  assert fewer == "**not reproduced** (rotation never reached the best baseline's final loss)"
  lead = "rotation's lead over the best baseline grows with staleness (staleness gain, P = 4)"
  assert got[lead].startswith("**not reproduced** (gain 0.")  # equal at P = 1, slower at P = 4
  got = claims(tmp_path, main_study(rot_end=1.5))  # the control: it reaches it sooner
  assert got["rotation needs fewer iterations than the best baseline at P = 4"] == "reproduced"
  assert got[lead] == "reproduced"


def test_one_failing_seed_fails_a_multi_seed_claim(tmp_path):
  got = claims(tmp_path, main_study(1.5, seed=0) + main_study(2.5, seed=1))
  assert got["rotation needs fewer iterations than the best baseline at P = 4"].startswith(
      "**not reproduced** (1 of 2 seeds: rotation never reached")
  got = claims(tmp_path, main_study(1.5, seed=0) + main_study(1.6, seed=1))
  assert got["rotation needs fewer iterations than the best baseline at P = 4"] == "reproduced (all 2 seeds)"


def test_diverged_runs_keep_the_no_stashing_claim(tmp_path):
  main = main_study(rot_end=1.5)
  no_stash = lambda m, p, end, status="finished": result(m, p, end, status=status, mode="no_stashing")
  base = [no_stash(m, 1, 1.0) for m in ("pipedream", "pipedream-lr", "nesterov", "rotation")]
  claim = "without weight stashing rotation degrades less than every baseline (final-loss change, P = 4)"
  rotation_diverged = base + [no_stash(m, 4, 2.6) for m in ("pipedream", "pipedream-lr", "nesterov")] + [
      no_stash("rotation", 4, 1.6, status="diverged")]
  got = claims(tmp_path, main, {"no-stashing": rotation_diverged})
  assert got[claim] == "**not reproduced** (rotation diverged or did not finish)"
  baseline_diverged = base + [no_stash("pipedream", 4, 2.0, status="diverged")] + [
      no_stash(m, 4, 2.6) for m in ("pipedream-lr", "nesterov")] + [no_stash("rotation", 4, 1.6)]
  got = claims(tmp_path, main, {"no-stashing": baseline_diverged})
  assert got[claim] == "reproduced"  # a diverged baseline degraded without bound
  ends = zip(("pipedream", "pipedream-lr", "nesterov"), (2.05, 2.6, 2.6))
  slow = base + [no_stash(m, 4, e) for m, e in ends]
  got = claims(tmp_path, main, {"no-stashing": slow + [no_stash("rotation", 4, 1.7)]})
  assert got[claim] == "**not reproduced** (rotation degrades more than pipedream)"


def _stretched_run(method, stages, stretch, seed=0):
  t = np.arange(1, 601) / stretch
  return {"config": {"method": method, "stages": stages, "seed": seed, "mode": "weight_stashing"},
          "status": "finished", "losses": list(2.0 + 3.0 * np.exp(-t / 100) + 0.5 / (1 + t / 30))}


def test_taxonomy_claim_in_both_slowdown_families(tmp_path):
  """Each variant's P = 4 curve reaches every level ``slowdown`` times later than its P = 1 curve."""
  def variants(slowdowns):
    return [_stretched_run(m, p, s if p == 4 else 1.0)
            for m, s in zip(("rotation", "rotation-2nd-uni", "rotation-1st-bi", "rotation-1st-uni"),
                            slowdowns)
            for p in (1, 4)]
  main = main_study(rot_end=1.5)
  got = claims(tmp_path, main, {"variants": variants((1.5, 2.0, 2.5, 3.0))})
  for how in ("", " at common targets"):
    assert got[f"second-order bilateral slows down least of the 2 x 2 taxonomy (P = 4){how}"] == "reproduced"
  got = claims(tmp_path, main, {"variants": variants((2.5, 2.0, 3.0, 3.5))})
  for how in ("", " at common targets"):
    verdict = got[f"second-order bilateral slows down least of the 2 x 2 taxonomy (P = 4){how}"]
    want = r"\*\*not reproduced\*\* \(rotation-2nd-uni (1\.9\d|2\.0\d) <= rotation 2\.\d\d\)"
    assert re.fullmatch(want, verdict), verdict


def test_slowdown_claim_counts_a_diverged_baseline_as_slowest(tmp_path):
  main = main_study(rot_end=1.5)
  main = [r for r in main if not (r["config"]["method"] == "nesterov" and r["config"]["stages"] == 4)]
  main.append(result("nesterov", 4, 1.2, status="diverged"))
  got = claims(tmp_path, main)
  assert got["rotation slows down least from P = 1 to P = 4"] == "reproduced"
  main[-2] = result("rotation", 4, 1.5, status="diverged")
  got = claims(tmp_path, main)
  assert got["rotation slows down least from P = 1 to P = 4"] == (
      "**not reproduced** (rotation diverged or never reached its own loss)")
  assert got["rotation needs fewer iterations than the best baseline at P = 4"] == (
      "**not reproduced** (rotation diverged or did not finish)")


def _stretched(stretch, n=600):  # a loss curve reaching every level ``stretch`` times later
  t = np.arange(1, n + 1) / stretch
  return list(2.0 + 3.0 * np.exp(-t / 100) + 0.5 / (1 + t / 30))


def test_size_section_reports_each_widths_slowdowns(tmp_path):
  results = []
  for width, slowdown in ((None, 4.0), (64, 2.0)):  # None: cpu-deep's own width, 32
    for method, speed in (("nesterov", 1.0), ("rotation", 1.5)):
      for p in (1, 8):
        stretch = (slowdown if p == 8 else 1.0) / speed
        results.append({"config": {"method": method, "stages": p, "seed": 0, "width": width,
                                   "model": "cpu-deep"}, "losses": _stretched(stretch), "status": "finished"})
  ctx = report.Context(tmp_path, 30, [], [])
  lines = report.size_section(ctx, "width", results, size_of=report.width_of, label="width")
  rows = [line.split(" | ") for line in lines[2:4]]
  assert [(r[0], r[1]) for r in rows] == [("| 32", "8"), ("| 64", "8")]
  for r, slowdown in zip(rows, (4.0, 2.0)):
    assert abs(float(r[2]) / slowdown - 1) < 0.05 and abs(float(r[3]) / slowdown - 1) < 0.05, r
    assert r[4].startswith("1.4") or r[4].startswith("1.5"), r  # rotation 1.5x ahead at P = 1 and 8
  assert ctx.figures == ["ablation_width_loss.png"] and (tmp_path / "ablation_width_loss.png").exists()


def test_size_section_groups_p1_controls_by_their_size(tmp_path):
  """Scaling: blocks = P grown together, each size with its own P = 1 control; the P = 1 runs of
  different sizes must not be pooled."""
  results = []
  for blocks, slowdown in ((4, 1.5), (8, 3.0)):
    for method in ("pipedream", "rotation"):
      for p in (1, blocks):
        stretch = (slowdown if p > 1 else 1.0) * (blocks / 4)  # bigger models are slower here
        results.append({"config": {"method": method, "stages": p, "seed": 0, "num_blocks": blocks,
                                   "model": "cpu-deep"}, "losses": _stretched(stretch), "status": "finished"})
  lines = report.size_section(report.Context(tmp_path, 30, [], []), "scaling", results,
                              size_of=report.blocks_of, label="blocks")
  rows = [line.split(" | ") for line in lines[2:4]]
  assert [(r[0], r[1]) for r in rows] == [("| 4", "4"), ("| 8", "8")]
  for r, slowdown in zip(rows, (1.5, 3.0)):
    assert abs(float(r[2]) / slowdown - 1) < 0.05, r  # pooled P = 1 controls would give 1.5 / 1.5x


def test_sync_readme_rewrites_only_stale_generated_blocks(tmp_path):
  (tmp_path / "r").mkdir()
  (tmp_path / "r" / "report.md").write_text(
      "# R\n\n## Claims\n\nintro\n\n| a | b |\n|---|---|\n| 1 | 2 |\n\nafter\n\n## Next\n\n| x |\n")
  readme = tmp_path / "README.md"
  block = '<!-- generated from r/report.md section "Claims" -->\n| a | b |\n| old |\n<!-- end generated -->'
  readme.write_text(f"top\n\n{block}\n\nbottom | kept |\n")
  assert report.sync_readme(readme) == [("r/report.md", "Claims")]
  want = block.replace("| a | b |\n| old |\n", "| a | b |\n|---|---|\n| 1 | 2 |\n")
  assert readme.read_text() == f"top\n\n{want}\n\nbottom | kept |\n"
  assert report.sync_readme(readme) == []  # up to date: nothing rewritten
  readme.write_text(block.replace("Claims", "Missing"))
  with pytest.raises(ValueError, match="no section '## Missing'"):
    report.sync_readme(readme)
  with pytest.raises(ValueError, match="--readme .*nope.md' is not a file"):
    report.main(["--readme", str(tmp_path / "nope.md")])


def test_diagnostics_section_averages_windows_per_stage_and_draws_them(tmp_path):
  def result(method, cosines, flips):
    return {"config": {"method": method, "stages": 3, "mode": "weight_stashing", "seed": 0},
            "diagnostics": [{"step": 300 * (i + 1), "cosine": c, "flip_rate": f}
                            for i, (c, f) in enumerate(zip(cosines, flips))]}
  results = [result("pipedream", [[0.5, 0.7, 1.0], [0.7, 0.9, 1.0]], [[0.4, 0.2, 0.0], [0.2, 0.2, 0.0]]),
             result("rotation", [[0.8, 0.9, 1.0]], [[0.1, 0.1, 0.0]]),
             {"config": {"method": "nesterov", "stages": 3, "mode": "weight_stashing", "seed": 0}}]
  ctx = report.Context(tmp_path, 30, [], [])
  lines = report.diagnostics_section(ctx, results)
  rows = [line for line in lines if line.startswith("| pipedream") or line.startswith("| rotation")]
  assert rows == [
      "| pipedream | 3 | weight_stashing | 2: 0.600, 1: 0.800, 0: 1.000 | 2: 0.30, 1: 0.20, 0: 0.00 |",
      "| rotation | 3 | weight_stashing | 2: 0.800, 1: 0.900, 0: 1.000 | 2: 0.10, 1: 0.10, 0: 0.00 |"]
  assert ctx.figures == ["diagnostics.png"] and (tmp_path / "diagnostics.png").stat().st_size > 0
  assert report.diagnostics_section(ctx, results[2:]) == []


def test_wall_clock_comes_only_from_runs_timed_alone(tmp_path):
  runs = main_study(1.5)
  for r in runs:
    r["steps_per_second"] = 100.0 if r["config"]["method"] == "rotation" else 200.0
  alone = report.main_section(report.Context(tmp_path, WINDOW, runs, []), runs)[0]
  table = "\n".join(alone[alone.index("## Wall-clock to the target at P (seconds)"):][:6])
  iters = {r["stages"]: r["iters"] for r in report.study_rows(report.curves_by(runs), WINDOW)
           if r["method"] == "rotation"}
  assert f"| rotation | {iters[1] / 100.0:.0f} | {iters[4] / 100.0:.0f} |" in table
  runs[0]["jobs"] = 2  # one run trained beside another: its seconds carry the other's load
  timed = report.step_seconds_by(runs)
  assert ("pipedream", 1) not in timed and ("rotation", 1) in timed
  shared = report.main_section(report.Context(tmp_path, WINDOW, runs, []), runs)[0]
  assert "Not measured: runs were trained 2 at a time (`--jobs`)" in "\n".join(shared)

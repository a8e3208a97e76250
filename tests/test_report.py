"""The report (experiments/report/build.py, sections.py, tables.py) rebuilt from a curves file of
synthetic runs."""


import json
import lzma

import numpy as np
import pytest

from experiments.report import build as report
from experiments.report import curves, sections, tables

STEPS, WINDOW = 200, 5


def result(method, stages, end, seed=0, status="finished", mode="weight_stashing"):
  """A run whose loss falls linearly from 4 to ``end`` (``NaN`` from the middle if diverged)."""
  losses = np.linspace(4.0, end, STEPS)
  if status == "diverged":
    losses[STEPS // 2:] = np.nan
  return {"config": {"method": method, "stages": stages, "seed": seed, "mode": mode},
          "status": status, "losses": losses.tolist()}


def main_study(rot_end, seed=0, baselines=(2.0, 2.1, 2.2)):
  runs = [result(m, 1, 1.0, seed) for m in ("pipedream", "pipedream-lr", "nesterov", "rotation")]
  runs += [result(m, 4, e, seed) for m, e in zip(("pipedream", "pipedream-lr", "nesterov"), baselines)]
  return runs + [result("rotation", 4, rot_end, seed)]


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
  ctx = sections.Context(tmp_path, 30, [], [])
  lines = sections.size_section(ctx, "width", results, size_of=tables.width_of, label="width")
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
  lines = sections.size_section(sections.Context(tmp_path, 30, [], []), "scaling", results,
                              size_of=tables.blocks_of, label="blocks")
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
  with pytest.raises(FileNotFoundError, match="curves.json.xz"):
    report.main([str(tmp_path)])


def test_diagnostics_section_averages_windows_per_stage_and_draws_them(tmp_path):
  def result(method, cosines, flips):
    return {"config": {"method": method, "stages": 3, "mode": "weight_stashing", "seed": 0},
            "diagnostics": [{"step": 300 * (i + 1), "cosine": c, "flip_rate": f}
                            for i, (c, f) in enumerate(zip(cosines, flips))]}
  results = [result("pipedream", [[0.5, 0.7, 1.0], [0.7, 0.9, 1.0]], [[0.4, 0.2, 0.0], [0.2, 0.2, 0.0]]),
             result("rotation", [[0.8, 0.9, 1.0]], [[0.1, 0.1, 0.0]]),
             result("nesterov-stage", [[0.9, 0.9, 1.0]], [[0.0, 0.0, 0.0]]),
             {"config": {"method": "nesterov", "stages": 3, "mode": "weight_stashing", "seed": 0}}]
  ctx = sections.Context(tmp_path, 30, [], [])
  lines = sections.diagnostics_section(ctx, results)
  results[2]["diagnostics"][0]["gradient_cosine"] = [0.2, 0.5, 1.0]  # logged by current code
  rows = [line for line in lines if line.startswith("| pipedream") or line.startswith("| rotation")]
  assert rows == [
      "| pipedream | 3 | weight_stashing | 2: 0.600, 1: 0.800, 0: 1.000 | n/a | 2: 0.30, 1: 0.20, 0: 0.00 |",
      "| rotation | 3 | weight_stashing | 2: 0.800, 1: 0.900, 0: 1.000 | n/a | 2: 0.10, 1: 0.10, 0: 0.00 |"]
  lines = sections.diagnostics_section(sections.Context(tmp_path, 30, [], []), results[2:3])
  want = ("| nesterov-stage | 3 | weight_stashing | 2: 0.900, 1: 0.900, 0: 1.000 | "
          "2: 0.200, 1: 0.500, 0: 1.000 |")
  assert want in "\n".join(lines)
  assert ctx.figures == ["diagnostics.png"] and (tmp_path / "diagnostics.png").stat().st_size > 0
  assert sections.diagnostics_section(ctx, results[3:]) == []


def test_wall_clock_comes_only_from_runs_timed_alone(tmp_path):
  runs = main_study(1.5)
  for r in runs:
    r["steps_per_second"] = 100.0 if r["config"]["method"] == "rotation" else 200.0
  alone = sections.main_section(sections.Context(tmp_path, WINDOW, runs, []), runs)[0]
  table = "\n".join(alone[alone.index("## Wall-clock to the target at P (seconds)"):][:8])
  iters = {r["stages"]: r["iters"] for r in tables.study_rows(tables.curves_by(runs), WINDOW)
           if r["method"] == "rotation"}
  assert f"| rotation | {iters[1] / 100.0:.0f} | {iters[4] / 100.0:.0f} |" in table
  runs[0]["jobs"] = 2  # one run trained beside another: its seconds carry the other's load
  timed = tables.step_seconds_by(runs)
  assert ("pipedream", 1) not in timed and ("rotation", 1) in timed
  shared = sections.main_section(sections.Context(tmp_path, WINDOW, runs, []), runs)[0]
  assert "Not measured: runs were trained 2 at a time (`--jobs`)" in "\n".join(shared)


def _curve_run(method, stages, stretch, seed, group="main", lr=3e-3, val=None):
  """A curves-file record reaching every level ``stretch`` times later than the reference."""
  losses = _stretched(stretch)
  return {"group": group, "name": f"{method}_P{stages}_lr{lr:g}_s{seed}", "status": "finished",
          "config": {"method": method, "stages": stages, "seed": seed, "mode": "weight_stashing",
                     "model": "cpu-deep", "num_blocks": None, "lr": lr, "steps": len(losses)},
          "losses": losses, "val_steps": [len(losses)], "val_losses": [val or losses[-1]],
          "seconds": 1.0, "steps_per_second": None, "jobs": 2,
          "host": {"cpu": "test CPU", "cores": 2}, "code": {"version": "0", "commit": "abc"}}


def _write_study(path, runs):
  meta = {"preset": "test", "command": "python -m experiments.sweep --preset test", "window": 30,
          "setting": ["a synthetic study"], "deviations": [], "plumbing": False,
          "code": {"version": "0", "commit": "abc"}}
  path.mkdir(parents=True, exist_ok=True)
  curves.write(path / curves.FILE, meta, runs)
  return path


def test_a_report_is_rebuilt_from_its_curves_and_a_methods_headline_ignores_the_others(tmp_path):
  runs = []
  for seed in (0, 1, 2):
    j = 1 + 0.05 * seed
    for m, s1, sp in (("pipedream", 1.0, 4.0), ("nesterov", 1.3, 6.0), ("pipedream-lr", 1.0, 3.5),
                      ("rotation", 1 / 1.2, 2.0 / 1.2)):
      runs += [_curve_run(m, 1, s1, seed), _curve_run(m, 8, sp * j, seed)]
  source = _write_study(tmp_path / "study", runs)
  summary = report.main([str(source)])
  assert set(summary) >= {"command", "commit", "hosts", "headline", "claims"}
  head = summary["headline"]["rotation"]["8"]
  assert set(head) == {"mean", "min", "max", "ci95", "seeds"} and head["seeds"] == 3
  assert abs(head["mean"] / 2.1 - 1) < 0.05  # 2.0 x the seeds' jitter (1, 1.05, 1.1)
  assert all(c["verdict"] in ("reproduced", "refuted", "inconclusive") for c in summary["claims"])
  assert json.loads((source / "summary.json").read_text())["headline"] == summary["headline"]
  text = (source / "report.md").read_text()
  assert "every run trained on one CPU: test CPU (2 cores)" in text
  assert "- pipeline schedule at P > 1: PipeDream 1F1B" in text
  assert "Not measured: runs were trained 2 at a time" in text
  for figure in ("main_loss.png", "main_slowdown.png", "main_levels.png"):
    assert f"![{figure}]({figure})" in text and (source / figure).stat().st_size > 0
  pair = report.main([str(source), "--methods", "pipedream", "rotation", "--out", str(tmp_path / "pair")])
  assert pair["headline"]["rotation"] == summary["headline"]["rotation"]
  assert set(pair["headline"]) == {"pipedream", "rotation"}
  assert "(baselines in this report: pipedream)" in pair["claims"][0]["claim"]
  with pytest.raises(ValueError, match=r"--methods \['muon'\]: not in this study"):
    report.main([str(source), "--methods", "muon"])


def test_runs_from_two_cpus_are_said_so():
  runs = [_curve_run("pipedream", 1, 1.0, 0), _curve_run("pipedream", 8, 4.0, 0)]
  runs[1]["host"] = {"cpu": "other CPU", "cores": 2}
  lines = report.header({"preset": "t", "command": "c", "setting": []}, runs, "c")
  assert any("the runs come from more than one CPU" in line for line in lines)


@pytest.mark.parametrize("tuned_vals,main_reading", [((1.70, 1.71, 1.69), "tuned"),
                                                     ((1.78, 1.81, 1.79), "shared")])
def test_a_tuned_rate_is_the_main_reading_only_beyond_the_seed_noise(tuned_vals, main_reading):
  shared_vals = (1.80, 1.79, 1.80)
  main = [_curve_run("rotation", p, 1.0, s, val=v) for s, v in enumerate(shared_vals) for p in (1, 8)]
  main += [_curve_run("pipedream", p, 1.0, s) for s in range(3) for p in (1, 8)]
  tuned = [_curve_run("rotation", p, 1.0, s, group=report.TUNED, lr=6e-3, val=v)
           for s, v in enumerate(tuned_vals) for p in (1, 8)]
  first, second, choice = report.choose_rates(main, tuned)
  assert choice["rotation"]["main"] == main_reading
  rot_lr = lambda rs: {r["config"]["lr"] for r in rs if r["config"]["method"] == "rotation"}
  assert rot_lr(first) == ({6e-3} if main_reading == "tuned" else {3e-3})
  assert rot_lr(second) == ({3e-3} if main_reading == "tuned" else {6e-3})
  assert len(first) == len(second) == 12


def test_add_merges_rerun_seeds_into_a_study_and_the_merged_curves_rebuild_it(tmp_path):
  both = lambda seeds: [r for s in seeds for m, sp in (("pipedream", 4.0), ("rotation", 2.0))
                        for r in (_curve_run(m, 1, 1.0, s), _curve_run(m, 8, sp * (1 + 0.05 * s), s))]
  first = _write_study(tmp_path / "first", both((0, 1)))
  more = _write_study(tmp_path / "more", both((2,)))
  meta = curves.read(more)["meta"]
  curves.write(more / curves.FILE, {**meta, "command": "python -m experiments.sweep --seeds 2"},
               curves.read(more)["runs"])
  summary = report.main([str(first), "--add", str(more)])
  assert summary["headline"]["rotation"]["8"]["seeds"] == 3
  merged = curves.read(first)
  assert sorted(r["config"]["seed"] for r in merged["runs"]) == [0] * 4 + [1] * 4 + [2] * 4
  text = (first / "report.md").read_text()
  assert ("(the sweeps: `python -m experiments.sweep --preset test`; `python -m experiments.sweep "
          "--seeds 2`)") in text
  assert report.main([str(first)])["headline"] == summary["headline"]  # the merged file alone rebuilds it
  again = report.main([str(first), "--add", str(more)])  # adding the same runs again changes nothing
  assert again["headline"] == summary["headline"] and len(curves.read(first)["runs"]) == 12
  clash = _write_study(tmp_path / "clash", [_curve_run("rotation", 8, 9.0, 0)])
  with pytest.raises(ValueError, match="differs between the files"):
    report.main([str(first), "--add", str(clash)])


def test_block_stores_compacted_curves_that_alone_rebuild_the_report(tmp_path, capsys):
  runs = [r for s in (0, 1) for m, sp in (("pipedream", 4.0), ("rotation", 2.0))
          for r in (_curve_run(m, 1, 1.0, s), _curve_run(m, 8, sp * (1 + 0.05 * s), s))]
  full = _write_study(tmp_path / "full", runs)
  out = tmp_path / "small"
  summary = report.main([str(full), "--block", "10", "--out", str(out)])
  assert f"wrote {out / 'report.md'}" in capsys.readouterr().out  # where it went, not SOURCE
  raw_file = json.loads(lzma.decompress((out / curves.FILE).read_bytes()).partition(b"\n")[0])
  assert all(r["loss_every"] == 10 for r in raw_file["runs"])
  stored = curves.read(out)["runs"]
  for r, raw in zip(sorted(stored, key=lambda r: r["name"]), sorted(runs, key=lambda r: r["name"])):
    x = np.asarray(raw["losses"])  # per step, each block's mean repeated (rounded to curves.LOSS_DECIMALS)
    want = np.repeat([x[i:i + 10].mean() for i in range(0, len(x), 10)], 10)[:len(x)]
    np.testing.assert_allclose(r["losses"], want, atol=10.0**-curves.LOSS_DECIMALS)  # rounded twice
  full_summary = report.main([str(full), "--out", str(tmp_path / "ref")])
  slow = lambda s: s["headline"]["rotation"]["8"]["mean"]
  assert slow(summary) == pytest.approx(slow(full_summary), rel=0.05)  # block means: close, not equal
  text = (out / "report.md").read_text()
  again = report.main([str(out)])  # the compacted curves alone rebuild every number
  assert again["headline"] == summary["headline"] and (out / "report.md").read_text() == text
  with pytest.raises(ValueError, match="--block needs"):
    report.main([str(full), "--block", "10"])
  bare = tmp_path / "bare"  # the same study without figures: the same numbers, no PNG written
  quiet = report.main([str(full), "--block", "10", "--out", str(bare), "--no-figures"])
  assert quiet["headline"] == summary["headline"] and not list(bare.glob("*.png"))
  text = (bare / "report.md").read_text()
  assert "## Figures" not in text and "No figures are published with this study" in text
  assert quiet["rebuilt_by"] == f"python -m experiments.report {bare} --no-figures"


def test_an_ablation_study_reports_every_ablation_and_its_claims_in_one_holm_family(tmp_path):
  """The ablations' report as the queue publishes it (the main runs beside six ablations): every
  section renders, and the main report's claims and the ablations' twelve rows are one family."""
  def run(method, p, stretch, seed, group, **config):
    r = _curve_run(method, p, stretch, seed, group=group)
    tag = "_".join(f"{k}{v}" for k, v in config.items())
    return {**r, "name": f"{group}_{r['name']}_{tag}", "config": {**r["config"], **config}}
  slow = {"pipedream": 4.0, "pipedream-lr": 3.5, "nesterov": 3.0, "rotation": 2.0, "muon": 2.5,
          "rotation-2nd-uni": 2.4, "rotation-1st-bi": 2.8, "rotation-1st-uni": 3.2, "rotation-sa": 1.9,
          "rotation-sa-reverse": 2.2, "rotation-random": 4.5, "rotation-frozen": 3.8}
  groups = {"main": ("pipedream", "pipedream-lr", "nesterov", "rotation", "muon"),
            "variants": ("rotation", "rotation-2nd-uni", "rotation-1st-bi", "rotation-1st-uni"),
            "no-stashing": ("pipedream", "pipedream-lr", "nesterov", "rotation"),
            "bases": ("rotation-random", "rotation-frozen", "rotation")}
  runs = []
  for seed in (0, 1, 2):
    j = 1 + 0.04 * seed
    for group, methods in groups.items():
      extra = {"mode": "no_stashing"} if group == "no-stashing" else {}
      for m in methods:
        runs += [run(m, p, 1.0 if p == 1 else slow[m] * j * (1.3 if extra else 1.0), seed, group, **extra)
                 for p in (1, 8)]
    runs += [run(m, 8, slow[m] * j, seed, "stage-aware")
             for m in ("rotation", "rotation-sa", "rotation-sa-reverse")]
    for w, lead in ((32, 1.0), (64, 1.2), (128, 1.5)):  # rotation's lead over Nesterov grows with width
      runs += [run(m, p, 1.0 if p == 1 else slow[m] * j / (lead if m == "rotation" else 1.0), seed, "width",
                   width=w) for m in ("nesterov", "rotation") for p in (1, 8)]
    runs += [run(m, p, 1.0 if p == 1 else slow[m] * j, seed, "moe", model="cpu-moe")
             for m in groups["no-stashing"] for p in (1, 8)]
  summary = report.main([str(_write_study(tmp_path / "ablations", runs)), "--no-figures"])
  claims = summary["claims"]
  assert len(claims) == 4 + 12 and {c["family"] for c in claims} == {16}
  assert {c["verdict"] for c in claims} <= {"reproduced", "refuted", "inconclusive"}
  text = (tmp_path / "ablations" / "report.md").read_text()
  for name in ("variants", "stage-aware", "no-stashing", "bases", "width", "moe"):
    assert f"## Ablation: {name}" in text
  rows = {c["claim"].split(" (P = ")[0]: c for c in claims}
  assert rows["a random fixed basis slows down more than the coordinate basis"]["verdict"] == "reproduced"
  assert rows["second-order bilateral slows down least of the 2 x 2 taxonomy"]["verdict"] == "reproduced"

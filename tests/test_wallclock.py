"""experiments/studies/wallclock.py: the wall-clock to target from committed iterations and a
recorded time per step (synthetic runs with known iterations), and the timing of real chunks."""

import json

import numpy as np

from experiments.report import curves, metrics
from experiments.studies import wallclock

# P = 1: rotation reaches every level 1.6x sooner than nesterov; P = 8: 3x sooner.
STRETCH = {1: {"pipedream": 1.5, "nesterov": 1.3, "rotation": 1.3 / 1.6},
           8: {"pipedream": 8.0, "nesterov": 6.0, "rotation": 2.0}}
MS = {"pipedream": 1.0, "nesterov": 1.0, "rotation": 2.5}  # milliseconds per step, as measured


def _run(method, stages, seed, steps=1200):
  stretch = STRETCH[stages][method] * (1 + 0.04 * seed)
  t = np.arange(1, steps + 1) / stretch
  losses = [round(float(v), 4) for v in 2.0 + 3.0 * np.exp(-t / 150) + 0.5 / (1 + t / 40)]
  return {"group": "main", "name": f"{method}_P{stages}_s{seed}", "status": "finished",
          "config": {"method": method, "stages": stages, "seed": seed, "steps": steps},
          "losses": losses, "val_steps": [steps], "val_losses": [losses[-1]],
          "host": {"cpu": "test CPU", "cores": 2}}


def test_the_wall_clock_is_iterations_times_the_measured_step_and_the_claims_follow(tmp_path):
  study = tmp_path / "study"
  study.mkdir()
  runs = [_run(m, p, s) for p in STRETCH for m in STRETCH[p] for s in (0, 1, 2)]
  curves.write(study / curves.FILE, {"window": 20, "command": "sweep"}, runs)
  measured = {"how": "by hand", "rounds": {m: {str(p): [MS[m] * 1e-3 * f for f in (0.9, 1.0, 1.3)]
                                               for p in STRETCH} for m in MS}}
  (tmp_path / "m.json").write_text(json.dumps({"measured": measured}))
  out = tmp_path / "out"
  summary = wallclock.main([str(study), "--out", str(out), "--measured", str(tmp_path / "m.json")])
  stored = curves.read(study)["runs"]
  for p in STRETCH:
    row = summary["rows"][str(p)]
    assert row["best"] == ["nesterov"] * 3  # the best baseline: lower final loss than pipedream's
    for i, seed in enumerate((0, 1, 2)):
      curve = {r["config"]["method"]: r["losses"] for r in stored
               if r["config"]["stages"] == p and r["config"]["seed"] == seed}
      target = metrics.final_smoothed(curve["nesterov"], 20)
      iters = {m: metrics.iterations_to(curve[m], target, 20) for m in ("nesterov", "rotation")}
      want = iters["rotation"] * 2.5 / (iters["nesterov"] * 1.0)  # the medians of the rounds
      # (summary.json's floats keep 10 significant digits: experiments.report.summary.DIGITS)
      assert abs(row["ratio"][i] / want - 1) < 1e-9
      assert abs(row["rows"]["rotation"]["seconds"][i] / (iters["rotation"] * 2.5e-3) - 1) < 1e-9
  # P = 1: 1/1.6 of the iterations at 2.5x the step -> about 1.56x the wall-clock: slower;
  # P = 8: 1/3 of the iterations -> about 0.83x: faster.
  assert 1.4 < np.mean(summary["rows"]["1"]["ratio"]) < 1.7
  assert 0.75 < np.mean(summary["rows"]["8"]["ratio"]) < 0.92
  verdicts = {c["claim"][-7:]: c["verdict"] for c in summary["claims"]}
  assert verdicts == {"(P = 1)": "refuted", "(P = 8)": "reproduced"}
  text = (out / "report.md").read_text()
  assert "2.50 ms [2.25, 3.25]" in text and "--measured" in summary["command"]
  again = wallclock.main([str(study), "--out", str(tmp_path / "again"),
                          "--measured", str(out / "summary.json")])  # the recorded times rebuild it
  assert again["rows"] == summary["rows"] and again["claims"] == summary["claims"]


def test_measure_times_each_chunk_in_turn_and_divides_by_its_steps():
  """Two tiny configs of the smoke preset, two rounds, a clock that advances one second per reading:
  each timed chunk reads 1 s, so each round's seconds per step are 1 / chunk; the chunks really run
  (the pipelines' states advance)."""
  from experiments.sweep import presets

  preset = presets.PRESETS["smoke"]
  configs = {("pipedream", 1): preset.config("pipedream", 1, 0),
             ("rotation", 2): preset.config("rotation", 2, 0)}
  ticks = iter(range(1000))
  times = wallclock.measure(configs, rounds=2, clock=lambda: float(next(ticks)))
  assert times == {k: [1.0 / c.chunk] * 2 for k, c in configs.items()}

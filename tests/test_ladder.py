"""The width ladder (experiments/studies/ladder.py, protocol amendment 10) on synthetic runs of known
answers: the rate rule per width with the full-length check at width 32, the sweeps it asks for,
the confirmatory claims computed by hand from final validation losses, and the CPU rule."""

import json

import numpy as np
import pytest

from experiments.report import curves
from experiments.studies import ladder

OPTIMUM = {32: 3e-3, 64: 2e-3, 128: 1e-3}  # every method's tuning optimum per width (P = 1 and 16)


def _run(method, stages, lr, seed, width, steps, val, cpu="cpu A", stretch=1.0):
  t = np.arange(1, steps + 1) / stretch
  losses = list(val + 1.0 + 3.0 * np.exp(-t / (steps / 8)))
  return {"group": "main", "name": f"W{width}_{method}_P{stages}_lr{lr:g}_n{steps}_s{seed}",
          "status": "finished",
          "config": {"method": method, "stages": stages, "lr": lr, "seed": seed, "steps": steps,
                     "width": None if width == 32 else width, "model": "cpu-deep",
                     "mode": "weight_stashing"},
          "losses": losses, "val_steps": [0, steps], "val_losses": [5.0, val],
          "host": {"cpu": cpu, "cores": 2}}


def _tuning_val(method, width, lr, steps):
  """A bowl in log-rate around the width's optimum; at the full length width 32's optimum is 2e-3."""
  best = 2e-3 if (width == 32 and steps == ladder.T) else OPTIMUM[width]
  return 2.0 + 0.1 * np.log(lr / best) ** 2 + {"pipedream": 0.02, "nesterov": 0.01}.get(method, 0.0)


def _tuning_runs(rates=(1e-3, 2e-3, 3e-3, 6e-3, 1e-2), widths=ladder.WIDTHS, steps=ladder.TUNE_T):
  return [_run(m, p, r, 0, w, steps, _tuning_val(m, w, r, steps))
          for w in widths for m in ladder.METHODS for p in ladder.STAGES for r in rates]


def test_the_rate_rule_per_width_with_the_check_at_width_32():
  first = ladder.tuning(_tuning_runs())
  assert first["chosen"] is None  # width 32 waits for its check at the full length
  assert first["widths"][64]["rotation"]["stage1"]["chosen"] == {1: 2e-3, 16: 2e-3}
  # 1e-3 is the grid's low edge at width 128: the rule widens it to 5e-4 before choosing
  assert first["widths"][128]["muon"]["stage1"]["todo"] == [5e-4]
  todo = ladder.sweeps(first, "R")
  assert (f"{ladder.SWEEP} --width 128 --steps {ladder.TUNE_T} --lr 0.0005 --methods pipedream nesterov "
          "rotation muon --seeds 0 --out R/tune") in todo
  assert (f"{ladder.SWEEP} --width 32 --steps {ladder.T} --lr 0.002 --methods pipedream nesterov rotation "
          "muon --seeds 0 --out R/check") in todo
  runs = _tuning_runs() + _tuning_runs(rates=(5e-4,), widths=(128,))
  runs += _tuning_runs(rates=(2e-3, 3e-3, 6e-3), widths=(32,), steps=ladder.T)
  done = ladder.tuning(runs)
  assert done["chosen"] is None  # at T, 2e-3 wins at the check's edge: 1e-3 is trained past it
  runs += _tuning_runs(rates=(1e-3,), widths=(32,), steps=ladder.T)
  done = ladder.tuning(runs)
  assert done["chosen"] == {w: {m: {1: r, 16: r} for m in ladder.METHODS}
                            for w, r in ((32, 2e-3), (64, 2e-3), (128, 1e-3))}
  assert done["widths"][32]["rotation"]["stage2"]["moved"] == {1: True, 16: True}
  confirmatory = ladder.sweeps(done, "R")
  assert len(confirmatory) == 2 * len(ladder.SEEDS) * len(ladder.WIDTHS)  # P = 16, then P = 1
  assert confirmatory[:2] == [f"{ladder.SWEEP} --width 32 --stages {p} --lr pipedream=0.002 "
                              "nesterov=0.002 rotation=0.002 muon=0.002 --methods pipedream nesterov "
                              "rotation muon --seeds 12 --out R/confirmatory"
                              for p in ("16 --no-reference", 1)]


def test_a_sweep_whose_runs_ran_here_is_not_asked_again():
  """Seed 12's first sweep (width 32, P = 16 at its rates, no P = 1 reference) ran on CPU "cpu A":
  the queue there goes on with the next one, and a queue on another type does not."""
  w, s = 32, 12
  first = [_run(m, 16, CHOSEN[w][m][16], s, w, ladder.T, 2.0) for m in ladder.METHODS]
  tune = {"widths": {}, "chosen": CHOSEN}
  ask = lambda runs, cpu="cpu A": ladder.sweeps(tune, "R", [s], ladder.ran_on(runs, cpu))
  every = ask([])
  assert len(every) == 2 * len(ladder.WIDTHS)
  assert ask(first) == every[1:] and "--stages 1 --lr pipedream=0.003 " in every[1]
  assert "--stages 16 --no-reference --lr pipedream=0.003 nesterov=0.003 rotation=0.001 " in every[0]
  # a P = 1 run that trained at a P = 16 rate (as the sweeps before --no-reference did) is no P = 1 run
  shared = [_run(m, 1, CHOSEN[w][m][16], s, w, ladder.T, 2.0) for m in ladder.METHODS]
  assert ask(first + shared) == every[1:]
  both = shared + [_run(m, 1, CHOSEN[w][m][1], s, w, ladder.T, 2.0) for m in ("rotation",)]
  assert ask(first + both) == every[2:]  # the other three's rates at P = 1 are their P = 16 rates
  assert ask(first, "cpu B") == every
  assert ask(first[:-1]) == every  # one run short: the sweep is asked again
  diverged = [dict(r, status="diverged") if r["config"]["method"] == "muon" else r for r in first]
  assert ask(diverged) == every[1:]  # a run that diverged ran: the report credits it with nothing


CHOSEN = {w: {m: {1: 3e-3, 16: 1e-3 if m == "rotation" else 3e-3} for m in ladder.METHODS}
          for w in ladder.WIDTHS}


def _val(seed, width, method, p):
  """Known final losses: wider is lower; staleness costs PipeDream most and rotation least, more at
  width 128; seeds move every run alike, plus a per-seed jitter in rotation's lead."""
  base = 2.0 - 0.1 * ladder.WIDTHS.index(width) + 0.01 * (seed - 12)
  cost = {"pipedream": 0.15, "nesterov": 0.10, "rotation": 0.05, "muon": 0.06}[method]
  grow = 1.0 + 0.5 * ladder.WIDTHS.index(width)
  return base + (cost * grow + 0.002 * (seed - 13.5) * (method == "rotation") if p == 16 else 0.0)


def _confirmatory(seeds=ladder.SEEDS, cpu="cpu A"):
  runs = []
  for s in seeds:
    for w in ladder.WIDTHS:
      for m in ladder.METHODS:
        for p in ladder.STAGES:
          v = _val(s, w, m, p)
          runs.append(_run(m, p, CHOSEN[w][m][p], s, w, ladder.T, v, cpu, stretch=1 + (v - 1.9) * 4))
  return runs


def test_the_claims_are_computed_from_final_validation_losses(tmp_path):
  seeds, left = ladder.by_seed(_confirmatory(), CHOSEN)
  assert sorted(seeds) == list(ladder.SEEDS) and left == {}
  result = ladder.study(_confirmatory(), CHOSEN, ladder.WINDOW)
  got = {c["claim"]: c for c in result["claims"]}
  assert len(got) == 11 and {c["family"] for c in got.values()} == {11}
  lead = lambda s, w: _val(s, w, "nesterov", 16) - _val(s, w, "rotation", 16)  # Nesterov: the best baseline
  for w in ladder.WIDTHS:
    assert all(result["seeds"][s]["best"][w] == "nesterov" for s in ladder.SEEDS)
    head = f"rotation ends below the best baseline at P = 16 (width {w};"
    (c,) = [c for n, c in got.items() if n.startswith(head)]
    assert c["mean"] == pytest.approx(np.mean([lead(s, w) for s in ladder.SEEDS]))
    assert c["verdict"] == "reproduced"
  (grows,) = [c for n, c in got.items() if "grows with width" in n]
  assert grows["mean"] == pytest.approx(np.mean([lead(s, 128) - lead(s, 32) for s in ladder.SEEDS]))
  (worse,) = [c for n, c in got.items() if "wider models end worse" in n]
  assert worse["mean"] == pytest.approx(np.mean([_val(s, 128, "nesterov", 16) - _val(s, 32, "nesterov", 16)
                                                 for s in ladder.SEEDS]))
  assert worse["verdict"] == "refuted"  # the wider model ends lower here, stale or not
  for c in got.values():
    assert len(c["leave_one_out"]) == 4
  # the README's table: each claim's verdict, mean and interval (at its Holm level) in its column
  table = ladder.glance(result["decided"])
  split = lambda line: [x.strip() for x in line.strip("|").split("|")]
  rows = {cells[0]: cells[1:] for cells in map(split, table) if cells[0].startswith(("rotation", "without"))}
  cell = lambda c: f"**{c['verdict']}** {c['mean']:+.3f} ({c['interval'][0]:+.3f} to {c['interval'][1]:+.3f})"
  assert table[0] == f"## {ladder.GLANCE}" and len(rows) == 5
  for _, claim, what in ladder.AT_EACH_WIDTH:
    want = [cell(got[f"{claim} (width {w}; {what})"]) for w in ladder.WIDTHS]
    assert rows[f"{claim} ({what})"] == want + [""]
  for c in (grows, worse):
    assert rows[c["claim"]] == ["", "", "", cell(c)]
  desc = ladder.descriptive(result["seeds"])
  assert desc["degradation"]["128 pipedream"]["mean"] == pytest.approx(0.15 * 2.0)


def test_three_seeds_draw_no_verdict_and_a_seed_spread_over_two_cpus_is_left_out():
  runs = _confirmatory(seeds=(12, 13, 14)) + _confirmatory(seeds=(15,))[:-1]
  runs += _confirmatory(seeds=(15,), cpu="cpu B")[-1:]
  result = ladder.study(runs, CHOSEN, ladder.WINDOW)
  assert result["claims"] == [] and sorted(result["seeds"]) == [12, 13, 14]
  assert result["left_out"][15] == "23 of 24 runs on cpu A; 1 of 24 runs on cpu B"
  assert ladder.seed_order(CHOSEN, runs, "cpu A") == [15]  # started on this type: it finishes it


def test_the_study_rebuilds_from_the_folders_it_writes(tmp_path):
  source = tmp_path / "src"
  source.mkdir()
  runs = _tuning_runs() + _tuning_runs(rates=(5e-4,), widths=(128,))
  runs += _tuning_runs(rates=(1e-3, 2e-3, 3e-3, 6e-3), widths=(32,), steps=ladder.T)
  chosen = ladder.tuning(runs)["chosen"]
  for s in ladder.SEEDS:
    for w in ladder.WIDTHS:
      for m in ladder.METHODS:
        for p in ladder.STAGES:
          runs.append(_run(m, p, chosen[w][m][p], s, w, ladder.T, _val(s, w, m, p)))
  setting = ["data: `x`, 100000000 tokens, vocabulary 256, sha256 `0`"]
  curves.write(source / curves.FILE, {"window": 60, "command": "c", "setting": setting}, runs)
  first = ladder.main([str(source), "--out", str(tmp_path / "out"), "--cpu", "cpu A"])
  assert len(first["claims"]) == 11 and first["left_out"] == {}
  text = (tmp_path / "out" / "report.md").read_text()
  assert "## The claims (one Holm family)" in text and (tmp_path / "out" / "ladder.png").stat().st_size > 0
  assert text.index(f"## {ladder.GLANCE}") < text.index("## The claims (one Holm family)")
  models = json.loads((tmp_path / "out" / "summary.json").read_text())["models"]
  assert {w: m["parameters"] for w, m in models.items()} == {"32": 220_992, "64": 834_944, "128": 3_242_496}
  assert models["128"]["passes"] == round(ladder.T * 512 / 90_000_000, 2)  # a 10% validation split
  assert "width 128: 3,242,496 parameters; 512 tokens a step; T = 4,800 steps read 0.03 of one pass" in text
  folders = [str(tmp_path / "out" / name) for name in ("tune", "confirmatory-cpu-a")]
  again = ladder.main(folders + ["--out", str(tmp_path / "again"), "--cpu", "cpu A"])
  assert [c["verdict"] for c in again["claims"]] == [c["verdict"] for c in first["claims"]]
  assert [c["mean"] for c in again["claims"]] == pytest.approx([c["mean"] for c in first["claims"]], abs=1e-4)
  # a queue passes the published folders beside its own full-resolution copies of the same runs
  split = tmp_path / "tuning-only"
  split.mkdir()
  tuning_runs = [r for r in runs if r["config"]["seed"] == 0]
  curves.write(split / curves.FILE, {"window": 60, "command": "c"}, tuning_runs)
  both = ladder.main(folders + [str(split), "--out", str(tmp_path / "both"), "--cpu", "cpu A"])
  assert [c["verdict"] for c in both["claims"]] == [c["verdict"] for c in first["claims"]]
  # the check's sweeps publish with another smoothing window than the 1,200-step tuning's
  check = tmp_path / "check-only"
  check.mkdir()
  curves.write(check / curves.FILE, {"window": 240, "command": "d"},
               [r for r in tuning_runs if r["config"]["steps"] == ladder.T])
  mixed = ladder.main(folders + [str(split), str(check), "--out", str(tmp_path / "mixed"),
                       "--cpu", "cpu A"])
  assert mixed["claims"]
  assert [c["verdict"] for c in mixed["claims"]] == [c["verdict"] for c in first["claims"]]


def test_a_queue_refuses_a_cpu_known_by_its_name_with_another_family_or_model(tmp_path, monkeypatch, capsys):
  from experiments.harness import provenance

  path = tmp_path / "cpus.json"
  monkeypatch.setattr(provenance, "cpu_type", lambda: {"cpu": "Some CPU", "family": 6, "model": 167})
  ladder.main(["--register-cpu", str(path)])
  assert capsys.readouterr().out.strip() == "some-cpu"
  ladder.main(["--register-cpu", str(path)])  # the same type again: fine
  monkeypatch.setattr(provenance, "cpu_type", lambda: {"cpu": "Some CPU", "family": 6, "model": 143})
  with pytest.raises(ValueError, match="refused: .*model': 143.* is not the .*model': 167"):
    ladder.main(["--register-cpu", str(path)])


def test_a_widths_tuning_counts_on_one_cpu_type():
  """A width whose tuning runs span two CPU types is decided by the type that holds all of it; while
  none does, by the queue's own type, whose missing runs are asked for (amendment 10's clarification)."""
  runs = _tuning_runs(widths=(64,))
  moved = [dict(r, host={"cpu": "cpu B", "cores": 2}) for r in runs if r["config"]["lr"] == 1e-2]
  kept = [r for r in runs if r["config"]["lr"] != 1e-2]
  mixed = ladder.tuning(kept + moved, here="cpu A")
  assert mixed["cpus"][64] == "cpu A" and mixed["widths"][64]["rotation"]["stage1"]["todo"] == [1e-2]
  assert ladder.tuning(kept + moved, here="cpu B")["widths"][64]["rotation"]["stage1"]["todo"] == [
      1e-3, 2e-3, 3e-3, 6e-3]
  whole = ladder.tuning(runs + moved, here="cpu B")  # cpu A holds all of width 64: it decides
  assert whole["cpus"][64] == "cpu A"
  assert whole["widths"][64]["rotation"]["stage1"]["chosen"] == {1: 2e-3, 16: 2e-3}

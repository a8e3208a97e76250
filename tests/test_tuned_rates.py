"""The long horizon's rate tuning (experiments/studies/tuned_rates.py, protocol amendment 8) on
synthetic grids whose final validation loss is a known parabola in log2(rate): each stage's choice,
widening and the sweeps it asks for, checked against the rule written out by hand."""

import math
import shlex

import numpy as np
import pytest

from experiments.report import curves
from experiments.studies import tuned_rates as tr


def _loss(lr, best, seed=0, p=1):
  return 2.0 + 0.1 * (math.log2(lr) - math.log2(best)) ** 2 + 0.01 * seed + 0.3 * (p > 1)


def _grid(best: dict, rates=tr.GRID, seeds=tr.TUNING_SEEDS, skip=()) -> dict:
  """``{(method, P): {rate: {seed: loss}}}`` with optimum ``best[(method, P)]``, leaving out ``skip``
  ((method, P, rate, seed) cells)."""
  out = {}
  for (m, p), b in best.items():
    for lr in (rates.get(m, tr.GRID) if isinstance(rates, dict) else rates):
      for s in seeds:
        if (m, p, lr, s) not in skip:
          out.setdefault((m, p), {}).setdefault(lr, {})[s] = _loss(lr, b, s, p)
  return out


def _best(value_1, value_16, methods=tr.METHODS):
  return {(m, p): v for m in methods for p, v in ((1, value_1), (16, value_16))}


def test_past_steps_along_the_grid_then_by_factors_of_two():
  assert tr.past(3e-3, "low") == 2e-3 and tr.past(3e-3, "high") == 6e-3
  assert tr.past(1e-3, "low") == 5e-4 and tr.past(5e-4, "low") == 2.5e-4
  assert tr.past(1e-2, "high") == 2e-2 and tr.past(2e-2, "high") == 4e-2


def test_stage_one_interior_optimum_is_chosen_per_p():
  grid = _grid(_best(3e-3, 2e-3))
  first = tr.stage_one(grid, "nesterov")
  assert first["todo"] == [] and first["chosen"] == {1: 3e-3, 16: 2e-3}
  # a missing seed leaves the method pending, with exactly the missing rate to train
  grid = _grid(_best(3e-3, 2e-3), skip={("nesterov", 16, 6e-3, 1)})
  first = tr.stage_one(grid, "nesterov")
  assert first["chosen"] is None and first["todo"] == [6e-3]


def test_stage_one_widens_an_edge_optimum_until_interior():
  grid = _grid(_best(3e-3, 4e-4))  # P = 16's true optimum below the grid
  first = tr.stage_one(grid, "muon")
  assert first["chosen"] is None and first["todo"] == [5e-4]
  grid = _grid(_best(3e-3, 4e-4), rates=tr.GRID + (5e-4,))
  assert tr.stage_one(grid, "muon")["todo"] == [2.5e-4]  # 5e-4 is still the edge
  grid = _grid(_best(3e-3, 4e-4), rates=tr.GRID + (5e-4, 2.5e-4))
  first = tr.stage_one(grid, "muon")
  assert first["chosen"] == {1: 3e-3, 16: 5e-4}  # interior now: 2.5e-4 and 1e-3 on either side


def test_stage_one_diverged_rate_has_no_mean_and_cannot_be_chosen():
  grid = _grid(_best(3e-3, 3e-3))
  grid[("rotation", 1)][3e-3][1] = None  # diverged
  first = tr.stage_one(grid, "rotation")
  assert first["chosen"][1] in (2e-3, 6e-3)
  means = dict(zip(first["rows"][1]["rates"], first["rows"][1]["mean"]))
  assert means[3e-3] is None
  by_hand = min((r for r in tr.GRID if r != 3e-3), key=lambda r: np.mean([_loss(r, 3e-3, s) for s in (0, 1)]))
  assert first["chosen"][1] == by_hand


def _first(chosen_1, chosen_16):
  return tr.stage_one(_grid(_best(chosen_1, chosen_16)), "rotation")


def test_stage_two_asks_for_the_candidates_then_the_choice_stands():
  first = _first(3e-3, 2e-3)
  two = tr.stage_two({}, "rotation", first)
  assert two["candidates"] == {1: [2e-3, 3e-3, 6e-3], 16: [1e-3, 2e-3, 3e-3]}
  assert two["todo"] == [1e-3, 2e-3, 3e-3, 6e-3] and two["chosen"] is None
  check = _grid(_best(3e-3, 2e-3, ("rotation",)), rates=(1e-3, 2e-3, 3e-3, 6e-3), seeds=(0,))
  two = tr.stage_two(check, "rotation", first)
  assert two["todo"] == [] and two["chosen"] == {1: 3e-3, 16: 2e-3} and two["moved"] == {1: False, 16: False}


def test_stage_two_moves_to_the_long_horizon_optimum_and_widens_past_its_edge():
  first = _first(3e-3, 3e-3)
  # at 38,400 P = 16 prefers lower rates: its optimum 1.2e-3, below the candidates 2e-3, 3e-3, 6e-3
  check = {("rotation", 1): {r: {0: _loss(r, 3e-3)} for r in (2e-3, 3e-3, 6e-3)},
           ("rotation", 16): {r: {0: _loss(r, 1.2e-3, p=16)} for r in (2e-3, 3e-3, 6e-3)}}
  two = tr.stage_two(check, "rotation", first)
  assert two["decided"] == {1: 3e-3} and two["todo"] == [1e-3] and two["chosen"] is None
  for p, b in ((1, 3e-3), (16, 1.2e-3)):
    check[("rotation", p)][1e-3] = {0: _loss(1e-3, b, p=p)}
  two = tr.stage_two(check, "rotation", first)
  assert two["todo"] == [5e-4]  # 1e-3 is now the lowest trained and the best: one more step past it
  for p, b in ((1, 3e-3), (16, 1.2e-3)):
    check[("rotation", p)][5e-4] = {0: _loss(5e-4, b, p=p)}
  two = tr.stage_two(check, "rotation", first)
  assert two["chosen"] == {1: 3e-3, 16: 1e-3} and two["moved"] == {1: False, 16: True}


def test_sweeps_follow_the_stages_and_the_confirmatory_plan():
  grid = _grid(_best(3e-3, 2e-3), skip={("muon", 1, 1e-2, 0)})
  result = tr.study(grid, {}, here="this CPU")
  commands = tr.sweeps(result, "R")
  assert commands[0] == (f"{tr.SWEEP} --steps 9600 --lr 0.01 --methods muon --seeds 0 1 --out R/t9600")
  assert len(commands) == 1 + 4  # muon's missing run, and the other three methods' stage 2 rates
  assert all("--steps 38400" in c and "--seeds 0 --out R/t38400" in c for c in commands[1:])
  assert "--methods pipedream nesterov rotation" in commands[1]
  chosen = {m: {1: 3e-3, 16: 3e-3} for m in tr.METHODS} | {"nesterov": {1: 3e-3, 16: 2e-3}}
  plan = tr.confirmatory(chosen, "R")
  assert len(plan) == 2 * len(tr.CONFIRMATORY_SEEDS)  # per seed: the P = 16 rates, then nesterov's P = 1
  assert "--lr pipedream=0.003 nesterov=0.002 rotation=0.003 muon=0.003" in plan[0]
  assert "--seeds 6 " in plan[0]
  assert "--stages 1 " in plan[1] and "--lr nesterov=0.003 --methods nesterov --seeds 6 " in plan[1]
  assert "--seeds 11 " in plan[-1]


def _run(method, p, lr, seed, steps, best):
  return {"group": "main", "name": f"{method}_P{p}_lr{lr}_n{steps}_s{seed}", "status": "finished",
          "config": {"method": method, "stages": p, "lr": lr, "seed": seed, "steps": steps, "b2": 0.999},
          "losses": list(np.linspace(5, 2, 300)), "val_steps": [0, 300],
          "val_losses": [5.5, _loss(lr, best, seed, p)], "host": {"cpu": "test CPU", "cores": 2}}


def test_main_end_to_end_and_rebuild(tmp_path, capsys):
  best = {"pipedream": (3e-3, 3e-3), "nesterov": (3e-3, 2e-3), "rotation": (3e-3, 3e-3), "muon": (6e-3, 3e-3)}
  grid = [_run(m, p, lr, s, 9600, b[i]) for m, b in best.items() for i, p in enumerate((1, 16))
          for lr in tr.GRID for s in (0, 1)]
  check = [_run(m, p, lr, 0, 38400, b[i]) for m, b in best.items() for i, p in enumerate((1, 16))
           for lr in tr.GRID]
  for name, runs in (("g", grid), ("c", check)):
    (tmp_path / name).mkdir()
    curves.write(tmp_path / name / curves.FILE, {"window": 21, "command": name}, runs)
  out = tmp_path / "out"
  result = tr.main(["--grid", str(tmp_path / "g"), "--check", str(tmp_path / "c"), "--out", str(out),
                    "--cpu", "test CPU"])
  assert result["chosen"] == {m: {1: b[0], 16: b[1]} for m, b in best.items()}
  report = (out / "report.md").read_text()
  assert "| nesterov | 16 | 0.001, 0.002, 0.003 |" in report and "0.002 (stands)" in report
  assert "test CPU" in report
  # the confirmatory sweeps come next: 6 seeds, with P = 1 sweeps for nesterov and muon
  capsys.readouterr()
  tr.main(["--grid", str(out / "t9600"), "--check", str(out / "t38400-test-cpu"), "--next"])
  printed = capsys.readouterr().out.strip().splitlines()
  assert len(printed) == 12 and all("--out results/long-horizon/confirmatory" in c for c in printed)
  first = (out / "report.md").read_text()
  tr.main(["--grid", str(out / "t9600"), "--check", str(out / "t38400-test-cpu"), "--out", str(out),
           "--cpu", "test CPU"])
  assert (out / "report.md").read_text() == first  # rebuilt from its own merged curves
  # seed 6 finished: its sweeps leave the report, and the command it records rebuilds it as it is
  chosen = result["chosen"]
  seed6 = [{**_run(m, p, chosen[m][p], 6, 38400, chosen[m][p]), "host": {"cpu": "test CPU", "cores": 2}}
           for m in best for p in (1, 16)]
  (tmp_path / "conf").mkdir()
  curves.write(tmp_path / "conf" / curves.FILE, {"window": 21, "command": "conf"}, seed6)
  tr.main(["--grid", str(out / "t9600"), "--check", str(out / "t38400-test-cpu"), "--confirmatory",
           str(tmp_path / "conf"), "--out", str(out), "--cpu", "test CPU"])
  with_six = (out / "report.md").read_text()
  assert with_six.count("--seeds 6 ") == 0 and with_six.count("--seeds 7 ") == 2
  made_by = with_six.splitlines()[2].removeprefix("- made by `python -m experiments.studies.tuned_rates ")
  tr.main(shlex.split(made_by.removesuffix("`")))
  assert (out / "report.md").read_text() == with_six


def _checks(best, rates, cpu):
  return [{**_run(m, p, lr, 0, 38400, b[i]), "host": {"cpu": cpu, "cores": 2}}
          for m, b in best.items() for i, p in enumerate((1, 16)) for lr in rates]


def test_stage_two_counts_on_one_cpu_type(tmp_path, capsys):
  """Amendment 9: stage 2's runs are read per CPU; the type a queue trains on asks for all of its
  missing runs (the other type's runs stand in for none of them); a complete type governs."""
  best = {m: (3e-3, 3e-3) for m in tr.METHODS}
  grid = [_run(m, p, lr, s, 9600, b[i]) for m, b in best.items() for i, p in enumerate((1, 16))
          for lr in tr.GRID for s in (0, 1)]
  old = _checks(best, (2e-3, 3e-3, 6e-3), "old CPU")[:10]  # part of stage 2 on the old type
  new = _checks(best, (2e-3,), "new CPU")  # one rate of it on the new
  for name, runs in (("g", grid), ("c", old + new)):
    (tmp_path / name).mkdir()
    curves.write(tmp_path / name / curves.FILE, {"window": 21, "command": name}, runs)
  args = ["--grid", str(tmp_path / "g"), "--check", str(tmp_path / "c")]
  capsys.readouterr()
  tr.main(args + ["--next", "--cpu", "new CPU"])
  printed = capsys.readouterr().out.strip().splitlines()
  assert [c.split("--lr ")[1].split()[0] for c in printed] == ["0.003", "0.006"]  # 2e-3 done here
  result = tr.main(args + ["--out", str(tmp_path / "out"), "--cpu", "new CPU"])
  assert result["governs"] == "new CPU" and result["chosen"] is None
  assert sorted(p.name for p in (tmp_path / "out").glob("t38400-*")) == ["t38400-new-cpu", "t38400-old-cpu"]
  # the new type completes: it governs, whatever CPU asks
  new = _checks(best, (2e-3, 3e-3, 6e-3), "new CPU")
  curves.write(tmp_path / "c" / curves.FILE, {"window": 21, "command": "c"}, old + new)
  result = tr.main(args + ["--out", str(tmp_path / "out"), "--cpu", "old CPU"])
  assert result["governs"] == "new CPU" and result["chosen"] == {m: {1: 3e-3, 16: 3e-3} for m in tr.METHODS}
  # two complete types break the rule's "no further stage-2 run": an error, not a choice
  curves.write(tmp_path / "c" / curves.FILE, {"window": 21, "command": "c"},
               _checks(best, (2e-3, 3e-3, 6e-3), "old CPU") + new)
  with pytest.raises(ValueError, match="complete on"):
    tr.main(args + ["--next"])


def test_every_rate_diverged_is_an_error():
  grid = _grid(_best(3e-3, 3e-3))
  for lr in tr.GRID:
    grid[("muon", 16)][lr][0] = None
  with pytest.raises(ValueError, match="muon: every rate"):
    tr.stage_one(grid, "muon")


def test_confirmatory_seeds_stay_on_one_cpu_type():
  """Amendment 9's order: a queue finishes the seeds started on its own type, then starts seeds no
  type has started, and retrains a seed begun elsewhere only when nothing else is left."""
  chosen = {m: {1: 3e-3, 16: 2e-3} for m in tr.METHODS}

  def runs(seed, cpu, whole=True):
    cells = [(m, p) for m in tr.METHODS for p in (1, 16)]
    return [{"config": {"method": m, "stages": p, "lr": chosen[m][p], "seed": seed, "steps": 38400},
             "status": "finished", "host": {"cpu": cpu}} for m, p in (cells if whole else cells[:3])]

  assert tr.seed_order(chosen, [], "A") == [6, 7, 8, 9, 10, 11]
  held = runs(6, "A") + runs(7, "B", whole=False) + runs(8, "A", whole=False)
  assert tr.seed_order(chosen, held, "A") == [8, 9, 10, 11]  # 6 done, 7 is B's
  assert tr.seed_order(chosen, held, "B") == [7, 9, 10, 11]
  # a run at another rate does not finish a seed
  wrong = [{**r, "config": {**r["config"], "lr": 1e-3}} for r in runs(9, "A")]
  assert 9 in tr.seed_order(chosen, held + wrong, "A")
  # every unfinished seed begun on B: A retrains the lowest whole
  held = [r for s in range(6, 12) for r in runs(s, "B", whole=s != 10 and s != 11)]
  held = [r for r in held if not (r["config"]["seed"] == 11 and r["config"]["stages"] == 16)]
  assert tr.seed_order(chosen, held, "A") == [10]
  assert tr.seed_order(chosen, held, "B") == [10, 11]
  commands = tr.sweeps({"methods": {}, "chosen": chosen}, "R", [10])
  assert commands and all("--seeds 10 " in c for c in commands)

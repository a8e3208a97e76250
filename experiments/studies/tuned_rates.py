"""``python -m experiments.studies.tuned_rates --grid DIR... --check DIR... --out DIR``: the long
horizon's learning rates, tuned by the rule of docs/protocol.md amendment 8.

Two mechanical stages, on the tuning seeds 0 and 1 (never the confirmatory seeds 6-11):

1. T = 9,600, seeds 0-1: per method the peak rates ``GRID``, each at P = 1 and 16. A (method, P)'s
   optimum is the rate with the lowest seed-mean final validation loss (``lr_grid.row``: a rate with
   a diverged seed has no mean); an optimum on the edge widens that method's grid by a factor of 2
   past the edge, both seeds, until it is interior.
2. T = 38,400, seed 0: per method the stage-1 optimum of each P and its two neighbours on the
   widened grid, each rate at P = 1 and 16. Where the lowest final validation loss at 38,400 among
   a P's three is its stage-1 optimum, the choice stands; otherwise the 38,400 optimum replaces it,
   and while that is the lowest or highest rate trained at 38,400 the next rate past it is trained.

Amendment 9: stage 2 counts on one CPU type (the runs' ``host["cpu"]``). Its runs are read per CPU
(``OUT/t38400-<cpu>``); the type that holds a complete stage 2 governs, and while none does, the
type a queue trains on (``--cpu``, default this machine's) does: ``--next`` asks for its missing
runs.

Each ``--grid`` / ``--check`` folder holds ``curves.json.xz`` of the stage's runs (sweeps'
``--finished-only --publish`` folders, or this study's own ``OUT/t9600`` and ``OUT/t38400``, from
which it rebuilds). Writes ``report.md`` and ``summary.json`` (``chosen``: ``{method: {P: rate}}``
once every rate is decided) and the merged curves, and prints the sweeps still to run; ``--next``
prints only those, one command a line (the queue runs them).
"""

from __future__ import annotations

import argparse
import json
import re

from experiments import cli
from experiments.harness import provenance
from experiments.report import curves
from experiments.studies import lr_grid, out_folder, write_summary

GRID = (1e-3, 2e-3, 3e-3, 6e-3, 1e-2)  # the protocol's grid
METHODS = ("pipedream", "nesterov", "rotation", "muon")
STAGES = (1, 16)
TUNING_SEEDS = (0, 1)
CHECK_SEED = 0
GRID_T, CHECK_T = 9600, 38400
CONFIRMATORY_SEEDS = tuple(range(6, 12))
SWEEP = "python -m experiments.sweep --preset cpu --warmup-steps 28 --stages 16"


def past(rate: float, side: str) -> float:
  """The next grid rate past ``rate`` on ``side`` ("low" or "high"): a ``GRID`` rate, else a factor of
  2 beyond."""
  if side == "low":
    below = [r for r in GRID if r < rate]
    return max(below) if below else rate / 2
  above = [r for r in GRID if r > rate]
  return min(above) if above else rate * 2


def cells(runs, steps: int) -> dict:
  """``{(method, P): {rate: {seed: final validation loss or None}}}`` of the runs of length ``steps``."""
  grid, _ = lr_grid.cells([r for r in runs if r["config"]["steps"] == steps and r["group"] == "main"])
  return grid


def _trained(grid: dict, method: str, rate: float, seeds) -> bool:
  return all(s in grid.get((method, p), {}).get(rate, {}) for p in STAGES for s in seeds)


def stage_one(grid: dict, method: str, seeds=TUNING_SEEDS) -> dict:
  """Stage 1 of one method: ``{"rows": {P: lr_grid.row}, "todo": rates still to train (every seed
  of ``seeds``, both P), "chosen": {P: rate} or None}``; the planned rates are ``GRID`` and every
  widening so far."""
  planned = set(GRID) | {r for p in STAGES for r in grid.get((method, p), {})}
  todo = sorted(r for r in planned if not _trained(grid, method, r, seeds))
  rows = {p: lr_grid.row(method, p, {r: grid.get((method, p), {}).get(r, {}) for r in sorted(planned)},
                         seeds) for p in STAGES}
  if todo:
    return {"rows": rows, "todo": todo, "chosen": None}
  widen = sorted({past(rows[p]["best"], rows[p]["edge"]) for p in STAGES
                  if rows[p]["edge"] in ("low", "high")})
  if any(rows[p]["best"] is None for p in STAGES):
    raise ValueError(f"{method}: every rate of the grid diverged at some P; the rule has no optimum")
  return {"rows": rows, "todo": widen, "chosen": None if widen else {p: rows[p]["best"] for p in STAGES}}


def neighbours(rates, best: float) -> list:
  """``best`` and the rates on either side of it in ``rates`` (sorted)."""
  rates = sorted(rates)
  i = rates.index(best)
  return rates[max(0, i - 1):i + 2]


def stage_two(check: dict, method: str, first: dict, seed: int = CHECK_SEED, steps: int = CHECK_T) -> dict:
  """Stage 2 of one method, given its stage-1 result: ``{"candidates": {P: [rates]}, "finals": {P:
  {rate: loss}}, "todo": rates to train at 38,400, "decided": {P: rate} so far, "chosen": the same
  once both P are decided (else None), "moved": {P: whether the long reading replaced stage 1's}}``
  (``seed``, ``steps``: the check's seed and length, amendment 8's by default)."""
  candidates = {p: neighbours(first["rows"][p]["rates"], first["chosen"][p]) for p in STAGES}
  trained = {r for p in STAGES for r in check.get((method, p), {})}
  planned = {r for c in candidates.values() for r in c} | trained
  todo = {r for r in planned if not _trained(check, method, r, (seed,))}
  finals = {p: {r: check.get((method, p), {}).get(r, {}).get(seed) for r in sorted(planned)}
            for p in STAGES}
  chosen, moved = {}, {}
  for p in STAGES:
    if any(r in todo for r in candidates[p]):
      continue
    scored = {r: v for r, v in finals[p].items() if v is not None and r not in todo}
    if not scored:
      raise ValueError(f"{method} P = {p}: every candidate rate diverged at T = {steps}")
    local = min((r for r in candidates[p] if r in scored), key=scored.get, default=None)
    if local == first["chosen"][p]:
      chosen[p], moved[p] = local, False
      continue
    best = min(scored, key=scored.get)
    edge = "low" if best == min(scored) else "high" if best == max(scored) else None
    if edge:
      todo.add(past(best, edge))
    elif not todo:
      chosen[p], moved[p] = best, True
  return {"candidates": candidates, "finals": finals, "todo": sorted(todo), "decided": chosen,
          "chosen": chosen if len(chosen) == len(STAGES) else None, "moved": moved}


def study(grid: dict, checks: dict, here: str | None = None) -> dict:
  """Both stages for every method, the rates chosen (once all are) and the sweeps still to run.

  ``checks``: ``{CPU: stage-2 cells of the runs trained on it}`` (amendment 9: stage 2 counts on
  one CPU type). The type that holds a complete stage 2 governs; while none does, ``here`` (the
  type a queue trains on) does, and its missing runs are the ones to train."""
  first = {m: stage_one(grid, m) for m in METHODS}
  per_cpu = {cpu: {m: stage_two(check, m, first[m]) if first[m]["chosen"] else None for m in METHODS}
             for cpu, check in checks.items()}
  if here is not None and here not in per_cpu:
    per_cpu[here] = {m: stage_two({}, m, first[m]) if first[m]["chosen"] else None for m in METHODS}
  complete = [cpu for cpu, two in per_cpu.items() if all(v and v["chosen"] for v in two.values())]
  if len(complete) > 1:
    raise ValueError(f"stage 2 is complete on {complete}: amendment 9 stops it once one type completes")
  governs = complete[0] if complete else here
  per = {m: {"stage1": first[m], "stage2": per_cpu[governs][m] if governs in per_cpu else None}
         for m in METHODS}
  chosen = {m: v["stage2"]["chosen"] for m, v in per.items()} if complete else None
  return {"methods": per, "chosen": chosen, "governs": governs, "stage2_by_cpu": per_cpu}


def sweeps(result: dict, results: str, order=CONFIRMATORY_SEEDS) -> list:
  """The sweep commands still to run, one per (T, rate, seeds): stage 1, then stage 2, then (once
  every rate is chosen) the confirmatory runs seed by seed, in ``order`` (``seed_order``)."""
  out = []
  for steps, stage, seeds in ((GRID_T, "stage1", TUNING_SEEDS), (CHECK_T, "stage2", (CHECK_SEED,))):
    by_rate = {}
    for m, v in result["methods"].items():
      for r in (v[stage] or {"todo": ()})["todo"]:
        by_rate.setdefault(r, []).append(m)
    out += [f"{SWEEP} --steps {steps} --lr {r:g} --methods {' '.join(ms)} --seeds "
            f"{' '.join(map(str, seeds))} --out {results}/t{steps}" for r, ms in sorted(by_rate.items())]
  if result["chosen"]:
    out += confirmatory(result["chosen"], results, order)
  return out


def seed_order(chosen: dict, runs, here: str) -> list:
  """Amendment 9: the confirmatory seeds a queue on CPU ``here`` trains, in order: those started and
  unfinished on its own type, then those started on no type; only when every unfinished seed was
  started on other types, the lowest of them (retrained whole here). A seed is finished on a type
  that holds every method at both P at its chosen rates."""
  need = {(m, p, chosen[m][p]) for m in METHODS for p in STAGES}
  held = {}  # (CPU, seed) -> {(method, P, rate)} of its finished runs
  for r in runs:
    c = r["config"]
    if c["steps"] == CHECK_T and r.get("status") == "finished":
      key = ((r.get("host") or {}).get("cpu"), c["seed"])
      held.setdefault(key, set()).add((c["method"], c["stages"], c["lr"]))
  return order_of_seeds(held, need, CONFIRMATORY_SEEDS, here)


def order_of_seeds(held: dict, need: set, seeds, here: str) -> list:
  """Amendment 9's order, from ``held`` (``{(CPU, seed): what its finished runs hold}``) and ``need``
  (what a complete seed holds): the unfinished ``seeds`` started on ``here``, then those started
  nowhere; only when every unfinished seed was started elsewhere, the lowest of them."""
  done = {s for (_, s), got in held.items() if need <= got}
  todo = [s for s in seeds if s not in done]
  mine = [s for s in todo if (here, s) in held]
  fresh = [s for s in todo if not any(seed == s for _, seed in held)]
  return mine + fresh or todo[:1]


def confirmatory(chosen: dict, results: str, order=CONFIRMATORY_SEEDS) -> list:
  """Seed by seed in ``order``: every method at its P = 16 rate (the sweep trains P = 1 beside it),
  plus a P = 1 sweep at the P = 1 rate of each method whose two rates differ."""
  out = []
  for s in order:
    rates = " ".join(f"{m}={chosen[m][16]:g}" for m in METHODS)
    out.append(f"{SWEEP} --steps {CHECK_T} --lr {rates} --methods {' '.join(METHODS)} --seeds {s} "
               f"--out {results}/confirmatory")
    apart = [m for m in METHODS if chosen[m][1] != chosen[m][16]]
    if apart:
      out.append(f"{SWEEP.replace('--stages 16', '--stages 1')} --steps {CHECK_T} --lr "
                 + " ".join(f"{m}={chosen[m][1]:g}" for m in apart)
                 + f" --methods {' '.join(apart)} --seeds {s} --out {results}/confirmatory")
  return out


def _rate_cell(r, loss, best, seeds=()) -> str:
  """The seed mean (bold at the optimum), else the seeds trained so far (``s0 2.1234``), else "-"."""
  if loss is None:
    some = [f"s{s} {v:.4f}" for s, v in zip(TUNING_SEEDS, seeds) if v is not None]
    return ", ".join(some) if some else "-"
  return f"**{loss:.4f}**" if r == best else f"{loss:.4f}"


def _stage_two_rows(per: dict) -> list:
  lines = []
  for m, two in per.items():
    for p in STAGES:
      if two is None:
        lines.append(f"| {m} | {p} | after stage 1 | | |")
        continue
      finals = ", ".join(f"{r:g}: " + ("-" if x is None else f"{x:.4f}") for r, x in two["finals"][p].items())
      chosen = ("pending" if p not in two["decided"] else
                f"{two['decided'][p]:g} ({'moved' if two['moved'][p] else 'stands'})")
      named = ", ".join(f"{r:g}" for r in two["candidates"][p])
      lines.append(f"| {m} | {p} | {named} | {finals} | {chosen} |")
  return lines


def report(result: dict, commands: list, command: str, hosts: list) -> str:
  lines = ["# The long horizon's learning rates (protocol amendments 8 and 9)", "", f"- made by `{command}`",
           "- runs from " + ("one CPU: " if len(hosts) <= 1 else "**more than one CPU**: ")
           + curves.hosts_text(hosts) + (" (stage 1 on one, stage 2 counted per CPU: amendment 9)"
                                         if len(hosts) > 1 else ""),
           f"- stage 1: T = {GRID_T}, seeds {list(TUNING_SEEDS)}, the seed-mean final validation loss per "
           "rate (bold: the optimum; `s0 x`: the seeds trained so far; '-': none yet, or diverged); "
           f"stage 2: T = {CHECK_T}, seed {CHECK_SEED}, the final validation loss per rate", ""]
  rates = sorted({r for v in result["methods"].values() for p in STAGES
                  for r in v["stage1"]["rows"][p]["rates"]})
  lines += ["## Stage 1: T = 9,600", "", "| method | P | " + " | ".join(f"{r:g}" for r in rates)
            + " | optimum |", "|---|---|" + "---|" * (len(rates) + 1)]
  for m, v in result["methods"].items():
    for p in STAGES:
      row = v["stage1"]["rows"][p]
      mean, per_seed = dict(zip(row["rates"], row["mean"])), dict(zip(row["rates"], row["per_seed"]))
      state = ("pending" if v["stage1"]["chosen"] is None else f"{row['best']:g}")
      lines.append(f"| {m} | {p} | " + " | ".join(_rate_cell(r, mean.get(r), row["best"], per_seed.get(r, ()))
                                                  for r in rates) + f" | {state} |")
  for cpu, per in result["stage2_by_cpu"].items():
    role = ("complete: it governs" if cpu == result["governs"] and result["chosen"] else
            "the queue's CPU: its missing runs train next" if cpu == result["governs"] else
            "another CPU type: amendment 9 counts stage 2 on the type that completes it")
    lines += ["", f"## Stage 2: T = 38,400, seed 0, on {cpu} ({role})", "",
              "| method | P | candidates | final per rate | chosen |", "|---|---|---|---|---|"]
    lines += _stage_two_rows(per)
  lines += ["", "## The rates", ""]
  if result["chosen"]:
    lines += ["| method | P = 1 | P = 16 |", "|---|---|---|"]
    lines += [f"| {m} | {c[1]:g} | {c[16]:g} |" for m, c in result["chosen"].items()]
  else:
    lines += ["Not all chosen yet."]
  lines += ["", "## Sweeps still to run", ""] + ([f"- `{c}`" for c in commands] or ["none"]) + [""]
  return "\n".join(lines)


def main(argv=None) -> dict:
  parser = argparse.ArgumentParser(prog="python -m experiments.studies.tuned_rates", description=__doc__,
                                   formatter_class=argparse.RawDescriptionHelpFormatter)
  parser.add_argument("--grid", nargs="*", default=[], help=f"folders of stage 1's runs (T = {GRID_T})")
  parser.add_argument("--check", nargs="*", default=[], help=f"folders of stage 2's runs (T = {CHECK_T})")
  parser.add_argument("--out", help="where to write report.md, summary.json and the merged curves")
  parser.add_argument("--results", default="results/long-horizon", help="the sweeps' --out prefix in "
                      "the printed commands (default results/long-horizon)")
  parser.add_argument("--next", action="store_true", help="print only the sweeps still to run")
  parser.add_argument("--confirmatory", nargs="*", default=[], help="folders of the confirmatory runs "
                      "so far (amendment 9: --next orders the seeds by the CPU types that hold them)")
  parser.add_argument("--cpu", help="the CPU type a queue trains on, whose stage-2 runs --next asks "
                      "for while no type holds a complete stage 2 (default: this machine's)")
  args = parser.parse_args(argv)
  grid = curves.merge(args.grid, block=lr_grid.BLOCK) if args.grid else None
  cpus = curves.cpus_of(args.check)
  checks = {cpu: curves.merge(args.check, block=lr_grid.BLOCK, cpu=cpu) for cpu in cpus}
  here = args.cpu or provenance.host()["cpu"]
  result = study(cells(grid["runs"] if grid else [], GRID_T),
                 {cpu: cells(m["runs"], CHECK_T) for cpu, m in checks.items()}, here)
  done = [r for f in args.confirmatory for r in curves.read(f)["runs"]]
  order = seed_order(result["chosen"], done, here) if result["chosen"] else CONFIRMATORY_SEEDS
  commands = sweeps(result, args.results, order)
  out = out_folder(args, commands)
  if out is None:
    return result
  folders = {f"t{GRID_T}": grid} | {f"t{CHECK_T}-{slug(cpu)}": m for cpu, m in checks.items()}
  folders = {name: m for name, m in folders.items() if m}
  checked = [f"{out}/{name}" for name in folders if name != f"t{GRID_T}"]
  sources = [f"--grid {out}/t{GRID_T}"] if grid else []
  sources += [f"--check {' '.join(checked)}"] if checked else []
  # the confirmatory folders decide the sweeps still to run: the command rebuilds the report only with them
  sources += [f"--confirmatory {' '.join(args.confirmatory)}"] if args.confirmatory else []
  command = (f"python -m experiments.studies.tuned_rates {' '.join(sources)} --cpu '{here}' "
             f"--out {out}")
  for name, m in folders.items():
    (out / name).mkdir(exist_ok=True)
    curves.write(out / name / curves.FILE, m["meta"], m["runs"])
  hosts = curves.hosts_of([r for m in folders.values() for r in m["runs"]])
  (out / "report.md").write_text(report(result, commands, command, hosts))
  summary = {"command": command, "hosts": hosts, "chosen": result["chosen"], "sweeps_to_run": commands,
             "governs": result["governs"], "methods": result["methods"],
             "stage2_by_cpu": result["stage2_by_cpu"]}
  write_summary(out, summary)
  print(f"wrote {out}/report.md: " + ("rates chosen: " + json.dumps(result["chosen"]) if result["chosen"]
                                      else f"{len(commands)} sweeps still to run"))
  return result


def slug(cpu: str) -> str:
  """A CPU's name as a folder suffix: ``"AMD EPYC"`` -> ``"amd-epyc"``."""
  return re.sub(r"[^a-z0-9]+", "-", cpu.lower()).strip("-")


if __name__ == "__main__":
  cli.exit_process(cli.run(main))

"""``python -m experiments.studies.lr_grid SOURCE [SOURCE ...] --out DIR``: is the shared rate interior?

docs/protocol.md fixes the rule before the runs: per method, at P = 1 and at the largest P, T = 2,400,
the peak rates 1e-3, 2e-3, 3e-3, 6e-3 and 1e-2 over seeds 0-1; the optimum is the rate with the
lowest seed-mean final validation loss; a grid whose optimum is on its edge is widened by factors of
2 past that edge until the optimum is interior. The shared rate (the preset's 3e-3) stays if it lies
within one grid step of every method's P = 1 optimum.

Each SOURCE is a folder holding ``curves.json.xz`` (a sweep's ``--finished-only --publish`` folder, a
published study such as docs/results/cpu, or this study's own ``--out``). Runs are keyed by
(method, P, rate, seed); runs of another setting than the most common one (a statistics decay, a
b1, a model) are left out and counted in the report. PipeDream-LR at P = 1 *is* PipeDream (PipeMare's
correction divides the rate by the delay, and P = 1 has none: ``pipeline_sim.pipemare_lr_schedule``),
so PipeDream-LR's P = 1 cells read PipeDream's runs.

Writes ``report.md`` (per method and P: the seed-mean final validation loss per rate, the optimum,
whether it is interior, the rule's verdict on the shared rate), ``lr.png`` and ``summary.json``, and
the merged runs as ``curves.json.xz`` with the training loss stored as block means of ``BLOCK``
steps (the grid reads only final validation losses; ``--out`` as the only SOURCE rebuilds it).
"""

from __future__ import annotations

import argparse
import pathlib

import numpy as np

from experiments import cli
from experiments.harness.methods import BASELINES
from experiments.report import curves, metrics, plots, tables
from experiments.studies import write_summary

SHARED = 3e-3  # the preset's shared peak rate
BLOCK = 100  # training-loss block mean stored per run
SAME_AT_P1 = {"pipedream-lr": "pipedream"}  # methods equal to another one at P = 1
SETTING_FREE = ("method", "stages", "lr", "seed", "tag")  # config fields a grid cell may vary


def merged(sources) -> tuple[dict, list]:
  """``(meta, compacted runs)`` of ``sources``, each run once (the same name must be the same run)."""
  data = curves.merge(sources, block=BLOCK)
  return data["meta"], data["runs"]


def cells(runs) -> tuple[dict, int]:
  """``({(method, P): {rate: {seed: final validation loss or None}}}, runs left out)``: the runs of
  the most common setting, PipeDream-LR's P = 1 read from PipeDream's."""
  if not runs:
    return {}, 0
  settings = [curves.setting(r["config"], SETTING_FREE) for r in runs]
  setting = max(sorted(set(settings)), key=settings.count)
  grid, left_out = {}, 0
  for r, mine in zip(runs, settings):
    c = r["config"]
    if mine != setting:
      left_out += 1
      continue
    grid.setdefault((c["method"], c["stages"]), {}).setdefault(c["lr"], {})[c["seed"]] = metrics.final_val(r)
  for method, alias in SAME_AT_P1.items():  # the alias's runs fill (and agree with) the method's own
    if (alias, 1) in grid and any(m == method for m, _ in grid):
      own, other = grid.get((method, 1), {}), grid[(alias, 1)]
      grid[(method, 1)] = {lr: {**own.get(lr, {}), **other.get(lr, {})} for lr in sorted({*own, *other})}
  return grid, left_out


def row(method: str, stages: int, by_rate: dict, seeds) -> dict:
  """One (method, P): seed-mean final validation loss per rate over ``seeds`` (a rate missing a seed
  or holding a diverged run has no mean), the optimum and whether it is interior: a rate with a mean
  on either side of it (``edge``: ``low``, ``high``, or ``both`` while it is the only one)."""
  rates = sorted(by_rate)
  mean = {}
  for lr in rates:
    vals = [by_rate[lr].get(s) for s in seeds]
    mean[lr] = float(np.mean(vals)) if all(v is not None for v in vals) else None
  done = [lr for lr in rates if mean[lr] is not None]
  best = min(done, key=lambda lr: mean[lr]) if done else None
  edge = (None if best is None else "both" if len(done) == 1 else "low" if best == done[0]
          else "high" if best == done[-1] else None)
  return {"method": method, "P": stages, "rates": rates, "mean": [mean[lr] for lr in rates],
          "per_seed": [[by_rate[lr].get(s) for s in seeds] for lr in rates], "best": best,
          "interior": best is not None and edge is None, "edge": edge}


def shared_rule(rows, shared: float = SHARED) -> dict:
  """The protocol's rule at P = 1: the shared rate is within one grid step of every method's optimum
  (``None``: some method's P = 1 optimum is missing or on the grid's edge)."""
  ones = [r for r in rows if r["P"] == 1]
  why = {}
  for r in ones:
    if r["best"] is None or not r["interior"] or shared not in r["rates"]:
      why[r["method"]] = None
      continue
    steps = abs(r["rates"].index(r["best"]) - r["rates"].index(shared))
    why[r["method"]] = steps
  ok = None if not ones or any(v is None for v in why.values()) else all(v <= 1 for v in why.values())
  return {"shared": shared, "keeps": ok, "grid_steps_to_optimum": why}


def readings(grid: dict, rows, seeds) -> dict:
  """The staleness gap read at the shared rate and at each P's own optimum (the protocol's "per-P
  tuned reading beside the shared one"): per method and seed the final validation loss at the
  largest P minus at P = 1, and per seed the final-loss staleness gain of rotation and Muon, the
  smallest baseline gap over the method's (> 1: it loses less to staleness than every baseline)."""
  best = {(r["method"], r["P"]): r["best"] for r in rows}
  top = max((p for _, p in best), default=1)
  gaps = []
  for method in sorted({m for m, p in best if p == 1 and (m, top) in best and top > 1}):
    for name, r1, rp in (("shared", SHARED, SHARED), ("tuned", best[(method, 1)], best[(method, top)])):
      one, stale = grid[(method, 1)].get(r1, {}), grid[(method, top)].get(rp, {})
      gaps.append({"method": method, "reading": name, "rates": [r1, rp], "P": top, "gap": [
          None if one.get(s) is None or stale.get(s) is None else stale[s] - one[s] for s in seeds]})
  gains = []
  for name in ("shared", "tuned"):
    by = {g["method"]: g["gap"] for g in gaps if g["reading"] == name}
    base = [m for m in BASELINES if m in by]
    for method in ("rotation", "muon"):
      if method in by and base:
        per_seed = []
        for i in range(len(seeds)):
          vals = [by[m][i] for m in base + [method]]
          ok = all(v is not None and v > 0 for v in vals)
          per_seed.append(min(by[m][i] for m in base) / by[method][i] if ok else None)
        gains.append({"method": method, "reading": name, "baselines": base, "per_seed": per_seed})
  return {"gaps": gaps, "gains": gains}


def study(runs, seeds) -> tuple[list, dict, int, dict]:
  grid, left_out = cells(runs)
  rows = [row(m, p, grid[(m, p)], seeds) for m, p in sorted(grid, key=lambda k: (k[1], k[0]))]
  return rows, shared_rule(rows), left_out, readings(grid, rows, seeds)


def _cell(r, i) -> str:
  m = r["mean"][i]
  if m is None:
    return "-"
  vals = [v for v in r["per_seed"][i] if v is not None]
  text = f"{m:.4f} [{min(vals):.4f}, {max(vals):.4f}]"
  return f"**{text}**" if r["rates"][i] == r["best"] else text


def write(rows, rule, left_out, read, meta, seeds, out: pathlib.Path, command: str) -> dict:
  out.mkdir(parents=True, exist_ok=True)
  rates = sorted({lr for r in rows for lr in r["rates"]})
  lines = ["# Learning-rate grid: is the shared rate interior?", "", f"- made by `{command}`",
           "- the sweeps: " + "; ".join(f"`{c}`" for c in meta["sweeps"]),
           f"- seeds {list(seeds)}; per cell the seed-mean final validation loss [min, max] over the seeds "
           "(bold: the optimum); '-' where a seed's run is missing or diverged",
           f"- runs of another setting left out: {left_out}", "",
           "| method | P | " + " | ".join(f"{lr:g}" for lr in rates) + " | optimum | interior? |",
           "|---|---|" + "---|" * len(rates) + "---|---|"]
  for r in rows:
    cells_ = [_cell(r, r["rates"].index(lr)) if lr in r["rates"] else "" for lr in rates]
    interior = ("yes" if r["interior"] else "no (one rate so far)" if r["edge"] == "both"
                else f"no ({r['edge']} edge: widen)" if r["edge"] else "-")
    best = "-" if r["best"] is None else f"{r['best']:g}"
    lines.append(f"| {r['method']} | {r['P']} | " + " | ".join(cells_) + f" | {best} | {interior} |")
  verdict = {True: f"**kept**: {rule['shared']:g} lies within one grid step of every method's P = 1 optimum",
             False: f"**changed**: {rule['shared']:g} lies more than one grid step from some method's P = 1 "
                    "optimum (the study reruns at a new shared rate and says so)",
             None: "**not decided yet**: some method's P = 1 optimum is missing or on the grid's edge"}
  lines += ["", "The shared rate (docs/protocol.md): " + verdict[rule["keeps"]] + "; grid steps from "
            "the shared rate to each P = 1 optimum: " + ", ".join(
                f"{m} {'-' if v is None else v}" for m, v in rule["grid_steps_to_optimum"].items()), "",
            "![final validation loss per rate](lr.png)", ""]
  if read["gaps"]:
    lines += ["## The staleness gap at the shared rate and at each P's own optimum", "",
              f"Per seed the final validation loss at P = {read['gaps'][0]['P']} minus at P = 1, mean [min, "
              "max] over the seeds, with the rates (P = 1, largest P) it is read at; then the final-loss "
              "staleness gain, the smallest baseline gap over the method's (> 1: it loses less to "
              f"staleness than every baseline). {len(seeds)} seeds: a reading, not a verdict.", "",
              "| method | reading | rates | gap |", "|---|---|---|---|"]
    lines += [f"| {g['method']} | {g['reading']} | {g['rates'][0]:g}, {g['rates'][1]:g} | "
              f"{tables.spread(g['gap'], '{:+.4f}', '-')} |" for g in read["gaps"]]
    lines += ["", "| method | reading | staleness gain (final loss) |", "|---|---|---|"]
    lines += [f"| {g['method']} | {g['reading']} | {tables.spread(g['per_seed'], '{:.2f}', '-')} |"
              for g in read["gains"]]
    lines += [""]
  (out / "report.md").write_text("\n".join(lines))
  lines_ = {f"{r['method']} P = {r['P']}": [(lr, m) for lr, m in zip(r["rates"], r["mean"]) if m is not None]
            for r in rows}
  plots.series(lines_, out / "lr.png", "final validation loss per peak learning rate (seed mean)",
               "peak learning rate", "final validation loss")
  summary = {"command": command, "sweeps": meta["sweeps"], "seeds": list(seeds), "rows": rows,
             "shared_rate": rule, "left_out": left_out, "readings": read}
  return write_summary(out, summary)


def main(argv=None):
  parser = argparse.ArgumentParser(prog="python -m experiments.studies.lr_grid", description=__doc__,
                                   formatter_class=argparse.RawDescriptionHelpFormatter)
  parser.add_argument("sources", nargs="+", help=f"folders holding {curves.FILE}")
  parser.add_argument("--seeds", nargs="+", type=int, default=[0, 1], help="the grid's seeds (default 0 1)")
  parser.add_argument("--out", required=True, help="where to write report.md, lr.png, summary.json and "
                      f"the merged {curves.FILE}")
  args = parser.parse_args(argv)
  meta, runs = merged(args.sources)
  rows, rule, left_out, read = study(runs, args.seeds)
  if not rows:
    raise ValueError(f"no runs in {args.sources}")
  out = pathlib.Path(args.out)
  command = (f"python -m experiments.studies.lr_grid {args.out} --seeds {' '.join(map(str, args.seeds))} "
             f"--out {args.out}")  # rebuilds from --out alone
  summary = write(rows, rule, left_out, read, meta, args.seeds, out, command)
  curves.write(out / curves.FILE, meta, runs)
  print(f"wrote {out / 'report.md'}: shared rate kept: {rule['keeps']}; optima " + "; ".join(
      f"{r['method']} P={r['P']}: {r['best']}" for r in rows))
  return summary


if __name__ == "__main__":
  cli.exit_process(cli.run(main))

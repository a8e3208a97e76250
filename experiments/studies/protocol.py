"""``python -m experiments.studies.protocol``: which parts of the study's protocol move its verdicts.

The default study (``python -m experiments.sweep``) shows rotation leading the baselines at P = 1
by more than at P = 16. Before reading that as a property of the method, this study varies the
protocol around the preset, one factor at a time, at P = 1 and the largest P, with several seeds:

1. **Warm-up measured in delays.** The paper warms up over 1.2% of a run that is hundreds of delays
   long; 1.2% of a CPU run is about two delays of the first stage (tau_max = P - 1). The preset's
   fraction is compared with warm-ups of ``K * tau_max`` steps (``--warmup-delays``), the same
   schedule at every P.
2. **Second-moment memory** ``b2`` (Adam's, Nesterov's and rotation's statistics): the preset's
   0.999 against ``--b2`` values.
3. **Learning rates tuned at every P.** Each method's peak rate on a grid of multiples of the
   preset's rate (``--lr-grid``), at P = 1 and at the largest P, full-length runs, chosen on the
   final validation loss averaged over the seeds; a grid whose best rate lies on its edge is extended
   (``--extend``), and a choice still on the edge is flagged. Three
   readings side by side: rates tuned at P = 1 (used at every P), rates tuned at each P, and an
   equal-rate control (every method at ``--equal-lr``).

For every setting: the own-level slowdown (the headline) of each method from P = 1 to the largest P, the
staleness gain of rotation's advantage over the best baseline (``experiments.report.metrics``), the final
smoothed loss at the largest P, and how long the largest P takes to get below the early plateau
(first step with smoothed loss <= ``--plateau``). Every run is a cached sweep run in
``--out/runs`` (resumable, identity-named); with the default ``--out`` the default sweep's runs
are reused. Writes ``protocol.md``, ``protocol.json`` and figures into ``--out``.
"""

from __future__ import annotations

import argparse
import json
import pathlib
import sys
import time

import numpy as np

from experiments import cli
from experiments.harness import data as data_lib
from experiments.harness import processes, provenance
from experiments.harness.methods import BASELINES, RECORDED
from experiments.report import metrics, plots, tables
from experiments.sweep import folders, presets, workers
from experiments.sweep import plan as plan_lib

METHODS = ("pipedream", "nesterov", "rotation")


def parse_args(argv=None):
  p = argparse.ArgumentParser(prog="python -m experiments.studies.protocol", description=__doc__,
                              formatter_class=argparse.RawDescriptionHelpFormatter)
  p.add_argument("--preset", default="cpu", help="the preset whose protocol is varied (default cpu)")
  p.add_argument("--top", type=int, default=16, help="the largest P (default 16)")
  p.add_argument("--seeds", nargs="+", type=int, default=[0, 1])
  p.add_argument("--methods", nargs="+", default=list(METHODS),
                 help="methods of the warm-up and b2 studies (default pipedream nesterov rotation)")
  p.add_argument("--warmup-delays", nargs="*", type=float, default=[4, 16],
                 help="warm-ups of K * tau_max steps compared with the preset's fraction")
  p.add_argument("--b2", nargs="*", type=float, default=[0.99], help="b2 values compared with 0.999")
  p.add_argument("--b2-seeds", nargs="+", type=int, help="seeds of the b2 study (default: --seeds)")
  p.add_argument("--lr-methods", nargs="*", default=list(BASELINES) + ["rotation"],
                 help="methods whose rates are tuned (default: every main method; none: skip)")
  p.add_argument("--lr-grid", nargs="+", type=float, default=[0.5, 1.0, 2.0],
                 help="multiples of each method's preset rate tried at P = 1 and the largest P")
  p.add_argument("--extend", type=int, default=2,
                 help="times a grid is extended (x0.5 or x2) while its choice lies on an edge (default 2)")
  p.add_argument("--jobs", type=int, help="runs trained at once (default and rules: the sweep's --jobs)")
  p.add_argument("--equal-lr", type=float, default=3e-3,
                 help="the equal-rate control's one rate (must lie on every tuned method's grid)")
  p.add_argument("--plateau", type=float, default=3.0,
                 help="smoothed loss that counts as below the early plateau (default 3.0)")
  p.add_argument("--out", default="results/cpu",
                 help="results folder (default: the default sweep's, whose runs are reused)")
  p.add_argument("--publish", default=None, help="also copy protocol.md and its figures here")
  return p.parse_args(argv)


def _validate(args, preset):
  if args.top < 2:
    raise ValueError(f"--top must be >= 2, got {args.top}")
  if not args.seeds:
    raise ValueError("--seeds: give at least one seed")
  for k in args.warmup_delays:
    if not k > 0:
      raise ValueError(f"--warmup-delays must be > 0, got {k:g}")
  for b in args.b2:
    if not 0 < b < 1:
      raise ValueError(f"--b2 must be in (0, 1), got {b:g}")
  for g in args.lr_grid:
    if not g > 0:
      raise ValueError(f"--lr-grid multiples must be > 0, got {g:g}")
  for m in args.lr_methods:
    if not any(np.isclose(preset.learning_rate(m) * g, args.equal_lr) for g in args.lr_grid):
      raise ValueError(f"--equal-lr {args.equal_lr:g} is not on {m}'s grid "
                       f"{[preset.learning_rate(m) * g for g in args.lr_grid]}")


def settings(args, preset) -> dict:
  """``{label: (run-config overrides, seeds)}`` of the warm-up and b2 studies (the preset first)."""
  t = preset.template
  tau = args.top - 1
  b2 = dict(preset.settings).get("b2", RECORDED["b2"])  # every method's own unless --b2
  base = f"preset: warm-up {t.warmup_fraction:.1%} ({int(t.warmup_fraction * t.steps)} steps), b2 {b2:g}"
  out = {base: ({}, args.seeds)}
  for k in args.warmup_delays:
    out[f"warm-up {k:g} tau_max ({int(round(k * tau))} steps)"] = ({"warmup_steps": int(round(k * tau))},
                                                                   args.seeds)
  for b in args.b2:
    seeds = args.b2_seeds or args.seeds
    out[f"b2 {b:g}" + (f" (seeds {seeds})" if seeds != args.seeds else "")] = ({"b2": b}, seeds)
  return out


def summarize(results, top: int, window: int, level: float) -> dict:
  """Per-seed study tables of one setting reduced to what the protocol report compares:
  ``{method: {field: [per-seed values]}}`` with the own-level slowdown (the headline), the staleness gain,
  the final smoothed loss at ``top`` and at P = 1, and the plateau exit at P = 1 and ``top``."""
  curves = tables.curves_by(results)
  baselines = tuple(m for m in BASELINES if any(k[0] == m for k in curves))
  per_seed = tables.seed_tables(curves, window, baselines)
  seeds = sorted(set.intersection(*(set(v) for v in curves.values())))
  out = {}
  for m in sorted({k[0] for k in curves}):
    at = lambda p: [next((r for r in t if r["method"] == m and r["stages"] == p), None) for t in per_seed]
    rows, rows_1 = at(top), at(1)
    out[m] = {
        "slowdown_levels": [r and r["slowdown_levels"] for r in rows],
        "staleness_gain": [r and r["staleness_gain"] for r in rows],
        "final": [r and r["final"] for r in rows],
        "final_1": [r and r["final"] for r in rows_1],
        "plateau_1": [metrics.iterations_to(curves[(m, 1)][s], level, window) for s in seeds],
        "plateau_top": [metrics.iterations_to(curves[(m, top)][s], level, window) for s in seeds],
    }
  return out


def _table(summaries: dict, methods, top: int, level: float) -> list:
  head = (["setting"] + [f"{m} slowdown" for m in methods] + ["rotation staleness gain"]
          + [f"{m} final at P={top} (P=1)" for m in methods]
          + [f"{m} steps to {level:g} at P={top}" for m in methods])
  lines = ["| " + " | ".join(head) + " |", "|---" * len(head) + "|"]
  for label, s in summaries.items():
    spread = tables.spread
    cells = ([spread(s[m]["slowdown_levels"]) if m in s else "" for m in methods]
             + [spread(s["rotation"]["staleness_gain"]) if "rotation" in s else ""]
             + [f"{spread(s[m]['final'], '{:.3f}')} ({spread(s[m]['final_1'], '{:.3f}')})" if m in s else ""
                for m in methods]
             + [spread(s[m]["plateau_top"], "{:.0f}") if m in s else "" for m in methods])
    lines.append(f"| {label} | " + " | ".join(cells) + " |")
  return lines


def val_loss(result: dict) -> float:
  """``metrics.final_val`` with ``inf`` for a run that diverged or did not finish (ranked last)."""
  v = metrics.final_val(result)
  return np.inf if v is None else v


def choose(grid_results: dict) -> tuple[float, bool]:
  """(rate with the lowest seed-mean final validation loss, whether it lies inside the grid)."""
  rates = sorted(grid_results)
  means = [np.mean([val_loss(r) for r in grid_results[lr]]) for lr in rates]
  i = int(np.argmin(means))
  return rates[i], 0 < i < len(rates) - 1


def main(argv=None) -> pathlib.Path:
  args = parse_args(argv)
  if args.preset not in presets.PRESETS:
    raise ValueError(f"unknown preset {args.preset!r}; choose from {sorted(presets.PRESETS)}")
  preset = presets.PRESETS[args.preset]
  _validate(args, preset)
  if args.publish:
    folders.check_folder(pathlib.Path(args.publish), "--publish")
  jobs = plan_lib.resolve_jobs(args.jobs, preset.template)
  provenance.code_version()
  t = preset.template
  top, window = args.top, preset.window()
  make = lambda m, p, s, **kw: preset.config(m, p, s, **kw)  # kw: fields and run settings
  study = settings(args, preset)
  grid = {(m, p): [preset.learning_rate(m) * g for g in sorted(args.lr_grid)]
          for m in args.lr_methods for p in (1, top)}
  planned = {label: [make(m, p, s, **over) for s in seeds for m in args.methods for p in (1, top)]
             for label, (over, seeds) in study.items()}
  planned_lr = {(m, p, lr): [make(m, p, s, lr=lr) for s in args.seeds]
                for (m, p), rates in grid.items() for lr in rates}
  for c in [c for cs in (*planned.values(), *planned_lr.values()) for c in cs]:
    c.validate()  # every planned run, before the first one trains
  ds = data_lib.load(None, context=t.model_config(256).context)
  out = folders.prepare_out(pathlib.Path(args.out))
  t0 = time.time()
  with folders.exclusive(out), workers.overall_bar(0, "protocol") as overall:
    def run_all(configs):
      overall.total += len(configs)
      overall.refresh()
      return workers.run_all(configs, ds, out, overall, jobs)

    by_setting = {label: run_all(cs) for label, cs in planned.items()}
    lr_runs = {key: run_all(cs) for key, cs in planned_lr.items()}
    for (m, p), rates in grid.items():  # a choice on the grid's edge: one more rate beyond it
      for _ in range(args.extend):
        lr, interior = choose({x: lr_runs[(m, p, x)] for x in rates})
        if interior:
          break
        new = rates[0] / 2 if lr == rates[0] else rates[-1] * 2
        lr_runs[(m, p, new)] = run_all([make(m, p, s, lr=new) for s in args.seeds])
        rates[:] = sorted(rates + [new])
  wall = time.time() - t0
  record = {"preset": args.preset, "top": top, "seeds": args.seeds, "window": window,
            "plateau": args.plateau, "wall_seconds": wall, "code": provenance.code_version(),
            "settings": {}, "learning_rates": {}}
  given = sys.argv[1:] if argv is None else list(argv)
  command = " ".join(["python -m experiments.studies.protocol"] + given)
  summaries = {label: summarize(rs, top, window, args.plateau) for label, rs in by_setting.items()}
  record["command"] = command
  record["settings"] = {label: {"overrides": study[label][0], "seeds": study[label][1], "summary": s}
                        for label, s in summaries.items()}
  lines = [f"# Protocol study (preset `{args.preset}`, P = 1 and P = {top}, seeds {args.seeds})", "",
           f"Command: `{command}`  ",
           f"Code: {record['code']}; {wall:.0f} s wall (cached runs take no time).", "",
           "Slowdown: the headline, from P = 1 to P = top (median over the loss levels the method's "
           "own two runs share of t_P / t_1). Staleness gain: median over the levels rotation's and "
           "the best baseline's runs share of the baseline's slowdown over rotation's (> 1: the lead "
           "grows with staleness). Final: smoothed "
           f"training loss at the end. Steps to {args.plateau:g}: first step whose smoothed loss is "
           "below the early plateau. Each cell: mean [min, max] over seeds.", "",
           "## Warm-up and b2", "", *_table(summaries, args.methods, top, args.plateau), ""]
  if args.lr_methods:
    lines += lr_section(args, grid, lr_runs, top, window, record, out)
  fig = out / "protocol_warmup_loss.png"
  curves = {(label, p): np.mean([tables.curve_of(r) for r in rs if r["config"]["method"] == "rotation"
                                 and r["config"]["stages"] == p], axis=0)
            for label, rs in by_setting.items() for p in (1, top) if "rotation" in args.methods}
  if curves:
    plots.loss_curves(curves, window, fig, "rotation: smoothed loss per protocol setting (seed mean)")
    lines += ["## Figures", "", f"![{fig.name}]({fig.name})", ""]
  if args.lr_methods:
    lines += ["![protocol_lr.png](protocol_lr.png)", ""]
  (out / "protocol.md").write_text("\n".join(lines) + "\n")
  processes.write_json(out / "protocol.json", json.loads(json.dumps(record, default=float)))
  if args.publish:
    folders.publish(out, pathlib.Path(args.publish),
                    [out / "protocol.md", *sorted(out.glob("protocol_*.png"))])
  print(f"done in {wall:.0f}s: {out / 'protocol.md'}")
  return out


def lr_section(args, grid, lr_runs, top, window, record, out) -> list:
  """The learning-rate tuning table and the three readings (tuned at P = 1, at each P, equal)."""
  chosen = {}
  lines = ["## Learning rates tuned at P = 1 and at P = top", "",
           f"Final validation loss (mean over seeds) per peak rate: the grid {args.lr_grid} x each "
           f"method's preset rate, extended by x0.5 or x2 (up to {args.extend} times) while the best "
           "lies on its edge; the chosen rate in bold; a choice still on the edge is flagged.", "",
           "| method | P | rate: final validation loss | chosen |", "|---|---|---|---|"]
  for m in args.lr_methods:
    for p in (1, top):
      lr, interior = choose({lr: lr_runs[(m, p, lr)] for lr in grid[(m, p)]})
      chosen[(m, p)] = lr
      cells = []
      for x in grid[(m, p)]:
        v = np.mean([val_loss(r) for r in lr_runs[(m, p, x)]])
        text = f"{x:g}: {v:.3f}" if np.isfinite(v) else f"{x:g}: diverged"
        cells.append(f"**{text}**" if x == lr else text)
      flag = "" if interior else " (grid edge)"
      lines.append(f"| {m} | {p} | " + ", ".join(cells) + f" | {lr:g}{flag} |")
      record["learning_rates"][f"{m} P={p}"] = {"chosen": lr, "interior": interior, "trials": {
          str(x): [val_loss(r) for r in lr_runs[(m, p, x)]] for x in grid[(m, p)]}}
  readings = {
      "rates tuned at P = 1": {(m, p): chosen[(m, 1)] for m in args.lr_methods for p in (1, top)},
      "rates tuned at each P": {(m, p): chosen[(m, p)] for m in args.lr_methods for p in (1, top)},
      f"equal rate {args.equal_lr:g}": {(m, p): next(x for x in grid[(m, p)] if np.isclose(x, args.equal_lr))
                                        for m in args.lr_methods for p in (1, top)},
  }
  summaries = {}
  for label, rates in readings.items():
    results = [r for (m, p), lr in rates.items() for r in lr_runs[(m, p, lr)]]
    summaries[label] = summarize(results, top, window, args.plateau)
    record["learning_rates"][label] = {"rates": {f"{m} P={p}": lr for (m, p), lr in rates.items()},
                                       "summary": summaries[label]}
  lines += ["", "## Three readings of the same runs", "",
            *_table(summaries, args.lr_methods, top, args.plateau), ""]
  series = {f"{m} P={p}": [(x, float(np.mean([val_loss(r) for r in lr_runs[(m, p, x)]])))
                           for x in grid[(m, p)]] for m in args.lr_methods for p in (1, top)}
  series = {k: [(x, y if np.isfinite(y) else None) for x, y in v] for k, v in series.items()}
  plots.series(series, out / "protocol_lr.png", "final validation loss against the peak rate",
               "peak learning rate", "final validation loss (seed mean)")
  return lines


if __name__ == "__main__":
  cli.exit_process(cli.run(main))

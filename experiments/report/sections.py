"""Report sections: the main study and each ablation's tables and figures (``experiments.report``
assembles them; ``experiments.report.ablations`` names the section of each ablation)."""

from __future__ import annotations

import collections
import dataclasses
import pathlib

import numpy as np

import pipeline_sim as ps
from experiments.harness.methods import BASELINES
from experiments.report import metrics, plots
from experiments.report.tables import (
  cell,
  curves_by,
  mean_curves,
  pivot,
  seed_tables,
  stage_aware_rows,
  step_seconds_by,
  study_rows,
)


@dataclasses.dataclass
class Context:
  """What a report section needs: the output folder, smoothing window, the main study's results
  and the list of figures written so far (sections append theirs)."""

  out: pathlib.Path
  window: int
  main_results: list
  figures: list
  intervals: bool = True  # t intervals in the tables (not with fewer seeds than a verdict needs)


def study_figures(ctx: Context, curves: dict, rows: list, name: str, title: str) -> None:
  plots.loss_curves(mean_curves(curves), ctx.window, ctx.out / f"{name}_loss.png", title)
  ctx.figures.append(f"{name}_loss.png")
  if len({p for _, p in curves}) > 1:
    plots.slowdown_vs_stages(rows, ctx.out / f"{name}_slowdown.png", title)
    ctx.figures.append(f"{name}_slowdown.png")


def main_section(ctx: Context, results) -> tuple[list, list]:
  """The main study's report lines and its per-seed tables (``seed_tables``)."""
  curves = curves_by(results)
  tables = seed_tables(curves, ctx.window, seconds=step_seconds_by(results))
  rows = metrics.aggregate(tables)
  stages = sorted({p for _, p in curves})
  top = stages[-1]
  baselines = sorted({m for m, _ in curves if m in BASELINES})
  study_figures(ctx, curves, rows, "main", "main study")
  lines = ["## Slowdown at the method's own levels (the headline)", "",
           f"Per seed, the median over {metrics.NUM_LEVELS} loss levels of the iterations at P over "
           "the iterations at P = 1. The levels come from the method's own two runs, so no other "
           "method moves it: the P = 1 run's smoothed loss at steps evenly spaced in its training, "
           "down to the lowest loss both runs reach. Mean [min, max] over seeds and Student's t 95% "
           "interval of the mean.", "",
           pivot(rows, "slowdown_levels", ci=ctx.intervals, none="no shared levels"), ""]
  if top > 1:
    lines += window_lines(ctx, curves, rows, top)
    plots.level_slowdowns(per_level(tables, top), ctx.out / "main_levels.png",
                          f"slowdown per level at P = {top} (one line per seed)")
    ctx.figures.append("main_levels.png")
  if not baselines:
    lines += ["## Comparisons with a baseline", "",
              "Not measured: this sweep has no baseline (" + ", ".join(BASELINES) + "), so there "
              "is no target, advantage, staleness gain or percent fewer.", ""]
  else:
    named = ", ".join(baselines)
    lines += [
        "## Advantage over the best baseline and its staleness gain", "",
        f"Best baseline: the lowest final smoothed loss at P = {top} among {named}, per seed. "
        "Advantage at P: median over the levels its runs and the method's runs (P = 1 and P) share "
        "of the best baseline's iterations over the method's. Staleness gain: median over those "
        "levels of the baseline's slowdown over the method's (> 1: the lead grows with "
        "staleness, as the paper claims; < 1: it shrinks).", "",
        "Advantage:", "", pivot(rows, "advantage", none="no shared levels"), "",
        "Staleness gain:", "", pivot(rows, "staleness_gain", ci=ctx.intervals, none="no shared levels",
                                     stages=[p for p in stages if p > 1]), "",
        f"## Percent fewer iterations than the best baseline, to the P = {top} target", "",
        f"Target: the best baseline's final smoothed loss at P = {top}. The P = 1 column is the "
        "control: how much faster each method is without staleness, to the same loss.", "",
        pivot(rows, "fewer_top", "{:+.1f}%", "never"), ""]
    shared = max((r.get("jobs") or 1 for r in results), default=1)
    lines += ["## Wall-clock to the target at P (seconds)", "",
              "Iterations to the best baseline's final loss at P times the run's measured "
              "steady-state seconds per step (the CPU analogue of the paper's GPU hours).", "",
              pivot(rows, "seconds", "{:.0f}") if shared == 1 else
              f"Not measured: runs were trained {shared} at a time (`--jobs`), so their seconds "
              "per step include the others' load; `--jobs 1` times every run alone.", "",
              "## Iterations to the target at P (best baseline's final loss at P)", "",
              pivot(rows, "iters", "{:.0f}"), "",
              "Slowdown from P = 1 to that target:", "", pivot(rows, "slowdown"), "",
              "Percent fewer than the best baseline to that target:", "",
              pivot(rows, "fewer", "{:+.1f}%", "never"), ""]
  lines += ["## Slowdown from P = 1, each method to its own final loss at P", "",
            "Iterations at P / iterations at P = 1 to reach the loss the method reaches at P.", "",
            pivot(rows, "slowdown_own"), "",
            "## Final smoothed training loss", "", pivot(rows, "final", "{:.4f}", "diverged"), ""]
  return lines, tables


def per_level(tables, p: int) -> dict:
  """``{method: [(levels, ratios) per seed]}`` of the headline at P (its per-level slowdowns)."""
  out = collections.defaultdict(list)
  for rows in tables:
    for r in rows:
      if r["stages"] == p and len(r["per_level"]["levels"]):
        out[r["method"]].append((r["per_level"]["levels"], r["per_level"]["ratios"]))
  return dict(out)


def window_lines(ctx: Context, curves, rows, top: int) -> list:
  """The headline at P = top with half and double the smoothing window."""
  at = {w: {r["method"]: r for r in metrics.aggregate(seed_tables(curves, w)) if r["stages"] == top}
        for w in (max(1, ctx.window // 2), ctx.window * 2)}
  mine = {r["method"]: r for r in rows if r["stages"] == top}
  half, double = at
  lines = [f"How the headline at P = {top} moves with the smoothing window (centred, in steps):", "",
           f"| method | window {2 * metrics.half_window(half) + 1} | window "
           f"{2 * metrics.half_window(ctx.window) + 1} (reported) | window "
           f"{2 * metrics.half_window(double) + 1} |", "|---|---|---|---|"]
  for m in sorted(mine, key=lambda m: (m not in BASELINES, m)):
    lines.append(f"| {m} | " + " | ".join(cell(t[m], "slowdown_levels", none="no shared levels")
                                          for t in (at[half], mine, at[double])) + " |")
  return lines + [""]


def study_section(ctx: Context, name: str, results, *, with_main_baselines=False,
                  show_baselines=True, fewer=False, bars=False) -> list:
  """An ablation shown like the main study: own-target slowdown and final loss per (method, P).

  Args:
    with_main_baselines: add the main study's baseline runs at the ablation's P values.
    show_baselines: keep the baselines' rows in the tables.
    fewer: add the percent-fewer table.
    bars: add a bar chart of the own-target slowdown at the largest P.
  """
  stages = {r["config"]["stages"] for r in results}
  if with_main_baselines:
    seeds = {r["config"]["seed"] for r in results}
    results = list(results) + [r for r in ctx.main_results if r["config"]["method"] in BASELINES
                               and r["config"]["stages"] in stages and r["config"]["seed"] in seeds]
  curves = curves_by(results)
  rows = study_rows(curves, ctx.window)
  study_figures(ctx, curves, rows, f"ablation_{name}", f"ablation: {name}")
  if not show_baselines:
    rows = [r for r in rows if r["method"] not in BASELINES]
  lines = ["Slowdown at the method's own levels (median over the levels its P = 1 and P runs share):",
           "", pivot(rows, "slowdown_levels", ci=ctx.intervals, none="no shared levels"), "",
           "Slowdown from P = 1 to the method's own final loss at P:", "", pivot(rows, "slowdown_own"), ""]
  if fewer:
    lines += ["Percent fewer iterations than the best baseline (to its final loss at P):", "",
              pivot(rows, "fewer", "{:+.1f}%", "never"), ""]
  lines += ["Final smoothed loss:", "", pivot(rows, "final", "{:.4f}", "diverged"), ""]
  if bars:
    top = max(stages)
    vals = {r["method"]: r["slowdown_own"] for r in rows
            if r["stages"] == top and r["method"] not in BASELINES}
    plots.bars(vals, ctx.out / f"ablation_{name}_bars.png", f"{name}: slowdown at P={top}", "slowdown")
    ctx.figures.append(f"ablation_{name}_bars.png")
  return lines


def stage_aware_section(ctx: Context, name: str, results, *, methods: tuple) -> list:
  """Iterations of each refresh allocation to the worst final loss of the allocations, per seed."""
  curves = curves_by(results)
  top, rows = stage_aware_rows(curves, methods, ctx.window)
  lines = [f"Target per seed: the worst final smoothed loss of the allocations, P = {top}.", "",
           "| allocation | iterations | speed-up vs uniform |", "|---|---|---|"]
  bar_vals = {m: row["iters"] for m, row in rows.items()}
  for m, row in rows.items():
    lines.append(f"| {m} | {cell(row, 'iters', '{:.0f}')} | {cell(row, 'speed', '{:+.1f}%', 'n/a')} |")
  lines.append("")
  plots.bars(bar_vals, ctx.out / f"ablation_{name}_bars.png",
             f"stage-aware refresh at P={top}: iterations to target", "iterations")
  plots.loss_curves(mean_curves(curves), ctx.window, ctx.out / f"ablation_{name}_loss.png",
                    f"ablation: {name}")
  ctx.figures += [f"ablation_{name}_bars.png", f"ablation_{name}_loss.png"]
  return lines


def size_section(ctx: Context, name: str, results, size_of, label: str) -> list:
  """Per model size (``size_of(result)``, printed under ``label``): each method's headline
  slowdown from P = 1 to the size's largest P, rotation's advantage over the best baseline at both,
  its staleness gain, and each method's final smoothed loss at the largest P (at P = 1 in brackets);
  and a figure of the seed-mean curves per size at the largest P."""
  sizes = sorted({size_of(r) for r in results})
  methods = sorted({r["config"]["method"] for r in results}, key=lambda m: (m not in BASELINES, m))
  baselines = tuple(m for m in BASELINES if m in methods)
  lines = [f"| {label} | P | " + " | ".join(f"{m} slowdown" for m in methods)
           + " | rotation advantage P=1 / P=top | rotation staleness gain | "
           + " | ".join(f"{m} final at P=top (P=1)" for m in methods) + " |",
           "|---|---|" + "---|" * (2 * len(methods) + 2)]
  figure = {}
  for size in sizes:
    group = [r for r in results if size_of(r) == size]
    top = max(r["config"]["stages"] for r in group)
    curves = curves_by(group)
    rows = study_rows(curves, ctx.window, baselines)
    at = lambda m, p: next((r for r in rows if r["method"] == m and r["stages"] == p), None)
    rot1, rot = at("rotation", 1), at("rotation", top)
    final = lambda m: (f"{cell(at(m, top), 'final', '{:.3f}', 'diverged') if at(m, top) else ''}"
                       f" ({cell(at(m, 1), 'final', '{:.3f}', 'diverged') if at(m, 1) else ''})")
    lines.append(
        f"| {size} | {top} | "
        + " | ".join(cell(at(m, top), "slowdown_levels") if at(m, top) and top > 1 else "" for m in methods)
        + f" | {cell(rot1, 'advantage') if rot1 else ''} / {cell(rot, 'advantage') if rot else ''}"
        + f" | {cell(rot, 'staleness_gain') if rot and top > 1 else ''} | "
        + " | ".join(final(m) for m in methods) + " |")
    figure.update({(f"{m} {label}={size}", top): c for (m, p), c in mean_curves(curves).items() if p == top})
  if figure:
    plots.loss_curves(figure, ctx.window, ctx.out / f"ablation_{name}_loss.png",
                      f"seed-mean smoothed loss at the largest P, per {label}")
    ctx.figures.append(f"ablation_{name}_loss.png")
  return lines + [""]


def diagnostics_section(ctx: Context, results) -> list:
  """Update diagnostics of the runs that logged them (``RunConfig.diagnose_every``): per method and
  P, per stage (delay tau_k), the mean over the logged windows and seeds of the cosines between the
  stale and the fresh update (whole, and the gradient's own part) and of the sign-flip rate along
  the top eigenvectors; a figure of the three against tau_k (``diagnostics.png``)."""
  logged = [r for r in results if r.get("diagnostics")]
  if not logged:
    return []
  by = collections.defaultdict(list)
  for r in logged:
    c = r["config"]
    by[(c["method"], c["stages"], c["mode"], c.get("schedule", "1f1b"))] += r["diagnostics"]
  lines = ["## Update diagnostics", "",
           "Per stage (its delay tau_k): cosine between the update it applies (stale gradient) and the "
           "one it would apply with a fresh gradient from the same state, whole (momentum included, "
           "so near 1 with a high b1 whatever the delay) and the gradient's own part u(g) - u(0) "
           "(the preconditioned gradient without the shared momentum); sign-flip rate of consecutive "
           "updates along the top eigenvectors of the window's gradient statistics (oscillation). "
           "Means over the logged windows and seeds; n/a: logged before the gradient cosine existed.", "",
           "| method | P | mode | whole-update cosine by tau_k (stage 0 first) | gradient cosine | "
           "flip rate |", "|---|---|---|---|---|---|"]
  figure = {"cosine": {}, "gradient cosine": {}, "flip rate": {}}
  for (m, p, mode, schedule), entries in sorted(by.items()):
    cos = np.nanmean([e["cosine"] for e in entries], axis=0)
    gcos = (np.nanmean([e["gradient_cosine"] for e in entries], axis=0)
            if all("gradient_cosine" in e for e in entries) else None)
    flips = np.nanmean([e["flip_rate"] for e in entries], axis=0)
    delays = ps.stage_delays(p, schedule)
    row = lambda values, spec: ", ".join(f"{t}: {x:{spec}}" for t, x in zip(delays, values))
    label = mode + (f", {schedule}" if schedule != "1f1b" and p > 1 else "")
    lines.append(f"| {m} | {p} | {label} | {row(cos, '.3f')} | "
                 f"{'n/a' if gcos is None else row(gcos, '.3f')} | {row(flips, '.2f')} |")
    for name, values in (("cosine", cos), ("gradient cosine", gcos), ("flip rate", flips)):
      if values is not None:
        figure[name][f"{m} P={p} {mode}" + (f" {schedule}" if schedule != "1f1b" and p > 1 else "")] = sorted(
            (t, float(x) if np.isfinite(x) else None) for t, x in zip(delays, values) if t > 0)
  plots.panels(figure, ctx.out / "diagnostics.png", "update diagnostics per stage against its delay",
               "tau_k (log scale)")
  ctx.figures.append("diagnostics.png")
  return lines + [""]

"""``results.csv``, ``report.md`` and figures of a sweep (the paper's section 5 tables).

Every table is computed per seed (``metrics.study_table``) and shown as the mean over seeds with
the min-max range in brackets when there are several seeds (``metrics.aggregate``); the figures
show the seed-averaged loss curves.
"""

from __future__ import annotations

import argparse
import collections
import csv
import dataclasses
import pathlib
import re

import numpy as np

from experiments import metrics, plots
from experiments import model as model_lib
from experiments.methods import ALLOCATIONS, BASELINES, VARIANTS


def curve_of(result: dict) -> np.ndarray:
  """Per-step losses of a run; a run that diverged or did not finish gets ``inf`` where it has no
  finite loss, so that it is never credited (``metrics.credited``)."""
  losses = np.asarray(result["losses"], np.float64)
  if result["status"] != "finished":
    losses = np.where(np.isfinite(losses), losses, np.inf)
    if np.all(np.isfinite(losses)):
      losses[-1] = np.inf
  return losses


def final_loss(result: dict, window: int) -> float:
  return metrics.final_smoothed(curve_of(result), window)


def curves_by(results, key=lambda config: config["method"]) -> dict:
  """``{(key, P): {seed: per-step losses}}``."""
  groups = collections.defaultdict(dict)
  for r in results:
    c = r["config"]
    groups[(key(c), c["stages"])][c["seed"]] = curve_of(r)
  return dict(groups)


def mean_curves(curves: dict) -> dict:
  """Seed-averaged curves (a diverged seed makes the mean diverge), for the figures."""
  return {k: np.mean(list(v.values()), axis=0) for k, v in curves.items()}


def step_seconds_by(results, key=lambda config: config["method"]) -> dict:
  """``{(key, P): {seed: steady-state seconds per step}}`` (runs that measured it alone: a run
  trained beside others, ``jobs`` > 1, is left out)."""
  groups = collections.defaultdict(dict)
  for r in results:
    c = r["config"]
    if r.get("steps_per_second") and (r.get("jobs") or 1) == 1:
      groups[(key(c), c["stages"])][c["seed"]] = 1.0 / r["steps_per_second"]
  return dict(groups)


def seed_tables(curves: dict, window: int, baselines=BASELINES, seconds: dict | None = None) -> list:
  """One study table (``metrics.study_table``) per seed that every curve shares; ``seconds``
  (``step_seconds_by``) adds the wall-clock to target."""
  seeds = sorted(set.intersection(*(set(v) for v in curves.values()))) if curves else []
  seconds = seconds or {}
  return [metrics.study_table({k: v[s] for k, v in curves.items()}, baselines, window,
                              step_seconds={k: v[s] for k, v in seconds.items() if s in v})
          for s in seeds]


def study_rows(curves: dict, window: int, baselines=BASELINES, seconds: dict | None = None) -> list:
  """Per-seed study tables aggregated over the seeds every curve shares."""
  return metrics.aggregate(seed_tables(curves, window, baselines, seconds))


def fmt(x, spec="{:.2f}", none="never"):
  if x is None:
    return none
  if isinstance(x, float) and not np.isfinite(x):
    return "diverged"
  return spec.format(x)


def cell(row, field, spec="{:.2f}", none="never"):
  """``mean`` or, over several seeds, ``mean [min, max]``."""
  text = fmt(row[field], spec, none)
  if row.get("seeds", 1) > 1 and row[field] is not None:
    text += f" [{spec.format(row[field + '_lo'])}, {spec.format(row[field + '_hi'])}]"
  return text


def pivot(rows, field, spec="{:.2f}", none="never"):
  stages = sorted({r["stages"] for r in rows})
  methods = sorted({r["method"] for r in rows}, key=lambda m: (m not in BASELINES, m))
  lines = ["| method | " + " | ".join(f"P={p}" for p in stages) + " |",
           "|---|" + "---|" * len(stages)]
  by = {(r["method"], r["stages"]): r for r in rows}
  for m in methods:
    lines.append(f"| {m} | " + " | ".join(
        cell(by[(m, p)], field, spec, none) if (m, p) in by else "" for p in stages) + " |")
  return "\n".join(lines)


@dataclasses.dataclass
class Context:
  """What a report section needs: the output folder, smoothing window, the main study's results
  and the list of figures written so far (sections append theirs)."""

  out: pathlib.Path
  window: int
  main_results: list
  figures: list


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
  shared = max((r.get("jobs") or 1 for r in results), default=1)
  rows = metrics.aggregate(tables)
  study_figures(ctx, curves, rows, "main", "main study")
  lines = ["## Slowdown at common targets (the headline)", "",
           f"Median over {metrics.NUM_LEVELS} loss levels that every run of the seed reaches of the "
           "iterations at P over the iterations at P = 1 (the same levels for every method).", "",
           pivot(rows, "slowdown_common"), "",
           "## Advantage over the best baseline and its staleness gain", "",
           "Advantage: median over the common levels of the best baseline's iterations over the "
           "method's, at P. Staleness gain: advantage at P / advantage at P = 1 (> 1: the lead grows "
           "with staleness, as the paper claims; < 1: it shrinks).", "",
           "Advantage:", "", pivot(rows, "advantage"), "",
           "Staleness gain:", "", pivot(rows, "staleness_gain"), "",
           "## Wall-clock to the target at P (seconds)", "",
           "Iterations to the best baseline's final loss at P times the run's measured steady-state "
           "seconds per step (the CPU analogue of the paper's GPU hours).", "",
           pivot(rows, "seconds", "{:.0f}") if shared == 1 else
           f"Not measured: runs were trained {shared} at a time (`--jobs`), so their seconds per "
           "step include the others' load, and the sweep's last runs ran partly alone (faster); "
           "`--jobs 1` times every run alone.", "",
           "## Slowdown from P = 1, each method to its own final loss at P", "",
           "Iterations at P / iterations at P = 1 to reach the loss the method reaches at P.", "",
           pivot(rows, "slowdown_own"), "",
           "## Slowdown from P = 1 to the target at P (best baseline's final loss)", "",
           pivot(rows, "slowdown"), "",
           "## Iterations to the target at P", "", pivot(rows, "iters", "{:.0f}"), "",
           "## Percent fewer iterations than the best baseline at P", "",
           pivot(rows, "fewer", "{:+.1f}%", "never"), "",
           "## Final smoothed training loss", "", pivot(rows, "final", "{:.4f}", "diverged"), "",
           "## Against the sync run's final loss (PipeDream at P = 1)", "",
           "Slowdown:", "", pivot(rows, "slowdown_sync"), "",
           "Iterations:", "", pivot(rows, "iters_sync", "{:.0f}"), ""]
  return lines, tables


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
  lines = ["Slowdown at common targets (median over the loss levels every run of the seed reaches):", "",
           pivot(rows, "slowdown_common"), "",
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


def stage_aware_rows(curves, methods: tuple, window: int):
  """Per allocation: iterations to the worst final smoothed loss of the allocations (per seed) and
  the speed-up over the first (uniform) allocation, as mean and [min, max] over seeds."""
  top = max(p for _, p in curves)
  seeds = sorted(set.intersection(*(set(v) for v in curves.values())))
  per_seed = []
  for s in seeds:
    finals = [metrics.final_smoothed(v[s], window) for v in curves.values()]
    target = max(finals) if all(np.isfinite(finals)) else None
    per_seed.append({m: metrics.iterations_to(curves[(m, top)][s], target, window)
                     for m in methods if (m, top) in curves})
  rows = {}
  for m in methods:
    its = [it.get(m) for it in per_seed]
    speeds = [metrics.ratio(it.get(methods[0]), it.get(m)) for it in per_seed]
    row = {"seeds": len(seeds)}
    for field, vals in (("iters", its), ("speed", [None if v is None else 100 * (v - 1) for v in speeds])):
      ok = bool(vals) and all(v is not None for v in vals)
      row[field] = float(np.mean(vals)) if ok else None
      row[field + "_lo"], row[field + "_hi"] = (min(vals), max(vals)) if ok else (None, None)
    row["per_seed"] = speeds
    rows[m] = row
  return top, rows


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


def width_of(result) -> int:
  """A result's model width (its config's override, else the named model's)."""
  c = result["config"]
  return c.get("width") or model_lib.CONFIGS[c["model"]].width


def blocks_of(result) -> int:
  """A result's block count (its config's override, else the named model's)."""
  c = result["config"]
  return c.get("num_blocks") or model_lib.CONFIGS[c["model"]].num_blocks


def size_section(ctx: Context, name: str, results, size_of, label: str) -> list:
  """Per model size (``size_of(result)``, printed under ``label``): each method's common-target
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
        + " | ".join(cell(at(m, top), "slowdown_common") if at(m, top) and top > 1 else "" for m in methods)
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
  P, per stage (delay tau_k), the mean over the logged windows and seeds of the cosine between the
  stale and the fresh update and of the sign-flip rate along the top eigenvectors; a figure of both
  against tau_k (``diagnostics.png``)."""
  logged = [r for r in results if r.get("diagnostics")]
  if not logged:
    return []
  by = collections.defaultdict(list)
  for r in logged:
    c = r["config"]
    by[(c["method"], c["stages"], c["mode"])] += r["diagnostics"]
  lines = ["## Update diagnostics", "",
           "Per stage (its delay tau_k): cosine between the update it applies (stale gradient) and the "
           "one it would apply with a fresh gradient from the same state; sign-flip rate of consecutive "
           "updates along the top eigenvectors of the window's gradient statistics (oscillation). Means "
           "over the logged windows and seeds.", "",
           "| method | P | mode | cosine by tau_k (stage 0 first) | flip rate by tau_k |",
           "|---|---|---|---|---|"]
  figure = {"cosine": {}, "flip rate": {}}
  for (m, p, mode), entries in sorted(by.items()):
    cos = np.nanmean([e["cosine"] for e in entries], axis=0)
    flips = np.nanmean([e["flip_rate"] for e in entries], axis=0)
    taus = [p - 1 - k for k in range(p)]
    lines.append(f"| {m} | {p} | {mode} | " + ", ".join(f"{t}: {x:.3f}" for t, x in zip(taus, cos))
                 + " | " + ", ".join(f"{t}: {x:.2f}" for t, x in zip(taus, flips)) + " |")
    for name, values in (("cosine", cos), ("flip rate", flips)):
      figure[name][f"{m} P={p} {mode}"] = sorted(
          (t, float(x) if np.isfinite(x) else None) for t, x in zip(taus, values) if t > 0)
  plots.panels(figure, ctx.out / "diagnostics.png", "update diagnostics per stage against its delay",
               "tau_k (log scale)")
  ctx.figures.append("diagnostics.png")
  return lines + [""]


def _at(rows, method, p):
  return next((r for r in rows if r["method"] == method and r["stages"] == p), None)


def verdict(checks) -> str:
  """One claim's verdict from its per-seed checks ``[(holds, reason if not)]``: reproduced only
  when it holds in every seed; otherwise not reproduced, with the failing seeds' reasons. A run
  that diverged, or a target never reached, fails the claim with its reason (never "n/a")."""
  if not checks:
    return "**not reproduced** (not measured)"
  fails = [reason for ok, reason in checks if not ok]
  if not fails:
    return "reproduced" + (f" (all {len(checks)} seeds)" if len(checks) > 1 else "")
  seeds = f"{len(fails)} of {len(checks)} seeds: " if len(checks) > 1 else ""
  return f"**not reproduced** ({seeds}{'; '.join(dict.fromkeys(fails))})"


def _least(values: dict, method: str):
  """(holds, reason) for "``method``'s value is the smallest": a missing value of another method
  (diverged, never reached) counts as infinitely large, a missing own value fails."""
  own = values.get(method)
  if own is None:
    return False, f"{method} diverged or never reached its own loss"
  others = {m: (np.inf if v is None else v) for m, v in values.items() if m != method}
  best = min(others, key=others.get) if others else None
  if best is None or own < others[best]:
    return True, None
  return False, f"{best} {others[best]:.2f} <= {method} {own:.2f}"


def _fewer(row, what: str = "rotation"):
  """(holds, reason) for "fewer iterations than the best baseline" from one seed's row."""
  if row is None:
    return False, f"{what}: no run"
  if row["fewer"] is not None:
    return row["fewer"] > 0, None if row["fewer"] > 0 else f"{row['fewer']:+.1f}%"
  if row["final"] is None:
    return False, f"{what} diverged or did not finish"
  if row["target"] is None:
    return False, "no baseline finished (no target)"
  return False, f"{what} never reached the best baseline's final loss"


def _final(row) -> float:
  """A row's final smoothed loss; ``inf`` for a run that diverged or did not finish."""
  return np.inf if row is None or row["final"] is None else row["final"]


def claims_section(ctx: Context, main_tables, groups) -> list:
  """Each claim of the paper that this sweep measured: the paper's number, ours (mean [min, max]
  over seeds) and the verdict from per-seed checks (``verdict``).

  Args:
    main_tables: the main study's per-seed tables (``seed_tables``).
    groups: ``{ablation name: results}``.
  """
  out = []
  main_rows = metrics.aggregate(main_tables)

  def add(claim, paper, ours, checks):
    out.append(f"| {claim} | {paper} | {ours} | {verdict(checks)} |")

  def study(name):
    tables = seed_tables(curves_by(groups[name]), ctx.window)
    rows = metrics.aggregate(tables)
    return tables, rows, max(r["stages"] for r in rows)

  top = max((r["stages"] for r in main_rows), default=1)
  if main_rows and top == 1:
    out.append("| every claim about staleness | P up to 32 | this sweep ran P = 1 only | not measured |")
  elif main_rows:
    rot = _at(main_rows, "rotation", top)
    base = [b for b in BASELINES if _at(main_rows, b, top)]
    if rot is not None and base:
      for field, how in (("slowdown_own", ""),
                         ("slowdown_common", " at common targets (median over levels)")):
        add(f"rotation slows down least from P = 1 to P = {top}{how}",
            "1.27x vs PipeDream 5.81x, PipeDream-LR 4.24x, Nesterov ~4x (P = 32)",
            f"rotation {cell(rot, field)}; " + ", ".join(f"{b} {cell(_at(main_rows, b, top), field)}"
                                                         for b in base),
            [_least({m: (_at(rows, m, top) or {}).get(field) for m in base + ["rotation"]}, "rotation")
             for rows in main_tables])
      add(f"rotation's lead over the best baseline grows with staleness (staleness gain, P = {top})",
          "the lead is almost entirely specific to staleness (> 1)", cell(rot, "staleness_gain"),
          [(r is not None and r["staleness_gain"] is not None and r["staleness_gain"] > 1,
            "rotation diverged or shares no levels" if r is None or r["staleness_gain"] is None
            else f"gain {r['staleness_gain']:.2f}")
           for r in (_at(rows, "rotation", top) for rows in main_tables)])
      add(f"rotation needs fewer iterations than the best baseline at P = {top}",
          "71.6% fewer (95M, P = 32)", cell(rot, "fewer", "{:+.1f}%", "never"),
          [_fewer(_at(rows, "rotation", top)) for rows in main_tables])
  if "variants" in groups:
    tables, rows, vtop = study("variants")
    for field, how in (("slowdown_own", ""), ("slowdown_common", " at common targets")):
      add(f"second-order bilateral slows down least of the 2 x 2 taxonomy (P = {vtop}){how}",
          "2nd/bi 1.27, 2nd/uni 1.66, 1st/bi 1.77, 1st/uni 2.55",
          ", ".join(f"{m} {cell(_at(rows, m, vtop), field)}" if _at(rows, m, vtop) else f"{m} no run"
                    for m in VARIANTS),
          [_least({m: (_at(r, m, vtop) or {}).get(field) for m in VARIANTS}, "rotation") for r in tables])
  if "stage-aware" in groups:
    _, rows = stage_aware_rows(curves_by(groups["stage-aware"]), ALLOCATIONS, ctx.window)
    why = "an allocation diverged or never reached the target"
    for method, claim, paper, sign in (
        ("rotation-sa", "stage-aware (proportional) refresh converges faster than uniform at equal "
         "budget", "+29.2%", 1), ("rotation-sa-reverse", "reverse allocation does worse than uniform",
                                  "worse", -1)):
      add(claim, paper, cell(rows[method], "speed", "{:+.1f}%", "never"),
          [(v is not None and sign * (v - 1) > 0, why if v is None else f"{100 * (v - 1):+.1f}%")
           for v in rows[method]["per_seed"]])
  if "no-stashing" in groups and main_rows and top > 1:
    tables, _, ntop = study("no-stashing")
    names = [m for m in BASELINES + ("rotation",) if _at(main_rows, m, ntop)]
    # final-loss change without stashing, per seed; inf when the run without stashing diverged
    per_seed = [{m: _final(_at(b, m, ntop)) - _final(_at(a, m, ntop)) for m in names}
                for a, b in zip(main_tables, tables)]
    mean = {m: float(np.mean([d[m] for d in per_seed])) for m in names}

    def check(d):
      if not np.isfinite(d["rotation"]):
        return False, "rotation diverged or did not finish"
      worse = [m for m in names if m != "rotation" and d[m] <= d["rotation"]]
      return not worse, f"rotation degrades more than {', '.join(worse)}" if worse else None

    add(f"without weight stashing rotation degrades less than every baseline (final-loss change, "
        f"P = {ntop})", "baselines severely, rotation barely",
        ", ".join(f"{m} {v:+.3f}" if np.isfinite(v) else f"{m} diverged" for m, v in mean.items()),
        [check(d) for d in per_seed])
  if "refresh-period" in groups:
    tables, rows, rtop = study("refresh-period")
    a, b = _at(rows, "rotation", rtop), _at(rows, "rotation-T100", rtop)
    add(f"refresh period 10 beats 100 (final loss, P = {rtop})", "T = 10 better",
        f"{cell(a, 'final', '{:.3f}', 'diverged')} vs {cell(b, 'final', '{:.3f}', 'diverged')}",
        [(_final(_at(r, "rotation", rtop)) < _final(_at(r, "rotation-T100", rtop)),
          "T = 100 ends lower" if np.isfinite(_final(_at(r, "rotation", rtop))) else "T = 10 diverged")
         for r in tables])
    if main_rows and rtop == top:
      best = lambda rows: min(_final(_at(rows, x, top)) for x in BASELINES)
      add(f"even with refresh period 100 rotation ends below every baseline (final loss, P = {top})",
          "T = 100 still leads the baselines",
          f"rotation-T100 {cell(b, 'final', '{:.3f}', 'diverged')}; " + ", ".join(
              f"{x} {cell(_at(main_rows, x, top), 'final', '{:.3f}', 'diverged')}" for x in BASELINES
              if _at(main_rows, x, top)),
          [(_final(_at(r, "rotation-T100", top)) < best(m),
            f"T = 100 ends at {_final(_at(r, 'rotation-T100', top)):.3f}, a baseline at {best(m):.3f}")
           for r, m in zip(tables, main_tables)])
  if "moe" in groups:
    tables, rows, mtop = study("moe")
    rot = _at(rows, "rotation", mtop)
    add(f"rotation helps a mixture-of-experts model (P = {mtop})", "fewer iterations",
        cell(rot, "fewer", "{:+.1f}%", "never") if rot else "no run",
        [_fewer(_at(r, "rotation", mtop)) for r in tables])
  if "scaling" in groups:
    # rotation's final loss at P = blocks, per size; P = 1 controls are the size section's business
    curves = curves_by([r for r in groups["scaling"] if r["config"]["stages"] == blocks_of(r)])
    sizes = sorted({p for _, p in curves})
    seeds = sorted(set.intersection(*(set(v) for v in curves.values())))
    fin = lambda p, s: (metrics.final_smoothed(curves[("rotation", p)][s], ctx.window)
                        if ("rotation", p) in curves else np.nan)
    seqs = [[fin(p, s) for p in sizes] for s in seeds]
    mean = np.mean(seqs, axis=0) if seqs else []
    add("with rotation, bigger models (blocks = P grown together) reach lower loss", "bigger is better",
        ", ".join(f"B=P={p}: {v:.3f}" for p, v in zip(sizes, mean)),
        [(all(np.isfinite(q)) and all(y < x for x, y in zip(q, q[1:])),
          "a run diverged" if not all(np.isfinite(q)) else "the loss does not fall with size")
         for q in seqs])
  if not out:
    return []
  return ["## The paper's claims, checked", "",
          "Verdicts are per seed: reproduced only when the claim holds in every seed; a run that "
          "diverged, or a target never reached, fails the claim.", "",
          "| claim | paper | ours (mean [min, max] over seeds) | verdict |", "|---|---|---|---|"] + out + [""]


def write_csv(path: pathlib.Path, results, window: int) -> None:
  with open(path, "w", newline="") as f:
    w = csv.writer(f)
    w.writerow(["name", "method", "stages", "mode", "model", "num_blocks", "seed", "lr", "steps",
                "status", "final_smoothed_loss", "final_val_loss", "seconds", "steps_per_second"])
    for r in results:
      c = r["config"]
      # A run that diverged or did not finish has no final validation loss (not an earlier one).
      val = r["val_losses"][-1:] if r["status"] == "finished" else []
      val = [v for v in val if np.isfinite(v)]
      sps = r.get("steps_per_second")
      w.writerow([r["name"], c["method"], c["stages"], c["mode"], c["model"], c["num_blocks"] or "",
                  c["seed"], c["lr"], c["steps"], r["status"], f"{final_loss(r, window):.5f}",
                  f"{val[-1]:.5f}" if val else "", f"{r['seconds']:.2f}",
                  f"{sps:.1f}" if sps else ""])


def write(out: pathlib.Path, preset, main_results, ablation_results, registry, ds, wall_seconds: float,
          deviations=(), command: str | None = None, code: dict | None = None) -> list:
  """Writes results.csv, report.md and the figures into ``out``; returns the main study's rows.

  Args:
    registry: ``{ablation name: Ablation}`` whose ``section`` renders that ablation.
    deviations: lines listing how this preset differs from the paper.
    command: the command line that made the report (recorded in its header).
    code: ``{"version", "commit"}`` of the code that wrote it (``runs.code_version()``).
  """
  window = preset.window()
  everything = list(main_results) + [r for _, r in ablation_results]
  write_csv(out / "results.csv", everything, window)
  ctx = Context(out, window, list(main_results), [])
  seeds = sorted({r["config"]["seed"] for r in everything})
  t = preset.template
  warmup = (f"{t.warmup_steps} steps" if t.warmup_steps is not None else f"{t.warmup_fraction:.1%}")
  trained = sum(r.get("seconds") or 0.0 for r in everything)
  code_of = lambda r: (r.get("versions") or {}).get("code") or {}
  commits = sorted({str(code_of(r).get("commit"))[:12] for r in everything})
  code = code or {}
  lines = [f"# Staleness study: preset `{preset.name}`", "",
           f"- made by `{command or 'python -m experiments.sweep'}` (code {code.get('version')}, commit "
           f"{str(code.get('commit'))[:12]}; runs trained by commit(s) {', '.join(commits)}): "
           f"{trained:.0f} s of training over its {len(everything)} runs (compilation included), "
           f"{wall_seconds:.0f} s for this invocation (cached runs are not retrained)",
           f"- data: `{ds.name}`, {ds.num_tokens} tokens, vocabulary {ds.vocab_size}, sha256 `{ds.sha256}`",
           f"- model `{t.model}`, {t.steps} steps of batch {t.batch_size}, warm-up "
           f"{warmup} then cosine to {t.final_lr_fraction:g} x peak, b2 {t.b2:g}, PipeDream-LR "
           f"T_c = {t.pipemare_fraction:.1%} of training; seeds {seeds}",
           f"- smoothing: centred window of {2 * metrics.half_window(window) + 1} steps; target at "
           f"P = final smoothed loss of the best asynchronous baseline ({', '.join(BASELINES)}) at "
           "that P; slowdown = iterations at P / iterations at P = 1 to that target; 'never' = the "
           "target was not reached; a diverged or unfinished run is credited with nothing; with "
           "several seeds: mean [min, max] over seeds", ""]
  if deviations:
    lines += ["## Deviations from the paper", ""] + [f"- {d}" for d in deviations] + [""]
  rows, tables = [], []
  if main_results:
    section, tables = main_section(ctx, main_results)
    rows = metrics.aggregate(tables)
    lines += section
  lines += diagnostics_section(ctx, everything)
  groups = collections.defaultdict(list)
  for a, r in ablation_results:
    groups[a].append(r)
  for name, results in groups.items():
    lines += [f"## Ablation: {name}", "", registry[name].description, ""]
    lines += registry[name].section(ctx, name, results)
  lines += claims_section(ctx, tables, groups)
  lines += ["## Figures", ""] + [f"![{f}]({f})" for f in ctx.figures] + [""]
  (out / "report.md").write_text("\n".join(lines))
  return rows


# ---- the README's generated tables ---------------------------------------------------------------

GENERATED = re.compile(r"(<!-- generated from (\S+) section \"([^\"]+)\" -->\n)(.*?)"
                       r"(<!-- end generated -->)", re.S)


def section_table(report_md: str, heading: str) -> str:
  """The first Markdown table under ``## heading`` of a report."""
  lines = report_md.splitlines()
  try:
    start = lines.index(f"## {heading}")
  except ValueError:
    raise ValueError(f"no section '## {heading}' in the report") from None
  table = []
  for line in lines[start + 1:]:
    if line.startswith("## "):
      break
    if line.startswith("|"):
      table.append(line)
    elif table:
      break
  if not table:
    raise ValueError(f"section '## {heading}' has no table")
  return "\n".join(table) + "\n"


def sync_readme(readme: pathlib.Path) -> list:
  """Rewrites each generated block of ``readme`` (between ``<!-- generated from PATH section
  "HEADING" -->`` and ``<!-- end generated -->``) with that table of the report at PATH (relative to
  the README's folder). Returns the blocks that changed (as ``(path, heading)``)."""
  text, changed = readme.read_text(), []

  def fill(m):
    table = section_table((readme.parent / m.group(2)).read_text(), m.group(3))
    if table != m.group(4):
      changed.append((m.group(2), m.group(3)))
    return m.group(1) + table + m.group(5)

  new = GENERATED.sub(fill, text)
  if new != text:
    readme.write_text(new)
  return changed


def main(argv=None) -> list:
  parser = argparse.ArgumentParser(prog="python -m experiments.report", description="Rewrites the "
                                   "README's generated tables from the published reports they name.")
  parser.add_argument("--readme", default="README.md", help="the README (default README.md)")
  readme = pathlib.Path(parser.parse_args(argv).readme)
  if not readme.is_file():
    raise ValueError(f"--readme {str(readme)!r} is not a file")
  changed = sync_readme(readme)
  print("\n".join(f"updated: {p}, section {h!r}" for p, h in changed) or "up to date")
  return changed


if __name__ == "__main__":
  from experiments import sweep  # one-line errors, as the sweep's

  sweep.exit_process(sweep.cli(entry=main))

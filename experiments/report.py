"""``results.csv``, ``report.md`` and figures of a sweep (SPEC section 5's tables)."""

from __future__ import annotations

import collections
import csv
import pathlib

import numpy as np

from experiments import metrics, plots
from experiments.presets import BASELINES


def final_loss(result: dict, window: int) -> float:
  losses = np.asarray(result["losses"], np.float64)
  if result["status"] != "finished" or not np.all(np.isfinite(losses)):
    return float("nan")
  return metrics.final_smoothed(losses, window)


def curves_by(results, key=lambda spec: spec["method"]) -> dict:
  """``{(key, P): mean per-step loss over seeds}``; a diverged seed makes the curve diverge."""
  groups = collections.defaultdict(list)
  for r in results:
    losses = np.asarray(r["losses"], np.float64)
    if r["status"] != "finished":
      losses = np.where(np.isfinite(losses), losses, np.inf)
      losses[np.isnan(losses)] = np.inf
    groups[(key(r["spec"]), r["spec"]["stages"])].append(losses)
  return {k: np.mean(v, axis=0) for k, v in groups.items()}


def _fmt(x, spec="{:.2f}", none="never"):
  if x is None:
    return none
  if isinstance(x, float) and not np.isfinite(x):
    return "diverged"
  return spec.format(x)


def _pivot(rows, field, fmt="{:.2f}", none="never"):
  stages = sorted({r["stages"] for r in rows})
  methods = sorted({r["method"] for r in rows}, key=lambda m: (m not in BASELINES, m))
  lines = ["| method | " + " | ".join(f"P={p}" for p in stages) + " |",
           "|---|" + "---|" * len(stages)]
  cell = {(r["method"], r["stages"]): r[field] for r in rows}
  for m in methods:
    lines.append(f"| {m} | " + " | ".join(
        _fmt(cell[(m, p)], fmt, none) if (m, p) in cell else "" for p in stages) + " |")
  return "\n".join(lines)


def _study(results, window, figures, out, name, title):
  curves = curves_by(results)
  rows = metrics.study_table(curves, BASELINES, window)
  plots.loss_curves(curves, window, out / f"{name}_loss.png", title)
  figures.append(f"{name}_loss.png")
  if len({p for _, p in curves}) > 1:
    plots.slowdown_vs_stages(rows, out / f"{name}_slowdown.png", title)
    figures.append(f"{name}_slowdown.png")
  return rows


def write(out: pathlib.Path, preset, main_results, ablation_results, ds, wall_seconds: float) -> None:
  """Writes results.csv, report.md and the figures into ``out``."""
  window = max(1, int(preset.steps * preset.smooth_fraction))
  everything = list(main_results) + [r for _, r in ablation_results]
  with open(out / "results.csv", "w", newline="") as f:
    w = csv.writer(f)
    w.writerow(["name", "method", "stages", "mode", "model", "num_blocks", "seed", "lr", "status",
                "final_smoothed_loss", "final_val_loss", "seconds", "steps_per_second"])
    for r in everything:
      s = r["spec"]
      val = [v for v in r["val_losses"] if np.isfinite(v)]
      w.writerow([r["name"], s["method"], s["stages"], s["mode"], s["model"], s["num_blocks"] or "",
                  s["seed"], s["lr"], r["status"], f"{final_loss(r, window):.5f}",
                  f"{val[-1]:.5f}" if val else "", f"{r['seconds']:.2f}",
                  f"{r['steps_done'] / max(r['seconds'], 1e-9):.1f}"])

  figures = []
  lines = [f"# Staleness study: preset `{preset.name}`", "",
           f"- data: `{ds.name}`, {ds.num_tokens} tokens, sha256 `{ds.sha256}`",
           f"- model `{preset.model}`, {preset.steps} steps of batch {preset.batch_size}; "
           f"wall time of this invocation {wall_seconds:.0f} s",
           f"- smoothing window {window} steps; target at P = final smoothed loss of the best "
           f"asynchronous baseline ({', '.join(BASELINES)}) at that P; slowdown = iterations at P / "
           f"iterations at P = 1 to that target; 'never' = the target was not reached", ""]
  if main_results:
    rows = _study(main_results, window, figures, out, "main", f"{preset.name}: main study")
    lines += ["## Slowdown from P = 1, each method to its own final loss at P", "",
              "Iterations at P / iterations at P = 1 to reach the loss the method reaches at P.", "",
              _pivot(rows, "slowdown_own"), "",
              "## Slowdown from P = 1 to the target at P (best baseline's final loss)", "",
              _pivot(rows, "slowdown"), "",
              "## Iterations to the target at P", "", _pivot(rows, "iters", "{:d}"), "",
              "## Percent fewer iterations than the best baseline at P", "",
              _pivot(rows, "fewer", "{:+.1f}%", "n/a"), "",
              "## Final smoothed training loss", "", _pivot(rows, "final", "{:.4f}"), "",
              "## Against the sync run's final loss (PipeDream at P = 1)", "",
              "Slowdown:", "", _pivot(rows, "slowdown_sync"), "",
              "Iterations:", "", _pivot(rows, "iters_sync", "{:d}"), ""]
  groups = collections.defaultdict(list)
  for a, r in ablation_results:
    groups[a].append(r)
  main_by_key = {(r["spec"]["method"], r["spec"]["stages"], r["spec"]["seed"]): r for r in main_results}
  for name, results in groups.items():
    lines += [f"## Ablation: {name}", ""]
    if name in ("variants", "refresh-period"):
      top = max(r["spec"]["stages"] for r in results)
      base = [r for k, r in main_by_key.items() if k[0] in BASELINES and k[1] in (1, top)]
      rows = _study(results + base, window, figures, out, f"ablation_{name}", f"ablation: {name}")
      rows = [r for r in rows if r["method"] not in BASELINES or name == "refresh-period"]
      lines += ["Slowdown from P = 1 to the method's own final loss at P:", "",
                _pivot(rows, "slowdown_own"), "", "Final smoothed loss:", "",
                _pivot(rows, "final", "{:.4f}"), ""]
      vals = {r["method"]: r["slowdown_own"] for r in rows
              if r["stages"] == top and r["method"] not in BASELINES}
      plots.bars(vals, out / f"ablation_{name}_bars.png", f"{name}: slowdown at P={top}", "slowdown")
      figures.append(f"ablation_{name}_bars.png")
    elif name in ("no-stashing", "moe"):
      rows = _study(results, window, figures, out, f"ablation_{name}", f"ablation: {name}")
      lines += ["Slowdown from P = 1 to the method's own final loss at P:", "", _pivot(rows, "slowdown_own"),
                "", "Percent fewer iterations than the best baseline (to its final loss at P):", "",
                _pivot(rows, "fewer", "{:+.1f}%", "n/a"), "", "Final smoothed loss:", "",
                _pivot(rows, "final", "{:.4f}"), ""]
    elif name == "stage-aware":
      curves = curves_by(results)
      top = max(p for _, p in curves)
      target = max(metrics.final_smoothed(v, window) for v in curves.values())
      iters = {m: metrics.iterations_to(v, target, window) for (m, _), v in curves.items()}
      uniform = iters.get("rotation")
      lines += [f"Target: the worst final smoothed loss of the three ({target:.4f}), P = {top}.", "",
                "| allocation | iterations | speed-up vs uniform |", "|---|---|---|"]
      for m in ("rotation", "rotation-sa", "rotation-sa-reverse"):
        if m in iters:
          speed = metrics.ratio(uniform, iters[m])
          lines.append(f"| {m} | {_fmt(iters[m], '{:d}')} | "
                       f"{_fmt(None if speed is None else 100 * (speed - 1), '{:+.1f}%')} |")
      lines.append("")
      plots.bars({m: v for m, v in iters.items()}, out / "ablation_stage-aware_bars.png",
                 f"stage-aware refresh at P={top}: iterations to target", "iterations")
      figures.append("ablation_stage-aware_bars.png")
      plots.loss_curves(curves, window, out / "ablation_stage-aware_loss.png", "ablation: stage-aware")
      figures.append("ablation_stage-aware_loss.png")
    elif name == "scaling":
      curves = curves_by(results, key=lambda s: f"{s['method']}")
      lines += ["Blocks = P grown together; final smoothed training loss:", "",
                "| method | " + " | ".join(f"B=P={p}" for p in sorted({p for _, p in curves})) + " |",
                "|---|" + "---|" * len({p for _, p in curves})]
      for m in sorted({m for m, _ in curves}):
        lines.append(f"| {m} | " + " | ".join(
            f"{metrics.final_smoothed(curves[(m, p)], window):.4f}" if (m, p) in curves else ""
            for p in sorted({p for _, p in curves})) + " |")
      lines.append("")
      plots.loss_curves(curves, window, out / "ablation_scaling_loss.png", "blocks = P scaling")
      figures.append("ablation_scaling_loss.png")
  lines += ["## Figures", ""] + [f"![{f}]({f})" for f in figures] + [""]
  (out / "report.md").write_text("\n".join(lines))

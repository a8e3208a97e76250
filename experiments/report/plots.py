"""PNG figures of a sweep: loss curves per P, slowdown vs P, ablation bars."""

from __future__ import annotations

import io
import pathlib

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
import matplotlib.ticker  # noqa: E402
import numpy as np  # noqa: E402
import PIL.Image  # noqa: E402

from experiments.report import metrics  # noqa: E402


def save(fig, path: pathlib.Path) -> None:
  """Writes ``fig`` as a PNG of 64 colours (line plots lose nothing visible; a quarter of the bytes
  of a full-colour PNG, which keeps docs/results small) and closes it."""
  fig.tight_layout()
  buffer = io.BytesIO()
  fig.savefig(buffer, dpi=110, format="png")
  plt.close(fig)
  image = PIL.Image.open(buffer).convert("RGB")
  image.quantize(colors=64, method=PIL.Image.Quantize.MEDIANCUT, dither=PIL.Image.Dither.NONE).save(
      path, format="PNG", optimize=True)


def loss_curves(curves: dict, window: int, path: pathlib.Path, title: str) -> None:
  """One panel per P, on one shared y range; smoothed training loss vs step for every method."""
  stages = sorted({p for _, p in curves})
  cols = min(3, len(stages))
  rows = -(-len(stages) // cols)
  fig, axes = plt.subplots(rows, cols, figsize=(5 * cols, 3.6 * rows), squeeze=False, sharey=True)
  for ax, p in zip(axes.flat, stages):
    for (method, stages_), losses in sorted(curves.items()):
      if stages_ == p:
        ax.plot(np.arange(1, len(losses) + 1), metrics.smooth(losses, window), label=method, lw=1.2)
    ax.set_title(f"P = {p}")
    ax.set_xlabel("step")
    ax.set_ylabel("train loss (smoothed)")
    ax.grid(alpha=0.3)
  for ax in list(axes.flat)[len(stages):]:
    ax.axis("off")
  axes.flat[0].legend(fontsize=8)
  fig.suptitle(title)
  save(fig, path)


def level_slowdowns(per_method: dict, path: pathlib.Path, title: str) -> None:
  """The headline per level: ``{method: [(levels, ratios) per seed]}``, slowdown against the loss
  level (late training to the left), one thin line per seed, one colour per method."""
  fig, ax = plt.subplots(figsize=(6.5, 4))
  for i, (method, seeds) in enumerate(sorted(per_method.items())):
    for j, (levels, ratios) in enumerate(seeds):
      ax.plot(levels, ratios, color=f"C{i}", lw=1, alpha=0.8, label=method if j == 0 else None)
  ax.invert_xaxis()
  ax.set_xlabel("loss level (smoothed training loss; training proceeds to the right)")
  ax.set_ylabel("iterations at P / at P = 1")
  ax.set_title(title, fontsize=10)
  ax.grid(alpha=0.3)
  ax.legend(fontsize=8)
  save(fig, path)


def slowdown_vs_stages(rows, path: pathlib.Path, title: str, field: str = "slowdown_levels") -> None:
  """Slowdown against P per method, the seeds' mean with their [min, max] as error bars. By default
  the headline, the slowdown at the method's own levels (``field="slowdown_own"``: to the method's
  own final loss at P)."""
  labels = {"slowdown_levels": "slowdown vs P = 1 at own levels (median over levels)",
            "slowdown_own": "slowdown vs P = 1 (to own final loss at P)"}
  fig, ax = plt.subplots(figsize=(6, 4))
  for method in sorted({r["method"] for r in rows}):
    pts = sorted((r["stages"], r[field], r.get(field + "_lo"), r.get(field + "_hi"))
                 for r in rows if r["method"] == method and r[field] is not None)
    if not pts:
      continue
    xs, ys, lo, hi = zip(*pts)
    err = None if None in lo else np.array([np.subtract(ys, lo), np.subtract(hi, ys)])
    ax.errorbar(xs, ys, yerr=err, marker="o", capsize=3, label=method)
  ax.set_xscale("log", base=2)
  stages = sorted({r["stages"] for r in rows})
  ax.set_xticks(stages, [str(p) for p in stages])
  ax.set_xlabel("pipeline stages P")
  ax.set_ylabel(labels.get(field, field), fontsize=8)
  ax.set_title(title + "  (bars: [min, max] over seeds)", fontsize=9)
  ax.grid(alpha=0.3)
  ax.legend(fontsize=8)
  save(fig, path)


def bars(values: dict, path: pathlib.Path, title: str, ylabel: str) -> None:
  """A bar per label; ``None`` values drawn as an empty bar marked 'never'."""
  fig, ax = plt.subplots(figsize=(max(4, 1.3 * len(values)), 3.6))
  labels = list(values)
  heights = [values[k] if values[k] is not None else 0.0 for k in labels]
  ax.bar(range(len(labels)), heights, color="tab:blue")
  for i, k in enumerate(labels):
    ax.text(i, heights[i], "never" if values[k] is None else f"{values[k]:.2f}", ha="center",
            va="bottom", fontsize=8)
  ax.set_xticks(range(len(labels)), labels, rotation=20, fontsize=8)
  ax.set_ylabel(ylabel)
  ax.set_title(title, fontsize=10)
  save(fig, path)


def _lines(ax, lines: dict, xlabel: str, ylabel: str) -> None:
  for label, pts in lines.items():
    pts = [(x, y) for x, y in pts if y is not None]
    if pts:
      ax.plot(*zip(*pts), marker="o", label=label)
  ax.set_xscale("log", base=2)
  ax.set_xlabel(xlabel)
  ax.set_ylabel(ylabel)
  ax.grid(alpha=0.3)
  if ax.get_legend_handles_labels()[0]:  # a panel without data (no gradient cosine logged) has none
    ax.legend(fontsize=8)


def series(lines: dict, path: pathlib.Path, title: str, xlabel: str, ylabel: str) -> None:
  """One line per label through ``(x, y)`` points (x on a log2 axis); ``None`` values are left out."""
  fig, ax = plt.subplots(figsize=(6, 4))
  _lines(ax, lines, xlabel, ylabel)
  ax.set_title(title, fontsize=10)
  save(fig, path)


def panels(by_panel: dict, path: pathlib.Path, title: str, xlabel: str) -> None:
  """``series`` side by side: ``{panel's y label: {line label: [(x, y)]}}``."""
  fig, axes = plt.subplots(1, len(by_panel), figsize=(5.5 * len(by_panel), 4), squeeze=False)
  for ax, (ylabel, lines) in zip(axes.flat, by_panel.items()):
    _lines(ax, lines, xlabel, ylabel)
  fig.suptitle(title, fontsize=10)
  save(fig, path)


def gain_vs_horizon(rows, path: pathlib.Path, paper_t_per_delay: float) -> None:
  """Against ``T / tau_max``, per horizon (``experiments.studies.horizon``'s rows): left, rotation's
  staleness gain, its mean with the 95% interval (or the single seed) and each seed's value; right,
  every method's headline slowdown from P = 1, each seed a point and the geometric mean over its
  seeds a line; the paper's regime marked on both."""
  fig, (ax, bx) = plt.subplots(1, 2, figsize=(11, 4))
  for r in rows:
    x = r["T"] / r["tau_max"]
    if r["gain"] is None:
      continue
    lo, hi = r["gain"]["ci95"] or (r["gain"]["min"], r["gain"]["max"])
    ax.errorbar([x], [r["gain"]["mean"]], yerr=[[r["gain"]["mean"] - lo], [hi - r["gain"]["mean"]]],
                marker="o", capsize=4, color="C0")
    seeds = [g for g in r["gains"] if g is not None]
    ax.scatter([x * 0.94] * len(seeds), seeds, s=12, facecolors="none", edgecolors="k", lw=0.8)
    ax.annotate(f"T = {r['T']}, {r['seeds']} seed(s)", (x, r["gain"]["mean"]), fontsize=7,
                xytext=(5, 5), textcoords="offset points")
  ax.axhline(1.0, color="gray", lw=0.8)
  ax.set_ylabel("rotation's staleness gain (> 1: lead grows)")
  ax.set_title("rotation's gain: mean and 95% interval; open circles: each seed", fontsize=9)
  methods = sorted({m for r in rows for m in r.get("slowdowns", {})})
  for i, m in enumerate(methods):
    xs, means = [], []
    for r in rows:
      vals = [v for v in r.get("slowdowns", {}).get(m, []) if v is not None and v > 0]
      if not vals:
        continue
      x = r["T"] / r["tau_max"] * (1 + 0.04 * (i - (len(methods) - 1) / 2))
      bx.scatter([x] * len(vals), vals, s=12, facecolors="none", edgecolors=f"C{i}", lw=0.8)
      xs.append(x)
      means.append(float(np.exp(np.mean(np.log(vals)))))
    bx.plot(xs, means, marker="o", color=f"C{i}", lw=1.2, label=m)
  bx.set_yscale("log")
  low, high = bx.get_ylim()
  bx.set_yticks([t for t in (1, 1.5, 2, 3, 4, 5, 7, 10, 15, 20, 30, 50) if low <= t <= high] or [low, high])
  bx.yaxis.set_major_formatter(matplotlib.ticker.FormatStrFormatter("%g"))
  bx.yaxis.set_minor_formatter(matplotlib.ticker.NullFormatter())
  bx.set_ylabel("slowdown from P = 1 (headline)")
  bx.set_title("each method's slowdown: seeds (open) and geometric mean", fontsize=9)
  bx.legend(fontsize=7)
  ticks = sorted({r["T"] / r["tau_max"] for r in rows} | {paper_t_per_delay})
  for a in (ax, bx):
    a.axvline(paper_t_per_delay, color="C3", ls="--", lw=1)
    a.text(paper_t_per_delay, a.get_ylim()[1], "the paper's regime (about) ", color="C3", fontsize=7,
           va="top", ha="right")
    a.set_xscale("log")
    a.set_xticks(ticks, [f"{t:,.0f}" for t in ticks])
    a.xaxis.set_minor_formatter(matplotlib.ticker.NullFormatter())
    a.set_xlabel("T / tau_max (training steps per step of the largest delay)")
    a.grid(alpha=0.3)
  save(fig, path)


def schedule_gaps(rows, path: pathlib.Path) -> None:
  """Each method's final-loss gap to P = 1 per schedule and P (``experiments.studies.pipedream_2bw``' rows),
  with its 95% interval (or the range of a single seed)."""
  methods = sorted({r["method"] for r in rows})
  settings = sorted({(r["schedule"], r["P"]) for r in rows})
  width = 0.8 / len(settings)
  fig, ax = plt.subplots(figsize=(max(6, 1.5 * len(methods)), 4))
  for i, (schedule, p) in enumerate(settings):
    xs, ys, err = [], [], [[], []]
    for j, m in enumerate(methods):
      r = next((r for r in rows if (r["schedule"], r["P"], r["method"]) == (schedule, p, m)), None)
      if r is None or r["gap"] is None:
        continue
      lo, hi = r["gap"]["ci95"] or (r["gap"]["min"], r["gap"]["max"])
      xs.append(j + (i - (len(settings) - 1) / 2) * width)
      ys.append(r["gap"]["mean"])
      err[0].append(r["gap"]["mean"] - lo)
      err[1].append(hi - r["gap"]["mean"])
    ax.bar(xs, ys, width, yerr=err, capsize=3, label=f"{schedule.upper()}, P = {p}")
  ax.set_xticks(range(len(methods)), methods)
  ax.axhline(0.0, color="gray", lw=0.8)
  ax.set_ylabel("final-loss gap to P = 1")
  ax.set_title("mean over seeds, 95% interval", fontsize=9)
  ax.legend(fontsize=8)
  ax.grid(alpha=0.3, axis="y")
  save(fig, path)

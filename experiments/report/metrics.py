"""Targets, iterations to target, slowdowns, advantage and percent fewer iterations (the paper's
section 5), per seed; ``aggregate`` turns per-seed tables into mean, range and 95% interval.

Definitions (following the paper; written out in ``docs/algorithms.md``):
- the *smoothed loss* is a **centred** moving average of the per-step training loss over an odd
  window of ``2 * (window // 2) + 1`` steps, attributed to the window's middle step, so that it has
  no lag (a trailing average would report every crossing ``window / 2`` steps late and bias
  slowdowns towards 1); it is undefined (NaN) for the first and last ``window // 2`` steps;
- the *final* smoothed loss is the last defined value (the mean of the last window);
- a run is *credited* only if it finished and every loss is finite: a run that diverged, even
  after reaching a target, or that did not finish, gets no number (``None``);
- a run's *iterations to* a loss is the first step (1-based) at which its smoothed loss is at or
  below it, or ``None`` (never).

The headline, a method's **slowdown at its own levels** (``slowdown_levels``) at P: the median over
``num_levels`` loss levels L of ``t_P(L) / t_1(L)``, its iterations to L at P over those at P = 1.
The levels come from that method's two runs alone (``common_levels`` of its P = 1 and P runs):
evenly spaced from the higher of their two lowest smoothed losses (both runs reach it) up to the
lower of their first smoothed values (both start above it). No other method's run moves it, and it
measures the whole of the stale run's training, past its plateau down to where it ends.

Beside it:
- *own-target slowdown* (``slowdown_own``): the same ratio at one level, the method's final
  smoothed loss at P;
- the *target at P* is the final smoothed loss of the best asynchronous baseline at P (lowest final
  smoothed loss among the credited baselines); ``iters`` and ``slowdown`` are measured to it;
- *percent fewer* = 100 * (1 - iterations of the method / iterations of the best baseline) to the
  target at P; ``fewer_top``: the same at every P to the target at the sweep's largest P, so that
  its P = 1 value is the control (how much faster the method is without any staleness, to the
  same loss);
- *advantage* of a method at P over the best baseline ``b`` at the top P: the median over the
  levels that the four runs (method and ``b``, at P = 1 and at P) share of ``t_b(L) / t_method(L)``;
  its *staleness gain* is the median over those levels of ``slowdown_b(L) / slowdown_method(L)``,
  > 1 when the method's lead grows with staleness (the paper's claim), < 1 when it shrinks;
- *wall-clock to target*: iterations to the target times the run's steady-state seconds per step.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import scipy.stats

# Numeric fields of a study row, aggregated across seeds.
FIELDS = ("slowdown_levels", "final", "target", "iters_own", "slowdown_own", "iters", "slowdown",
          "fewer", "fewer_top", "advantage", "staleness_gain", "seconds")
NUM_LEVELS = 20


def final_val(run) -> float | None:
  """A run's final validation loss; ``None`` for a run that diverged or did not finish."""
  v = run["val_losses"][-1] if run["status"] == "finished" and run["val_losses"] else None
  return float(v) if v is not None and np.isfinite(v) else None


def half_window(window: int) -> int:
  return max(0, int(window) // 2)


def smooth(losses: Sequence[float], window: int) -> np.ndarray:
  """Centred moving average over ``2 * (window // 2) + 1`` steps; NaN where the window does not fit."""
  x = np.asarray(losses, np.float64)
  h = min(half_window(window), (len(x) - 1) // 2)
  w = 2 * h + 1
  out = np.full(len(x), np.nan)
  with np.errstate(invalid="ignore"):  # inf - inf (a diverged run) is NaN: never "reached"
    c = np.concatenate([[0.0], np.cumsum(x)])
    out[h:len(x) - h] = (c[w:] - c[:-w]) / w
  return out


def credited(losses) -> bool:
  """Only a curve of finite losses (a finished, non-diverged run) is credited with any number."""
  return losses is not None and len(losses) > 0 and bool(np.all(np.isfinite(losses)))


def final_smoothed(losses, window: int) -> float:
  """The last defined smoothed value; NaN for a curve that is not credited."""
  if not credited(losses):
    return float("nan")
  s = smooth(losses, window)
  return float(s[~np.isnan(s)][-1])


def iterations_to(losses, target: float | None, window: int) -> int | None:
  """First 1-based step whose smoothed loss is <= target; ``None`` if never or not credited."""
  if target is None or not np.isfinite(target) or not credited(losses):
    return None
  s = smooth(losses, window)
  hit = np.nonzero(np.nan_to_num(s, nan=np.inf) <= target)[0]
  return int(hit[0]) + 1 if len(hit) else None


def ratio(numerator: int | None, denominator: int | None) -> float | None:
  if numerator is None or denominator is None or denominator == 0:
    return None
  return numerator / denominator


def percent_fewer(method_iters: int | None, baseline_iters: int | None) -> float | None:
  if method_iters is None or baseline_iters is None or baseline_iters == 0:
    return None
  return 100.0 * (1.0 - method_iters / baseline_iters)


def common_levels(curves, window: int, num_levels: int = NUM_LEVELS, reference=None) -> np.ndarray:
  """Loss levels every credited curve of ``curves`` reaches and starts above (a run that diverged or
  did not finish is left out, and credited with nothing); empty if the curves share no range.

  Without ``reference`` the levels are evenly spaced in loss; with it (one of ``curves``, the
  synchronous run) they are its running-minimum smoothed loss at ``num_levels`` steps evenly spaced
  after its first smoothed step up to the step it reaches the lowest common level: evenly spaced in its
  training time, so that the first fast descent (a few dozen steps that cover half the loss range)
  weighs no more than any other stretch of training."""
  curves = [c for c in curves if credited(c)]
  if not curves:
    return np.zeros(0)
  smoothed = [smooth(c, window) for c in curves]
  defined = [s[~np.isnan(s)] for s in smoothed]
  low = max(float(np.min(d)) for d in defined)  # every run gets at least this low
  high = min(float(d[0]) for d in defined)  # every run starts above this
  if not high > low:
    return np.zeros(0)
  if reference is None:
    return np.linspace(low, high, num_levels + 1)[:-1]  # from the lowest common level up, below the start
  running = np.minimum.accumulate(np.nan_to_num(smooth(reference, window), nan=np.inf))
  first = int(np.argmax(np.isfinite(running)))
  last = int(np.argmax(running <= low))
  levels = running[np.round(np.linspace(first, last, num_levels + 1)).astype(int)[1:]]  # after its start
  return np.maximum(levels[levels < high], low)


def times_to(losses, levels, window: int) -> np.ndarray:
  """1-based first step at which the smoothed loss is at or below each level (NaN: never)."""
  if not credited(losses):
    return np.full(len(levels), np.nan)
  s = np.nan_to_num(smooth(losses, window), nan=np.inf)
  running = np.minimum.accumulate(s)
  idx = np.searchsorted(-running, -np.asarray(levels, np.float64), side="left")  # running is non-increasing
  return np.where(idx < len(s), idx + 1.0, np.nan)


def median_ratio(numerator, denominator) -> float | None:
  """Median over levels of ``numerator / denominator`` (arrays of iterations); ``None`` if empty."""
  r = np.asarray(numerator, np.float64) / np.asarray(denominator, np.float64)
  r = r[np.isfinite(r)]
  return float(np.median(r)) if len(r) else None


def level_slowdown(base, stale, window: int, num_levels: int = NUM_LEVELS):
  """``(median, levels, ratios)``: the slowdown of ``stale`` over ``base`` (two runs of one method)
  at each of the levels the two share; ``(None, [], [])`` if they share none or one is not
  credited."""
  if not (credited(base) and credited(stale)):
    return None, np.zeros(0), np.zeros(0)
  levels = common_levels([base, stale], window, num_levels, reference=base)
  if not len(levels):
    return None, np.zeros(0), np.zeros(0)
  ratios = times_to(stale, levels, window) / times_to(base, levels, window)
  return median_ratio(ratios, 1.0), levels, ratios


def advantage(method_1, method_p, base_1, base_p, window: int, num_levels: int = NUM_LEVELS):
  """``(advantage at P, staleness gain)`` of a method over a baseline from their P = 1 and P runs,
  at the levels all four share (``None`` where there are none, or a run is not credited)."""
  runs = [method_1, method_p, base_1, base_p]
  if not all(credited(c) for c in runs):
    return None, None
  levels = common_levels(runs, window, num_levels, reference=method_1)
  if not len(levels):
    return None, None
  m1, mp, b1, bp = (times_to(c, levels, window) for c in runs)
  return median_ratio(bp, mp), median_ratio((bp / b1) / (mp / m1), 1.0)


def study_table(curves: dict, baselines: Sequence[str], window: int,
                step_seconds: dict | None = None, num_levels: int = NUM_LEVELS):
  """Rows ``{method, stages, best_baseline, per_level, *FIELDS}`` for every (method, P) of one
  seed's curves (see the module docstring; ``per_level`` holds the headline's levels and ratios).

  Args:
    curves: ``{(method, P): per-step losses}``; a run that diverged or did not finish is given
      with a non-finite loss (or as ``None``) and is credited with nothing.
    baselines: the asynchronous baselines whose best sets the target.
    window: smoothing window.
    step_seconds: ``{(method, P): steady-state seconds per step}`` for the wall-clock to target
      (``seconds``); ``None`` leaves it out.
    num_levels: levels of the headline and of the advantage.
  """
  stage_set = sorted({p for _, p in curves})
  top = stage_set[-1]
  finals = {k: final_smoothed(v, window) for k, v in curves.items()}
  at = lambda curve, t: iterations_to(curve, t, window)

  def best_at(p):  # (target, best baseline): docs/protocol.md's lowest final smoothed training loss
    cands = [(finals[(b, p)], b) for b in baselines if np.isfinite(finals.get((b, p), np.nan))]
    return min(cands) if cands else (None, None)

  top_target, top_best = best_at(top)
  rows = []
  for p in stage_set:
    target, best = best_at(p)
    best_iters = at(curves[(best, p)], target) if best else None
    fastest_top = [at(curves[(b, p)], top_target) for b in baselines if (b, p) in curves]
    fastest_top = min((i for i in fastest_top if i is not None), default=None)
    for (method, stages), losses in sorted(curves.items()):
      if stages != p:
        continue
      base_curve = curves.get((method, 1))
      own = finals[(method, p)] if np.isfinite(finals[(method, p)]) else None
      iters, iters_own = at(losses, target), at(losses, own)
      headline, levels, ratios = (level_slowdown(base_curve, losses, window, num_levels)
                                  if base_curve is not None else (None, np.zeros(0), np.zeros(0)))
      adv = gain = None
      if top_best is not None and base_curve is not None and (top_best, p) in curves:
        adv, gain = advantage(base_curve, losses, curves[(top_best, 1)], curves[(top_best, p)],
                              window, num_levels)
      rate = (step_seconds or {}).get((method, p))
      rows.append({
          "method": method, "stages": p, "best_baseline": best,
          "per_level": {"levels": levels.tolist(), "ratios": ratios.tolist()},
          "slowdown_levels": headline,
          "final": own, "target": target,
          "iters_own": iters_own, "slowdown_own": ratio(iters_own, at(base_curve, own)),
          "iters": iters, "slowdown": ratio(iters, at(base_curve, target)),
          "fewer": percent_fewer(iters, best_iters),
          "fewer_top": percent_fewer(at(losses, top_target), fastest_top),
          "advantage": adv, "staleness_gain": gain,
          "seconds": iters * rate if iters is not None and rate else None,
      })
  return rows


def spread(y: np.ndarray, blocks=None) -> tuple[float, int]:
  """``(standard deviation, degrees of freedom)`` of ``y`` for a t interval of its mean: the sample
  one (``n - 1``), or with ``blocks`` (one label per value, e.g. each seed's CPU) the pooled
  within-block one (``n - B`` for B blocks), so that a fixed block effect is not counted as noise;
  ``(nan, 0)`` where the blocks leave no degrees of freedom (every block a single value): no test."""
  if blocks is None or len(set(blocks)) <= 1:
    return float(y.std(ddof=1)), len(y) - 1
  labels = np.asarray([str(b) for b in blocks])
  resid = np.concatenate([y[labels == b] - y[labels == b].mean() for b in sorted(set(labels))])
  df = len(y) - len(set(labels))
  if df < 1:
    return float("nan"), 0
  return float(np.sqrt((resid ** 2).sum() / df)), df


def interval(values, level: float = 0.95, log: bool = False, blocks=None) -> dict | None:
  """``{"mean", "min", "max", "ci95": [lo, hi] or None, "seeds"}`` of per-seed values: the interval
  is Student's t interval of the mean at confidence ``level`` (``None`` with one seed; the key keeps
  its name at any level, ``"level"`` says which). ``log``: for ratios, the interval of the mean of
  ``log x`` mapped back (``exp(mean(log x) +- t s / sqrt(n))``) and ``"mean"`` the geometric mean.
  ``None`` if a value is missing (a seed that diverged or never reached a level has no number to
  average) or, with ``log``, not positive. ``blocks``: one label per value (a fixed blocking factor,
  ``spread``): the mean stays the plain mean, the interval uses the pooled within-block spread."""
  if not len(values) or any(v is None or not np.isfinite(v) or (log and v <= 0) for v in values):
    return None
  x = np.asarray(values, np.float64)
  y = np.log(x) if log else x
  back = np.exp if log else (lambda v: v)
  out = {"mean": float(back(y.mean())), "min": float(x.min()), "max": float(x.max()), "ci95": None,
         "seeds": len(x)}
  if level != 0.95 or log:
    out.update(level=level, log=log)
  sd, df = spread(y, blocks) if len(x) > 1 else (None, 0)
  if df >= 1:
    half = float(scipy.stats.t.ppf(0.5 + level / 2, df) * sd / np.sqrt(len(x)))
    out["ci95"] = [float(back(y.mean() - half)), float(back(y.mean() + half))]
  return out


def aggregate(tables: Sequence[list]) -> list:
  """Per-seed study tables -> one row per (method, P): each field's mean over seeds with its range
  ``{field}_lo``, ``{field}_hi``, its 95% interval ``{field}_ci`` and its per-seed values
  ``{field}_seeds``; a field is ``None`` unless every seed has a value."""
  keyed = {}
  for rows in tables:
    for r in rows:
      keyed.setdefault((r["method"], r["stages"]), []).append(r)
  out = []
  for (method, stages), rows in sorted(keyed.items()):
    best = {r["best_baseline"] for r in rows}
    row = {"method": method, "stages": stages, "seeds": len(rows),
           "best_baseline": best.pop() if len(best) == 1 else "/".join(sorted(map(str, best)))}
    for f in FIELDS:
      vals = [r[f] for r in rows]
      iv = interval(vals) if len(rows) == len(tables) else None
      row[f] = iv["mean"] if iv else None
      row[f + "_lo"], row[f + "_hi"] = (iv["min"], iv["max"]) if iv else (None, None)
      row[f + "_ci"] = iv["ci95"] if iv else None
      row[f + "_seeds"] = vals
    out.append(row)
  return out

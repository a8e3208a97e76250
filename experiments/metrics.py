"""Targets, iterations to target, slowdown and percent fewer iterations (the paper's section 5).

Definitions (following the paper; see ``docs/algorithms.md``):
- the *smoothed loss* is a **centred** moving average of the per-step training loss over an odd
  window of ``2 * (window // 2) + 1`` steps, attributed to the window's middle step, so that it has
  no lag (a trailing average would report every crossing ``window / 2`` steps late and bias
  slowdowns towards 1); it is undefined (NaN) for the first and last ``window // 2`` steps;
- the *final* smoothed loss is the last defined value (the mean of the last window);
- a run is *credited* only if it finished and every loss is finite: a run that diverged, even
  after reaching a target, or that did not finish, gets no iterations, slowdown or percent fewer
  (``None``);
- the *target at P* is the final smoothed loss of the best asynchronous baseline (lowest final
  smoothed loss among the credited baselines) at that P;
- a run's *iterations to target* is the first step (1-based) at which its smoothed loss is at or
  below the target, or ``None`` ("never");
- *slowdown* of a method at P = its iterations at P / its iterations at P = 1, both to the target
  at P; the per-method *own-target slowdown* uses the method's own final smoothed loss at P as the
  target (how many times longer the stale run takes to reach what it reaches);
- *percent fewer* = 100 * (1 - iterations of the method / iterations of the best baseline) at P.
The same numbers are also reported against the sync run's (P = 1 PipeDream) final smoothed loss.

Metrics that separate robustness to staleness from speed (``common_levels`` and after):
- *common levels*: ``num_levels`` loss levels evenly spaced between the highest final smoothed loss
  of the compared runs (every run reaches it) and the lowest first smoothed value (every run starts
  above it); none when the runs share no such range;
- *common-target slowdown* of a method at P: the median over the common levels L of
  ``t_P(L) / t_1(L)`` (its iterations to L at P over those at P = 1): how much longer staleness
  makes the same progress take, for every method at the same levels;
- *advantage* of a method over the best baseline at P: the median over the common levels of
  ``t_best(L) / t_method(L)``, the best baseline being the one with the smallest median
  ``t(L)`` at P; its *staleness gain* ``advantage_P / advantage_1`` is > 1 when the method's lead
  grows with staleness (the paper's claim), < 1 when it shrinks (per level it equals the best
  baseline's slowdown over the method's);
- *wall-clock to target*: iterations to the target times the run's measured steady-state seconds
  per step.
With several seeds every number is computed per seed and reported as the mean and the min-max
range across seeds (``aggregate``).
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

# Numeric fields of a study row, aggregated across seeds.
FIELDS = ("final", "target", "iters_own", "slowdown_own", "iters", "slowdown", "fewer",
          "sync_target", "iters_sync", "slowdown_sync", "slowdown_common", "advantage",
          "staleness_gain", "seconds")
NUM_LEVELS = 20


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


def common_levels(curves, window: int, num_levels: int = NUM_LEVELS) -> np.ndarray:
  """Loss levels every credited curve of ``curves`` reaches (see the module docstring; a run that
  diverged or did not finish is left out, and credited with nothing); empty if the curves share no
  range."""
  curves = [c for c in curves if credited(c)]
  if not curves:
    return np.zeros(0)
  smoothed = [smooth(c, window) for c in curves]
  defined = [s[~np.isnan(s)] for s in smoothed]
  low = max(float(np.min(d)) for d in defined)  # every run gets at least this low
  high = min(float(d[0]) for d in defined)  # every run starts above this
  if not high > low:
    return np.zeros(0)
  return np.linspace(low, high, num_levels + 1)[:-1]  # from the lowest common level up, below the start


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


def study_table(curves: dict, baselines: Sequence[str], window: int, sync_method: str = "pipedream",
                step_seconds: dict | None = None):
  """Rows ``{method, stages, best_baseline, *FIELDS}`` for every (method, P) of one seed's curves.

  Args:
    curves: ``{(method, P): per-step losses}``; a run that diverged or did not finish is given
      with a non-finite loss (or as ``None``) and is credited with nothing.
    baselines: the asynchronous baselines whose best sets the target.
    window: smoothing window.
    sync_method: the method whose P = 1 run defines the sync target.
    step_seconds: ``{(method, P): steady-state seconds per step}`` for the wall-clock to target
      (``seconds``); ``None`` leaves it out.
  """
  stage_set = sorted({p for _, p in curves})
  finals = {k: final_smoothed(v, window) for k, v in curves.items()}
  levels = common_levels(curves.values(), window)
  times = {k: times_to(v, levels, window) for k, v in curves.items()}

  def best_at(p):  # the baseline with the smallest median time to the common levels at P
    cands = [(float(np.median(times[(b, p)])), b) for b in baselines
             if (b, p) in times and len(levels) and np.all(np.isfinite(times[(b, p)]))]
    return min(cands)[1] if cands else None

  def advantage(method, p):
    best = best_at(p)
    return None if best is None or (method, p) not in times else median_ratio(times[(best, p)],
                                                                              times[(method, p)])
  sync_target = finals.get((sync_method, 1))
  sync_target = sync_target if sync_target is not None and np.isfinite(sync_target) else None
  rows = []
  for p in stage_set:
    candidates = [(finals[(b, p)], b) for b in baselines if (b, p) in finals and np.isfinite(finals[(b, p)])]
    target, best = min(candidates) if candidates else (None, None)
    best_iters = iterations_to(curves[(best, p)], target, window) if best else None
    for (method, stages), losses in sorted(curves.items()):
      if stages != p:
        continue
      base_curve = curves.get((method, 1))
      own = finals[(method, p)]
      own = own if np.isfinite(own) else None
      at = lambda curve, t: iterations_to(curve, t, window)
      iters, iters_own, iters_sync = at(losses, target), at(losses, own), at(losses, sync_target)
      rows.append({
          "method": method, "stages": p, "best_baseline": best,
          "final": own, "target": target,
          "iters_own": iters_own, "slowdown_own": ratio(iters_own, at(base_curve, own)),
          "iters": iters, "slowdown": ratio(iters, at(base_curve, target)),
          "fewer": percent_fewer(iters, best_iters),
          "sync_target": sync_target, "iters_sync": iters_sync,
          "slowdown_sync": ratio(iters_sync, at(base_curve, sync_target)),
          "slowdown_common": (median_ratio(times[(method, p)], times[(method, 1)])
                              if (method, 1) in times else None),
          "advantage": advantage(method, p),
          "staleness_gain": None, "seconds": None,
      })
      adv, adv1 = rows[-1]["advantage"], advantage(method, 1)
      rows[-1]["staleness_gain"] = adv / adv1 if adv is not None and adv1 else None
      rate = (step_seconds or {}).get((method, p))
      if iters is not None and rate:
        rows[-1]["seconds"] = iters * rate
  return rows


def aggregate(tables: Sequence[list]) -> list:
  """Per-seed study tables -> one row per (method, P): each field's mean over seeds with its
  range ``{field}_lo``, ``{field}_hi``; a field is ``None`` unless every seed has a value."""
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
      ok = len(rows) == len(tables) and all(v is not None for v in vals)
      row[f] = float(np.mean(vals)) if ok else None
      row[f + "_lo"] = float(np.min(vals)) if ok else None
      row[f + "_hi"] = float(np.max(vals)) if ok else None
    out.append(row)
  return out

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
With several seeds every number is computed per seed and reported as the mean and the min-max
range across seeds (``aggregate``).
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

# Numeric fields of a study row, aggregated across seeds.
FIELDS = ("final", "target", "iters_own", "slowdown_own", "iters", "slowdown", "fewer",
          "sync_target", "iters_sync", "slowdown_sync")


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


def study_table(curves: dict, baselines: Sequence[str], window: int, sync_method: str = "pipedream"):
  """Rows ``{method, stages, best_baseline, *FIELDS}`` for every (method, P) of one seed's curves.

  Args:
    curves: ``{(method, P): per-step losses}``; a run that diverged or did not finish is given
      with a non-finite loss (or as ``None``) and is credited with nothing.
    baselines: the asynchronous baselines whose best sets the target.
    window: smoothing window.
    sync_method: the method whose P = 1 run defines the sync target.
  """
  stage_set = sorted({p for _, p in curves})
  finals = {k: final_smoothed(v, window) for k, v in curves.items()}
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
      })
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

"""Targets, iterations to target, slowdown and percent fewer iterations (SPEC section 5).

Definitions (following the paper):
- the smoothed loss is a trailing moving average of the per-step training loss over ``window``
  steps (NaN until ``window`` steps exist);
- the *target at P* is the final smoothed loss of the best asynchronous baseline (lowest final
  smoothed loss among PipeDream, PipeDream-LR and Nesterov) at that P;
- a run's *iterations to target* is the first step (1-based) at which its smoothed loss is at or
  below the target, or ``None`` ("never") if it never gets there;
- *slowdown* of a method at P = its iterations at P / its iterations at P = 1, both to the target
  at P (``None`` if either never reaches it); since a weaker method never reaches the best
  baseline's loss, the per-method *own-target slowdown* uses the method's own final smoothed loss
  at P as the target instead (how many times longer the stale run takes to reach what it reaches);
- *percent fewer* = 100 * (1 - iterations of the method / iterations of the best baseline) at P.
The same numbers are also reported against the sync run's (P = 1 PipeDream) final smoothed loss.
"""

from __future__ import annotations

from typing import Optional, Sequence

import numpy as np


def smooth(losses: Sequence[float], window: int) -> np.ndarray:
  x = np.asarray(losses, np.float64)
  window = max(1, min(int(window), len(x)))
  out = np.full(len(x), np.nan)
  with np.errstate(invalid="ignore"):  # inf - inf (a diverged run) is NaN: never "reached"
    c = np.concatenate([[0.0], np.cumsum(x)])
    out[window - 1:] = (c[window:] - c[:-window]) / window
  return out


def final_smoothed(losses, window: int) -> float:
  s = smooth(losses, window)
  return float(s[-1])


def iterations_to(losses, target: float, window: int) -> Optional[int]:
  """First 1-based step whose smoothed loss is <= target; ``None`` if never (or non-finite)."""
  if target is None or not np.isfinite(target):
    return None
  s = smooth(losses, window)
  hit = np.nonzero(np.nan_to_num(s, nan=np.inf) <= target)[0]
  return int(hit[0]) + 1 if len(hit) else None


def ratio(numerator: Optional[int], denominator: Optional[int]) -> Optional[float]:
  if numerator is None or denominator is None or denominator == 0:
    return None
  return numerator / denominator


def percent_fewer(method_iters: Optional[int], baseline_iters: Optional[int]) -> Optional[float]:
  if method_iters is None or baseline_iters is None or baseline_iters == 0:
    return None
  return 100.0 * (1.0 - method_iters / baseline_iters)


def study_table(curves: dict, baselines: Sequence[str], window: int, sync_method: str = "pipedream"):
  """Rows ``{method, stages, final, target, iters, slowdown, fewer, sync_target, iters_sync,
  slowdown_sync}`` for every (method, P) in ``curves``.

  Args:
    curves: ``{(method, P): per-step losses}`` (diverged runs: losses with NaN/inf).
    baselines: the asynchronous baselines whose best sets the target.
    window: smoothing window.
    sync_method: the method whose P = 1 run defines the sync target.
  """
  stage_set = sorted({p for _, p in curves})
  finals = {k: final_smoothed(v, window) for k, v in curves.items()}
  sync_curve = curves.get((sync_method, 1))
  sync_target = final_smoothed(sync_curve, window) if sync_curve is not None else None
  rows = []
  for p in stage_set:
    candidates = [(finals[(b, p)], b) for b in baselines if (b, p) in finals and np.isfinite(finals[(b, p)])]
    target, best = min(candidates) if candidates else (None, None)
    best_iters = iterations_to(curves[(best, p)], target, window) if best else None
    for (method, stages), losses in sorted(curves.items()):
      if stages != p:
        continue
      iters = iterations_to(losses, target, window)
      base_curve = curves.get((method, 1))
      iters_p1 = iterations_to(base_curve, target, window) if base_curve is not None else None
      iters_sync = iterations_to(losses, sync_target, window)
      iters_sync_p1 = iterations_to(base_curve, sync_target, window) if base_curve is not None else None
      own = finals[(method, p)]
      iters_own = iterations_to(losses, own, window)
      iters_own_p1 = iterations_to(base_curve, own, window) if base_curve is not None else None
      rows.append({
          "method": method, "stages": p, "final": own, "target": target,
          "iters_own": iters_own, "slowdown_own": ratio(iters_own, iters_own_p1),
          "best_baseline": best, "iters": iters, "slowdown": ratio(iters, iters_p1),
          "fewer": percent_fewer(iters, best_iters),
          "sync_target": sync_target, "iters_sync": iters_sync,
          "slowdown_sync": ratio(iters_sync, iters_sync_p1),
      })
  return rows

"""Stage-aware basis-refresh budgets (docs/algorithms.md section 3).

The paper gives staler pipeline stages more frequent basis refreshes at the same total budget as a
uniform period, but does not publish the formula. Ours: with uniform period ``T`` and ``P`` stages
the budget is ``P / T`` refreshes per step. Each stage gets a weight ``w_k``, its refresh *rate*
``r_k = (P / T) * w_k / sum(w)`` and its period ``T_k = max(1, round(1 / r_k))``:

- ``"uniform"``: ``w_k = 1`` (every stage ``T``);
- ``"proportional"``: ``w_k = tau_k + 1`` (refresh rate grows linearly with the delay; the ``+1``
  keeps the undelayed last stage refreshing);
- ``"reverse"``: ``w_k = tau_{P-1-k} + 1`` (the least stale stages refresh most: the ablation's
  control).

Rounding to integer periods keeps the total within a few percent of ``P / T``
(``refresh_budget`` reports it exactly).
"""

from __future__ import annotations

from collections.abc import Sequence

ALLOCATIONS = ("uniform", "proportional", "reverse")


def stage_aware_refresh(delays: Sequence[int], refresh_every: int = 10,
                        allocation: str = "proportional") -> tuple[int, ...]:
  """Per-stage refresh periods at the budget of a uniform ``refresh_every``.

  Args:
    delays: per-stage delays ``tau_k >= 0`` (for example ``pipeline_sim.stage_delays(P)``).
    refresh_every: the uniform period ``T >= 1`` whose budget is shared out.
    allocation: ``"uniform"``, ``"proportional"`` or ``"reverse"``.

  Returns:
    One period (int >= 1) per stage.
  """
  if allocation not in ALLOCATIONS:
    raise ValueError(f"unknown allocation {allocation!r}; choose from {ALLOCATIONS}")
  if isinstance(refresh_every, bool) or not isinstance(refresh_every, int) or refresh_every < 1:
    raise ValueError(f"refresh_every must be an int >= 1, got {refresh_every!r}")
  delays = [int(d) for d in delays]
  if not delays or min(delays) < 0:
    raise ValueError(f"delays must be a non-empty sequence of ints >= 0, got {delays}")
  if allocation == "uniform":
    weights = [1] * len(delays)
  elif allocation == "proportional":
    weights = [d + 1 for d in delays]
  else:
    weights = [d + 1 for d in reversed(delays)]
  budget = len(delays) / refresh_every
  return tuple(max(1, round(sum(weights) / (budget * w))) for w in weights)


def refresh_budget(periods: Sequence[int]) -> float:
  """Refreshes per step summed over stages (``sum_k 1 / T_k``)."""
  return sum(1.0 / p for p in periods)

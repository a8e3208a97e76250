"""Stage-aware budgets: basis-refresh periods (docs/algorithms.md section 3) and statistics
memories (section 3b) set from each pipeline stage's delay.

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

``stage_aware_decay`` is this project's own rule, beyond the paper (which spends refresh *budget* by
delay): it ties the *memory* of the ``L``, ``R`` statistics to the delay. A decay ``shampoo_beta`` averages
over about ``M = 1 / (1 - shampoo_beta)`` steps; stage k gets ``M_k = max(min_memory, M / (1 + tau_k))``,
so the undelayed stage keeps the base memory and a stage ``tau_k`` updates behind forgets
``1 + tau_k`` times faster, tracking a moving eigenbasis with less lag (the estimation-lag
hypothesis of docs/study.md). The rule was fixed a priori (the simplest inverse-delay form, no
constant fitted to any run) before its comparison runs.
"""

from __future__ import annotations

from collections.abc import Sequence

from rotation.options import check_decay, concrete

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


def stage_aware_decay(delays: Sequence[int], shampoo_beta: float = 0.999,
                      min_memory: float = 10.0) -> tuple[float, ...]:
  """Per-stage decays of the ``L``, ``R`` statistics from the stages' delays (module docstring).

  Args:
    delays: per-stage delays ``tau_k >= 0`` (for example ``pipeline_sim.stage_delays(P)``).
    shampoo_beta: the base decay in [0, 1), an undelayed stage's; its memory is ``1 / (1 - shampoo_beta)``.
    min_memory: the shortest memory in steps (>= 1; default 10, one default refresh period).

  Returns:
    One decay per stage, ``1 - (1 + tau_k) / M`` with ``M = 1 / (1 - shampoo_beta)``, no shorter
    than ``min_memory`` steps (and never longer than the base).
  """
  if isinstance(shampoo_beta, bool) or concrete("shampoo_beta", shampoo_beta) is None:
    raise ValueError(f"shampoo_beta must be a number known here, got {shampoo_beta!r}")
  check_decay("shampoo_beta", shampoo_beta)  # [0, 1), as everywhere a decay is given
  memory = 1.0 / (1.0 - shampoo_beta)
  if not isinstance(min_memory, (int, float)) or isinstance(min_memory, bool) or not 1 <= min_memory:
    raise ValueError(f"min_memory must be a number >= 1 (steps), got {min_memory!r}")
  delays = [int(d) for d in delays]
  if not delays or min(delays) < 0:
    raise ValueError(f"delays must be a non-empty sequence of ints >= 0, got {delays}")
  return tuple(1.0 - 1.0 / min(memory, max(min_memory, memory / (1 + d))) for d in delays)

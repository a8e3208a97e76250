"""Pipeline schedules as values (docs/algorithms.md section 1).

A schedule says two things, and both pipelines and the optimizers read them from here only:

- ``delays(P)``: stage k's update t applies a gradient computed at the stage's weights of update
  ``t - tau_k`` (``W(0)`` before the first). The emulator (``Pipeline``) keeps ``tau_k + 1`` weight
  versions per stage; the delay-aware optimizers (PipeDream-LR, stage-aware refresh and decay,
  Nesterov's per-stage momentum) are built for these delays (``per_stage(..., delays=)``), and a
  pipeline refuses optimizers built for others.
- ``batched``, what a device pipeline (``DevicePipeline``) runs to give those delays. Every schedule
  runs the 1F1B phases over a stream of micro-batches. Unbatched (1F1B): a batch is one
  micro-batch, and weight stashing keeps one version per micro-batch in flight. Batched: a batch is
  M >= P micro-batches that all run on the stage's version ``W(t - tau_k)``; the stage sums their
  gradients and applies the batch's mean once, at its last backward, keeping ``versions(P)``
  earlier versions beside its current weights (``Versions``). Its versions are its stash, so a
  batched schedule needs mode ``weight_stashing``.

A new schedule is a subclass with ``name``, ``delays`` and ``batched`` (and ``schedule_of`` knowing
its text, the form a run records).
"""

from __future__ import annotations

import abc
import dataclasses
import re

SCHEDULES = ("1f1b", "2bw", "uniform-D")  # the texts ``schedule_of`` reads (D: a delay >= 1)


def _check_stages(num_stages) -> int:
  if isinstance(num_stages, bool) or not isinstance(num_stages, int) or num_stages < 1:
    raise ValueError(f"number of stages must be an int >= 1, got {num_stages!r}")
  return num_stages


@dataclasses.dataclass(frozen=True)
class Schedule(abc.ABC):
  """A pipeline schedule (module docstring): every kind gives its ``name`` and ``delays``."""

  batched = False

  @property
  @abc.abstractmethod
  def name(self) -> str:
    """The text a run records (``schedule_of`` reads it back)."""

  @abc.abstractmethod
  def delays(self, num_stages: int) -> tuple[int, ...]:
    """Stage k's delay ``tau_k`` in updates at P = ``num_stages``."""

  def versions(self, num_stages: int) -> int:
    """A batched schedule's earlier weight versions per stage (at least one)."""
    return max(1, *self.delays(num_stages))


@dataclasses.dataclass(frozen=True)
class OneFOneB(Schedule):
  """PipeDream 1F1B without flushes: ``tau_k = P - 1 - k``; the first stage lags ``P - 1``
  updates, the last none."""

  @property
  def name(self) -> str:
    return "1f1b"

  def delays(self, num_stages: int) -> tuple[int, ...]:
    p = _check_stages(num_stages)
    return tuple(p - 1 - k for k in range(p))


@dataclasses.dataclass(frozen=True)
class TwoBW(Schedule):
  """PipeDream-2BW (Narayanan et al., 2021): every stage computes update t's gradient at
  ``W(t - 1)`` (two weight versions, gradients accumulated over a batch of at least P
  micro-batches): ``tau_k = 1`` whatever P; P = 1 is no pipeline (``(0,)``), the synchronous
  reference of every schedule."""

  batched = True

  @property
  def name(self) -> str:
    return "2bw"

  def delays(self, num_stages: int) -> tuple[int, ...]:
    p = _check_stages(num_stages)
    return (1 if p > 1 else 0,) * p


@dataclasses.dataclass(frozen=True)
class UniformDelay(Schedule):
  """Every stage ``delay`` updates behind, whatever P, P = 1 included: the delayed-gradient runs of
  delay studies (update t applies the gradient at ``W(t - delay)``), run as a batched schedule
  that keeps ``delay`` earlier versions."""

  delay: int = 1
  batched = True

  def __post_init__(self):
    if isinstance(self.delay, bool) or not isinstance(self.delay, int) or self.delay < 1:
      raise ValueError(f"a uniform delay must be an int >= 1, got delay={self.delay!r}")

  @property
  def name(self) -> str:
    return f"uniform-{self.delay}"

  def delays(self, num_stages: int) -> tuple[int, ...]:
    return (self.delay,) * _check_stages(num_stages)


def schedule_of(schedule: Schedule | str) -> Schedule:
  """The schedule a value or its text (``SCHEDULES``) means."""
  if isinstance(schedule, Schedule):
    return schedule
  if schedule == "1f1b":
    return OneFOneB()
  if schedule == "2bw":
    return TwoBW()
  found = re.fullmatch(r"uniform-(\d+)", schedule) if isinstance(schedule, str) else None
  if found and int(found.group(1)) >= 1:
    return UniformDelay(int(found.group(1)))
  raise ValueError(f"unknown pipeline schedule {schedule!r}; choose from {', '.join(SCHEDULES)} "
                   "(every stage D >= 1 updates behind)")

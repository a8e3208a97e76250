"""The one interface both pipelines implement (the emulator ``Pipeline`` and ``DevicePipeline``), so
that a training loop drives either without asking which it has, and the checks their
constructors share.

A loop: ``state = pipe.place(pipe.init(params, example_batch), mesh, fsdp)``; per chunk of batches
(leaves ``(C, batch, ...)``) ``state, (steps, losses, grad_norms) = pipe.advance(state,
pipe.place_batches(batches, mesh))``, then ``state, (steps, ...) = pipe.finish(state)`` for the
batches still in flight; ``pipe.params(state)`` is the weights every stage holds now. ``steps`` are
the indices of the batches that completed (the emulator completes a chunk's own; a device pipeline
completes them ``in_flight`` batches behind, and ``flushes``: its last ones complete only in ``finish``).
"""

from __future__ import annotations

from typing import Any, Protocol, runtime_checkable

from pipeline_sim.delays import num_stages_of
from pipeline_sim.schedules import Schedule, schedule_of


@runtime_checkable
class PipelineProtocol(Protocol):
  """What a training loop calls on a pipeline (module docstring)."""

  in_flight: int  # batches still in flight after ``advance`` (the emulator: 0)
  flushes: bool  # ``finish`` completes batches (the last evaluation waits for it)

  def init(self, params, example_batch=None) -> Any: ...

  def place(self, state, mesh, fsdp: bool = False) -> Any: ...

  def place_batches(self, batches, mesh) -> Any: ...

  def advance(self, state, batches) -> tuple: ...

  def finish(self, state) -> tuple: ...

  def params(self, state) -> Any: ...


def check_pipeline(labels, mode: str, modes, schedule: Schedule | str, staged,
                   name: str = "pipeline") -> tuple[int, tuple[int, ...], Schedule]:
  """The checks both constructors make: ``mode`` one of ``modes``, the schedule known (a batched
  one only with weight stashing), as many stage functions as stages. Returns ``(P, per-stage
  delays, the schedule's value)``."""
  if mode not in modes:
    raise ValueError(f"unknown {name} mode {mode!r}; choose from {modes}")
  num_stages = num_stages_of(labels)
  schedule = schedule_of(schedule)
  delays = schedule.delays(num_stages)
  if schedule.batched and mode != "weight_stashing":
    raise ValueError(f"schedule {schedule.name!r} needs mode 'weight_stashing' (its weight versions are "
                     f"the stash), got mode {mode!r}")
  if staged is not None and len(staged.stage_fns) != num_stages:
    raise ValueError(f"got {len(staged.stage_fns)} stage functions for {num_stages} stages")
  return num_stages, delays, schedule

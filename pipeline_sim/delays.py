"""Stage delays of a pipeline schedule and the per-leaf stage machinery (docs/algorithms.md section 1).

Parameters are any pytree; a *labels* pytree of the same structure gives every leaf its stage
(an int in ``[0, P)``). ``split_stages`` turns a tree into P trees of the same structure in which
the other stages' leaves are ``None`` (optax and ``jax.tree`` skip them), and ``merge_stages``
puts such parts back together.
"""

from __future__ import annotations

import jax
import optax

from pipeline_sim.schedules import Schedule, schedule_of


def stage_delays(num_stages: int, schedule: Schedule | str = "1f1b") -> tuple[int, ...]:
  """Stage k's delay ``tau_k`` in updates under ``schedule`` (a ``Schedule`` or its text:
  ``pipeline_sim.schedules``): 1F1B's ``P - 1 - k``, 2BW's one at every stage (none at P = 1), a
  uniform delay's D at every stage."""
  return schedule_of(schedule).delays(num_stages)


def num_stages_of(labels) -> int:
  """P of a labels tree: ``max(labels) + 1`` (labels must be ints >= 0)."""
  flat = jax.tree.leaves(labels)
  bad = [l for l in flat if isinstance(l, bool) or not isinstance(l, int) or l < 0]
  if not flat or bad:
    raise ValueError(f"stage labels must be a non-empty tree of ints >= 0, got "
                     f"{bad[0] if bad else 'no leaves'!r}")
  return max(flat) + 1


class StageOptimizers(tuple):
  """P per-stage optimizers and the stage delays they were built for (``per_stage(..., delays=)``):
  a pipeline whose schedule has other delays refuses them when it is constructed."""

  delays: tuple[int, ...]

  def __new__(cls, optimizers, delays):
    out = super().__new__(cls, optimizers)
    out.delays = tuple(int(d) for d in delays)
    return out


def stage_optimizers(optimizer, num_stages: int, delays=None, schedule: str = "") -> tuple:
  """Stage k's optimizer: one ``optax.GradientTransformation`` copied to every stage, or a sequence
  of one per stage (checked: count and type; optimizers built for stage delays, a
  ``StageOptimizers``, also against the pipeline's ``delays``, those of ``schedule``)."""
  built = getattr(optimizer, "delays", None)
  if built is not None and delays is not None and tuple(built) != tuple(delays):
    raise ValueError(f"the optimizers were built for stage delays {tuple(built)}, but the pipeline's "
                     f"schedule {schedule!r} has delays {tuple(delays)} at P = {num_stages}: build them "
                     "for the pipeline's schedule")
  if isinstance(optimizer, optax.GradientTransformation):  # (itself a NamedTuple)
    return (optimizer,) * num_stages
  if isinstance(optimizer, (str, bytes)) or not all(
      isinstance(o, optax.GradientTransformation) for o in optimizer):
    raise TypeError("optimizer must be an optax.GradientTransformation or a sequence of one per "
                    f"stage, got {optimizer!r}")
  if len(optimizer) != num_stages:
    raise ValueError(f"got {len(optimizer)} optimizers for {num_stages} stages")
  return tuple(optimizer)


def check_labels(params, labels, num_stages: int) -> None:
  """``ValueError`` unless ``labels`` has the structure of ``params``, holds ints in ``[0, P)`` and
  gives every stage at least one leaf."""
  stage_delays(num_stages)
  if jax.tree.structure(labels) != jax.tree.structure(params):
    raise ValueError("stage labels do not cover the parameters: label structure "
                     f"{jax.tree.structure(labels)} vs parameters {jax.tree.structure(params)}")
  flat = jax.tree.leaves(labels)
  bad = [l for l in flat if isinstance(l, bool) or not isinstance(l, int) or not 0 <= l < num_stages]
  if bad:
    raise ValueError(f"stage labels must be ints in [0, {num_stages}), got {bad[0]!r}")
  empty = sorted(set(range(num_stages)) - set(flat))
  if empty:
    raise ValueError(f"stage(s) {empty} of {num_stages} have no parameters")


def split_stages(tree, labels, num_stages: int) -> list:
  """P copies of ``tree`` keeping only stage k's leaves (others ``None``)."""
  flat_labels, treedef = jax.tree.flatten(labels)
  leaves = treedef.flatten_up_to(tree)
  return [treedef.unflatten([x if l == k else None for x, l in zip(leaves, flat_labels)])
          for k in range(num_stages)]


def merge_stages(parts, labels):
  """Inverse of ``split_stages``."""
  flat_labels, treedef = jax.tree.flatten(labels)
  flats = [treedef.flatten_up_to(p) for p in parts]
  return treedef.unflatten([flats[l][i] for i, l in enumerate(flat_labels)])


def leaf_delays(labels, num_stages: int, schedule: str = "1f1b"):
  """Per-leaf delay ``tau`` of the leaf's stage under ``schedule`` (``stage_delays``)."""
  delays = stage_delays(num_stages, schedule)
  return jax.tree.map(lambda l: delays[l], labels)

"""Gradients as an asynchronous pipeline computes them (docs/algorithms.md section 1).

- weight stashing / stale gradients: the ordinary gradient, taken at the mixed-version point or at
  the current weights (``jax.value_and_grad`` of the whole loss; the driver picks the point);
- no stashing: the forward runs with stale weights and saves every stage's input; the backward
  runs stage by stage from the last to the first, each stage linearised at its *current* weights
  and the saved (stale) input. This needs the model as a sequence of stage functions.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence
from typing import Any

import jax
import jax.numpy as jnp


class OtherStageError(ValueError):
  """A stage function read a parameter leaf of another stage."""


class OtherStageLeaf:
  """Stands for a leaf of another stage (``None`` in stage k's part) when a stage function that
  failed is traced again to find out why: any use raises ``OtherStageError`` naming the stage and
  the leaf, where the ``None`` failed deep inside the model's code."""

  def __init__(self, stage: int, path: str):
    self._stage, self._path = stage, path

  def _refuse(self, *args, **kwargs):
    raise OtherStageError(f"stage {self._stage}'s function reads parameter leaf {self._path}, which its "
                     "labels put on another stage: a stage sees only its own leaves (give the leaf "
                     f"label {self._stage}, or move that computation to its stage)")

  def __getattr__(self, name):
    if name.startswith("__"):  # protocol probes (copy, pickle, numpy): not a use
      raise AttributeError(name)
    self._refuse()

  __len__ = __iter__ = __getitem__ = __array__ = __jax_array__ = __bool__ = __float__ = __int__ = _refuse
  __add__ = __radd__ = __sub__ = __rsub__ = __mul__ = __rmul__ = __matmul__ = __rmatmul__ = _refuse
  __truediv__ = __rtruediv__ = __neg__ = __pow__ = _refuse

  def __repr__(self):
    return f"OtherStageLeaf(stage={self._stage}, path={self._path})"


def _guarded(k: int, part):
  """``part`` with its ``None`` leaves (the other stages') as ``OtherStageLeaf``."""
  return jax.tree_util.tree_map_with_path(
      lambda path, x: OtherStageLeaf(k, jax.tree_util.keystr(path)) if x is None else x, part,
      is_leaf=lambda x: x is None)


@dataclasses.dataclass(frozen=True)
class Staged:
  """A model as P stage functions.

  Attributes:
    stage_fns: ``f_k(stage_params, activations) -> activations``; ``stage_params`` is the parameter
      tree with other stages' leaves ``None``.
    loss_of: ``(last stage's output, batch) -> scalar loss``.
    inputs_of: ``batch -> stage 0's input`` (default ``batch[0]``).
  """

  stage_fns: Sequence[Callable[[Any, Any], Any]]
  loss_of: Callable[[Any, Any], jax.Array]
  inputs_of: Callable[[Any], Any] = lambda batch: batch[0]

  def stage(self, k: int) -> Callable[[Any, Any], Any]:
    """Stage k's function as the pipelines call it (its part: other stages' leaves ``None``). If
    it fails, it is traced again with those leaves as ``OtherStageLeaf``: a read of another stage's
    leaf then raises ``OtherStageError`` (a ``ValueError``) naming the stage and the leaf; any other
    failure is raised as it was."""
    f = self.stage_fns[k]

    def call(part, act):
      try:
        return f(part, act)
      except Exception as error:
        try:
          jax.eval_shape(lambda p, a: f(_guarded(k, p), a), part, act)
        except OtherStageError as found:
          raise OtherStageError(f"{found} (it failed with {type(error).__name__}: {error})") from error
        except Exception:  # noqa: BLE001 - another failure: the original error is the one to raise
          pass
        raise

    return call

  def loss(self, parts, batch):
    """The full loss from per-stage parameter parts (each stage may see different versions)."""
    act = self.inputs_of(batch)
    for k, p in enumerate(parts):
      act = self.stage(k)(p, act)
    return self.loss_of(act, batch)


def no_stashing_value_and_grad(staged: Staged, stale_parts, current_parts, batch):
  """Loss of the stale forward and the per-stage gradients of the inconsistent backward.

  Returns:
    ``(loss, grads)`` with ``grads[k]`` shaped like ``current_parts[k]``.
  """
  num_stages = len(staged.stage_fns)
  inputs, act = [], staged.inputs_of(batch)
  for k, p in enumerate(stale_parts):
    inputs.append(act)
    act = staged.stage(k)(p, act)
  loss = staged.loss_of(act, batch)
  grads = [None] * num_stages
  cotangent = jnp.ones_like(loss)
  for k in reversed(range(num_stages)):
    f = staged.stage(k)
    if k == num_stages - 1:
      f = lambda p, a, f=f: staged.loss_of(f(p, a), batch)
    if k == 0:  # stage 0's input (tokens) needs no cotangent
      _, vjp = jax.vjp(lambda p, f=f: f(p, inputs[0]), current_parts[0])
      (grads[0],) = vjp(cotangent)
    else:
      _, vjp = jax.vjp(f, current_parts[k], inputs[k])
      grads[k], cotangent = vjp(cotangent)
  return loss, grads

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

  def loss(self, parts, batch):
    """The full loss from per-stage parameter parts (each stage may see different versions)."""
    act = self.inputs_of(batch)
    for f, p in zip(self.stage_fns, parts):
      act = f(p, act)
    return self.loss_of(act, batch)


def no_stashing_value_and_grad(staged: Staged, stale_parts, current_parts, batch):
  """Loss of the stale forward and the per-stage gradients of the inconsistent backward.

  Returns:
    ``(loss, grads)`` with ``grads[k]`` shaped like ``current_parts[k]``.
  """
  num_stages = len(staged.stage_fns)
  inputs, act = [], staged.inputs_of(batch)
  for f, p in zip(staged.stage_fns, stale_parts):
    inputs.append(act)
    act = f(p, act)
  loss = staged.loss_of(act, batch)
  grads = [None] * num_stages
  cotangent = jnp.ones_like(loss)
  for k in reversed(range(num_stages)):
    f = staged.stage_fns[k]
    if k == num_stages - 1:
      f = lambda p, a, f=f: staged.loss_of(f(p, a), batch)
    if k == 0:  # stage 0's input (tokens) needs no cotangent
      _, vjp = jax.vjp(lambda p, f=f: f(p, inputs[0]), current_parts[0])
      (grads[0],) = vjp(cotangent)
    else:
      _, vjp = jax.vjp(f, current_parts[k], inputs[k])
      grads[k], cotangent = vjp(cotangent)
  return loss, grads

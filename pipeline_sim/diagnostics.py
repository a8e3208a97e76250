"""Update-direction diagnostics of an emulated pipeline (``diagnose``): how far each stage's stale
update points from the fresh one it replaces, and how often it flips sign along the sharpest
direction. Analysis beside training: the trial steps are discarded and the run's numbers do not
change (``experiments.harness.runs`` logs them with ``--diagnose-every``)."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np

from pipeline_sim.delays import merge_stages, split_stages
from pipeline_sim.driver import Pipeline, PipelineState


def diagnose(pipe: Pipeline, state: PipelineState, batches) -> dict:
  """Update-direction diagnostics over ``len(batches)`` trial steps from ``state`` (which is not
  consumed; the trial steps are discarded). Modes ``weight_stashing`` and ``no_stashing``.

  Returns (NumPy):
    ``cosine`` (steps, P): per stage, the cosine between the update it applies (from the stale
      gradient) and the update it would apply with a fresh gradient at the current weights, from
      the same optimizer state (1 at P = 1; below 1 for every stage of a deeper pipeline, the last
      one too, whose input comes from the earlier stages' stale weights). Both updates carry the
      momentum already in the state, so with a high b1 this is near 1 whatever the delay;
    ``gradient_cosine`` (steps, P): the same for the gradient's own part of each update,
      ``u(g) - u(0)`` (the update for the gradient minus the update for a zero gradient, from the
      same state): the preconditioned gradient without the momentum it shares with the other
      (exact for momentum SGD and any optimizer whose update is affine in the gradient; for Adam
      the second moment's own change with g enters too);
    ``flip_rate`` (P,): per stage, the fraction of consecutive steps whose applied update changes
      sign along the top eigenvectors of its matrices' gradient statistics ``L = sum_t G G^T``,
      ``R = sum_t G^T G`` over the window (``u1^T dW v1``; the mean over the stage's matrices, a
      leaf of more than two axes counting as a stack of matrices over its last two, as scanned
      layers are; NaN for a stage without one): oscillation along the sharpest direction.
  """
  if pipe.mode == "stale_gradients":
    raise ValueError("diagnose supports modes 'weight_stashing' and 'no_stashing'")
  out = _diagnose(pipe, state, batches)
  return {k: np.asarray(v) for k, v in out.items()}


def _updates(pipe: Pipeline, grad_parts, state: PipelineState):
  """Per-stage updates the optimizers would apply for ``grad_parts`` from ``state`` (discarded)."""
  parts = split_stages(state.params, pipe.labels, pipe.num_stages)
  if pipe.merged:
    u, _ = pipe.optimizers[0].update(merge_stages(grad_parts, pipe.labels), state.opt_states[0],
                                     state.params)
    return split_stages(u, pipe.labels, pipe.num_stages)
  return [pipe.optimizers[k].update(g, state.opt_states[k], parts[k])[0] for k, g in enumerate(grad_parts)]


@functools.partial(jax.jit, static_argnums=0)
def _diagnose(pipe: Pipeline, state: PipelineState, batches):
  def cosine(a, b):
    a, b = jnp.concatenate([x.ravel() for x in jax.tree.leaves(a)]), jnp.concatenate(
        [x.ravel() for x in jax.tree.leaves(b)])
    return jnp.vdot(a, b) / jnp.maximum(jnp.linalg.norm(a) * jnp.linalg.norm(b), 1e-30)

  def one(st, batch):
    _, stale, _ = pipe.stale_gradients(st, batch)
    fresh = split_stages(jax.grad(pipe.loss_fn)(st.params, batch), pipe.labels, pipe.num_stages)
    u_stale, u_fresh = _updates(pipe, stale, st), _updates(pipe, fresh, st)
    u_zero = _updates(pipe, [jax.tree.map(jnp.zeros_like, g) for g in fresh], st)
    own = lambda u: jax.tree.map(jnp.subtract, u, u_zero)
    cos = jnp.stack([cosine(a, b) for a, b in zip(u_stale, u_fresh)])
    gcos = jnp.stack([cosine(a, b) for a, b in zip(own(u_stale), own(u_fresh))])
    new, _ = pipe.step(st, batch)
    delta = jax.tree.map(jnp.subtract, new.params, st.params)
    return new, (cos, gcos, [x for x in jax.tree.leaves(delta) if x.ndim >= 2],
                 [x for x in jax.tree.leaves(merge_stages(fresh, pipe.labels)) if x.ndim >= 2])

  _, (cos, gcos, deltas, grads) = jax.lax.scan(one, state, batches)
  stage_of = [k for k, x in zip(jax.tree.leaves(pipe.labels), jax.tree.leaves(state.params)) if x.ndim >= 2]
  flips = []
  for d, g in zip(deltas, grads):  # (steps, *stack, m, n) each
    # a leaf of more axes is a stack of matrices over its last two: one flip rate per matrix
    d, g = (x.reshape(x.shape[0], -1, *x.shape[-2:]) for x in (d, g))
    _, u = jnp.linalg.eigh(jnp.einsum("tbij,tbkj->bik", g, g))
    _, v = jnp.linalg.eigh(jnp.einsum("tbji,tbjk->bik", g, g))
    c = jnp.einsum("bi,tbij,bj->tb", u[..., -1], d, v[..., -1])
    flips.append(jnp.mean(jnp.sign(c[1:]) != jnp.sign(c[:-1])))
  rate = jnp.stack([jnp.mean(jnp.stack([f for f, k in zip(flips, stage_of) if k == s]))
                    if s in stage_of else jnp.nan for s in range(pipe.num_stages)])
  return {"cosine": cos, "gradient_cosine": gcos, "flip_rate": rate}

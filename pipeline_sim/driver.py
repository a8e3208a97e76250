"""Training driver: asynchronous pipeline steps inside a jit-compiled ``lax.scan``.

Every stage has its own optimizer and state, as in a real pipeline, where stage k applies its
update before the earlier stages have computed their gradients (``pipeline_sim.DevicePipeline``
runs exactly this): one optimizer means P copies of it, each over its stage's leaves (so
``clip_by_global_norm`` clips each stage by its own norm), and a sequence of P optimizers gives
per-stage learning rates, momenta or refresh periods. ``merged=True`` instead runs one optimizer
once over every stage's leaves with one state (modes ``weight_stashing`` and ``no_stashing``,
where every stage updates at every step): one update and one compiled refresh per same-shape group
of basis rotation instead of P (``experiments.bench.pipeline``). It computes the same numbers as
the P copies for transformations that treat leaves independently (Adam, basis rotation without
``stagger``), but a global-norm clip or ``stagger`` then spans every stage, which no real pipeline
can do. One step ``i`` per micro-batch:

- ``"weight_stashing"``: stage k keeps a ring of its last ``tau_k + 1`` weight versions; the
  gradient of micro-batch ``i`` is taken at ``(W_0(i - tau_0), ..., W_{P-1}(i - tau_{P-1}))`` and
  every stage applies its block at once (PipeDream 1F1B with stashing).
- ``"stale_gradients"``: gradients at the current weights go into a per-stage FIFO; stage k applies
  the one from ``tau_k`` steps ago; during its first ``tau_k`` steps it does not update and its
  optimizer state is untouched.
- ``"no_stashing"``: stale forward, backward at the current weights (needs ``Staged``).

Two of the field's staleness remedies ride on the stash (docs/algorithms.md, "remedies"):

- **weight prediction** (``predict=s``; SpecTrain, Chen et al. 2018; PipeMare, Yang et al. 2021):
  stage k's forward and backward of micro-batch ``i`` run at
  ``W_hat = W_k(i - tau_k) + s_k * tau_k * (W_k(i - tau_k) - W_k(i - tau_k - 1))``, the stashed
  version extrapolated ``tau_k`` steps along the last update the stage had applied when it stashed
  it (``w - tau * s * delta`` with ``delta`` the last step taken downhill); the ring then holds one
  version more per stage. ``s = 0`` is weight stashing exactly.
- **delay compensation** (``pipeline_sim.dc_asgd``): every optimizer update receives the weights its
  gradient was computed at as the extra argument ``stale_params`` (optax's extra-args convention;
  transformations that take none ignore it): the stashed or predicted weights, under no stashing
  the forward's. ``stale_gradients`` passes none (its FIFO keeps gradients, not weights), so a
  ``dc_asgd`` there is refused when the step is traced.

Memory: the rings hold ``sum_k (tau_k + 1) * |stage k|`` elements (weights for the stashing modes,
gradients for ``stale_gradients``), beside the current parameters and optimizer states.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Sequence
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import optax

from pipeline_sim import buffers as rb
from pipeline_sim import sharding
from pipeline_sim.delays import (
  check_labels,
  merge_stages,
  split_stages,
  stage_optimizers,
)
from pipeline_sim.gradients import Staged, no_stashing_value_and_grad
from pipeline_sim.protocol import check_pipeline

MODES = ("weight_stashing", "stale_gradients", "no_stashing")


class PipelineState(NamedTuple):
  """State of the emulated pipeline."""

  step: jax.Array  # int32 (): micro-batches processed (= updates of the last stage).
  params: Any  # current weights W(step), the user's parameter pytree.
  opt_states: tuple  # one optimizer state per stage over its leaves; (state,) if ``merged``.
  buffers: tuple  # per stage: leaves (tau_k + 1, *shape): weight versions or gradient FIFO.


class Pipeline:
  """An emulated asynchronous pipeline; ``init`` then ``run`` chunks of steps.

  Args:
    loss_fn: ``loss(params, batch) -> scalar``; may be omitted when ``staged`` is given.
    optimizer: one ``optax.GradientTransformation`` (P copies: each stage's own over its leaves, as
      on devices) or a sequence of P (one per stage).
    labels: stage index of every parameter leaf (same structure as the parameters); the number of
      stages P is ``max(labels) + 1`` and every stage must own at least one leaf.
    mode: one of ``MODES``.
    staged: the model as P stage functions (required for ``"no_stashing"``).
    grad_norms: if true, ``run`` returns ``(state, (losses, grad_norms))``: also the global norm of
      each step's freshly computed gradient (all stages, before any clipping).
    merged: run the one ``optimizer`` once over every stage's leaves with one state (not per stage;
      see the module docstring); modes ``weight_stashing`` and ``no_stashing`` only.
    schedule: a ``pipeline_sim.schedules.Schedule`` or its text: ``"1f1b"`` (PipeDream's delays
      ``tau_k = P - 1 - k``), ``"2bw"`` (PipeDream-2BW: update t's gradient at ``W_{t-1}`` for every
      stage, ``W_0`` for t = 0, a delay of one whatever P) or ``"uniform-D"`` (every stage D
      updates behind). A batched schedule (2BW, uniform) needs mode ``"weight_stashing"``: its
      weight versions are its stash, its forward and backward always see one version, so there is
      none without stashing, and a gradient FIFO at the current weights would apply batch t's
      gradient at update t + 1). Optimizers built for other delays (``per_stage(..., delays=)``)
      are refused.

    predict: weight prediction's scale ``s`` (module docstring), one float for every stage or a
      sequence of P; ``None`` (the default) stashes without prediction. Mode ``"weight_stashing"``
      only (1F1B or 2BW), every scale finite and ``>= 0``.

  ``run(state, batches)`` is jit-compiled and *consumes* ``state`` (its buffers are donated, so that
  the pipeline is updated in place): use the state it returns, never the one passed in (a consumed
  one is refused with a ``ValueError``).
  """

  def __init__(self, loss_fn: Callable | None,
               optimizer: optax.GradientTransformation | Sequence[optax.GradientTransformation],
               labels, mode: str = "weight_stashing", staged: Staged | None = None,
               grad_norms: bool = False, merged: bool = False, schedule: str = "1f1b",
               predict: float | Sequence[float] | None = None):
    num_stages, self.delays, self.schedule = check_pipeline(labels, mode, MODES, schedule, staged)
    if mode == "no_stashing" and staged is None:
      raise ValueError("mode 'no_stashing' needs the model as stage functions (staged=Staged(...))")
    if loss_fn is None:
      if staged is None:
        raise ValueError("give loss_fn or staged")
      loss_fn = lambda params, batch: staged.loss(split_stages(params, labels, num_stages), batch)
    self.optimizers = stage_optimizers(optimizer, num_stages, self.delays, self.schedule.name)
    single = isinstance(optimizer, optax.GradientTransformation)
    if merged and (not single or mode == "stale_gradients"):
      raise ValueError("merged=True runs one optimizer over every stage at every step: it needs one "
                       f"optimizer and mode 'weight_stashing' or 'no_stashing' (got mode {mode!r}"
                       f"{'' if single else f' and {len(optimizer)} optimizers'})")
    self.merged = merged
    self.predict = _prediction_scales(predict, num_stages, mode)
    # ring depth per stage: tau_k + 1 versions, one more for prediction's previous version
    self._depths = tuple(tau + 1 + (self.predict is not None) for tau in self.delays)
    self.loss_fn, self.labels, self.num_stages = loss_fn, labels, num_stages
    self.mode, self.staged, self.grad_norms = mode, staged, grad_norms
    self.run = rb.Consuming(self._run, "Pipeline.run")
    self._init = jax.jit(self._init_impl)

  def _split(self, tree):
    return split_stages(tree, self.labels, self.num_stages)

  # ---- the pipeline protocol (pipeline_sim.protocol) ---------------------------------------------

  in_flight = 0  # the emulator completes each chunk's own steps: none in flight after ``advance``
  flushes = False  # ``finish`` has nothing to complete

  def init(self, params, example_batch=None) -> PipelineState:
    """The state at step 0, built by one compiled program (P optimizers' inits run op by op would
    compile hundreds of small programs; docs/benchmarks.md, "Figures the code's comments cite").
    ``example_batch`` is not needed (the protocol's argument)."""
    del example_batch
    check_labels(params, self.labels, self.num_stages)
    return self._init(params)

  def place(self, state: PipelineState, mesh, fsdp: bool = False) -> PipelineState:
    """The state on the data-parallel ``mesh``: replicated, or with ``fsdp`` sharded over it."""
    return sharding.fsdp(state, mesh) if fsdp else sharding.replicate(state, mesh)

  def place_batches(self, batches, mesh):
    """A chunk of batches split over the data devices of ``mesh``."""
    return sharding.shard_batches(batches, mesh)

  def advance(self, state: PipelineState, batches):
    """``run``, as the protocol returns it: ``(state, (steps, losses, grad_norms))`` in NumPy, the
    chunk's own steps (grad norms NaN unless the pipeline was built with ``grad_norms``)."""
    first = int(state.step)
    state, out = self.run(state, batches)
    losses, norms = (np.asarray(x) for x in out) if self.grad_norms else (np.asarray(out), None)
    norms = np.full(losses.shape, np.nan) if norms is None else norms
    return state, (np.arange(first, first + len(losses)), losses, norms)

  def finish(self, state: PipelineState):
    """Nothing is in flight: ``(state, empty steps, losses and grad norms)``."""
    return state, (np.zeros(0, np.int32), np.zeros(0), np.zeros(0))

  def params(self, state: PipelineState):
    """The current weights W(step)."""
    return state.params

  def _init_impl(self, params) -> PipelineState:
    parts = self._split(params)
    if self.merged:
      opt_states = (self.optimizers[0].init(params),)
    else:
      opt_states = tuple(opt.init(p) for opt, p in zip(self.optimizers, parts))
    if self.mode == "stale_gradients":
      parts = [jax.tree.map(jnp.zeros_like, p) for p in parts]
    buffers = tuple(rb.ring_init(p, depth) for p, depth in zip(parts, self._depths))
    # Copies (never the caller's arrays forwarded), so donating the state never deletes them.
    return PipelineState(jnp.zeros([], jnp.int32), jax.tree.map(jnp.copy, params), opt_states, buffers)

  def buffer_bytes(self, state: PipelineState) -> int:
    return rb.tree_bytes(state.buffers)

  def _apply(self, k, grads, params, opt_state, stale=None):
    extra = {} if stale is None else {"stale_params": stale}
    updates, opt_state = optax.with_extra_args_support(self.optimizers[k]).update(
        grads, opt_state, params, **extra)
    return optax.apply_updates(params, updates), opt_state

  def _stashed(self, state: PipelineState) -> list:
    """Per stage, the weights micro-batch ``state.step`` computes at: ``W_k(i - tau_k)`` from the
    ring, extrapolated when predicting (``W(j)`` lives in slot ``j % depth``; the ring starts full of
    ``W(0)``, so versions before 0 read as ``W(0)`` and the first prediction moves nothing)."""
    i = state.step
    out = []
    for k, (buf, tau, depth) in enumerate(zip(state.buffers, self.delays, self._depths)):
      w = rb.ring_read(buf, (i - tau) % depth)
      if self.predict is not None and tau > 0:
        prev = rb.ring_read(buf, (i - tau - 1) % depth)
        c = self.predict[k] * tau
        w = jax.tree.map(lambda a, b: (a + c * (a - b)).astype(a.dtype), w, prev)
      out.append(w)
    return out

  def stale_gradients(self, state: PipelineState, batch):
    """(loss, per-stage gradients, per-stage stale weights) of the step's micro-batch as the
    pipeline computes them: at the stashed (or predicted) weights (weight stashing), or stale
    forward and current backward (no stashing; the stale weights are then the forward's)."""
    stale_parts = self._stashed(state)
    if self.mode == "weight_stashing":
      loss, grads = jax.value_and_grad(self.loss_fn)(merge_stages(stale_parts, self.labels), batch)
      return loss, self._split(grads), stale_parts
    loss, grads = no_stashing_value_and_grad(self.staged, stale_parts, self._split(state.params), batch)
    return loss, grads, stale_parts

  def step(self, state: PipelineState, batch):
    """One micro-batch: returns the new state and the loss the pipeline observed (with
    ``grad_norms``: ``(loss, global gradient norm)``)."""
    i = state.step
    parts = self._split(state.params)
    slots = [(i + 1) % depth for depth in self._depths]  # W(i + 1) and g(i - tau) go here
    new_parts, new_opt, new_buffers = [], [], []
    if self.mode == "stale_gradients":
      loss, grads = jax.value_and_grad(self.loss_fn)(state.params, batch)
      grad_parts = self._split(grads)
      for k, (g, tau) in enumerate(zip(grad_parts, self.delays)):
        fifo = rb.ring_write(state.buffers[k], i % (tau + 1), g)
        stale = rb.ring_read(fifo, slots[k])
        update = functools.partial(self._apply, k, stale)
        if tau == 0:
          p, s = update(parts[k], state.opt_states[k])
        else:  # warm-up: no update, optimizer state untouched
          p, s = jax.lax.cond(i >= tau, update, lambda p, s: (p, s), parts[k], state.opt_states[k])
        new_parts.append(p), new_opt.append(s), new_buffers.append(fifo)
    else:
      loss, grad_parts, at = self.stale_gradients(state, batch)
      if self.merged:
        params, s = self._apply(0, merge_stages(grad_parts, self.labels), state.params,
                                state.opt_states[0], merge_stages(at, self.labels))
        new_parts, new_opt = self._split(params), [s]
      else:
        for k, g in enumerate(grad_parts):
          p, s = self._apply(k, g, parts[k], state.opt_states[k], at[k])
          new_parts.append(p), new_opt.append(s)
      new_buffers = [rb.ring_write(b, slot, p)  # W(i + 1)
                     for b, slot, p in zip(state.buffers, slots, new_parts)]
    params = merge_stages(new_parts, self.labels)
    new_state = PipelineState(i + 1, params, tuple(new_opt), tuple(new_buffers))
    return new_state, ((loss, optax.tree.norm(grad_parts)) if self.grad_norms else loss)

  def _run(self, state: PipelineState, batches):
    return jax.lax.scan(self.step, state, batches)


def _prediction_scales(predict, num_stages: int, mode: str) -> tuple[float, ...] | None:
  """``predict`` as P floats (``None`` stays ``None``), refused by name when it cannot mean a scale."""
  if predict is None:
    return None
  if mode != "weight_stashing":
    raise ValueError(f"weight prediction (predict={predict!r}) extrapolates the stashed weights: it needs "
                     f"mode 'weight_stashing', got mode {mode!r}")
  scales = [predict] * num_stages if np.ndim(predict) == 0 else list(predict)
  if len(scales) != num_stages:
    raise ValueError(f"predict has {len(scales)} scales for {num_stages} stages: give one, or one per stage")
  for s in scales:
    if isinstance(s, bool) or not isinstance(s, (int, float, np.floating, np.integer)) or not np.isfinite(s) \
        or s < 0:
      raise ValueError(f"predict scales must be finite numbers >= 0, got {s!r} in predict={predict!r}")
  return tuple(float(s) for s in scales)

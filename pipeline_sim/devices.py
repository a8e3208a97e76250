"""A real asynchronous pipeline across devices (PipeDream 1F1B, 2BW, a uniform delay), on JAX's own
SPMD machinery.

P stages on a ``(stage, data)`` mesh: device ``(k, d)`` holds only stage k's parameters, optimizer
state and weight stash, and the ``data`` axis splits every micro-batch (gradients are averaged over
it with ``pmean``). The whole schedule is one ``shard_map``-ped program inside a ``lax.scan``:
activations move forward and cotangents backward with ``jax.lax.ppermute``.

Schedule (docs/algorithms.md section 1: PipeDream 1F1B, forward and backward of equal length).
Time runs in *phases*. In phase ``u`` stage k runs

- the forward of micro-batch ``m = (u - k) / 2`` when ``u - k`` is even: it saves its input (and,
  with weight stashing, the weights it used) in a ring slot ``m % (tau_k + 1)`` and sends its output
  to stage k + 1;
- the backward of micro-batch ``m = (u - 2P + 1 + k) / 2`` when ``u - k`` is odd: it recomputes its
  forward from the saved input (at the stashed weights, or at the current weights without
  stashing), takes the vector-Jacobian product with the cotangent from stage k + 1 (the last stage
  differentiates the loss), sends the input cotangent to stage k - 1 and applies its optimizer.

So stage 0 forwards micro-batch m in phase 2m and finishes its backward in phase 2m + 2P - 1; in
steady state every stage alternates one forward and one backward. Stage k's forward of m comes
after the backwards of micro-batches ``m' <= m - P + k`` only: it misses the last ``tau_k = P - 1 - k``
updates, which is exactly the delay that ``pipeline_sim.Pipeline`` emulates, and every stage applies
micro-batch m's gradient as its m-th update. The two compute the same trajectory (the tests check
it to float64 round-off); only the bookkeeping differs. A stage recomputes its forward at its
backward (rematerialisation at stage boundaries), so only stage inputs are kept in flight.

Batched schedules (``pipeline_sim.schedules``: PipeDream-2BW, ``schedule="2bw"``, Narayanan et al.,
2021; a uniform delay D, ``"uniform-D"``): the same 1F1B phases over a stream of micro-batches,
M >= P of them per batch (``micro_batches``, default P), each a contiguous 1/M of the batch's rows.
Every micro-batch of batch t runs its forward and backward on the stage's version
``W_{t - tau_k}`` (``W_0`` before the first update, and never older than the first batch after a
flush, which starts a new fill); the stage sums their gradients and applies the batch's mean
gradient once, at the backward of the batch's last micro-batch: update t applies the gradient at
``W_{t - tau_k}`` to ``W_t``. A stage keeps its current weights, its last ``V = max(1, tau)``
versions before them (``Versions``) and a gradient accumulator. With M >= P the version a
micro-batch needs is always kept: batch t's first forward at stage k comes after the backward of
micro-batch ``tM - P + k``, which completes batch t - 2's update since ``tM - P + k >= (t - 1)M -
1``, so the stage has applied t - 1 or t updates while batch t runs, and ``W_{t - tau}`` is at most
``tau`` versions old. With a mean loss over the batch this is the emulator's
``Pipeline(..., schedule=...)`` step for step. At P = 1 2BW has no delay: it is synchronous.

Streams and batches in flight: ``run`` feeds a chunk of C batches (one micro-batch each under 1F1B,
M under a batched schedule; 2CM phases) and returns the C batches that *completed* during it (stage
0's last backward done): batches ``c0 - in_flight .. c0 + C - 1 - in_flight``, with ``in_flight =
ceil((P - 1) / M)``: P - 1 under 1F1B, 1 under a batched schedule with M = P, 0 at P = 1.
``finish`` drains the pipeline (stage 0 takes no more input) and returns the rest; after it every
stage has applied every batch, as the emulator after the same number of steps.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from pipeline_sim import buffers as rb
from pipeline_sim.buffers import Consuming
from pipeline_sim.delays import (
  check_labels,
  merge_stages,
  split_stages,
  stage_optimizers,
)
from pipeline_sim.gradients import Staged
from pipeline_sim.protocol import check_pipeline
from pipeline_sim.schedules import OneFOneB

STAGE, DATA = "stage", "data"
DEVICE_MODES = ("weight_stashing", "no_stashing")


def pipeline_mesh(num_stages: int, devices: Sequence[jax.Device] | None = None) -> Mesh:
  """A ``(stage, data)`` mesh: P stages, the remaining factor of the devices on ``data``.

  Raises:
    ValueError: the number of devices is not a multiple of ``num_stages``.
  """
  devices = list(jax.local_devices() if devices is None else devices)
  if num_stages < 1 or len(devices) % num_stages:
    raise ValueError(f"{len(devices)} devices cannot hold {num_stages} pipeline stages: the device count "
                     "must be a multiple of the number of stages")
  return Mesh(np.asarray(devices).reshape(num_stages, -1), (STAGE, DATA))


@dataclasses.dataclass(frozen=True)
class _Layout:
  """Where each leaf of a pytree lives in per-dtype flat vectors (static)."""

  treedef: Any
  leaves: tuple  # (dtype name, offset, shape, PRNG impl or None) per leaf
  sizes: dict  # dtype name -> elements


def _key_impl(x):
  """The PRNG implementation of a typed key array or shape (``None`` for any other leaf)."""
  if not jax.dtypes.issubdtype(x.dtype, jax.dtypes.prng_key):
    return None
  found = []
  jax.eval_shape(lambda k: found.append(jax.random.key_impl(k)), x)
  return found[0]


def _layout(tree) -> _Layout:
  """A typed PRNG key (``optax.add_noise``'s state) is stored as its key data (uint32)."""
  leaves, treedef = jax.tree.flatten(tree)
  sizes, specs = {}, []
  for x in leaves:
    impl = _key_impl(x)
    if impl is not None:
      x = jax.eval_shape(jax.random.key_data, x)
    d = jnp.dtype(x.dtype).name
    specs.append((d, sizes.get(d, 0), tuple(x.shape), impl))
    sizes[d] = sizes.get(d, 0) + int(np.prod(x.shape, dtype=int))
  return _Layout(treedef, tuple(specs), sizes)


def _pack(tree, layout: _Layout, widths: dict) -> dict:
  """``tree`` as one zero-padded flat vector per dtype of ``widths``."""
  parts = {d: [] for d in widths}
  for x, (d, _, _, impl) in zip(layout.treedef.flatten_up_to(tree), layout.leaves):
    parts[d].append(jnp.ravel(jax.random.key_data(x) if impl is not None else x).astype(d))
  out = {}
  for d, w in widths.items():
    flat = jnp.concatenate(parts[d]) if parts[d] else jnp.zeros((0,), d)
    out[d] = jnp.pad(flat, (0, w - flat.shape[0]))
  return out


def _unpack(flat: dict, layout: _Layout):
  leaves = [flat[d][o:o + int(np.prod(s, dtype=int))].reshape(s) for d, o, s, _ in layout.leaves]
  leaves = [x if impl is None else jax.random.wrap_key_data(x, impl=impl)
            for x, (_, _, _, impl) in zip(leaves, layout.leaves)]
  return layout.treedef.unflatten(leaves)


def _widths(layouts) -> dict:
  names = sorted({d for lay in layouts for d in lay.sizes})
  return {d: max(lay.sizes.get(d, 0) for lay in layouts) for d in names}


class DevicePipelineState(NamedTuple):
  """State of the pipeline across devices; every array but the counters has leading ``(P, D)``
  axes sharded over ``(stage, data)``: device ``(k, d)`` holds entry ``[k, d]`` only."""

  phase: jax.Array  # int32 (): phases run so far (two per micro-batch in steady state).
  fed: jax.Array  # int32 (): batches stage 0 has taken in (micro-batches under 1F1B).
  start: jax.Array  # int32 (): first batch since the last flush (0 for one unbroken stream).
  carry: dict  # dtype name -> (P, D, L): stage k's (params, optimizer state, stash), packed; the
  #   stash is 1F1B's ring of tau_k + 1 weight versions, or a batched schedule's ``Versions``.
  inbox: Any  # message tree, leaves (P, D, P, *local): inputs of micro-batches in flight, slot m % (tau_k+1).
  fwd: Any  # message tree, leaves (P, D, *local): what each stage received from stage k - 1.
  bwd: Any  # activation tree, leaves (P, D, *local): the cotangent each stage received from stage k + 1.
  pending: jax.Array  # float (2, in_flight * M): loss and squared gradient norm so far of the
  #   micro-batches of the batches in flight after the last call (from micro-batch
  #   ``phase // 2 - in_flight * M`` on).


class Versions(NamedTuple):
  """A batched schedule's per-stage stash (beside the stage's current weights ``W_n``)."""

  previous: Any  # leaves (V, *shape): the stage's weights W_{n-1}, ..., W_{n-V} (W_0 for those
  #   before the first update), its parameters' dtypes.
  grad_sum: Any  # the sum of the current batch's micro-batch gradients, the parameters' shapes.
  updates: jax.Array  # int32 (): n, the updates this stage has applied.


class DevicePipeline:
  """PipeDream 1F1B or 2BW across the devices of a ``(stage, data)`` mesh; ``init``, ``run``, ``finish``.

  Args:
    staged: the model as P stage functions; every stage but the last must return activations of one
      shape and dtype (the message between stages).
    optimizer: one ``optax.GradientTransformation`` (P copies: each stage's own over its leaves, as
      ``Pipeline``) or a sequence of P (per-stage optimizers).
    labels: stage index of every parameter leaf (P = ``max(labels) + 1``).
    mode: ``"weight_stashing"`` or ``"no_stashing"`` (``DEVICE_MODES``; 2BW: ``"weight_stashing"``).
    mesh: a ``(stage, data)`` mesh with P entries on ``stage`` (default ``pipeline_mesh(P)``).
    schedule: a ``pipeline_sim.schedules.Schedule`` or its text: ``"1f1b"`` (a batch is one
      micro-batch; stage k lags ``P - 1 - k`` updates), ``"2bw"`` (PipeDream-2BW, see the module
      docstring: every stage one update behind) or ``"uniform-D"`` (every stage D behind).
    micro_batches: a batched schedule's micro-batches per batch, M >= P (default P); the batch
      size must be a multiple of M times the ``data`` devices. 1F1B: 1 (its batch is the
      micro-batch).

  Data parallelism: each of the D devices of a stage runs the stage functions on its contiguous
  1/D of the micro-batch, and losses and gradients are averaged over them. A loss that is a mean
  over the batch is then the global batch's; a loss with a *product* of batch means (the MoE
  load-balancing loss of ``experiments.harness.model``) is computed per shard, so the run equals the
  emulator's with the mean of the D shards' losses, not with the global batch's loss.

  Example::

    pipe = DevicePipeline(Staged(stage_fns, loss_of), optax.adamw(1e-3), labels)
    state = pipe.init(params, first_batch)  # shapes only
    for chunk in chunks:  # leaves (C, batch, ...)
      state, (steps, losses, grad_norms) = pipe.run(state, chunk)  # -1 where none completed
    state, (steps, losses, grad_norms) = pipe.finish(state)  # the last in_flight batches
    params = pipe.params(state)  # = the emulator's after the same batches
  """

  def __init__(self, staged: Staged, optimizer, labels, mode: str = "weight_stashing",
               mesh: Mesh | None = None, schedule: str = "1f1b", micro_batches: int | None = None):
    num_stages, self.delays, schedule = check_pipeline(labels, mode, DEVICE_MODES, schedule, staged,
                                                       name="device pipeline")
    if not schedule.batched and micro_batches not in (None, 1):
      raise ValueError(f"micro_batches={micro_batches!r} needs a batched schedule such as '2bw' (a "
                       f"{schedule.name!r} batch is one micro-batch)")
    if micro_batches is None:
      micro_batches = num_stages if schedule.batched else 1
    if schedule.batched and (isinstance(micro_batches, bool) or not isinstance(micro_batches, int)
                             or micro_batches < num_stages):
      raise ValueError(f"schedule {schedule.name!r} needs micro_batches >= P = {num_stages} (an int), got "
                       f"{micro_batches!r}: with fewer, a micro-batch's version may not be kept")
    optimizer = stage_optimizers(optimizer, num_stages, self.delays, schedule.name)
    self.mesh = pipeline_mesh(num_stages) if mesh is None else mesh
    if tuple(self.mesh.axis_names) != (STAGE, DATA) or self.mesh.shape[STAGE] != num_stages:
      raise ValueError(f"the mesh must have axes ({STAGE!r}, {DATA!r}) with {num_stages} entries on "
                       f"{STAGE!r}; got {dict(self.mesh.shape)}")
    self.staged, self.labels, self.mode = staged, labels, mode
    self.optimizers, self.num_stages = tuple(optimizer), num_stages
    self.schedule, self.micro_batches = schedule, micro_batches
    # Every schedule runs 1F1B's phases over micro-batches: stage k holds the inputs of the P - k
    # micro-batches in flight there (1F1B's delays, counted in micro-batches, whatever the schedule).
    self._micro_delays = OneFOneB().delays(num_stages)
    self.in_flight = -(-(num_stages - 1) // micro_batches)  # batches in flight after a call
    self._run = Consuming(self._run_impl, "DevicePipeline.run/finish")
    self._layouts = None  # fixed by ``init`` (the state's packed layout), with what follows
    self._template = self._stash_bytes = self._grad_layouts = self._widths = self._grad_widths = None
    self._act = self._message = None

  # ---- set-up ----------------------------------------------------------------------------------

  def _stage_carry(self, k, part):
    if self.schedule.batched:
      versions = self.schedule.versions(self.num_stages)
      previous = jax.tree.map(lambda x: jnp.broadcast_to(x, (versions, *x.shape)), part)
      stash = Versions(previous, jax.tree.map(jnp.zeros_like, part), jnp.zeros((), jnp.int32))
    elif self.mode == "weight_stashing":
      stash = rb.ring_init(part, self._micro_delays[k] + 1)
    else:
      stash = None
    return part, self.optimizers[k].init(part), stash

  def _stash_bytes_of(self, stash) -> int:
    if isinstance(stash, Versions):
      return rb.tree_bytes((stash.previous, stash.grad_sum))
    return 0 if stash is None else rb.tree_bytes(stash)

  def _weights(self, k, params, stash, m, start, forward: bool):
    """The weights stage k's forward (or backward) of micro-batch m runs on (``start``: the first
    batch since the last flush)."""
    if self.schedule.batched:  # W_{t - tau_k} for batch t (never older than the fill's first batch)
      t = m // self.micro_batches
      age = stash.updates - jnp.maximum(t - self.delays[k], start)  # in [0, V] (module docstring)
      return jax.tree.map(lambda cur, prev: jnp.where(age > 0, prev[jnp.maximum(age - 1, 0)], cur),
                          params, stash.previous)
    if stash is None or forward:
      return params
    return rb.ring_read(stash, m % (self._micro_delays[k] + 1))

  def init(self, params, example_batch=None) -> DevicePipelineState:
    """The pipeline state for ``params``; ``example_batch`` is one batch (shapes only; required:
    it fixes the messages between stages)."""
    if example_batch is None:
      raise ValueError("DevicePipeline.init needs example_batch: one batch (its shapes fix the messages "
                       "between stages)")
    check_labels(params, self.labels, self.num_stages)
    n_data, per = self.mesh.shape[DATA], self.micro_batches
    for x in jax.tree.leaves(example_batch):
      if x.shape[0] % (n_data * per):
        raise ValueError(f"batch size {x.shape[0]} is not divisible by the {n_data} devices of the "
                         f"{DATA!r} axis" + (f" times {per} micro-batches" if per > 1 else ""))
    # what ``finish`` drains with before any ``run`` of this object (a resumed pipeline): one batch
    self._template = jax.tree.map(lambda x: jax.ShapeDtypeStruct((1, *x.shape), x.dtype), example_batch)
    example_batch = jax.tree.map(lambda x: x[:x.shape[0] // per], example_batch)  # one micro-batch
    parts = split_stages(params, self.labels, self.num_stages)
    shapes = [jax.eval_shape(lambda p, k=k: self._stage_carry(k, p), part) for k, part in enumerate(parts)]
    self._layouts = [_layout(c) for c in shapes]
    self._stash_bytes = tuple(self._stash_bytes_of(c[2]) for c in shapes)
    self._grad_layouts = [_layout(p) for p in parts]
    self._widths, self._grad_widths = _widths(self._layouts), _widths(self._grad_layouts)
    local_batch = jax.tree.map(
        lambda x: jax.ShapeDtypeStruct((x.shape[0] // n_data, *x.shape[1:]), x.dtype), example_batch)
    act = jax.eval_shape(self.staged.stage(0), parts[0], self.staged.inputs_of(local_batch))
    self._act = act
    self._message = (act, local_batch)
    pk, pd = self.num_stages, n_data
    grid = self.mesh.devices  # (P, D)
    device = NamedSharding(self.mesh, P(STAGE, DATA))

    # Each stage's carry is built on its own first device (its parameters moved there, its
    # optimizer state initialised there) and copied to the stage's other data devices: no device
    # ever holds another stage's state.
    def build(k, part):  # stage k's packed carry, (1, 1, width) per dtype
      packed = _pack(self._stage_carry(k, part), self._layouts[k], self._widths)
      return {d: x[None, None] for d, x in packed.items()}
    stage_carry = [jax.jit(build, static_argnums=0)(k, jax.device_put(part, grid[k, 0]))
                   for k, part in enumerate(parts)]
    carry = {d: jax.make_array_from_single_device_arrays(
        (pk, pd, w), device, [jax.device_put(stage_carry[k][d], grid[k, j])
                              for k in range(pk) for j in range(pd)])
             for d, w in self._widths.items()}

    def zeros(tree, lead=()):  # (P, D, *lead, *local) per leaf, each device allocating its own block
      return jax.tree.map(lambda s: jax.jit(lambda: jnp.zeros((pk, pd, *lead, *s.shape), s.dtype),
                                            out_shardings=device)(), tree)

    whole = NamedSharding(self.mesh, P())
    scalar = lambda: jax.device_put(jnp.zeros((), jnp.int32), whole)
    return DevicePipelineState(scalar(), scalar(), scalar(), carry, zeros(self._message, (pk,)),
                               zeros(self._message), zeros(act),
                               jax.device_put(jnp.zeros((2, self.in_flight * per), jnp.result_type(float)),
                                              whole))

  def _state_shardings(self, state):
    device = NamedSharding(self.mesh, P(STAGE, DATA))
    whole = NamedSharding(self.mesh, P())
    return DevicePipelineState(whole, whole, whole, *(jax.tree.map(lambda _: device, t) for t in state[3:7]),
                               whole)

  # ---- one device's phase ------------------------------------------------------------------------

  def _branches(self):
    """Per-device work of one phase: index 0 idle, 1 + k forward of stage k, 1 + P + k backward."""
    pk, staged = self.num_stages, self.staged
    zeros = lambda tree: jax.tree.map(lambda s: jnp.zeros(s.shape, s.dtype), tree)
    no_grads = lambda: {d: jnp.zeros((w,), d) for d, w in self._grad_widths.items()}
    no_loss = lambda: jnp.zeros((), jnp.result_type(float))

    def idle(carry, inbox, fwd, bwd, batch, m, start):
      return carry, inbox, zeros(self._message), zeros(self._act), no_grads(), no_loss()

    def forward(k):
      def branch(carry, inbox, fwd, bwd, batch, m, start):
        params, opt_state, stash = _unpack(carry, self._layouts[k])
        slot = m % (self._micro_delays[k] + 1)
        message = (zeros(self._act), batch) if k == 0 else fwd
        inbox = rb.ring_write(inbox, slot, message)
        if not self.schedule.batched and stash is not None:  # stash the version this forward uses
          stash = rb.ring_write(stash, slot, params)
          carry = _pack((params, opt_state, stash), self._layouts[k], self._widths)
        if k == pk - 1:  # the last stage's forward is recomputed in its backward, one phase later
          out = zeros(self._message)
        else:
          x = staged.inputs_of(message[1]) if k == 0 else message[0]
          out = (staged.stage(k)(self._weights(k, params, stash, m, start, True), x), message[1])
        return carry, inbox, out, zeros(self._act), no_grads(), no_loss()
      return branch

    def backward(k):
      def branch(carry, inbox, fwd, bwd, batch, m, start):
        params, _, stash = _unpack(carry, self._layouts[k])
        act, mb = rb.ring_read(inbox, m % (self._micro_delays[k] + 1))
        weights = self._weights(k, params, stash, m, start, False)
        f = staged.stage(k)
        x = staged.inputs_of(mb) if k == 0 else act
        if k == pk - 1:
          fn = lambda w, x: staged.loss_of(f(w, x), mb)
          if k == 0:
            loss, g = jax.value_and_grad(lambda w: fn(w, x))(weights)
            cot = zeros(self._act)
          else:
            loss, (g, cot) = jax.value_and_grad(fn, argnums=(0, 1))(weights, x)
        else:
          loss = no_loss()
          if k == 0:
            _, vjp = jax.vjp(lambda w: f(w, x), weights)
            (g,), cot = vjp(bwd), zeros(self._act)
          else:
            _, vjp = jax.vjp(f, weights, x)
            g, cot = vjp(bwd)
        grads = _pack(g, self._grad_layouts[k], self._grad_widths)
        loss = jnp.asarray(loss, jnp.result_type(float)) / self.micro_batches  # its share of the batch's
        return carry, inbox, zeros(self._message), cot, grads, loss
      return branch

    return [idle] + [forward(k) for k in range(pk)] + [backward(k) for k in range(pk)]

  def _updates(self):
    """Per-device work after a backward: ``(carry, grads, m) -> (carry, squared norm of the gradient
    applied)``; index 0 idle, 1 + k stage k's (batched: accumulate, and apply at a batch's last)."""
    no_norm = lambda: jnp.zeros((), jnp.result_type(float))
    sq_norm = lambda tree: sum((jnp.sum(jnp.square(x.astype(no_norm().dtype)))
                                for x in jax.tree.leaves(tree)), no_norm())

    def idle(carry, grads, m):
      return carry, no_norm()

    def update(k):
      def apply(params, opt_state, g):
        updates, opt_state = self.optimizers[k].update(g, opt_state, params)
        return optax.apply_updates(params, updates), opt_state

      def branch(carry, grads, m):
        params, opt_state, stash = _unpack(carry, self._layouts[k])
        g = _unpack(grads, self._grad_layouts[k])
        if not self.schedule.batched:
          params, opt_state = apply(params, opt_state, g)
          return _pack((params, opt_state, stash), self._layouts[k], self._widths), sq_norm(g)
        grad_sum = jax.tree.map(jnp.add, stash.grad_sum, g)

        def last(_):  # the batch's mean gradient (at W_{t - tau}) updates W_t; W_t becomes the previous
          # averaged over the data devices here, once per batch (their sums are each device's own)
          mean = jax.tree.map(lambda x: jax.lax.pmean(x, DATA) / self.micro_batches, grad_sum)
          new, state = apply(params, opt_state, mean)
          zero = jax.tree.map(jnp.zeros_like, grad_sum)
          previous = jax.tree.map(lambda cur, prev: jnp.concatenate([cur[None], prev[:-1]]), params,
                                  stash.previous)  # W_t, W_{t-1}, ...: the oldest drops out
          return (new, state, Versions(previous, zero, stash.updates + 1)), sq_norm(mean)

        def more(_):
          return (params, opt_state, stash._replace(grad_sum=grad_sum)), no_norm()

        is_last = m % self.micro_batches == self.micro_batches - 1
        carry_tree, norm = jax.lax.cond(is_last, last, more, None)
        return _pack(carry_tree, self._layouts[k], self._widths), norm
      return branch

    return [idle] + [update(k) for k in range(self.num_stages)]

  def _device_program(self, carry, inbox, fwd, bwd, batches, u0, c0, start, limit):
    """The scan over one call's phases, as one device runs it (leading (1, 1) axes stripped)."""
    pk = self.num_stages
    squeeze = lambda t: jax.tree.map(lambda x: x[0, 0], t)
    carry, inbox, fwd, bwd = squeeze((carry, inbox, fwd, bwd))
    branches, updates = self._branches(), self._updates()
    k = jax.lax.axis_index(STAGE)
    num_chunk = jax.tree.leaves(batches)[0].shape[0]
    # Only live messages move: in phase u, stage i forwards to i + 1 and stage i + 1 sends its
    # cotangent back to i exactly for the pairs (i, i + 1) with i = u (mod 2); the other pairs idle.
    def send(parity):
      pairs = [i for i in range(pk - 1) if i % 2 == parity]
      if not pairs:  # P = 2, odd phases: nothing is live
        return lambda out, cot: jax.tree.map(jnp.zeros_like, (out, cot))
      return lambda out, cot: (jax.lax.ppermute(out, STAGE, [(i, i + 1) for i in pairs]),
                               jax.lax.ppermute(cot, STAGE, [(i + 1, i) for i in pairs]))

    def phase(state, u):
      carry, inbox, fwd, bwd = state
      is_forward = (u - k) % 2 == 0
      m = jnp.where(is_forward, (u - k) // 2, (u - 2 * pk + 1 + k) // 2)
      valid = (m >= start) & (m < limit)
      index = jnp.where(valid, jnp.where(is_forward, 1 + k, 1 + pk + k), 0)
      batch = jax.tree.map(lambda b: b[jnp.clip(m - c0, 0, num_chunk - 1)], batches)
      carry, inbox, out, cot, grads, loss = jax.lax.switch(index, branches, carry, inbox, fwd, bwd, batch, m,
                                                           start // self.micro_batches)
      is_backward = valid & ~is_forward
      # Only a backward's loss and gradients are averaged over the data devices (a forward or an idle
      # phase has none): half the phases; under 2BW the gradients only once per batch, at its
      # update (``_updates``). Every device of a stage's data group takes the same branch.
      mean = lambda t: jax.lax.pmean(t, DATA)
      if not self.schedule.batched:
        grads, loss = jax.lax.cond(is_backward, mean, lambda t: t, (grads, loss))
      else:
        loss = jax.lax.cond(is_backward, mean, lambda t: t, loss)
      carry, sq_norm = jax.lax.switch(jnp.where(is_backward, 1 + k, 0), updates, carry, grads, m)
      if pk > 1:  # u is the same on every device, so every device takes the same branch
        fwd, bwd = jax.lax.cond(u % 2 == 0, send(0), send(1), out, cot)
      return (carry, inbox, fwd, bwd), (jnp.where(is_backward, m, -1), loss, sq_norm)

    us = u0 + jnp.arange(2 * num_chunk, dtype=jnp.int32)
    state, record = jax.lax.scan(phase, (carry, inbox, fwd, bwd), us)
    expand = lambda t: jax.tree.map(lambda x: x[None, None], t)
    return expand(state) + (expand(record),)

  def _run_impl(self, state: DevicePipelineState, batches, feed):
    per, in_flight = self.micro_batches, self.in_flight
    num_chunk = jax.tree.leaves(batches)[0].shape[0]
    limit = state.fed + jnp.where(feed, num_chunk, 0).astype(jnp.int32)
    # (C, batch, ...) -> (C * M, batch / M, ...): micro-batch j of batch c is its j-th 1/M of the rows
    micro = jax.tree.map(lambda x: x.reshape(num_chunk * per, x.shape[1] // per, *x.shape[2:]), batches)
    device, whole = P(STAGE, DATA), P()
    batch_spec = jax.tree.map(lambda _: P(None, DATA), micro)
    specs = (jax.tree.map(lambda _: device, state.carry), jax.tree.map(lambda _: device, state.inbox),
             jax.tree.map(lambda _: device, state.fwd), jax.tree.map(lambda _: device, state.bwd))
    program = jax.shard_map(
        self._device_program, mesh=self.mesh, in_specs=specs + (batch_spec, whole, whole, whole, whole),
        out_specs=specs + ((device, device, device),), check_vma=False)
    carry, inbox, fwd, bwd, (ms, losses, sq_norms) = program(
        state.carry, state.inbox, state.fwd, state.bwd, micro, state.phase, state.fed * per,
        state.start * per, limit * per)
    # Gather each micro-batch's share of its batch's loss (last stage) and squared norm of the
    # gradients applied (all stages) in a window over the micro-batches of the C batches that
    # complete in this call and of the ``in_flight`` still in flight after it; a batch sums its M entries.
    pk, span = self.num_stages, (num_chunk + in_flight) * per
    base = state.phase // 2 - in_flight * per
    ms, losses, sq_norms = ms[:, 0], losses[:, 0], sq_norms[:, 0]  # data replicas agree
    idx = jnp.where(ms >= 0, ms - base, span)  # out of range: dropped
    window = jnp.zeros((2, span), state.pending.dtype).at[:, :in_flight * per].set(state.pending)
    is_last = (jnp.arange(pk) == pk - 1)[:, None]
    window = window.at[0, idx].add(jnp.where(is_last, losses, 0.0), mode="drop")
    window = window.at[1, idx].add(sq_norms, mode="drop")
    totals = window[:, :num_chunk * per].reshape(2, num_chunk, per).sum(-1)
    steps = state.phase // (2 * per) - in_flight + jnp.arange(num_chunk, dtype=jnp.int32)
    done = (steps >= state.start) & (steps < limit)
    out = (jnp.where(done, steps, -1), jnp.where(done, totals[0], jnp.nan),
           jnp.where(done, jnp.sqrt(totals[1]), jnp.nan))
    new = DevicePipelineState(state.phase + 2 * num_chunk * per, limit, state.start, carry, inbox, fwd,
                              bwd, window[:, num_chunk * per:])
    return new, out

  # ---- public ----------------------------------------------------------------------------------

  def run(self, state: DevicePipelineState, batches):
    """Feeds a chunk of C batches (leaves ``(C, batch, ...)``).

    Returns:
      ``(state, (steps, losses, grad_norms))``: the C batch indices that completed in this call
      (``fed - in_flight .. fed + C - 1 - in_flight``), the loss each observed (under 2BW the mean of its
      micro-batches' losses) and the global norm of the gradient its update applied (all stages).
      Entries that completed no batch (the pipeline fill, at the start and after ``finish``, whose
      batches ``finish`` already returned) have index -1 and NaN: keep ``steps >= 0``.

    Like ``Pipeline.run``, this consumes ``state`` (its buffers are donated): use the one returned
    (a consumed one is refused by name).
    """
    self._template = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype), batches)
    return self._call(state, batches, True)

  def _call(self, state, batches, feed):
    # XLA returns P(STAGE, DATA) with a size-1 data axis as P(STAGE): an equal layout, but another
    # jit cache key. Relabelling it (no copy) keeps one compiled program per chunk shape.
    state, out = self._run(state, batches, feed)
    return jax.device_put(state, self._state_shardings(state)), out

  def finish(self, state: DevicePipelineState):
    """Flushes the pipeline: the ``2(P - 1)`` phases in which stage 0 takes no input and the
    micro-batches in flight complete. Returns ``(state, (steps, losses, grad_norms))`` of the
    batches they complete (NumPy). Every stage has then applied every batch; a later ``run`` starts
    a new fill, as a synchronous pipeline does after its flush (PipeDream-Flush, GPipe). It needs
    ``init`` (or ``run``) of this object first, not a ``run``: a pipeline resumed from a checkpoint
    (``init``, then the restored state) can finish at once."""
    if self._layouts is None:
      raise ValueError("DevicePipeline.finish needs init(params, example_batch) of this pipeline first "
                       "(it fixes the layout of the state)")
    fed = int(state.fed)
    if self.in_flight == 0 or fed == int(state.start):  # nothing in flight
      return state, (np.zeros(0, np.int32), np.zeros(0), np.zeros(0))
    # The drain runs the chunk's own program (one compile per run): its phases past the 2(P - 1)
    # that complete the micro-batches in flight find no valid micro-batch and idle.
    length = max(self.in_flight, jax.tree.leaves(self._template)[0].shape[0])
    drain = jax.tree.map(lambda s: jnp.zeros((length, *s.shape[1:]), s.dtype), self._template)
    state, out = self._run(state, drain, False)  # relabelled by the device_put below
    steps, losses, norms = (np.asarray(x) for x in out)
    keep = (steps >= int(state.start)) & (steps < fed)
    fresh = jnp.asarray(fed, jnp.int32)
    state = state._replace(phase=2 * self.micro_batches * fresh, start=fresh,
                           pending=jnp.zeros_like(state.pending))
    return jax.device_put(state, self._state_shardings(state)), (steps[keep], losses[keep], norms[keep])

  def lower(self, state: DevicePipelineState, batches):
    """``jax.jit(...).lower`` of ``run`` (for XLA's cost and memory analyses)."""
    return self._run.lower(state, batches, True)

  def buffer_bytes(self, state: DevicePipelineState) -> int:
    """Bytes of the weight stash over all stages, each stage's on its own devices: 1F1B's ``tau_k + 1``
    versions of stage k (as ``Pipeline.buffer_bytes``); a batched schedule's V earlier versions and
    gradient accumulator (V + 1 stage-sized buffers, as the emulator's tau_k + 1 versions where
    ``tau_k = V``)."""
    del state
    return int(sum(self._stash_bytes))

  # ---- the pipeline protocol (pipeline_sim.protocol); ``init``, ``finish`` and ``params`` above
  # and below are its own

  flushes = True  # the last ``in_flight`` batches complete in ``finish``

  def place(self, state: DevicePipelineState, mesh=None, fsdp: bool = False) -> DevicePipelineState:
    """The state as ``init`` laid it out on this pipeline's own mesh (``mesh`` and ``fsdp`` are the
    emulator's: a device pipeline places each stage on its own devices)."""
    del mesh, fsdp
    return state

  def place_batches(self, batches, mesh=None):
    """The batches as given: ``run`` splits them over the stages' data devices itself."""
    del mesh
    return batches

  def advance(self, state: DevicePipelineState, batches):
    """``run``, keeping only the batches that completed: ``(state, (steps, losses, grad_norms))``
    in NumPy, ``in_flight`` batches behind the chunk (the rest complete in the next call or ``finish``)."""
    state, out = self.run(state, batches)
    steps, losses, norms = (np.asarray(x) for x in out)
    keep = steps >= 0
    return state, (steps[keep], losses[keep], norms[keep])

  def params(self, state: DevicePipelineState):
    """Every stage's current weights, merged into the user's parameter tree (on the host)."""
    carry = {d: np.asarray(x[:, 0]) for d, x in state.carry.items()}
    parts = [_unpack({d: x[k] for d, x in carry.items()}, lay)[0] for k, lay in enumerate(self._layouts)]
    return merge_stages(parts, self.labels)

  def memory(self, state: DevicePipelineState) -> dict:
    """Bytes each device holds: its packed carry (parameters, optimizer state, weight stash; padded
    to the largest stage) and in-flight inputs; and each stage's exact weight-stash bytes."""
    per_device = sum(x[0, 0].nbytes for x in state.carry.values())
    per_device += sum(x[0, 0].nbytes for x in jax.tree.leaves(state.inbox))
    return {"per_device": int(per_device), "stash_per_stage": list(self._stash_bytes)}

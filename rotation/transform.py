"""Basis rotation as an Optax transformation (the paper's Algorithms 1 and 2, arXiv 2602.03515;
docs/algorithms.md section 2).

``scale_by_basis_rotation(inner)`` rotates every selected weight matrix's gradient into an
estimated Hessian eigenbasis ``G~ = U^T G V``, runs ``inner`` (Adam by default) on the rotated
gradients, and rotates the update back ``U u~ V^T``. The bases are Kronecker factors per matrix,
refreshed infrequently (cold start by SVD at step 1, then one QR power-iteration step every
``refresh_every`` steps) under ``jax.lax.switch``; a step at which no leaf refreshes (most steps)
takes a plain path instead, under one ``jax.lax.cond``: the statistics and the rotations only, the
inner moments neither cut into blocks nor passed through the switch (the same numbers, tested).

Which matrices: ``weight_dimension_numbers`` (``rotation.RotationDimensionNumbers``, optax's
convention) names each leaf's reduction (row) and output (column) axes; every other axis is a batch
axis with bases of its own per index (a scanned stack's layers). By default exactly the 2-D leaves
are rotated, as ``(in, out)`` matrices, as in the paper's code, and every other leaf gets plain
``inner``. A side longer than ``block_size`` is cut into blocks, each block pair with bases of its
own (``rotation.dims``).

State layout: the inner state is over parameter-shaped trees (the rotated gradients, put back in
each parameter's own layout), so its moments are shaped, and can be sharded, like the parameters;
the bases and statistics are stacked per leaf and block shape, ``(K, a, a)``.

Moment handling across a basis change: inner-state fields shaped like the parameters and named
``mu``, ``trace`` or ``ema`` (``FIRST_MOMENTS``) are kept in rotated coordinates and re-expressed
exactly, ``M~_new = U_new^T U_old M~_old V_old^T V_new``, so that a refresh, a column-sign flip or a
column reordering never changes the update that follows; fields named ``nu``, ``nu_max`` or
``sum_of_squares`` (``SECOND_MOMENTS``) are only permuted with the basis columns. An inner
transformation with any other parameter-shaped field is refused at init, by the field's name.

Threads: the library changes no process state. On the CPU backend the refreshes' QR and eigh call
LAPACK in OpenBLAS, whose own threads compete with XLA's; the caller chooses their number
(``OPENBLAS_NUM_THREADS=1``, or ``rotation.limit_lapack_threads()`` once; docs/benchmarks.md,
"Threads", gives the measured effect).

Numerics: statistics, bases, ``eigh``, QR and rotations are computed in float32 (float64 for
float64 leaves); ``precond_dtype`` only changes how statistics and bases are stored, ``precision``
only the per-step matmuls. Updates are returned in the gradient's dtype.

Non-finite gradients: they propagate into the moments and statistics exactly as in Adam (use
``optax.apply_if_finite`` to skip such steps, which leaves this state untouched); a basis refresh
whose input or result is not finite keeps the previous basis and moments instead of installing
NaNs, and never hands the non-finite values to a decomposition (LAPACK's SVD can loop for ever on
inf mixed with finite values), so an inf or NaN at any step, the first included, returns.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import optax

from rotation import dims
from rotation import matrix as mx
from rotation.adam import scale_by_adam
from rotation.moments import FIRST_MOMENTS, SECOND_MOMENTS, at, moment_fields, replace_at
from rotation.options import (
  DEFAULT_BLOCK_SIZE,
  Ablation,
  Options,
  check_ablation,
  check_learning_rate,
  compute_dtype,
  resolve,
)
from rotation.plan import (
  check_float_leaves,
  given_bases,
  is_key,
  leaf_plans,
  periods,
  random_bases,
  state_plans,
  static_int,
)
from rotation.sharding import PartitionSpec, explicit_axes, mesh_of, place, spec_on, stack_spec
from rotation.stacks import batched, owned, stack
from rotation.state import BasisRotationState, RotationPiece, bases_leaves, per_leaf


def scale_by_basis_rotation(
    inner: optax.GradientTransformation | None = None,
    *,
    weight_dimension_numbers: Any = None,
    source: str = "second",
    geometry: str = "bilateral",
    refresh_every: int | Any = 10,
    b1: float | None = None,
    b2: float = 0.999,
    eps: float = 1e-8,
    eps_root: float = 0.0,
    mu_dtype: Any | None = None,
    shampoo_beta: float | None = None,
    block_size: int | None = DEFAULT_BLOCK_SIZE,
    max_precond_dim: int | None = None,
    precond_dtype: Any | None = None,
    precision: Any = jax.lax.Precision.HIGHEST,
    first_order_step: str = "paper",
    stagger: bool = False,
    orthonormalization: str = "qr",
    batch_refresh: bool | None = None,
    second_moments: str = "permute",
    ablation: Ablation | None = None,
) -> optax.GradientTransformationExtraArgs:
  """Runs ``inner`` in a rotated (Kronecker-factored) eigenbasis of every selected matrix.

  Per selected matrix ``W`` (m x n) and step ``t = 1, 2, ...`` with gradient ``G``:
  (1) second-order source: ``L <- shampoo_beta L + (1 - shampoo_beta) G G^T``, ``R`` likewise
  with ``G^T G``;
  (2) if ``t == 1`` or ``t % refresh_every == 0``: refresh the bases, re-expressing the inner first
  moments exactly; (3) ``G~ = U^T G V``; (4) ``u~ = inner(G~)``; (5) return ``U u~ V^T``.

  Step 1 is exact: at ``t == 1`` both sources' statistics (``L = (1 - shampoo_beta) G G^T``, the look-ahead
  momentum ``(1 - b1) G``) have the singular vectors of ``G`` as eigenvectors, so the bases come
  from one SVD ``G = U S V^T`` and the rotated gradient is set to ``S`` (bilateral), ``S V^T``
  (left only) or ``U S`` (right only) exactly. Warm refresh (``t % refresh_every == 0``), per
  rotated side: sort the basis by its eigenvalue estimate (Rayleigh quotient ``diag(Q^T S Q)``;
  first-order source: ``||M^T q||^2`` or ``||M q||^2``), permute the second moments along that side
  with the same permutation, then one step of orthogonal iteration ``Q <- qr(S Q).Q``. First-order
  source, bilateral: ``Q_L <- qr(M Q_R).Q``, ``Q_R <- qr(M^T Q_L).Q`` (the paper's step).

  Args:
    inner: transformation run in the rotated space; default ``scale_by_adam(b1, b2, eps, eps_root,
      mu_dtype)`` with the paper's bias correction. It receives parameter-shaped rotated gradients
      (float32, or float64 for float64 leaves) and ``params=None`` (weight decay belongs outside,
      in original coordinates). Its parameter-shaped state fields must be moments of
      ``FIRST_MOMENTS`` or ``SECOND_MOMENTS`` (else it is refused at init). Extra arguments of
      ``update`` reach ``inner`` only if it accepts them (``optax.with_extra_args_support``).
    weight_dimension_numbers: which leaves are rotated, as which matrices. ``None``: every 2-D
      leaf as ``(in, out)``, all others plain ``inner``. Else a ``RotationDimensionNumbers`` (used
      for every leaf with two or more axes), a pytree prefix of the parameters holding
      ``RotationDimensionNumbers`` or ``None`` (plain ``inner``), or a callable of the parameters
      returning one (evaluated at init on the parameters and at every step on the updates, as in
      ``optax.masked``, so it must depend on structure and shapes only). Ready-made specs:
      ``rotation.LINEAR``, ``ATTENTION_QKV``, ``ATTENTION_OUT``, ``stacked(spec)``.
    source: ``"second"`` (eigenbasis of the gradient second moments ``L``, ``R``; = SOAP) or
      ``"first"`` (singular vectors of the momentum; no ``L``/``R`` memory).
    geometry: ``"bilateral"`` (rotate both sides) or ``"unilateral"`` (only the smaller side, the
      input side of a square matrix: left if ``rows <= cols``, else right).
    refresh_every: basis refresh period ``T_freq`` (int >= 1), or a pytree prefix of the
      parameters giving one period per leaf (for example per pipeline stage).
    b1: first-moment decay of the default inner Adam (``None``: 0.9) and the look-ahead weight of
      the first-order source, which needs it given explicitly with a custom ``inner`` (set it to
      that optimizer's first-moment decay).
    b2: second-moment decay of the default inner Adam.
    eps: the default inner Adam's epsilon (>= 0).
    eps_root: the default inner Adam's epsilon inside the square root.
    mu_dtype: dtype of the default inner Adam's first moment (``None``: float32).
    shampoo_beta: decay of ``L`` and ``R``; ``None`` means ``b2``.
    block_size: a rotated side longer than this is cut into blocks of this size (the last one
      shorter), each block pair with bases of its own; ``None``: never cut.
    max_precond_dim: a side longer than this (before blocking) is left unrotated; ``None``: no
      limit. The opt-out of rotating long sides (SOAP's 10,000).
    precond_dtype: storage dtype of the statistics and bases (``None``: float32). Their
      decompositions and the rotations always run in float32.
    precision: ``jax.lax.Precision`` of the per-step matmuls (statistics, rotations in and out);
      the refresh's matmuls always run at ``HIGHEST``.
    first_order_step: the warm refresh of the first-order source in *unilateral* geometry.
      ``"paper"`` (the paper's code): ``Q <- qr(M[:, columns sorted by norm]).Q`` (left; ``M^T`` for
      the right side), the other side held at the identity; it discards the old basis.
      ``"power"``: a true power step ``Q <- qr(M M^T Q).Q`` (left; ``M^T M`` for the right side)
      from the sorted old basis, which tracks the eigenbasis better.
    stagger: spread the warm refreshes of the rotated leaves evenly over the period (the r-th of
      n leaves at steps ``t`` with ``(t - r * T // n) % T == 0``), so that no step pays every
      refresh at once; each leaf still refreshes once every ``T`` steps.
    orthonormalization: how a warm refresh orthonormalises (``eigenbasis.ORTHONORMALIZATIONS``):
      ``"qr"`` (Householder QR, the default) or ``"cholesky_qr"`` (shifted Cholesky-QR3: matmuls,
      Cholesky factors and triangular solves, fast on accelerators where QR is slow; it falls back to
      QR for a numerically rank-deficient input).
    batch_refresh: refresh a piece's K matrices in one batched call (``vmap``) rather than one at a
      time (``lax.map``). ``None``: batched except on CPU, where concurrent batched LAPACK kernels
      (eigh, QR, SVD) can deadlock XLA's thread pool.
    second_moments: how the inner second moments (``SECOND_MOMENTS``) follow a warm refresh.
      ``"permute"`` (the paper's and SOAP's): only reordered with the basis columns.
      ``"rotate"``: re-expressed as the variances of a diagonal second moment in the new basis,
      ``nu_new = (U_new^T U_old)^2 nu_old (V_old^T V_new)^2`` (elementwise squares; the
      permutation exactly when the bases only reorder). Early in training, when the basis still
      moves a lot, "permute" leaves first moments (re-expressed exactly) over coordinates whose
      second moment is near zero, and the step after a refresh can be hundreds of times the
      learning rate (docs/algorithms.md, "the refresh spike"); "rotate" keeps the two consistent.
    ablation: ``None`` (the paper's method) or a ``rotation.Ablation``: fixed (given or random)
      bases, or bases frozen after a step, for the mechanism's ablations.

  Returns:
    An ``optax.GradientTransformationExtraArgs`` whose state is ``BasisRotationState``.

  References:
    Mitigating Staleness in Asynchronous Pipeline Parallelism via Basis Rotation, ICML 2026
    (arXiv 2602.03515), Algorithms 1 and 2; Vyas et al., SOAP, 2024 (arXiv 2409.11321); Anil et
    al., Scalable Second Order Optimization for Deep Learning, 2020 (arXiv 2002.09018), blocking.
  """
  if inner is not None and not isinstance(inner, optax.GradientTransformation):
    raise TypeError(f"inner must be an optax.GradientTransformation (or None for Adam), got {inner!r}"
                    + (": for a learning rate use rotation.basis_rotation(learning_rate, ...)"
                       if isinstance(inner, (int, float)) else ""))
  ablation = check_ablation(ablation)
  opts = resolve(source=source, geometry=geometry, refresh_every=refresh_every, b1=b1, b2=b2, eps=eps,
                 shampoo_beta=shampoo_beta, block_size=block_size, max_precond_dim=max_precond_dim,
                 precond_dtype=precond_dtype, precision=precision, first_order_step=first_order_step,
                 stagger=stagger, orthonormalization=orthonormalization, batch_refresh=batch_refresh,
                 fixed=ablation.bases is not None, freeze_after=ablation.freeze_after,
                 second_moments=second_moments, custom_inner=inner is not None)
  inner = optax.with_extra_args_support(
      scale_by_adam(opts.b1, b2, eps, eps_root, mu_dtype) if inner is None else inner)

  def init_fn(params):
    return init(params, inner, opts, weight_dimension_numbers, ablation.bases)

  def update_fn(updates, state, params=None, **extra_args):
    del params
    step = lambda u, s: update(u, s, inner, opts, weight_dimension_numbers, refresh_every, **extra_args)
    axes = explicit_axes(updates)
    if not axes:
      return step(updates, state)
    # Under a mesh with explicit axes (jax.make_mesh's default) every op would need its output
    # sharding spelled out; the update runs with those axes automatic instead, and its outputs are
    # laid out exactly as its inputs (the updates like the gradients, the state as it came).
    shardings = jax.tree.map(lambda x: jax.typeof(x).sharding, (updates, state))
    return jax.sharding.auto_axes(step, axes=axes, out_sharding=shardings)(updates, state)

  return optax.GradientTransformationExtraArgs(init_fn, update_fn)


def _stored(x, opts: Options, like=None):
  """``x`` in its storage dtype: ``precond_dtype``, else ``like``, else its own."""
  return None if x is None else x.astype(opts.precond_dtype or like or x.dtype)


def init(params, inner, opts: Options, weight_dimension_numbers, bases) -> BasisRotationState:
  """The initial state: identity (or given) bases, zero statistics, ``inner``'s state over
  parameter-shaped zeros; on the parameters' mesh when they are sharded."""
  check_float_leaves(params)
  try:
    block = static_int("block_size", opts.block_size, 1, none_ok=True)
    max_dim = static_int("max_precond_dim", opts.max_precond_dim, 0, none_ok=True)
  except ValueError as e:
    raise ValueError(f"{e} (init needs it concrete: under optax.inject_hyperparams, initialise "
                     "outside jit or list it in static_args)") from None
  plans = leaf_plans(params, weight_dimension_numbers, opts.geometry, max_dim, block)
  leaves, treedef = jax.tree.flatten(params)
  template = treedef.unflatten([jnp.zeros_like(x, dtype=compute_dtype(x)) for x in leaves])
  inner_state = inner.init(template)
  first, _, other = moment_fields(inner_state, template)
  if other and not opts.fixed and any(p is not None for p in plans):
    names = ", ".join(f"{jax.tree_util.keystr(p)} ({n or 'unnamed'})" for p, n in other)
    raise ValueError(f"inner state field(s) {names} are shaped like the parameters but are neither "
                     f"first moments {FIRST_MOMENTS} nor second moments {SECOND_MOMENTS}: they would "
                     "stay in the old basis at a refresh. Use an inner optimizer whose moments "
                     "carry these names, or fixed bases.")
  if opts.source == "first" and not opts.fixed and not first and any(p is not None for p in plans):
    raise ValueError(f"source='first' needs an inner transformation with a first moment (a field "
                     f"named one of {FIRST_MOMENTS})")
  given = (random_bases(bases, plans) if is_key(bases) else given_bases(bases, params, plans)
           if opts.fixed else None)
  entries = [None if plan is None else _initial_pieces(x, plan, opts, given and given[i])
             for i, (x, plan) in enumerate(zip(leaves, plans))]
  mesh = mesh_of(leaves)
  if mesh is not None:  # laid out on the parameters' mesh: stacks split along K, the rest whole
    entries = [None if e is None else jax.tree.map(lambda s: place(s, mesh, stack_spec(s.shape, mesh)), e)
               for e in entries]
    inner_state = jax.tree.map(lambda x: place(x, mesh, spec_on(x, mesh)), inner_state)
  # A tree with no leaves has no bases: one empty array stands for them, not its own (empty)
  # structure. So optax.tree_map_params, which initialises on a leafless stand-in for the parameters
  # and maps f over whatever has the stand-in's structure, maps the inner moments, never the bases.
  tree = per_leaf(params, entries) if leaves else jnp.zeros((0,), jnp.float32)
  count = jnp.zeros([], jnp.int32)
  if mesh is not None:
    count = place(count, mesh, PartitionSpec())
  return BasisRotationState(count, tree, inner_state)


def _initial_pieces(x, plan, opts: Options, given) -> tuple:
  """One rotated leaf's pieces at init: identity bases (or the given ones) and zero statistics."""
  cdt = compute_dtype(x)
  pieces = []
  for j, (k, a, b) in enumerate(plan.layout.pieces):
    eye = lambda d: jnp.broadcast_to(jnp.eye(d, dtype=cdt), (k, d, d))
    zeros = lambda d: jnp.zeros((k, d, d), cdt)
    left, right = (eye(a) if plan.left else None), (eye(b) if plan.right else None)
    if opts.fixed:
      left, right = given[j]
    pieces.append(RotationPiece(_stored(left, opts), _stored(right, opts),
                                _stored(zeros(a), opts) if plan.left and opts.second else None,
                                _stored(zeros(b), opts) if plan.right and opts.second else None))
  return tuple(pieces)


def _piece_args(items, moments: bool = True) -> tuple[list, list]:
  """Per piece of every rotated leaf ``(g, U, V, L, R, firsts, seconds)`` in the compute dtype (only
  ``(g, U, V, L, R)`` without ``moments``: the moments are then never cut), and the index of the
  leaf that owns it."""
  args, owners = [], []
  for n, item in enumerate(items):
    cdt = compute_dtype(item.g)
    cut = lambda x, lay=item.plan.layout, cdt=cdt: dims.to_pieces(x.astype(cdt), lay)
    up = lambda x, cdt=cdt: None if x is None else x.astype(cdt)
    gp = cut(item.g)
    fp, sp = ([cut(f) for f in item.firsts], [cut(s) for s in item.seconds]) if moments else ([], [])
    for j, piece in enumerate(item.pieces):
      args.append(mx.PieceArgs(gp[j], up(piece.left), up(piece.right), up(piece.stat_left),
                               up(piece.stat_right), tuple(f[j] for f in fp), tuple(s[j] for s in sp)))
      owners.append(n)
  return args, owners


class LeafItem(NamedTuple):
  """One rotated leaf going into a step: its plan, its pieces' bases and statistics, its gradient,
  its inner moments and its refresh schedule (period and offset)."""

  plan: Any
  pieces: Any
  g: Any
  firsts: list
  seconds: list
  period: Any
  offset: Any


def _schedules(items) -> list:
  """The rotated leaves grouped by refresh schedule: ``[((period, offset), [leaf index, ...])]``
  (a traced period, under ``optax.inject_hyperparams``, by identity)."""
  groups = {}
  for n, item in enumerate(items):
    schedule = (item.period, item.offset)
    key = tuple(x if isinstance(x, int) else id(x) for x in schedule)
    groups.setdefault(key, (schedule, []))[1].append(n)
  return list(groups.values())


def _branch(count, period, offset, opts: Options):
  """Which refresh a schedule runs at step ``count``: 0 none, 1 cold (step 1), 2 warm."""
  warm_now = (count > 1) & ((count - offset) % period == 0)
  if opts.freeze_after is not None:
    warm_now = warm_now & (count <= opts.freeze_after)
  return jnp.where(count == 1, 1, jnp.where(warm_now, 2, 0))


def refresh_due(count, items, opts: Options):
  """Whether any rotated leaf of ``items`` refreshes its bases at step ``count``."""
  return jnp.any(jnp.stack([_branch(count, *sched, opts) > 0 for sched, _ in _schedules(items)]))


def _statistics_of(opts: Options):
  return jax.vmap(lambda g, sl, sr: mx.statistics(g, sl, sr, opts.shampoo_beta, opts.precision))


def _new_pieces(pieces, stats, bases, opts: Options) -> tuple:
  """A leaf's pieces from its per-piece statistics ``(L, R)`` and bases ``(U, V)``, in their storage
  dtypes."""
  like = lambda new, old: _stored(new, opts, old.dtype if new is not None else None)
  return tuple(RotationPiece(like(ql, piece.left), like(qr, piece.right), like(sl, piece.stat_left),
                             like(sr, piece.stat_right))
               for piece, (sl, sr), (ql, qr) in zip(pieces, stats, bases))


def rotate_in_only(items, together: bool, opts: Options) -> list:
  """No refresh due at this step: the statistics and the rotation in for every rotated leaf, the
  bases and moments as they are. Same return as ``refresh_and_rotate``; only the gradients are cut
  into pieces (and same-shape pieces stacked when ``together``), never the moments."""
  args, owners = _piece_args(items, moments=False)
  stats_of = _statistics_of(opts)
  done = batched(lambda a: (stats_of(a.g, a.stat_left, a.stat_right),
                            mx.rotate_in_stacked(a.g, a.left, a.right, opts.precision)), args, together)
  results = []
  for n, item in enumerate(items):
    mine, cdt = owned(done, owners, n), compute_dtype(item.g)
    results.append((dims.from_pieces([rot for _, rot in mine], item.plan.layout),
                    _new_pieces(item.pieces, [st for st, _ in mine],
                                [(p.left, p.right) for p in item.pieces], opts),
                    [f.astype(cdt) for f in item.firsts], [s.astype(cdt) for s in item.seconds]))
  return results


def refresh_and_rotate(count, items, together: bool, opts: Options) -> list:
  """Statistics, refresh and rotation in for every rotated leaf at once. ``items``: a ``LeafItem``
  per rotated leaf. Returns per leaf the rotated gradient
  (the leaf's layout), the new pieces and the re-expressed moments (compute dtype).

  The pieces of all leaves are one list: those of equal shapes run as one stack when
  ``together`` (``rotation.stacks``), and the leaves sharing a refresh schedule share one
  ``lax.switch``, so a model of many small kernels costs a few large ops, not many small ones."""
  args, owners = _piece_args(items)
  stats_of = _statistics_of(opts)
  with_stats = lambda a: a._replace(**dict(zip(("stat_left", "stat_right"),
                                                stats_of(a.g, a.stat_left, a.stat_right))))
  # resolved here, not in ``resolve``: building a transformation must not start JAX's backend (a
  # multi-host program calls jax.distributed.initialize first)
  batched_refresh = jax.default_backend() != "cpu" if opts.batch_refresh is None else opts.batch_refresh
  each = jax.vmap if batched_refresh else (lambda f: lambda a: jax.lax.map(f, a))
  cold = each(lambda a: mx.cold(a, opts))
  warm = each(lambda a: mx.warm(a, opts))
  keep = lambda a: mx.keep(a, opts.precision)
  outs, stats = [None] * len(args), [None] * len(args)
  for (period, offset), leaves in _schedules(items):
    mine = set(leaves)
    ks = [k for k, n in enumerate(owners) if n in mine]
    # stacked once: the statistics, the switch and its results run on a few stacks, not on every
    # piece (XLA copies each result that a branch passes through unchanged)
    stacks, split = stack([args[k] for k in ks], together)
    stacks = [with_stats(x) for x in stacks]
    got = split(jax.lax.switch(_branch(count, period, offset, opts),
                               [lambda st: [keep(x) for x in st], lambda st: [cold(x) for x in st],
                                lambda st: [warm(x) for x in st]], stacks))
    for k, o, st in zip(ks, got, split([(x.stat_left, x.stat_right) for x in stacks])):
      outs[k], stats[k] = o, st
  results = []
  for n, item in enumerate(items):
    o_n = owned(outs, owners, n)
    join = lambda parts, lay=item.plan.layout: dims.from_pieces(parts, lay)
    results.append((join([o.rotated for o in o_n]),
                    _new_pieces(item.pieces, owned(stats, owners, n), [(o.left, o.right) for o in o_n], opts),
                    [join([o.firsts[k] for o in o_n]) for k in range(len(item.firsts))],
                    [join([o.seconds[k] for o in o_n]) for k in range(len(item.seconds))]))
  return results


def update(updates, state, inner, opts: Options, weight_dimension_numbers, refresh_every, **extra_args):
  """One step: statistics and refreshes, the gradients rotated in, ``inner`` on them, the update
  rotated back; returns ``(updates, new state)``."""
  count = optax.safe_int32_increment(state.count)
  leaves, treedef = jax.tree.flatten(updates)
  if not leaves:  # nothing to rotate (init kept no bases)
    new_updates, inner_state = inner.update(updates, state.inner_state, None, **extra_args)
    return new_updates, BasisRotationState(count, state.bases, inner_state)
  plans = state_plans(updates, weight_dimension_numbers, state.bases)
  entries = bases_leaves(state.bases, updates)
  first, second, _ = moment_fields(state.inner_state, updates)
  values = {path: treedef.flatten_up_to(at(state.inner_state, path)) for path in first + second}
  leaf_periods = periods(refresh_every, updates)
  n_rotated = sum(p is not None for p in plans)
  # on one device the same-shape pieces of all leaves run as one stack; on several, each leaf's
  # stacks keep their own layout (a concatenation would move them between devices)
  together = jax.device_count() == 1
  rotated = [g.astype(compute_dtype(g)) for g in leaves]
  new_entries = list(entries)
  idx = [i for i, plan in enumerate(plans) if plan is not None]
  offset = lambda i: plans[i].rank * leaf_periods[i] // n_rotated if opts.stagger else 0
  items = [LeafItem(plans[i], entries[i], leaves[i], [values[p][i] for p in first],
                    [values[p][i] for p in second], leaf_periods[i], offset(i)) for i in idx]
  # between refreshes (most steps) the moments are neither cut into pieces nor passed through the
  # refresh's switch: one cond picks the plain path unless some leaf refreshes now
  if not items:
    results = []
  elif opts.fixed:
    results = rotate_in_only(items, together, opts)
  else:
    results = jax.lax.cond(refresh_due(count, items, opts),
                           lambda: refresh_and_rotate(count, items, together, opts),
                           lambda: rotate_in_only(items, together, opts))
  for i, (g_rot, pieces, new_f, new_s) in zip(idx, results):
    rotated[i], new_entries[i] = g_rot, pieces
    for p, v in zip(first + second, new_f + new_s):
      values[p][i] = v.astype(values[p][i].dtype)
  inner_state = state.inner_state
  for path, vals in values.items():
    inner_state = replace_at(inner_state, path, treedef.unflatten(vals))
  new_updates, inner_state = inner.update(treedef.unflatten(rotated), inner_state, None, **extra_args)
  out = _rotate_back(leaves, treedef.flatten_up_to(new_updates), plans, new_entries, together, opts)
  return treedef.unflatten(out), BasisRotationState(count, per_leaf(updates, new_entries), inner_state)


def _rotate_back(leaves, inner_updates, plans, entries, together: bool, opts: Options) -> list:
  """Each rotated leaf's inner update rotated back, ``U u V^T``; every leaf in its gradient's dtype."""
  rot_out = jax.vmap(lambda a: mx.rotate_out(*a, opts.precision))
  parts, owners = [], []
  for n, (g, u, plan, pieces) in enumerate(zip(leaves, inner_updates, plans, entries)):
    if plan is not None:
      cdt = compute_dtype(g)
      up = lambda x, cdt=cdt: None if x is None else x.astype(cdt)
      for p, pc in zip(dims.to_pieces(u.astype(cdt), plan.layout), pieces):
        parts.append((p, up(pc.left), up(pc.right)))
        owners.append(n)
  rotated_out = batched(rot_out, parts, together)
  out = []
  for n, (g, u, plan) in enumerate(zip(leaves, inner_updates, plans)):
    if plan is not None:
      u = dims.from_pieces(owned(rotated_out, owners, n), plan.layout)
    out.append(u.astype(g.dtype))
  return out


# The keyword parameters of scale_by_basis_rotation that basis_rotation forwards unchanged (all but
# ``inner``: the alias's inner is the paper's Adam of b1, b2, eps, eps_root and mu_dtype).
_ROTATION_OPTIONS = tuple(name for name, p in inspect.signature(scale_by_basis_rotation).parameters.items()
                          if p.kind is inspect.Parameter.KEYWORD_ONLY)


def basis_rotation(
    learning_rate: optax.ScalarOrSchedule,
    b1: float = 0.9,
    b2: float = 0.999,
    eps: float = 1e-8,
    eps_root: float = 0.0,
    mu_dtype: Any | None = None,
    weight_decay: float = 1e-4,
    mask: None | Any | Callable[[Any], Any] = None,
    *,
    weight_dimension_numbers: Any = None,
    source: str = "second",
    geometry: str = "bilateral",
    refresh_every: int | Any = 10,
    shampoo_beta: float | None = None,
    block_size: int | None = DEFAULT_BLOCK_SIZE,
    max_precond_dim: int | None = None,
    precond_dtype: Any | None = None,
    precision: Any = jax.lax.Precision.HIGHEST,
    first_order_step: str = "paper",
    stagger: bool = False,
    orthonormalization: str = "qr",
    batch_refresh: bool | None = None,
    second_moments: str = "permute",
    ablation: Ablation | None = None,
) -> optax.GradientTransformationExtraArgs:
  """AdamW in a rotated eigenbasis: the paper's optimizer, a drop-in for ``optax.adamw``.

  The positional arguments, their defaults and ``mask`` (the weight-decay mask) are
  ``optax.adamw``'s. Leaves that ``weight_dimension_numbers`` selects (by default every 2-D leaf)
  go through the rotation, all other leaves through plain Adam with the same hyper-parameters;
  decoupled weight decay is applied in original coordinates, then the learning rate. With the
  defaults (second-order source, bilateral) this is SOAP with the paper's settings.

  Args:
    learning_rate: a float or an optax schedule.
    b1, b2, eps, eps_root, mu_dtype: the inner Adam's, as in ``optax.adamw``.
    weight_decay: decoupled weight decay (``W <- W - lr * wd * W``).
    mask: which leaves are decayed (``optax.add_decayed_weights``' mask: a tree of bools or a
      callable of the parameters; ``None``: all).
    The keyword-only options are ``scale_by_basis_rotation``'s, documented there. They are spelled
    out here (not passed as ``**kwargs``) so that ``optax.inject_hyperparams`` sees every one.

  Returns:
    The chained ``optax.GradientTransformationExtraArgs``.
  """
  check_learning_rate(learning_rate)
  given = locals()  # every option forwarded by its name: scale_by_basis_rotation's keyword parameters
  options = {name: given[name] for name in _ROTATION_OPTIONS}
  return optax.chain(
      scale_by_basis_rotation(**options),
      optax.add_decayed_weights(weight_decay, mask),
      optax.scale_by_learning_rate(learning_rate),
  )

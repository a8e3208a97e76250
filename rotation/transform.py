"""Basis rotation as an Optax transformation (the paper's Algorithm 1 and 2; SPEC section 2).

``scale_by_basis_rotation(inner)`` rotates every selected weight matrix's gradient into an
estimated Hessian eigenbasis ``G~ = U^T G V``, runs ``inner`` (Adam by default) on the rotated
gradients, and rotates the update back ``U u~ V^T``. The bases are Kronecker factors per matrix,
refreshed infrequently (cold start by ``eigh``/SVD at step 1, then one QR power-iteration step every
``refresh_every`` steps) under ``jax.lax.switch``.

Moment handling across a basis change: fields named ``mu`` in the inner state are first moments
kept in rotated coordinates and re-expressed exactly, ``M~_new = U_new^T U_old M~_old V_old^T V_new``,
so that a refresh, a column-sign flip or a column reordering never changes the update that follows;
fields named ``nu`` are second moments, only permuted with the basis columns (never rotated).
Any other inner state is left as it is.

Leaves: 0-D and 1-D leaves, leaves the mask excludes and sides longer than ``max_precond_dim``
are not rotated (those leaves get plain ``inner``). A leaf with more than two axes is treated as
the matrix ``(prod(shape[:-1]), shape[-1])``: leading axes are merged into the row side. A
callable ``mask`` is evaluated on the parameters at init and on the updates at every step (as in
``optax.masked``), so it must depend only on the tree's structure and shapes.

Numerics: statistics, ``eigh``, QR and rotations run in float32 with ``Precision.HIGHEST``
whatever the parameter dtype; updates are returned in the gradient's dtype.

Non-finite gradients: they propagate into the moments and statistics exactly as in Adam (use
``optax.apply_if_finite`` to skip such steps, which leaves this state untouched); a basis refresh
whose result is not finite keeps the previous basis and moments instead of installing NaNs.
"""

from __future__ import annotations

import functools
import math
from typing import Any, Callable, NamedTuple, Optional, Union

import jax
import jax.numpy as jnp
import optax
from optax import tree_utils as otu

from rotation import eigenbasis as eb

SOURCES = ("second", "first")
GEOMETRIES = ("bilateral", "unilateral")
DEFAULT_MAX_PRECOND_DIM = 10000


class BasisRotationState(NamedTuple):
  """State of ``scale_by_basis_rotation``.

  Rotated matrices of the same shape (and refresh period and sides) form a *group* and are stored
  stacked on a leading axis of size k, so that every step runs a few batched matmuls instead of
  one small op per matrix. Groups are ordered by first appearance among the flattened parameters;
  ``leaf_bases`` maps them back to per-leaf bases. An unrotated side has ``(k, 0, 0)`` placeholders.
  """

  count: jax.Array  # int32 (): updates taken so far.
  members: tuple  # per group int32 (k,): positions of its matrices among the flattened leaves.
  left: tuple  # per group float32 (k, m, m): left bases U, columns by descending eigenvalue.
  right: tuple  # per group float32 (k, n, n): right bases V, columns by descending eigenvalue.
  stat_left: tuple  # per group float32 (k, m, m): EMA of G G^T (second-order source only).
  stat_right: tuple  # per group float32 (k, n, n): EMA of G^T G (second-order source only).
  inner_state: optax.OptState  # inner's state over (unrotated leaves, rotated group stacks).


def scale_by_adam(b1: float = 0.9, b2: float = 0.999, eps: float = 1e-8) -> optax.GradientTransformation:
  """Adam with the paper's bias correction, ``sqrt(1 - b2^t) / (1 - b1^t) * mu / (sqrt(nu) + eps)``.

  This differs from ``optax.scale_by_adam`` only in where ``eps`` sits relative to the bias
  correction. Moments are float32; the state is ``optax.ScaleByAdamState`` (fields ``mu``, ``nu``).
  """

  def init_fn(params):
    zeros = lambda p: jnp.zeros(p.shape, jnp.float32)
    return optax.ScaleByAdamState(jnp.zeros([], jnp.int32), jax.tree.map(zeros, params),
                                  jax.tree.map(zeros, params))

  def update_fn(updates, state, params=None):
    del params
    count = optax.safe_int32_increment(state.count)
    mu = jax.tree.map(lambda m, g: b1 * m + (1 - b1) * g, state.mu, updates)
    nu = jax.tree.map(lambda v, g: b2 * v + (1 - b2) * g * g, state.nu, updates)
    t = count.astype(jnp.float32)
    scale = jnp.sqrt(1 - b2**t) / (1 - b1**t)
    new = jax.tree.map(lambda g, m, v: (scale * m / (jnp.sqrt(v) + eps)).astype(g.dtype), updates, mu, nu)
    return new, optax.ScaleByAdamState(count, mu, nu)

  return optax.GradientTransformation(init_fn, update_fn)


def _matrix_shape(shape):
  return math.prod(shape[:-1]), shape[-1]


def _rotated_sides(shape, selected, geometry, max_dim):
  """Static (rotate_left, rotate_right) for a leaf of ``shape``."""
  if not selected or len(shape) < 2:
    return False, False
  m, n = _matrix_shape(shape)
  left, right = (True, True) if geometry == "bilateral" else (m < n, m >= n)
  return left and m <= max_dim, right and n <= max_dim


def _rotate_in(g, ql, qr):
  if ql.size:
    g = eb.mm(ql.T, g)
  if qr.size:
    g = eb.mm(g, qr)
  return g


def _rotate_out(u, ql, qr):
  if ql.size:
    u = eb.mm(ql, u)
  if qr.size:
    u = eb.mm(u, qr.T)
  return u


class _Plan(NamedTuple):
  """Static layout: which flattened leaves are rotated, in which group."""

  treedef: Any
  shapes: tuple  # per leaf
  plain: tuple  # indices of unrotated leaves
  groups: tuple  # per group: (members, (m, n), rotate_left, rotate_right, period)


def _plan(tree, mask, geometry, max_dim, refresh_every) -> _Plan:
  leaves, treedef = jax.tree.flatten(tree)
  selected = jax.tree.leaves(_mask_tree(mask, tree))
  periods = jax.tree.leaves(_periods(refresh_every, tree))
  plain, groups = [], {}
  for i, (leaf, sel, period) in enumerate(zip(leaves, selected, periods)):
    left, right = _rotated_sides(jnp.shape(leaf), bool(sel), geometry, max_dim)
    if left or right:
      key = (_matrix_shape(jnp.shape(leaf)), left, right, period)
      groups.setdefault(key, []).append(i)
    else:
      plain.append(i)
  return _Plan(treedef, tuple(jnp.shape(x) for x in leaves), tuple(plain),
               tuple((tuple(members), *key) for key, members in groups.items()))


def _check_int_periods(refresh_every):
  for p in jax.tree.leaves(refresh_every):
    if isinstance(p, bool) or not isinstance(p, int) or p < 1:
      raise ValueError(f"refresh_every must be a Python int >= 1 or a pytree of them (with "
                       f"optax.inject_hyperparams, list it in static_args), got {p!r}")


def _periods(refresh_every, tree):
  """One static int period per leaf of ``tree`` (``refresh_every`` is an int or a tree prefix)."""
  if isinstance(refresh_every, int):
    return jax.tree.map(lambda _: refresh_every, tree)
  try:
    return jax.tree.map(lambda p, sub: jax.tree.map(lambda _: p, sub), refresh_every, tree)
  except ValueError as e:
    raise ValueError(f"refresh_every's tree structure is not a prefix of the parameters': {e}") from e


def _mask_tree(mask, params):
  if mask is None:
    return jax.tree.map(lambda p: jnp.ndim(p) >= 2, params)
  tree = mask(params) if callable(mask) else mask
  if jax.tree.structure(tree) != jax.tree.structure(params):
    raise ValueError(
        "mask does not match the parameters: mask structure "
        f"{jax.tree.structure(tree)} vs parameters {jax.tree.structure(params)}")
  return tree


def scale_by_basis_rotation(
    inner: Optional[optax.GradientTransformation] = None,
    *,
    source: str = "second",
    geometry: str = "bilateral",
    refresh_every: Union[int, Any] = 10,
    b1: float = 0.9,
    b2: float = 0.999,
    eps: float = 1e-8,
    shampoo_beta: Optional[float] = None,
    max_precond_dim: int = DEFAULT_MAX_PRECOND_DIM,
    mask: Union[None, Any, Callable[[Any], Any]] = None,
) -> optax.GradientTransformationExtraArgs:
  """Runs ``inner`` in a rotated (Kronecker-factored) eigenbasis of every selected matrix.

  Per selected matrix ``W`` (m x n) and step ``t = 1, 2, ...`` with gradient ``G``:
  (1) second-order source: ``L <- bs L + (1 - bs) G G^T``, ``R <- bs R + (1 - bs) G^T G``;
  (2) if ``t == 1`` or ``t % refresh_every == 0``: refresh the bases (cold start ``eigh`` of
  ``L``/``R`` or SVD of the look-ahead momentum; warm: sort by Rayleigh quotient, permute ``nu``,
  one QR power step), re-expressing the inner first moment exactly; (3) ``G~ = U^T G V``;
  (4) ``u~ = inner(G~)``; (5) return ``U u~ V^T``.

  Args:
    inner: transformation run in the rotated space; default ``scale_by_adam(b1, b2, eps)`` with
      the paper's bias correction. It receives rotated float32 gradients and ``params=None``
      (weight decay belongs outside, in original coordinates).
    source: ``"second"`` (eigenbasis of the gradient second moments ``L``, ``R``; = SOAP) or
      ``"first"`` (singular vectors of the momentum; no ``L``/``R`` memory).
    geometry: ``"bilateral"`` (rotate both sides) or ``"unilateral"`` (only the smaller side:
      left if ``m < n``, else right).
    refresh_every: basis refresh period ``T_freq`` (int >= 1), or a pytree prefix of the
      parameters giving one period per leaf or group (for example per pipeline stage).
    b1: first-moment decay of the default inner Adam; also the look-ahead weight of the
      first-order source.
    b2: second-moment decay of the default inner Adam.
    eps: the default inner Adam's epsilon (>= 0).
    shampoo_beta: decay ``bs`` of ``L`` and ``R``; ``None`` means ``b2``.
    max_precond_dim: a side longer than this is left unrotated.
    mask: which leaves to rotate: ``None`` (every leaf with ``ndim >= 2``), a pytree of bools with
      the parameters' structure, or a callable ``params -> such a pytree``.

  Returns:
    An ``optax.GradientTransformationExtraArgs`` whose state is ``BasisRotationState``.

  References:
    Mitigating Staleness in Asynchronous Pipeline Parallelism via Basis Rotation, ICML 2026
    (arXiv 2602.03515); Vyas et al., SOAP, 2024 (arXiv 2409.11321).
  """
  if source not in SOURCES:
    raise ValueError(f"unknown source {source!r}; choose from {SOURCES}")
  if geometry not in GEOMETRIES:
    raise ValueError(f"unknown geometry {geometry!r}; choose from {GEOMETRIES}")
  _check_int_periods(refresh_every)
  if isinstance(eps, (int, float)) and eps < 0:
    raise ValueError(f"eps must be >= 0, got {eps}")
  if isinstance(max_precond_dim, bool) or not isinstance(max_precond_dim, int) or max_precond_dim < 0:
    raise ValueError(f"max_precond_dim must be a Python int >= 0 (with optax.inject_hyperparams, "
                     f"list it in static_args), got {max_precond_dim!r}")
  inner = scale_by_adam(b1, b2, eps) if inner is None else inner
  bs = b2 if shampoo_beta is None else shampoo_beta

  def plan_of(tree):
    return _plan(tree, mask, geometry, max_precond_dim, refresh_every)

  def inner_tree(plan, leaves):
    """The rotated space: (unrotated leaves, one (k, m, n) stack per group), float32."""
    plain = [leaves[i].astype(jnp.float32) for i in plan.plain]
    stacks = [jnp.stack([leaves[i].reshape(shape).astype(jnp.float32) for i in members])
              for members, shape, *_ in plan.groups]
    return plain, stacks

  def init_fn(params):
    plan = plan_of(params)
    leaves = jax.tree.leaves(params)
    side = lambda k, d, on, fill: fill((k, d, d)) if on else jnp.zeros((k, 0, 0), jnp.float32)
    eye = lambda shape: jnp.broadcast_to(jnp.eye(shape[1], dtype=jnp.float32), shape)
    zeros = lambda shape: jnp.zeros(shape, jnp.float32)
    second = source == "second"
    groups = plan.groups
    inner_state = inner.init(inner_tree(plan, [jnp.zeros(jnp.shape(x), jnp.float32) for x in leaves]))
    if source == "first" and otu.tree_get(inner_state, "mu") is None:
      raise ValueError("source='first' needs an inner transformation with a first moment named 'mu'")
    return BasisRotationState(
        count=jnp.zeros([], jnp.int32),
        members=tuple(jnp.asarray(members, jnp.int32) for members, *_ in groups),
        left=tuple(side(len(g[0]), g[1][0], g[2], eye) for g in groups),
        right=tuple(side(len(g[0]), g[1][1], g[3], eye) for g in groups),
        stat_left=tuple(side(len(g[0]), g[1][0], g[2] and second, zeros) for g in groups),
        stat_right=tuple(side(len(g[0]), g[1][1], g[3] and second, zeros) for g in groups),
        inner_state=inner_state)

  def statistics(g, sl, sr):
    """One matrix's second-order statistics L, R (updated every step; lifted with vmap)."""
    if source == "second":
      if sl.size:
        sl = bs * sl + (1 - bs) * eb.mm(g, g.T)
      if sr.size:
        sr = bs * sr + (1 - bs) * eb.mm(g.T, g)
    return sl, sr

  def refresh(warm, args):
    """One matrix's basis refresh, first-moment re-expression and second-moment permutation."""
    g, ql, qr, sl, sr, mu, nu = args
    rot_l, rot_r = ql.size > 0, qr.size > 0
    if source == "first":
      look_ahead = b1 * _rotate_out(mu, ql, qr) + (1 - b1) * g
      if warm:
        new_l, new_r, new_nu = eb.first_order_bases(look_ahead, ql, qr, nu, rot_l, rot_r)
      else:
        new_l, new_r = eb.svd_bases(look_ahead, rot_l, rot_r)
        new_l, new_r, new_nu = (ql if new_l is None else new_l), (qr if new_r is None else new_r), nu
    elif warm:
      new_l, new_r, new_nu = ql, qr, nu
      if rot_l:
        new_l, new_nu = eb.warm_refresh_second(ql, sl, new_nu, axis=0)
      if rot_r:
        new_r, new_nu = eb.warm_refresh_second(qr, sr, new_nu, axis=1)
    else:
      new_l = eb.eigh_descending(sl) if rot_l else ql
      new_r = eb.eigh_descending(sr) if rot_r else qr
      new_nu = nu
    new_mu = mu  # exact re-expression of the first moment in the new basis
    if rot_l:
      new_mu = eb.mm(eb.mm(new_l.T, ql), new_mu)
    if rot_r:
      new_mu = eb.mm(new_mu, eb.mm(qr.T, new_r))
    ok = jnp.all(jnp.isfinite(new_l)) & jnp.all(jnp.isfinite(new_r)) & jnp.all(jnp.isfinite(new_nu))
    keep = lambda new, old: jnp.where(ok, new, old)
    return keep(new_l, ql), keep(new_r, qr), keep(new_mu, mu), keep(new_nu, nu)

  def group_step(count, period, g, ql, qr, sl, sr, mu, nu):
    """A group of k same-shape matrices: statistics, refresh under lax.switch, rotation in.

    The refresh loops over the matrices with ``lax.map`` rather than batching them: batched CPU
    LAPACK kernels (eigh, QR) can deadlock XLA's thread pool when several run concurrently.
    """
    sl, sr = jax.vmap(statistics)(g, sl, sr)
    keep = lambda args: (args[1], args[2], args[5], args[6])
    cold = lambda args: jax.lax.map(functools.partial(refresh, False), args)
    warm = lambda args: jax.lax.map(functools.partial(refresh, True), args)
    branch = jnp.where(count == 1, 1, jnp.where(count % period == 0, 2, 0))
    ql, qr, mu, nu = jax.lax.switch(branch, [keep, cold, warm], (g, ql, qr, sl, sr, mu, nu))
    return jax.vmap(_rotate_in)(g, ql, qr), ql, qr, sl, sr, mu, nu

  def update_fn(updates, state, params=None, **extra_args):
    del params
    plan = plan_of(updates)
    leaves = jax.tree.leaves(updates)
    count = optax.safe_int32_increment(state.count)
    plain, stacks = inner_tree(plan, leaves)
    mus = otu.tree_get(state.inner_state, "mu")
    nus = otu.tree_get(state.inner_state, "nu")
    outs = []
    for j, (_, _, _, _, period) in enumerate(plan.groups):
      mu = stacks[j] * 0 if mus is None else mus[1][j]
      nu = stacks[j] * 0 if nus is None else nus[1][j]
      outs.append(group_step(count, period, stacks[j], state.left[j], state.right[j],
                             state.stat_left[j], state.stat_right[j], mu, nu))
    rotated, left, right, stat_left, stat_right, new_mu, new_nu = (
        [o[i] for o in outs] for i in range(7))
    inner_state = state.inner_state
    if mus is not None:
      inner_state = otu.tree_set(inner_state, mu=(mus[0], new_mu))
    if nus is not None:
      inner_state = otu.tree_set(inner_state, nu=(nus[0], new_nu))
    (plain_u, stack_u), inner_state = inner.update((plain, rotated), inner_state, None, **extra_args)
    out = [None] * len(leaves)
    for i, u in zip(plan.plain, plain_u):
      out[i] = u.astype(leaves[i].dtype)
    for j, (members, *_) in enumerate(plan.groups):
      back = jax.vmap(_rotate_out)(stack_u[j], left[j], right[j])
      for row, i in enumerate(members):
        out[i] = back[row].reshape(plan.shapes[i]).astype(leaves[i].dtype)
    new_state = BasisRotationState(count, state.members, tuple(left), tuple(right), tuple(stat_left),
                                   tuple(stat_right), inner_state)
    return jax.tree.unflatten(plan.treedef, out), new_state

  return optax.GradientTransformationExtraArgs(init_fn, update_fn)


def basis_rotation(
    learning_rate: optax.ScalarOrSchedule,
    b1: float = 0.9,
    b2: float = 0.999,
    eps: float = 1e-8,
    weight_decay: float = 0.01,
    *,
    source: str = "second",
    geometry: str = "bilateral",
    refresh_every: Union[int, Any] = 10,
    shampoo_beta: Optional[float] = None,
    max_precond_dim: int = DEFAULT_MAX_PRECOND_DIM,
    mask: Union[None, Any, Callable[[Any], Any]] = None,
    weight_decay_mask: Union[None, Any, Callable[[Any], Any]] = None,
) -> optax.GradientTransformationExtraArgs:
  """AdamW in a rotated eigenbasis: the paper's optimizer as an optax alias.

  Selected matrices go through the rotation, all other leaves through plain Adam with the same
  hyper-parameters; decoupled weight decay is applied in original coordinates, then the learning
  rate. With the defaults (second-order source, bilateral) this is SOAP with the paper's settings.

  Args:
    learning_rate: a float or an optax schedule.
    b1: first-moment decay.
    b2: second-moment decay.
    eps: Adam epsilon.
    weight_decay: decoupled weight decay (``W <- W - lr * wd * W``).
    source: ``"second"`` or ``"first"``; see ``scale_by_basis_rotation``.
    geometry: ``"bilateral"`` or ``"unilateral"``.
    refresh_every: basis refresh period, an int or a pytree prefix of ints.
    shampoo_beta: decay of the second-order statistics (default ``b2``).
    max_precond_dim: sides longer than this are not rotated.
    mask: which leaves to rotate (see ``scale_by_basis_rotation``).
    weight_decay_mask: passed to ``optax.add_decayed_weights`` (default: all leaves).

  Returns:
    The chained ``optax.GradientTransformationExtraArgs``.
  """
  return optax.chain(
      scale_by_basis_rotation(source=source, geometry=geometry, refresh_every=refresh_every,
                              b1=b1, b2=b2, eps=eps, shampoo_beta=shampoo_beta,
                              max_precond_dim=max_precond_dim, mask=mask),
      optax.add_decayed_weights(weight_decay, weight_decay_mask),
      optax.scale_by_learning_rate(learning_rate),
  )


def leaf_bases(state: BasisRotationState, params):
  """Per-leaf ``(U, V)`` of a ``BasisRotationState`` (``None`` for unrotated leaves; a ``(0, 0)``
  array for an unrotated side). A host-side utility for diagnostics and tests."""
  leaves, treedef = jax.tree.flatten(params)
  out = [None] * len(leaves)
  for members, left, right in zip(state.members, state.left, state.right):
    for row, i in enumerate(jax.device_get(members).tolist()):
      out[i] = (left[row], right[row])
  return jax.tree.unflatten(treedef, out)

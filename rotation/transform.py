"""Basis rotation as an Optax transformation (the paper's Algorithms 1 and 2, arXiv 2602.03515;
docs/algorithms.md section 2).

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
the matrix ``(prod(shape[:-1]), shape[-1])``: leading axes are merged into the row side (a 3-D
``(heads, d_in, d_out)`` kernel is rotated as ``(heads * d_in, d_out)``; a 4-D convolution kernel
``(h, w, c_in, c_out)`` as ``(h * w * c_in, c_out)``), so only the last axis is a side of its own.
Every leaf must be floating point (an integer leaf is an error at ``init``). A
callable ``mask`` is evaluated on the parameters at init and on the updates at every step (as in
``optax.masked``), so it must depend only on the tree's structure and shapes.

Threads: on the CPU backend the first ``init`` makes the OpenBLAS that JAX's LAPACK calls use
single-threaded, unless ``OPENBLAS_NUM_THREADS`` or ``OMP_NUM_THREADS`` is set (``rotation.threads``
says what that changes and how to opt out).

Numerics: statistics, ``eigh``, QR and rotations run in float32 with ``Precision.HIGHEST``
whatever the parameter dtype; updates are returned in the gradient's dtype.

Non-finite gradients: they propagate into the moments and statistics exactly as in Adam (use
``optax.apply_if_finite`` to skip such steps, which leaves this state untouched); a basis refresh
whose input or result is not finite keeps the previous basis and moments instead of installing
NaNs, and never hands the non-finite values to a decomposition (LAPACK's SVD can loop for ever on
inf mixed with finite values), so an inf or NaN at any step, the first included, returns.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import optax
from optax import tree_utils as otu

from rotation import eigenbasis as eb
from rotation import threads
from rotation.plan import (
  _check_float_leaves,
  _check_int_periods,
  _given_bases,
  _is_key,
  _plan,
  _random_bases,
  _rotate_in,
  _rotate_out,
)

SOURCES = ("second", "first")
GEOMETRIES = ("bilateral", "unilateral")
FIRST_ORDER_STEPS = ("paper", "power")
DEFAULT_MAX_PRECOND_DIM = 10000


class RotationGroup(NamedTuple):
  """Stacked state of the k rotated matrices of one group (same shape, sides and period).

  A side that is not rotated (unilateral geometry, a side longer than ``max_precond_dim``) and a
  statistic that is not kept (first-order source) are ``None``: an empty pytree node that every
  checkpointer stores.
  """

  members: jax.Array  # int32 (k,): positions of the k matrices among the flattened leaves (static
  #   layout derived from the parameters at init; kept so that ``leaf_bases`` needs no plan).
  left: jax.Array | None  # float32 (k, m, m): left bases U, columns by descending eigenvalue.
  right: jax.Array | None  # float32 (k, n, n): right bases V, columns by descending eigenvalue.
  stat_left: jax.Array | None  # float32 (k, m, m): EMA of G G^T (second-order source only).
  stat_right: jax.Array | None  # float32 (k, n, n): EMA of G^T G (second-order source only).


class BasisRotationState(NamedTuple):
  """State of ``scale_by_basis_rotation``.

  Rotated matrices of the same shape (and refresh period and sides) form a *group* and are stored
  stacked on a leading axis of size k, so that every step runs a few batched matmuls instead of
  one small op per matrix. Groups are ordered by first appearance among the flattened parameters;
  ``leaf_bases`` maps them back to per-leaf bases.
  """

  count: jax.Array  # int32 (): updates taken so far.
  groups: tuple  # one RotationGroup per group.
  inner_state: optax.OptState  # inner's state over (unrotated leaves, one (k, m, n) stack per group).


def _concrete(name: str, value) -> float | None:
  """``value`` as a Python float when it is known at construction (a Python or NumPy number, a 0-d
  array), ``None`` when it is traced (``optax.inject_hyperparams``); anything else is refused."""
  if isinstance(value, (str, bytes)) or np.ndim(value) != 0:
    raise TypeError(f"{name} must be a real scalar, got {value!r}")
  if isinstance(value, jax.core.Tracer):
    return None
  try:
    if np.iscomplexobj(value):
      raise TypeError
    return float(value)
  except (TypeError, ValueError):
    raise TypeError(f"{name} must be a real scalar, got {value!r}") from None


def _check_decay(name: str, value) -> None:
  """A decay rate known at construction must lie in [0, 1) (one traced by
  ``optax.inject_hyperparams`` is not known then)."""
  v = _concrete(name, value)
  if v is not None and not 0 <= v < 1:
    raise ValueError(f"{name} must be in [0, 1), got {value!r}")


def _check_learning_rate(value) -> None:
  """A learning rate is a real scalar or a schedule (a callable of the step)."""
  if not callable(value):
    _concrete("learning_rate", value)


def scale_by_adam(b1: float = 0.9, b2: float = 0.999, eps: float = 1e-8) -> optax.GradientTransformation:
  """Adam with the paper's bias correction, ``sqrt(1 - b2^t) / (1 - b1^t) * mu / (sqrt(nu) + eps)``.

  This differs from ``optax.scale_by_adam`` only in where ``eps`` sits relative to the bias
  correction. Moments are float32; the state is ``optax.ScaleByAdamState`` (fields ``mu``, ``nu``).
  """
  _check_decay("b1", b1)
  _check_decay("b2", b2)

  def init_fn(params):
    _check_float_leaves(params)
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


def scale_by_basis_rotation(
    inner: optax.GradientTransformation | None = None,
    *,
    source: str = "second",
    geometry: str = "bilateral",
    refresh_every: int | Any = 10,
    b1: float = 0.9,
    b2: float = 0.999,
    eps: float = 1e-8,
    shampoo_beta: float | None = None,
    max_precond_dim: int = DEFAULT_MAX_PRECOND_DIM,
    mask: None | Any | Callable[[Any], Any] = None,
    first_order_step: str = "paper",
    stagger: bool = False,
    orthonormalization: str = "qr",
    batch_refresh: bool | None = None,
    bases: Any | None = None,
    freeze_after: int | None = None,
) -> optax.GradientTransformationExtraArgs:
  """Runs ``inner`` in a rotated (Kronecker-factored) eigenbasis of every selected matrix.

  Per selected matrix ``W`` (m x n) and step ``t = 1, 2, ...`` with gradient ``G``:
  (1) second-order source: ``L <- bs L + (1 - bs) G G^T``, ``R <- bs R + (1 - bs) G^T G``;
  (2) if ``t == 1`` or ``t % refresh_every == 0``: refresh the bases, re-expressing the inner first
  moment exactly; (3) ``G~ = U^T G V``; (4) ``u~ = inner(G~)``; (5) return ``U u~ V^T``.

  Step 1 is exact: at ``t == 1`` both sources' statistics (``L = (1 - bs) G G^T``, the look-ahead
  momentum ``(1 - b1) G``) have the singular vectors of ``G`` as eigenvectors, so the bases come
  from one SVD ``G = U S V^T`` and the rotated gradient is set to ``S`` (bilateral), ``S V^T``
  (left only) or ``U S`` (right only) exactly. Computing ``U^T G V`` in float32 instead leaves
  off-diagonal round-off that ``/ (sqrt(nu) + eps)`` turns into update entries as large as the
  real ones. Warm refresh (``t % refresh_every == 0``), per rotated side: sort the basis by its
  eigenvalue estimate (Rayleigh quotient ``diag(Q^T S Q)``; first-order source: ``||M^T q||^2`` or
  ``||M q||^2``), permute ``nu`` along that side with the same permutation, then one step of
  orthogonal iteration ``Q <- qr(S Q).Q``. First-order source, bilateral: ``Q_L <- qr(M Q_R).Q``,
  ``Q_R <- qr(M^T Q_L).Q`` from the sorted old bases (the paper's step).

  Args:
    inner: transformation run in the rotated space; default ``scale_by_adam(b1, b2, eps)`` with
      the paper's bias correction. It receives rotated float32 gradients and ``params=None``
      (weight decay belongs outside, in original coordinates). Extra arguments of ``update``
      (``value=loss`` and the like) reach ``inner`` only if it accepts them
      (``optax.with_extra_args_support``).
    source: ``"second"`` (eigenbasis of the gradient second moments ``L``, ``R``; = SOAP) or
      ``"first"`` (singular vectors of the momentum; no ``L``/``R`` memory).
    geometry: ``"bilateral"`` (rotate both sides) or ``"unilateral"`` (only the smaller side, the
      input side of a square matrix: left if ``rows <= cols``, else right, for Flax's (in, out)
      kernels).
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
    first_order_step: the warm refresh of the first-order source in *unilateral* geometry.
      ``"paper"`` (the paper's code): ``Q <- qr(M[:, columns sorted by norm]).Q`` (left; ``M^T`` for
      the right side), the other side held at the identity; it discards the old basis.
      ``"power"``: a true power step ``Q <- qr(M M^T Q).Q`` (left; ``M^T M`` for the right side)
      from the sorted old basis, which tracks the eigenbasis better.
    stagger: spread the warm refreshes of the rotated matrices evenly over the period (the r-th of
      n matrices at steps ``t`` with ``(t - r * T // n) % T == 0``), so that no step pays every
      refresh at once; each matrix still refreshes once every ``T`` steps. Matrices with different
      offsets are not batched together. Default: the paper's schedule (all at ``t % T == 0``).
    orthonormalization: how a warm refresh orthonormalises (``eigenbasis.ORTHONORMALIZATIONS``):
      ``"qr"`` (Householder QR, the default) or ``"cholesky_qr"`` (shifted Cholesky-QR3: matmuls,
      Cholesky factors and triangular solves, fast on accelerators where QR is slow; it falls back to
      QR for a numerically rank-deficient input). Both give bases with the same nested column spans.
    batch_refresh: refresh a group's same-shape matrices in one batched call (``vmap``) rather than
      one at a time (``lax.map``). ``None``: batched except on CPU, where concurrent batched LAPACK
      kernels (eigh, QR, SVD) can deadlock XLA's thread pool.
    bases: ``None`` (estimate the bases, the paper's method) or *fixed* bases: a pytree with the
      parameters' structure holding, per leaf, ``(U, V)`` (``None`` for a side, or the whole
      leaf, that is not rotated; sides as ``mask``, ``geometry`` and ``max_precond_dim`` select
      them). The bases are then never refreshed and no statistics are kept: Adam in a given basis
      (the identity: exactly ``inner``; a random orthogonal basis; the exact eigenbasis of a known
      Hessian, as an oracle; a frozen estimate). Ablations of the mechanism. A PRNG key
      (``jax.random.key(seed)``) draws random orthogonal (Haar) bases for every rotated side.
    freeze_after: ``None`` (refresh for ever) or a step count: no warm refresh after it, so the
      bases estimated by then stay frozen (the statistics are still kept). An ablation.

  Returns:
    An ``optax.GradientTransformationExtraArgs`` whose state is ``BasisRotationState``.

  References:
    Mitigating Staleness in Asynchronous Pipeline Parallelism via Basis Rotation, ICML 2026
    (arXiv 2602.03515), Algorithms 1 and 2; Vyas et al., SOAP, 2024 (arXiv 2409.11321).
  """
  if source not in SOURCES:
    raise ValueError(f"unknown source {source!r}; choose from {SOURCES}")
  if geometry not in GEOMETRIES:
    raise ValueError(f"unknown geometry {geometry!r}; choose from {GEOMETRIES}")
  if first_order_step not in FIRST_ORDER_STEPS:
    raise ValueError(f"unknown first_order_step {first_order_step!r}; choose from {FIRST_ORDER_STEPS}")
  if orthonormalization not in eb.ORTHONORMALIZATIONS:
    raise ValueError(f"unknown orthonormalization {orthonormalization!r}; choose from "
                     f"{eb.ORTHONORMALIZATIONS}")
  _check_int_periods(refresh_every)
  if freeze_after is not None and (isinstance(freeze_after, bool) or not isinstance(freeze_after, int)
                                   or freeze_after < 1):
    raise ValueError(f"freeze_after must be None or a Python int >= 1, got {freeze_after!r}")
  eps_value = _concrete("eps", eps)
  if eps_value is not None and eps_value < 0:
    raise ValueError(f"eps must be >= 0, got {eps!r}")
  for name, value in (("b1", b1), ("b2", b2), ("shampoo_beta", shampoo_beta)):
    if value is not None:
      _check_decay(name, value)
  if isinstance(max_precond_dim, bool) or not isinstance(max_precond_dim, int) or max_precond_dim < 0:
    raise ValueError(f"max_precond_dim must be a Python int >= 0 (with optax.inject_hyperparams, "
                     f"list it in static_args), got {max_precond_dim!r}")
  if inner is not None and not isinstance(inner, optax.GradientTransformation):
    raise TypeError(f"inner must be an optax.GradientTransformation (or None for Adam), got {inner!r}"
                    + (": for a learning rate use rotation.basis_rotation(learning_rate, ...)"
                       if isinstance(inner, (int, float)) else ""))
  inner = optax.with_extra_args_support(scale_by_adam(b1, b2, eps) if inner is None else inner)
  bs = b2 if shampoo_beta is None else shampoo_beta
  second = source == "second" and bases is None
  fixed = bases is not None

  def plan_of(tree):
    return _plan(tree, mask, geometry, max_precond_dim, refresh_every, stagger)

  def inner_tree(plan, leaves):
    """The rotated space: (unrotated leaves, one (k, m, n) stack per group), float32."""
    plain = [leaves[i].astype(jnp.float32) for i in plan.plain]
    stacks = [jnp.stack([leaves[i].reshape(g.shape).astype(jnp.float32) for i in g.members])
              for g in plan.groups]
    return plain, stacks

  def init_fn(params):
    _check_float_leaves(params)
    if not fixed and jax.default_backend() == "cpu":
      threads.limit_lapack_threads()  # the refreshes' LAPACK single-threaded; see rotation.threads
    plan = plan_of(params)
    leaves = jax.tree.leaves(params)
    inner_state = inner.init(inner_tree(plan, [jnp.zeros(jnp.shape(x), jnp.float32) for x in leaves]))
    if source == "first" and otu.tree_get(inner_state, "mu") is None:
      raise ValueError("source='first' needs an inner transformation with a first moment named 'mu'")

    given = (_random_bases(bases, plan) if _is_key(bases) else _given_bases(bases, params, plan)
             if fixed else None)

    def group(j, g):
      k, (m, n) = len(g.members), g.shape
      eye = lambda d: jnp.broadcast_to(jnp.eye(d, dtype=jnp.float32), (k, d, d))
      zeros = lambda d: jnp.zeros((k, d, d), jnp.float32)
      left = eye(m) if g.left else None
      right = eye(n) if g.right else None
      if fixed:
        left, right = given[j]
      return RotationGroup(
          members=jnp.asarray(g.members, jnp.int32), left=left, right=right,
          stat_left=zeros(m) if g.left and second else None,
          stat_right=zeros(n) if g.right and second else None)

    return BasisRotationState(jnp.zeros([], jnp.int32),
                              tuple(group(j, g) for j, g in enumerate(plan.groups)), inner_state)

  def statistics(g, sl, sr):
    """One matrix's second-order statistics L, R (updated every step; lifted with vmap)."""
    if sl is not None:
      sl = bs * sl + (1 - bs) * eb.mm(g, g.T)
    if sr is not None:
      sr = bs * sr + (1 - bs) * eb.mm(g.T, g)
    return sl, sr

  def reexpress(mu, ql, qr, new_l, new_r):
    """The rotated first moment in the new basis: ``U_new^T U_old M~ V_old^T V_new`` (exact)."""
    if ql is not None:
      mu = eb.mm(eb.mm(new_l.T, ql), mu)
    if qr is not None:
      mu = eb.mm(mu, eb.mm(qr.T, new_r))
    return mu

  def guarded(refresh):
    """``refresh`` (one matrix's args -> candidate ``(U, V, nu, rotated gradient)``) made safe: the
    decompositions only ever see finite input (LAPACK's SVD can loop for ever on inf mixed with
    finite values), and the old bases and moments are kept (the gradient rotated by the old bases)
    if the input or the result is not finite."""

    def safe(args):
      g, ql, qr, sl, sr, mu, nu = args
      finite = jnp.all(jnp.asarray([jnp.all(jnp.isfinite(x)) for x in (g, sl, sr, mu) if x is not None]))
      clean = jax.tree.map(lambda x: jnp.where(finite, x, jnp.zeros_like(x)), args)
      new_l, new_r, new_nu, g_rot = refresh(clean)
      new = (new_l, new_r, reexpress(mu, ql, qr, new_l, new_r), new_nu, g_rot)
      ok = finite & jnp.all(jnp.asarray([jnp.all(jnp.isfinite(x))
                                         for x in jax.tree.leaves(new[:2] + new[3:4])]))
      old = (ql, qr, mu, nu, _rotate_in(g, ql, qr))
      return jax.tree.map(lambda a, b: jnp.where(ok, a, b), new, old)

    return safe

  @guarded
  def cold(args):
    """Step 1 for one matrix: bases and rotated gradient from the SVD of ``G`` (exact)."""
    g, ql, qr, sl, sr, mu, nu = args
    if ql is not None and qr is not None:  # both complete bases: U (m, m), V (n, n)
      u, s, vt = jnp.linalg.svd(g, full_matrices=True)
      k = s.shape[0]
      g_rot = jnp.zeros(g.shape, g.dtype).at[jnp.arange(k), jnp.arange(k)].set(s)
      return u, vt.T, nu, g_rot
    # One side: it is the shorter one (unilateral geometry picks it; a side left unrotated by
    # max_precond_dim is the longer one), so the thin SVD already holds its complete basis, and
    # the other side's (possibly huge) basis is never built.
    u, s, vt = jnp.linalg.svd(g, full_matrices=False)
    if ql is not None:
      return u, None, nu, s[:, None] * vt  # U^T G = S V^T
    return None, vt.T, nu, u * s[None, :]  # G V = U S

  @guarded
  def warm(args):
    """A warm refresh of one matrix: sort, permute ``nu``, one orthogonal-iteration step."""
    g, ql, qr, sl, sr, mu, nu = args
    if second:
      new_l, new_r, new_nu = ql, qr, nu
      if ql is not None:
        new_l, new_nu = eb.warm_refresh_second(ql, sl, new_nu, axis=0, method=orthonormalization)
      if qr is not None:
        new_r, new_nu = eb.warm_refresh_second(qr, sr, new_nu, axis=1, method=orthonormalization)
    else:
      look_ahead = b1 * _rotate_out(mu, ql, qr) + (1 - b1) * g
      new_l, new_r, new_nu = eb.first_order_bases(look_ahead, ql, qr, nu, first_order_step,
                                                  orthonormalization)
    return new_l, new_r, new_nu, _rotate_in(g, new_l, new_r)

  def group_step(count, plan_g, group, g, mu, nu):
    """A group of k same-shape matrices: statistics, refresh under lax.switch, rotation in.

    Refreshes loop over the matrices with ``lax.map`` or run batched (``vmap``): see
    ``batch_refresh``.
    """
    if fixed:  # given bases: rotate, nothing to refresh
      return jax.vmap(_rotate_in)(g, group.left, group.right), group, mu, nu
    batched = jax.default_backend() != "cpu" if batch_refresh is None else batch_refresh
    each = jax.vmap if batched else (lambda f: lambda a: jax.lax.map(f, a))
    sl, sr = jax.vmap(statistics)(g, group.stat_left, group.stat_right)
    args = (g, group.left, group.right, sl, sr, mu, nu)
    keep = lambda a: (a[1], a[2], a[5], a[6], jax.vmap(_rotate_in)(a[0], a[1], a[2]))
    warm_now = (count > 1) & ((count - plan_g.offset) % plan_g.period == 0)
    if freeze_after is not None:
      warm_now = warm_now & (count <= freeze_after)
    branch = jnp.where(count == 1, 1, jnp.where(warm_now, 2, 0))
    ql, qr, mu, nu, g_rot = jax.lax.switch(
        branch, [keep, each(cold), each(warm)], args)
    return g_rot, group._replace(left=ql, right=qr, stat_left=sl, stat_right=sr), mu, nu

  def update_fn(updates, state, params=None, **extra_args):
    del params
    plan = plan_of(updates)
    leaves = jax.tree.leaves(updates)
    count = optax.safe_int32_increment(state.count)
    plain, stacks = inner_tree(plan, leaves)
    mus = otu.tree_get(state.inner_state, "mu")  # (plain leaves, group stacks) or None
    nus = otu.tree_get(state.inner_state, "nu")
    rotated, groups, new_mu, new_nu = [], [], [], []
    for j, (plan_g, group) in enumerate(zip(plan.groups, state.groups)):
      mu = jnp.zeros_like(stacks[j]) if mus is None else mus[1][j]
      nu = jnp.zeros_like(stacks[j]) if nus is None else nus[1][j]
      out = group_step(count, plan_g, group, stacks[j], mu, nu)
      for acc, x in zip((rotated, groups, new_mu, new_nu), out):
        acc.append(x)
    inner_state = state.inner_state
    if mus is not None:
      inner_state = otu.tree_set(inner_state, mu=(mus[0], new_mu))
    if nus is not None:
      inner_state = otu.tree_set(inner_state, nu=(nus[0], new_nu))
    (plain_u, stack_u), inner_state = inner.update((plain, rotated), inner_state, None, **extra_args)
    out = [None] * len(leaves)
    for i, u in zip(plan.plain, plain_u):
      out[i] = u.astype(leaves[i].dtype)
    for plan_g, group, u in zip(plan.groups, groups, stack_u):
      back = jax.vmap(_rotate_out)(u, group.left, group.right)
      for row, i in enumerate(plan_g.members):
        out[i] = back[row].reshape(plan.shapes[i]).astype(leaves[i].dtype)
    return jax.tree.unflatten(plan.treedef, out), BasisRotationState(count, tuple(groups), inner_state)

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
    refresh_every: int | Any = 10,
    shampoo_beta: float | None = None,
    max_precond_dim: int = DEFAULT_MAX_PRECOND_DIM,
    mask: None | Any | Callable[[Any], Any] = None,
    weight_decay_mask: None | Any | Callable[[Any], Any] = None,
    first_order_step: str = "paper",
    stagger: bool = False,
    orthonormalization: str = "qr",
    batch_refresh: bool | None = None,
    bases: Any | None = None,
    freeze_after: int | None = None,
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
    first_order_step: ``"paper"`` or ``"power"``; see ``scale_by_basis_rotation``.
    stagger: spread the refreshes of different matrices over the period; see
      ``scale_by_basis_rotation``.
    orthonormalization: ``"qr"`` or ``"cholesky_qr"``; see ``scale_by_basis_rotation``.
    batch_refresh: batch the refresh of same-shape matrices; see ``scale_by_basis_rotation``.
    bases: fixed bases instead of estimated ones; see ``scale_by_basis_rotation``.
    freeze_after: last step with a warm refresh (``None``: every period); see
      ``scale_by_basis_rotation``.

  Returns:
    The chained ``optax.GradientTransformationExtraArgs``.
  """
  _check_learning_rate(learning_rate)
  return optax.chain(
      scale_by_basis_rotation(source=source, geometry=geometry, refresh_every=refresh_every,
                              b1=b1, b2=b2, eps=eps, shampoo_beta=shampoo_beta,
                              max_precond_dim=max_precond_dim, mask=mask,
                              first_order_step=first_order_step, stagger=stagger,
                              orthonormalization=orthonormalization, batch_refresh=batch_refresh,
                              bases=bases, freeze_after=freeze_after),
      optax.add_decayed_weights(weight_decay, weight_decay_mask),
      optax.scale_by_learning_rate(learning_rate),
  )


def leaf_bases(state: BasisRotationState, params):
  """Per-leaf ``(U, V)`` of a ``BasisRotationState`` (``None`` for unrotated leaves and for an
  unrotated side). A host-side utility for diagnostics and tests."""
  leaves, treedef = jax.tree.flatten(params)
  out = [None] * len(leaves)
  for group in state.groups:
    for row, i in enumerate(jax.device_get(group.members).tolist()):
      out[i] = (None if group.left is None else group.left[row],
                None if group.right is None else group.right[row])
  return treedef.unflatten(out)

"""Basis rotation as an Optax transformation (the paper's Algorithms 1 and 2, arXiv 2602.03515;
docs/algorithms.md section 2).

``scale_by_basis_rotation(inner)`` rotates every selected weight matrix's gradient into an
estimated Hessian eigenbasis ``G~ = U^T G V``, runs ``inner`` (Adam by default) on the rotated
gradients, and rotates the update back ``U u~ V^T``. The bases are Kronecker factors per matrix,
refreshed infrequently (cold start by SVD at step 1, then one QR power-iteration step every
``refresh_every`` steps) under ``jax.lax.switch``.

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

Threads: on the CPU backend the first ``init`` makes the OpenBLAS that JAX's LAPACK calls use
single-threaded, unless ``OPENBLAS_NUM_THREADS`` or ``OMP_NUM_THREADS`` is set (``rotation.threads``
says what that changes and how to opt out).

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

import sys
from collections.abc import Callable
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import optax

from rotation import dims, threads
from rotation import eigenbasis as eb
from rotation.plan import (
  _rotate_in,
  _rotate_out,
  check_float_leaves,
  check_periods,
  given_bases,
  is_key,
  leaf_plans,
  periods,
  random_bases,
  state_plans,
  static_int,
)

SOURCES = ("second", "first")
GEOMETRIES = ("bilateral", "unilateral")
FIRST_ORDER_STEPS = ("paper", "power")
FIRST_MOMENTS = ("mu", "trace", "ema")
SECOND_MOMENT_RULES = ("permute", "rotate")  # how second moments follow a basis change
SECOND_MOMENTS = ("nu", "nu_max", "sum_of_squares")
DEFAULT_BLOCK_SIZE = 1024


class RotationPiece(NamedTuple):
  """Stacked bases and statistics of the K same-shape matrices (a x b) of one leaf's piece: its
  batch indices times its block pairs (``rotation.dims``). A side that is not rotated and a
  statistic that is not kept (first-order source, fixed bases) are ``None``."""

  left: jax.Array | None  # (K, a, a): left bases U, columns by descending eigenvalue.
  right: jax.Array | None  # (K, b, b): right bases V.
  stat_left: jax.Array | None  # (K, a, a): EMA of G G^T (second-order source only).
  stat_right: jax.Array | None  # (K, b, b): EMA of G^T G.


class BasisRotationState(NamedTuple):
  """State of ``scale_by_basis_rotation``."""

  count: jax.Array  # int32 (): updates taken so far.
  bases: Any  # the parameters' tree structure: per leaf a tuple of RotationPiece, or None (plain).
  inner_state: optax.OptState  # inner's state over parameter-shaped rotated gradients.


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
  """A decay rate known at construction must lie in [0, 1)."""
  v = _concrete(name, value)
  if v is not None and not 0 <= v < 1:
    raise ValueError(f"{name} must be in [0, 1), got {value!r}")


def _check_learning_rate(value) -> None:
  """A learning rate is a real scalar or a schedule (a callable of the step)."""
  if not callable(value):
    _concrete("learning_rate", value)


def _check_dtype(name: str, value):
  if value is None:
    return None
  try:
    dtype = jnp.dtype(value)
  except TypeError:
    raise ValueError(f"{name} must be None or a floating dtype, got {value!r}") from None
  if not jnp.issubdtype(dtype, jnp.floating):
    raise ValueError(f"{name} must be None or a floating dtype, got {value!r}")
  return dtype


def _compute_dtype(x):
  return jnp.promote_types(jnp.result_type(x), jnp.float32)


def scale_by_adam(b1: float = 0.9, b2: float = 0.999, eps: float = 1e-8, eps_root: float = 0.0,
                  mu_dtype: Any | None = None) -> optax.GradientTransformation:
  """Adam with the paper's bias correction, ``sqrt(1 - b2^t) / (1 - b1^t) * mu / (sqrt(nu + eps_root)
  + eps)``.

  This differs from ``optax.scale_by_adam`` only in where ``eps`` sits relative to the bias
  correction. ``nu`` is kept in the gradient's (float32 or wider) dtype, ``mu`` in ``mu_dtype``
  (default: the same); the state is ``optax.ScaleByAdamState`` (fields ``mu``, ``nu``).
  """
  _check_decay("b1", b1)
  _check_decay("b2", b2)
  mu_dtype = _check_dtype("mu_dtype", mu_dtype)

  def init_fn(params):
    check_float_leaves(params)
    mu = jax.tree.map(lambda p: jnp.zeros_like(p, dtype=mu_dtype or _compute_dtype(p)), params)
    nu = jax.tree.map(lambda p: jnp.zeros_like(p, dtype=_compute_dtype(p)), params)
    return optax.ScaleByAdamState(jnp.zeros([], jnp.int32), mu, nu)

  def update_fn(updates, state, params=None):
    del params
    count = optax.safe_int32_increment(state.count)
    mu = jax.tree.map(lambda m, g: b1 * m.astype(_compute_dtype(g)) + (1 - b1) * g, state.mu, updates)
    nu = jax.tree.map(lambda v, g: b2 * v + (1 - b2) * g * g, state.nu, updates)
    t = count.astype(jnp.float32)
    scale = jnp.sqrt(1 - b2**t) / (1 - b1**t)
    new = jax.tree.map(lambda g, m, v: (scale * m / (jnp.sqrt(v + eps_root) + eps)).astype(g.dtype),
                       updates, mu, nu)
    mu = jax.tree.map(lambda m, old: m.astype(old.dtype), mu, state.mu)
    return new, optax.ScaleByAdamState(count, mu, nu)

  return optax.GradientTransformation(init_fn, update_fn)


def _is_variable(x) -> bool:
  """A Flax NNX ``Variable``: a box around one parameter, whose metadata (sharding names) describe
  the parameter, so a basis is never put in one."""
  nnx = sys.modules.get("flax.nnx")
  return nnx is not None and isinstance(x, nnx.Variable)


def _per_leaf(params, values):
  """``values`` (one per flattened leaf) in the parameters' structure, without Flax Variables."""
  it = iter(values)
  return jax.tree.map(lambda _: next(it), params, is_leaf=_is_variable)


def _bases_leaves(bases, params) -> list:
  """One entry of ``bases`` (built by ``_per_leaf``) per leaf of ``params``: a tuple of pieces, or
  ``None`` (unrotated). Read against the parameters' structure, so that ``None`` leaves of the
  parameters (other stages' leaves in a per-stage tree) shift nothing."""
  return jax.tree.structure(params, is_leaf=_is_variable).flatten_up_to(bases)


def _moment_fields(inner_state, template) -> list[tuple[Any, str]]:
  """(key path, field name) of every subtree of ``inner_state`` shaped like ``template`` (the
  parameters): the fields that live in rotated coordinates."""
  treedef = jax.tree.structure(template)
  shapes = [jnp.shape(x) for x in jax.tree.leaves(template)]
  if not shapes:
    return []
  matches = lambda x: (jax.tree.structure(x) == treedef
                       and [jnp.shape(y) for y in jax.tree.leaves(x)] == shapes)
  out = []
  for path, x in jax.tree_util.tree_flatten_with_path(inner_state, is_leaf=matches)[0]:
    if not matches(x):
      continue
    names = [getattr(k, "name", getattr(k, "key", None)) for k in path]
    out.append((path, next((n for n in reversed(names) if isinstance(n, str)), "")))
  # A parameters tree of a single leaf matches every array of its shape: keep only named fields.
  return [(p, n) for p, n in out if n or treedef.num_leaves > 1]


def _replace_at(tree, path, value):
  """``tree`` with the subtree at key ``path`` replaced by ``value``."""
  if not path:
    return value
  key, rest = path[0], path[1:]
  if isinstance(key, jax.tree_util.GetAttrKey):
    return tree._replace(**{key.name: _replace_at(getattr(tree, key.name), rest, value)})
  if isinstance(key, jax.tree_util.SequenceKey):
    items = list(tree)
    items[key.idx] = _replace_at(items[key.idx], rest, value)
    return type(tree)(items) if not hasattr(tree, "_fields") else type(tree)(*items)
  if isinstance(key, jax.tree_util.DictKey):
    new = dict(tree)
    new[key.key] = _replace_at(tree[key.key], rest, value)
    return type(tree)(new) if type(tree) is not dict else new
  raise TypeError(f"cannot update the inner state at {jax.tree_util.keystr(path)}")


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
    bases: Any | None = None,
    freeze_after: int | None = None,
    second_moments: str = "permute",
) -> optax.GradientTransformationExtraArgs:
  """Runs ``inner`` in a rotated (Kronecker-factored) eigenbasis of every selected matrix.

  Per selected matrix ``W`` (m x n) and step ``t = 1, 2, ...`` with gradient ``G``:
  (1) second-order source: ``L <- bs L + (1 - bs) G G^T``, ``R <- bs R + (1 - bs) G^T G``;
  (2) if ``t == 1`` or ``t % refresh_every == 0``: refresh the bases, re-expressing the inner first
  moments exactly; (3) ``G~ = U^T G V``; (4) ``u~ = inner(G~)``; (5) return ``U u~ V^T``.

  Step 1 is exact: at ``t == 1`` both sources' statistics (``L = (1 - bs) G G^T``, the look-ahead
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
    shampoo_beta: decay ``bs`` of ``L`` and ``R``; ``None`` means ``b2``.
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
    bases: ``None`` (estimate the bases, the paper's method) or *fixed* bases: a pytree with the
      parameters' structure holding, per rotated leaf of one block, ``(U, V)`` (``(a, a)``, or
      ``(K, a, a)`` for a stack; ``None`` for a side that is not rotated). The bases are then never
      refreshed and no statistics are kept: Adam in a given basis (ablations). A PRNG key
      (``jax.random.key(seed)``) draws random orthogonal (Haar) bases for every rotated side.
    freeze_after: ``None`` (refresh for ever) or a step count: no warm refresh after it, so the
      bases estimated by then stay frozen (the statistics are still kept). An ablation.
    second_moments: how the inner second moments (``SECOND_MOMENTS``) follow a warm refresh.
      ``"permute"`` (the paper's and SOAP's): only reordered with the basis columns.
      ``"rotate"``: re-expressed as the variances of a diagonal second moment in the new basis,
      ``nu_new = (U_new^T U_old)^2 nu_old (V_old^T V_new)^2`` (elementwise squares; the
      permutation exactly when the bases only reorder). Early in training, when the basis still
      moves a lot, "permute" leaves first moments (re-expressed exactly) over coordinates whose
      second moment is near zero, and the step after a refresh can be hundreds of times the
      learning rate (docs/algorithms.md, "the refresh spike"); "rotate" keeps the two consistent.

  Returns:
    An ``optax.GradientTransformationExtraArgs`` whose state is ``BasisRotationState``.

  References:
    Mitigating Staleness in Asynchronous Pipeline Parallelism via Basis Rotation, ICML 2026
    (arXiv 2602.03515), Algorithms 1 and 2; Vyas et al., SOAP, 2024 (arXiv 2409.11321); Anil et
    al., Scalable Second Order Optimization for Deep Learning, 2020 (arXiv 2002.09018), blocking.
  """
  if source not in SOURCES:
    raise ValueError(f"unknown source {source!r}; choose from {SOURCES}")
  if geometry not in GEOMETRIES:
    raise ValueError(f"unknown geometry {geometry!r}; choose from {GEOMETRIES}")
  if second_moments not in SECOND_MOMENT_RULES:
    raise ValueError(f"unknown second_moments {second_moments!r}; choose from {SECOND_MOMENT_RULES}")
  if first_order_step not in FIRST_ORDER_STEPS:
    raise ValueError(f"unknown first_order_step {first_order_step!r}; choose from {FIRST_ORDER_STEPS}")
  if orthonormalization not in eb.ORTHONORMALIZATIONS:
    raise ValueError(f"unknown orthonormalization {orthonormalization!r}; choose from "
                     f"{eb.ORTHONORMALIZATIONS}")
  check_periods(refresh_every)
  freeze_after = static_int("freeze_after", freeze_after, 1, none_ok=True, traced_ok=True)
  if not isinstance(block_size, jax.core.Tracer):
    static_int("block_size", block_size, 1, none_ok=True)
  if not isinstance(max_precond_dim, jax.core.Tracer):
    static_int("max_precond_dim", max_precond_dim, 0, none_ok=True)
  eps_value = _concrete("eps", eps)
  if eps_value is not None and eps_value < 0:
    raise ValueError(f"eps must be >= 0, got {eps!r}")
  for name, value in (("b1", b1), ("b2", b2), ("shampoo_beta", shampoo_beta)):
    if value is not None:
      _check_decay(name, value)
  precond_dtype = _check_dtype("precond_dtype", precond_dtype)
  try:
    precision = jax.lax.Precision(precision) if precision is not None else None
  except ValueError:
    raise ValueError(f"precision must be a jax.lax.Precision or its name, got {precision!r}") from None
  if inner is not None and not isinstance(inner, optax.GradientTransformation):
    raise TypeError(f"inner must be an optax.GradientTransformation (or None for Adam), got {inner!r}"
                    + (": for a learning rate use rotation.basis_rotation(learning_rate, ...)"
                       if isinstance(inner, (int, float)) else ""))
  if source == "first" and inner is not None and b1 is None:
    raise ValueError("source='first' with a given inner needs b1= (the look-ahead weight: the inner "
                     "optimizer's first-moment decay)")
  b1 = 0.9 if b1 is None else b1
  inner = optax.with_extra_args_support(
      scale_by_adam(b1, b2, eps, eps_root, mu_dtype) if inner is None else inner)
  bs = b2 if shampoo_beta is None else shampoo_beta
  fixed = bases is not None
  second = source == "second" and not fixed
  stored = lambda x, like=None: None if x is None else x.astype(precond_dtype or like or x.dtype)

  def moment_fields(inner_state, template):
    fields = _moment_fields(inner_state, template)
    first = [p for p, n in fields if n in FIRST_MOMENTS]
    second_ = [p for p, n in fields if n in SECOND_MOMENTS]
    other = [(p, n) for p, n in fields if n not in FIRST_MOMENTS + SECOND_MOMENTS]
    return first, second_, other

  def init_fn(params):
    check_float_leaves(params)
    if not fixed and jax.default_backend() == "cpu":
      threads.limit_lapack_threads()  # the refreshes' LAPACK single-threaded; see rotation.threads
    try:
      block = static_int("block_size", block_size, 1, none_ok=True)
      max_dim = static_int("max_precond_dim", max_precond_dim, 0, none_ok=True)
    except ValueError as e:
      raise ValueError(f"{e} (init needs it concrete: under optax.inject_hyperparams, initialise "
                       "outside jit or list it in static_args)") from None
    plans = leaf_plans(params, weight_dimension_numbers, geometry, max_dim, block)
    leaves, treedef = jax.tree.flatten(params)
    template = treedef.unflatten([jnp.zeros_like(x, dtype=_compute_dtype(x)) for x in leaves])
    inner_state = inner.init(template)
    first, _, other = moment_fields(inner_state, template)
    if other and not fixed and any(p is not None for p in plans):
      names = ", ".join(f"{jax.tree_util.keystr(p)} ({n or 'unnamed'})" for p, n in other)
      raise ValueError(f"inner state field(s) {names} are shaped like the parameters but are neither "
                       f"first moments {FIRST_MOMENTS} nor second moments {SECOND_MOMENTS}: they would "
                       "stay in the old basis at a refresh. Use an inner optimizer whose moments "
                       "carry these names, or fixed bases.")
    if source == "first" and not fixed and not first:
      raise ValueError(f"source='first' needs an inner transformation with a first moment (a field "
                       f"named one of {FIRST_MOMENTS})")
    given = (random_bases(bases, plans) if is_key(bases) else given_bases(bases, params, plans)
             if fixed else None)

    def leaf(i, x, plan):
      if plan is None:
        return None
      cdt = _compute_dtype(x)
      pieces = []
      for j, (k, a, b) in enumerate(plan.layout.pieces):
        eye = lambda d: jnp.broadcast_to(jnp.eye(d, dtype=cdt), (k, d, d))
        zeros = lambda d: jnp.zeros((k, d, d), cdt)
        left, right = (eye(a) if plan.left else None), (eye(b) if plan.right else None)
        if fixed:
          left, right = given[i][j]
        piece = RotationPiece(stored(left), stored(right),
                              stored(zeros(a)) if plan.left and second else None,
                              stored(zeros(b)) if plan.right and second else None)
        pieces.append(piece)
      return tuple(pieces)

    entries = [leaf(i, x, plan) for i, (x, plan) in enumerate(zip(leaves, plans))]
    mesh = _mesh_of(leaves)
    if mesh is not None:  # laid out on the parameters' mesh: stacks split along K, the rest whole
      entries = [None if e is None else jax.tree.map(
          lambda s: jax.device_put(s, stack_sharding(s.shape, mesh)), e) for e in entries]
      replicated = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec())
      # on the mesh, each spec written as an update's outputs write it (P(None,), not P())
      canonical = lambda x: jax.device_put(x, jax.sharding.NamedSharding(
          mesh, jax.typeof(x).sharding.spec) if _explicit_axes([x]) else x.sharding)
      inner_state = jax.tree.map(
          lambda x: canonical(x) if getattr(x, "sharding", None) is not None and getattr(
              x.sharding, "mesh", None) == mesh else jax.device_put(x, replicated), inner_state)
    per_leaf = _per_leaf(params, entries)
    if type(params).__name__ == "_ParamsPlaceholder":
      # optax.tree_map_params maps f over the subtrees that its placeholder stands in; the bases
      # have the parameters' structure but are not parameters (transform_non_params gets them).
      per_leaf = _NOT_PARAMS
    count = jnp.zeros([], jnp.int32)
    if mesh is not None:
      count = jax.device_put(count, replicated)
    return BasisRotationState(count, per_leaf, inner_state)

  def statistics(g, sl, sr):
    """One matrix's second-order statistics L, R (updated every step; lifted with vmap)."""
    if sl is not None:
      sl = bs * sl + (1 - bs) * eb.mm(g, g.T, precision)
    if sr is not None:
      sr = bs * sr + (1 - bs) * eb.mm(g.T, g, precision)
    return sl, sr

  def reexpress(mu, ql, qr, new_l, new_r):
    """The rotated first moment in the new basis: ``U_new^T U_old M~ V_old^T V_new`` (exact)."""
    if ql is not None:
      mu = eb.mm(eb.mm(new_l.T, ql), mu)
    if qr is not None:
      mu = eb.mm(mu, eb.mm(qr.T, new_r))
    return mu

  def rotate_second(nu, ql, qr, new_l, new_r):
    """A second moment's variances in the new basis (``second_moments="rotate"``)."""
    if ql is not None:
      nu = eb.mm(jnp.square(eb.mm(new_l.T, ql)), nu)
    if qr is not None:
      nu = eb.mm(nu, jnp.square(eb.mm(qr.T, new_r)))
    return nu

  def guarded(refresh):
    """``refresh`` (one matrix's ``(g, U, V, L, R, firsts, seconds)`` -> candidate ``(U, V,
    seconds, rotated gradient)``) made safe: the decompositions only ever see finite input, and
    the old bases and moments are kept if the input or the result is not finite."""

    def safe(args):
      g, ql, qr, sl, sr, firsts, seconds = args
      finite = jnp.all(jnp.asarray([jnp.all(jnp.isfinite(x)) for x in (g, sl, sr, *firsts)
                                    if x is not None]))
      clean = jax.tree.map(lambda x: jnp.where(finite, x, jnp.zeros_like(x)), args)
      new_l, new_r, new_seconds, g_rot = refresh(clean)
      new_firsts = tuple(reexpress(m, ql, qr, new_l, new_r) for m in firsts)
      if second_moments == "rotate":
        new_seconds = tuple(rotate_second(v, ql, qr, new_l, new_r) for v in seconds)
      new = (new_l, new_r, new_firsts, new_seconds, g_rot)
      ok = finite & jnp.all(jnp.asarray([jnp.all(jnp.isfinite(x))
                                         for x in jax.tree.leaves((new_l, new_r, new_seconds))]))
      old = (ql, qr, firsts, seconds, _rotate_in(g, ql, qr))
      return jax.tree.map(lambda a, b: jnp.where(ok, a, b), new, old)

    return safe

  @guarded
  def cold(args):
    """Step 1 for one matrix: bases and rotated gradient from the SVD of ``G`` (exact)."""
    g, ql, qr, sl, sr, firsts, seconds = args
    if ql is not None and qr is not None:  # both complete bases: U (m, m), V (n, n)
      u, s, vt = jnp.linalg.svd(g, full_matrices=True)
      k = s.shape[0]
      g_rot = jnp.zeros(g.shape, g.dtype).at[jnp.arange(k), jnp.arange(k)].set(s)
      return u, vt.T, seconds, g_rot
    # One side: it is the shorter one (unilateral geometry picks it; a side left unrotated by
    # max_precond_dim is the longer one), so the thin SVD already holds its complete basis.
    u, s, vt = jnp.linalg.svd(g, full_matrices=False)
    if ql is not None:
      return u, None, seconds, s[:, None] * vt  # U^T G = S V^T
    return None, vt.T, seconds, u * s[None, :]  # G V = U S

  @guarded
  def warm(args):
    """A warm refresh of one matrix: sort, permute the second moments, one orthogonal-iteration
    step."""
    g, ql, qr, sl, sr, firsts, seconds = args
    if second:
      new_l, new_r, new_seconds = ql, qr, seconds
      if ql is not None:
        new_l, new_seconds = eb.warm_refresh_second(ql, sl, new_seconds, axis=0, method=orthonormalization)
      if qr is not None:
        new_r, new_seconds = eb.warm_refresh_second(qr, sr, new_seconds, axis=1, method=orthonormalization)
    else:
      look_ahead = b1 * _rotate_out(firsts[0], ql, qr) + (1 - b1) * g
      new_l, new_r, new_seconds = eb.first_order_bases(look_ahead, ql, qr, seconds, first_order_step,
                                                       orthonormalization)
    return new_l, new_r, new_seconds, _rotate_in(g, new_l, new_r)

  def rotate_in(count, items, together):
    """Statistics, refresh and rotation in for every rotated leaf at once. ``items``: per leaf
    ``(plan, pieces, g, firsts, seconds, period, offset)``. Returns per leaf the rotated gradient
    (the leaf's layout), the new pieces and the re-expressed moments (compute dtype).

    The pieces of all leaves are one list: those of equal shapes run as one stack when
    ``together`` (``_stack``), and the leaves sharing a refresh schedule share one
    ``lax.switch``, so a model of many small kernels costs a few large ops, not many small ones."""
    args, owners = [], []
    for n, (plan, pieces, g, firsts, seconds, _, _) in enumerate(items):
      cdt = _compute_dtype(g)
      cut = lambda x, lay=plan.layout, cdt=cdt: dims.to_pieces(x.astype(cdt), lay)
      up = lambda x, cdt=cdt: None if x is None else x.astype(cdt)
      gp, fp, sp = cut(g), [cut(f) for f in firsts], [cut(s) for s in seconds]
      for j, piece in enumerate(pieces):
        args.append((gp[j], up(piece.left), up(piece.right), up(piece.stat_left), up(piece.stat_right),
                     tuple(f[j] for f in fp), tuple(s[j] for s in sp)))
        owners.append(n)
    with_stats = lambda a: a[:3] + tuple(jax.vmap(statistics)(a[0], a[3], a[4])) + a[5:]
    rot_in = jax.vmap(lambda g, ql, qr: _rotate_in(g, ql, qr, precision))
    keep = lambda a: (a[1], a[2], a[5], a[6], rot_in(a[0], a[1], a[2]))
    batched = jax.default_backend() != "cpu" if batch_refresh is None else batch_refresh
    each = jax.vmap if batched else (lambda f: lambda a: jax.lax.map(f, a))
    outs, stats = [None] * len(args), [None] * len(args)
    schedules = {}  # (period, offset) -> pieces; a traced period (inject_hyperparams) by identity
    for k, n in enumerate(owners):
      key = tuple(x if isinstance(x, int) else id(x) for x in items[n][5:])
      schedules.setdefault(key, (items[n][5:], []))[1].append(k)
    for (period, offset), ks in schedules.values():
      # stacked once: the statistics, the switch and its results run on a few stacks, not on every
      # piece (XLA copies each result that a branch passes through unchanged)
      stacks, split = _stack([args[k] for k in ks], together)
      stacks = [with_stats(x) for x in stacks]
      if fixed:
        got = split([keep(x) for x in stacks])
      else:
        warm_now = (count > 1) & ((count - offset) % period == 0)
        if freeze_after is not None:
          warm_now = warm_now & (count <= freeze_after)
        branch = jnp.where(count == 1, 1, jnp.where(warm_now, 2, 0))
        got = split(jax.lax.switch(branch, [lambda st: [keep(x) for x in st],
                                            lambda st: [each(cold)(x) for x in st],
                                            lambda st: [each(warm)(x) for x in st]], stacks))
      for k, o, st in zip(ks, got, split([x[3:5] for x in stacks])):
        outs[k], stats[k] = o, st
    results = []
    for n, (plan, pieces, _, firsts, seconds, _, _) in enumerate(items):
      s_n, o_n = _owned(stats, owners, n), _owned(outs, owners, n)
      new_pieces = tuple(
          RotationPiece(stored(ql, piece.left.dtype if ql is not None else None),
                        stored(qr, piece.right.dtype if qr is not None else None),
                        stored(sl, piece.stat_left.dtype if sl is not None else None),
                        stored(sr, piece.stat_right.dtype if sr is not None else None))
          for piece, (sl, sr), (ql, qr, _, _, _) in zip(pieces, s_n, o_n))
      join = lambda parts, lay=plan.layout: dims.from_pieces(parts, lay)
      results.append((join([o[4] for o in o_n]), new_pieces,
                      [join([o[2][k] for o in o_n]) for k in range(len(firsts))],
                      [join([o[3][k] for o in o_n]) for k in range(len(seconds))]))
    return results

  def update_fn(updates, state, params=None, **extra_args):
    del params
    axes = _explicit_axes(updates)
    if not axes:
      return update(updates, state, **extra_args)
    # Under a mesh with explicit axes (jax.make_mesh's default) every op would need its output
    # sharding spelled out; the update runs with those axes automatic instead, and its outputs are
    # laid out exactly as its inputs (the updates like the gradients, the state as it came).
    shardings = jax.tree.map(lambda x: jax.typeof(x).sharding, (updates, state))
    return jax.sharding.auto_axes(lambda u, s: update(u, s, **extra_args), axes=axes,
                                  out_sharding=shardings)(updates, state)

  def update(updates, state, **extra_args):
    plans = state_plans(updates, weight_dimension_numbers, state.bases)
    leaves, treedef = jax.tree.flatten(updates)
    entries = _bases_leaves(state.bases, updates)
    count = optax.safe_int32_increment(state.count)
    first, second_, _ = moment_fields(state.inner_state, updates)
    values = {path: treedef.flatten_up_to(_at(state.inner_state, path)) for path in first + second_}
    leaf_periods = periods(refresh_every, updates)
    n_rotated = sum(p is not None for p in plans)
    # on one device the same-shape pieces of all leaves run as one stack; on several, each leaf's
    # stacks keep their own layout (a concatenation would move them between devices)
    together = jax.device_count() == 1
    rotated = [g.astype(_compute_dtype(g)) for g in leaves]
    new_entries = list(entries)
    idx = [i for i, plan in enumerate(plans) if plan is not None]
    items = [(plans[i], entries[i], leaves[i], [values[p][i] for p in first], [values[p][i] for p in second_],
              leaf_periods[i], plans[i].rank * leaf_periods[i] // n_rotated if stagger else 0) for i in idx]
    for i, (g_rot, pieces, new_f, new_s) in zip(idx, rotate_in(count, items, together) if items else []):
      rotated[i], new_entries[i] = g_rot, pieces
      for p, v in zip(first + second_, new_f + new_s):
        values[p][i] = v.astype(values[p][i].dtype)
    inner_state = state.inner_state
    for path, vals in values.items():
      inner_state = _replace_at(inner_state, path, treedef.unflatten(vals))
    new_updates, inner_state = inner.update(treedef.unflatten(rotated), inner_state, None, **extra_args)
    rot_out = jax.vmap(lambda a: _rotate_out(*a, precision))
    parts, owners = [], []
    for n, (g, u, plan, pieces) in enumerate(zip(leaves, treedef.flatten_up_to(new_updates), plans,
                                                new_entries)):
      if plan is not None:
        cdt = _compute_dtype(g)
        up = lambda x, cdt=cdt: None if x is None else x.astype(cdt)
        for p, pc in zip(dims.to_pieces(u.astype(cdt), plan.layout), pieces):
          parts.append((p, up(pc.left), up(pc.right)))
          owners.append(n)
    rotated_out = _batched(rot_out, parts, together)
    out = []
    for n, (g, u, plan) in enumerate(zip(leaves, treedef.flatten_up_to(new_updates), plans)):
      if plan is not None:
        u = dims.from_pieces(_owned(rotated_out, owners, n), plan.layout)
      out.append(u.astype(g.dtype))
    new_bases = _per_leaf(updates, new_entries)
    return treedef.unflatten(out), BasisRotationState(count, new_bases, inner_state)

  return optax.GradientTransformationExtraArgs(init_fn, update_fn)


def _stack(arg_list, together: bool) -> tuple[list, Callable]:
  """``(stacks, split)``: when ``together``, the elements of ``arg_list`` of equal structure,
  trailing shapes and dtypes concatenated into one stack each (otherwise each element its own), and
  ``split``, which takes per-stack results (K-stacked like their stack) back to one per element."""
  if not together:
    return list(arg_list), list
  groups = {}
  for i, a in enumerate(arg_list):
    sig = (jax.tree.structure(a), tuple((x.shape[1:], x.dtype) for x in jax.tree.leaves(a)))
    groups.setdefault(sig, []).append(i)
  members = list(groups.values())
  stacks = [arg_list[m[0]] if len(m) == 1 else
            jax.tree.map(lambda *xs: jnp.concatenate(xs, 0), *[arg_list[i] for i in m]) for m in members]

  def split(results):
    out = [None] * len(arg_list)
    for m, res in zip(members, results):
      start = 0
      for i in m:
        k = jax.tree.leaves(arg_list[i])[0].shape[0]
        out[i] = res if len(m) == 1 else jax.tree.map(lambda x, start=start, k=k: x[start:start + k], res)
        start += k
    return out

  return stacks, split


def _batched(fn, arg_list, together: bool) -> list:
  """``fn`` (a function of K-stacked arguments whose outputs are K-stacked) on each element of
  ``arg_list``; when ``together``, the elements of equal structure, trailing shapes and dtypes run
  as one concatenated stack, split back afterwards (the same numbers per matrix, fewer ops)."""
  stacks, split = _stack(arg_list, together)
  return split([fn(x) for x in stacks])


def _owned(values, owners, n) -> list:
  """The elements of ``values`` whose owner (the parallel list ``owners``) is ``n``, in order."""
  return [v for v, o in zip(values, owners) if o == n]


_NOT_PARAMS = type("NotParams", (), {"__repr__": lambda self: "NotParams"})()


def _explicit_axes(tree) -> tuple:
  """The mesh axes of explicit type that ``tree``'s arrays are typed with (sharding in types)."""
  for x in jax.tree.leaves(tree):
    mesh = getattr(getattr(jax.typeof(x), "sharding", None), "mesh", None)
    types = getattr(mesh, "axis_types", None)
    if types:
      return tuple(n for n, t in zip(mesh.axis_names, types) if t == jax.sharding.AxisType.Explicit)
  return ()


def _at(tree, path):
  for key in path:
    if isinstance(key, jax.tree_util.GetAttrKey):
      tree = getattr(tree, key.name)
    elif isinstance(key, jax.tree_util.SequenceKey):
      tree = tree[key.idx]
    else:
      tree = tree[key.key]
  return tree


def _mesh_of(leaves):
  """The mesh of the first concrete parameter sharded by ``NamedSharding`` over several devices
  (an eager ``init`` of sharded parameters, what ``nnx.Optimizer`` does), else ``None``."""
  for x in leaves:
    sharding = getattr(x, "sharding", None)
    if isinstance(sharding, jax.sharding.NamedSharding) and not isinstance(x, jax.core.Tracer) \
        and len(sharding.mesh.devices.flat) > 1:
      return sharding.mesh
  return None


def stack_sharding(shape, mesh) -> jax.sharding.NamedSharding:
  """The sharding of a (K, a, a) stack of bases or statistics on ``mesh``: K split over the mesh
  axes (largest first) whose sizes multiply to a divisor of K, and the rows over the axes left
  whose sizes divide ``a`` (a leaf of few matrices, as a single large one, is still split)."""
  free = sorted((n for n in mesh.axis_names if mesh.shape[n] > 1), key=lambda n: -mesh.shape[n])
  spec = []
  for dim in shape[:2]:
    axes, size = [], 1
    for name in list(free):
      if dim % (size * mesh.shape[name]) == 0:
        axes.append(name)
        size *= mesh.shape[name]
        free.remove(name)
    spec.append(tuple(axes) if len(axes) > 1 else axes[0] if axes else None)
  return jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec(*spec, *([None] * (len(shape) - 2))))


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
    bases: Any | None = None,
    freeze_after: int | None = None,
    second_moments: str = "permute",
) -> optax.GradientTransformationExtraArgs:
  """AdamW in a rotated eigenbasis: the paper's optimizer, a drop-in for ``optax.adamw``.

  The positional arguments, their defaults and ``mask`` (the weight-decay mask) are
  ``optax.adamw``'s. Leaves that ``weight_dimension_numbers`` selects (by default every 2-D leaf)
  go through the rotation, all other leaves through plain Adam with the same hyper-parameters;
  decoupled weight decay is applied in original coordinates, then the learning rate. With the
  defaults (second-order source, bilateral) this is SOAP with the paper's settings.

  Args:
    learning_rate: a float or an optax schedule.
    b1: first-moment decay.
    b2: second-moment decay.
    eps: Adam epsilon.
    eps_root: Adam epsilon inside the square root.
    mu_dtype: dtype of the first moment (``None``: float32).
    weight_decay: decoupled weight decay (``W <- W - lr * wd * W``).
    mask: which leaves are decayed (``optax.add_decayed_weights``' mask: a tree of bools or a
      callable of the parameters; ``None``: all).
    weight_dimension_numbers: which leaves are rotated, as which matrices; see
      ``scale_by_basis_rotation``.
    source: ``"second"`` or ``"first"``; see ``scale_by_basis_rotation``.
    geometry: ``"bilateral"`` or ``"unilateral"``.
    refresh_every: basis refresh period, an int or a pytree prefix of ints.
    shampoo_beta: decay of the second-order statistics (default ``b2``).
    block_size: rotated sides longer than this are cut into blocks (``None``: never).
    max_precond_dim: sides longer than this are not rotated (``None``: no limit).
    precond_dtype: storage dtype of the statistics and bases.
    precision: precision of the per-step matmuls.
    first_order_step: ``"paper"`` or ``"power"``; see ``scale_by_basis_rotation``.
    stagger: spread the refreshes of different leaves over the period.
    orthonormalization: ``"qr"`` or ``"cholesky_qr"``.
    batch_refresh: batch the refresh of a piece's matrices.
    bases: fixed bases instead of estimated ones.
    freeze_after: last step with a warm refresh (``None``: every period).
    second_moments: ``"permute"`` or ``"rotate"``; see ``scale_by_basis_rotation``.

  Returns:
    The chained ``optax.GradientTransformationExtraArgs``.
  """
  _check_learning_rate(learning_rate)
  return optax.chain(
      scale_by_basis_rotation(weight_dimension_numbers=weight_dimension_numbers, source=source,
                              geometry=geometry, refresh_every=refresh_every, b1=b1, b2=b2, eps=eps,
                              eps_root=eps_root, mu_dtype=mu_dtype, shampoo_beta=shampoo_beta,
                              block_size=block_size, max_precond_dim=max_precond_dim,
                              precond_dtype=precond_dtype, precision=precision,
                              first_order_step=first_order_step, stagger=stagger,
                              orthonormalization=orthonormalization, batch_refresh=batch_refresh,
                              bases=bases, freeze_after=freeze_after, second_moments=second_moments),
      optax.add_decayed_weights(weight_decay, mask),
      optax.scale_by_learning_rate(learning_rate),
  )


def leaf_bases(state, params):
  """Per-leaf bases of a ``BasisRotationState`` (or of the first one in a chain's state):
  ``(U, V)`` for a leaf that is one matrix (no batch axes, one block), otherwise a tuple of
  ``(U, V)`` stacks ``(K, a, a)``, one per piece (``rotation.dims``); ``None`` for a plain
  leaf and for an unrotated side. A host-side utility for diagnostics and tests."""
  if not isinstance(state, BasisRotationState):  # a chain's state: its (first) rotation's
    found = [x for x in jax.tree.leaves(state, is_leaf=lambda x: isinstance(x, BasisRotationState))
             if isinstance(x, BasisRotationState)]
    if not found:
      raise ValueError("leaf_bases: the state holds no BasisRotationState")
    state = found[0]
  out = []
  for pieces in _bases_leaves(state.bases, params):
    if pieces is None:
      out.append(None)
      continue
    pairs = tuple((p.left, p.right) for p in pieces)
    one = len(pieces) == 1 and next(x for x in pairs[0] if x is not None).shape[0] == 1
    out.append(tuple(None if q is None else q[0] for q in pairs[0]) if one else pairs)
  return _per_leaf(params, out)

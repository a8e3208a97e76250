"""Which leaves basis rotation rotates, as which matrices, on which sides (``rotation.transform``
uses it): the per-leaf static plan from the dimension numbers, the rotations in and out, bases
given by the user or drawn at random, and the checks of the leaves and the integer options."""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from rotation import dims


class LeafPlan(NamedTuple):
  """Static plan of one rotated leaf."""

  layout: dims.Layout  # canonical view and block pieces
  left: bool  # input (row) side rotated
  right: bool  # output (column) side rotated
  rank: int  # position among the rotated leaves (staggered refresh offsets)


def _leaf_specs(weight_dimension_numbers, params) -> list:
  """One ``RotationDimensionNumbers`` or ``None`` per flattened leaf of ``params``."""
  leaves = jax.tree.leaves(params)
  if not leaves:  # nothing to rotate (and optax.tree_map_params's placeholder has no structure)
    return []
  spec = weight_dimension_numbers
  if spec is None:  # the paper's default: every 2-D leaf is an (in, out) matrix
    return [dims.LINEAR if jnp.ndim(x) == 2 else None for x in leaves]
  if dims.is_spec(spec):  # one spec for every leaf with two or more axes
    return [spec if jnp.ndim(x) >= 2 else None for x in leaves]
  tree = spec(params) if callable(spec) else spec
  if dims.is_spec(tree):
    return _leaf_specs(tree, params)
  out = []

  def collect(s, sub):
    if s is not None and not dims.is_spec(s):
      raise ValueError(f"weight_dimension_numbers: every entry must be a rotation."
                       f"RotationDimensionNumbers or None (plain Adam), got {s!r}")
    out.extend([s] * len(jax.tree.leaves(sub)))

  try:
    jax.tree.map(collect, tree, params, is_leaf=lambda x: x is None or dims.is_spec(x))
  except ValueError as e:
    if "weight_dimension_numbers: every entry" in str(e):
      raise
    raise ValueError(f"weight_dimension_numbers does not match the parameters (it must be a tree "
                     f"prefix of them): {e}") from None
  return out


def leaf_plans(params, weight_dimension_numbers, geometry, max_dim, block_size) -> list:
  """At init: one ``LeafPlan`` (or ``None``: plain inner) per flattened leaf of ``params``."""
  paths = [jax.tree_util.keystr(p) for p, _ in jax.tree_util.tree_leaves_with_path(params)]
  plans = []
  for where, x, spec in zip(paths, jax.tree.leaves(params),
                            _leaf_specs(weight_dimension_numbers, params)):
    if spec is None:
      plans.append(None)
      continue
    batch, red, out = dims.check_spec(spec, jnp.shape(x), f"parameter {where or 'leaf'}")
    lay = dims.layout(jnp.shape(x), batch, red, out, None)
    left, right = (True, True) if geometry == "bilateral" else (lay.m <= lay.n, lay.m > lay.n)
    left, right = (left and (max_dim is None or lay.m <= max_dim),
                   right and (max_dim is None or lay.n <= max_dim))
    if not (left or right):
      plans.append(None)
      continue
    # An unrotated side is never cut: its blocks would only multiply the rotated side's bases.
    lay = lay._replace(rows=dims.segments(lay.m, block_size if left else None),
                       cols=dims.segments(lay.n, block_size if right else None))
    plans.append(LeafPlan(lay, left, right, 0))
  return _ranked(plans)


def _ranked(plans):
  rank = iter(range(len(plans)))
  return [None if p is None else p._replace(rank=next(rank)) for p in plans]


def state_plans(updates, weight_dimension_numbers, bases) -> list:
  """At update: the same plans read back from the state's bases (their block sizes and rotated
  sides), so that no integer option (which ``optax.inject_hyperparams`` traces) is needed."""
  leaves, treedef = jax.tree.flatten(updates)
  per_leaf = treedef.flatten_up_to(bases)
  plans = []
  for x, spec, pieces in zip(leaves, _leaf_specs(weight_dimension_numbers, updates), per_leaf):
    if pieces is None:
      plans.append(None)
      continue
    batch, red, out = dims.check_spec(spec, jnp.shape(x), "update")
    first = pieces[0]
    left, right = first.left is not None, first.right is not None
    lay = dims.layout(jnp.shape(x), batch, red, out, None)
    lay = lay._replace(rows=dims.segments(lay.m, first.left.shape[-1] if left else None),
                       cols=dims.segments(lay.n, first.right.shape[-1] if right else None))
    plans.append(LeafPlan(lay, left, right, 0))
  return _ranked(plans)


def _lookup(tree, path):
  """The subtree of ``tree`` at a key path of the parameters (``None`` where it has none)."""
  for key in path:
    if tree is None:
      return None
    name = getattr(key, "key", getattr(key, "idx", getattr(key, "name", None)))
    try:
      tree = getattr(tree, name) if isinstance(key, jax.tree_util.GetAttrKey) else tree[name]
    except (KeyError, IndexError, TypeError, AttributeError):
      return None
  return tree


def given_bases(bases, params, plans):
  """Per rotated leaf: float32 ``(U, V)`` looked up in a tree of fixed bases by the leaf's key
  path, shaped ``(a, a)`` for a leaf that is one matrix or ``(K, a, a)`` for a stack (shapes
  checked; ``None`` for a side, or a leaf, that is not rotated). A blocked leaf is refused."""
  paths = [path for path, _ in jax.tree_util.tree_leaves_with_path(params)]
  out = []
  for path, plan in zip(paths, plans):
    if plan is None:
      out.append(None)
      continue
    where = jax.tree_util.keystr(path)
    if len(plan.layout.pieces) != 1:
      raise ValueError(f"bases: parameter {where} is blocked ({plan.layout.pieces}); fixed bases "
                       "are for leaves of one block (raise block_size)")
    k, a, b = plan.layout.pieces[0]
    sides = []
    for side, dim, rotated in ((0, a, plan.left), (1, b, plan.right)):
      if not rotated:
        sides.append(None)
        continue
      pair = _lookup(bases, path)
      q = pair[side] if isinstance(pair, (tuple, list)) and len(pair) == 2 else None
      want = ((dim, dim),) + (((k, dim, dim),) if k > 1 else ())
      if q is None or jnp.shape(q) not in want:
        raise ValueError(f"bases: parameter {where} of shape {plan.layout.shape} needs a "
                         f"{'left' if side == 0 else 'right'} basis of shape {want[-1]}, got "
                         f"{None if q is None else jnp.shape(q)}")
      sides.append(jnp.broadcast_to(jnp.asarray(q, jnp.float32), (k, dim, dim)))
    out.append((tuple(sides),))
  return out


def is_key(x) -> bool:
  return isinstance(x, jax.Array) and jnp.issubdtype(x.dtype, jax.dtypes.prng_key)


def random_bases(key, plans):
  """Per rotated leaf and piece: Haar-random orthogonal ``(U, V)`` stacks (``None`` for an
  unrotated side), one independent draw per leaf, piece and side from ``key``."""
  out = []
  for i, plan in enumerate(plans):
    if plan is None:
      out.append(None)
      continue
    pieces = []
    for j, (k, a, b) in enumerate(plan.layout.pieces):
      draw = lambda side: jax.random.fold_in(jax.random.fold_in(jax.random.fold_in(key, i), j), side)
      pieces.append((jax.random.orthogonal(draw(0), a, (k,), jnp.float32) if plan.left else None,
                     jax.random.orthogonal(draw(1), b, (k,), jnp.float32) if plan.right else None))
    out.append(tuple(pieces))
  return out


def check_float_leaves(params):
  """A non-float leaf would get its update cast to an integer (zero, or a wrong step)."""
  for path, x in jax.tree_util.tree_leaves_with_path(params):
    if not jnp.issubdtype(jnp.result_type(x), jnp.floating):
      raise TypeError(f"parameter {jax.tree_util.keystr(path) or 'leaf'} has dtype "
                      f"{jnp.result_type(x)}: this optimizer updates real floating-point leaves only "
                      "(freeze integer leaves, e.g. with optax.masked or optax.set_to_zero; a complex "
                      "parameter can be kept as two real ones)")


def static_int(name: str, value, low: int, none_ok: bool = False, traced_ok: bool = False):
  """``value`` as a Python int >= ``low`` (a concrete 0-d integer array counts: what
  ``optax.inject_hyperparams`` makes of an int), ``None`` if allowed, or, where ``traced_ok``,
  a traced integer scalar as it is. One clear error otherwise."""
  if value is None and none_ok:
    return None
  if isinstance(value, jax.core.Tracer) and traced_ok and jnp.issubdtype(value.dtype, jnp.integer) \
      and value.ndim == 0:
    return value
  ok = not isinstance(value, (bool, np.bool_)) and (
      isinstance(value, int) or (np.ndim(value) == 0 and hasattr(value, "dtype")
                                 and jnp.issubdtype(value.dtype, jnp.integer)
                                 and not isinstance(value, jax.core.Tracer)))
  if not ok or int(value) < low:
    raise ValueError(f"{name} must be {'None or ' if none_ok else ''}an int >= {low}, got {value!r}")
  return int(value)


def periods(refresh_every, tree) -> list:
  """One period per flattened leaf of ``tree`` (``refresh_every`` is an int or a tree prefix)."""
  try:
    per = jax.tree.map(lambda p, sub: jax.tree.map(lambda _: p, sub), refresh_every, tree)
  except ValueError as e:
    raise ValueError(f"refresh_every's tree structure is not a prefix of the parameters': {e}") from e
  return jax.tree.leaves(per)


def check_periods(refresh_every):
  for p in jax.tree.leaves(refresh_every):
    static_int("refresh_every (or each of its leaves)", p, 1, traced_ok=True)


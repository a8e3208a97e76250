"""Which leaves basis rotation rotates, on which sides, grouped by matrix shape (one batched refresh
per group); the rotations in and out; bases given by the user or drawn at random, looked up by
path; and the checks of the leaves and refresh periods (``rotation.transform`` uses them)."""

from __future__ import annotations

import math
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp

from rotation import eigenbasis as eb


def _matrix_shape(shape):
  return math.prod(shape[:-1]), shape[-1]


def _rotated_sides(shape, selected, geometry, max_dim):
  """Static (rotate_left, rotate_right) for a leaf of ``shape``.

  Unilateral geometry rotates the smaller side, and the *input* side of a square matrix, as the
  paper does. Flax kernels are (in, out), the transpose of PyTorch's (out, in), so the input side
  is the left one: rotate left when ``rows <= cols``, else right.
  """
  if not selected or len(shape) < 2:
    return False, False
  m, n = _matrix_shape(shape)
  left, right = (True, True) if geometry == "bilateral" else (m <= n, m > n)
  return left and m <= max_dim, right and n <= max_dim


def _rotate_in(g, ql, qr):
  if ql is not None:
    g = eb.mm(ql.T, g)
  if qr is not None:
    g = eb.mm(g, qr)
  return g


def _rotate_out(u, ql, qr):
  if ql is not None:
    u = eb.mm(ql, u)
  if qr is not None:
    u = eb.mm(u, qr.T)
  return u


class _GroupPlan(NamedTuple):
  """Static layout of one group."""

  members: tuple  # positions of its matrices among the flattened leaves
  shape: tuple  # (m, n) of each matrix
  left: bool  # left side rotated
  right: bool  # right side rotated
  period: int  # refresh period
  offset: int  # warm refreshes at steps t > 1 with (t - offset) % period == 0


class _Plan(NamedTuple):
  """Static layout: which flattened leaves are rotated, in which group."""

  treedef: Any
  shapes: tuple  # per leaf
  plain: tuple  # indices of unrotated leaves
  groups: tuple  # one _GroupPlan per group


def _plan(tree, mask, geometry, max_dim, refresh_every, stagger=False) -> _Plan:
  leaves, treedef = jax.tree.flatten(tree)
  selected = jax.tree.leaves(_mask_tree(mask, tree))
  periods = jax.tree.leaves(_periods(refresh_every, tree))
  sides = [_rotated_sides(jnp.shape(x), bool(sel), geometry, max_dim) for x, sel in zip(leaves, selected)]
  rotated = [i for i, (left, right) in enumerate(sides) if left or right]
  plain, groups = [], {}
  for i, (leaf, (left, right), period) in enumerate(zip(leaves, sides, periods)):
    if left or right:
      # Staggered: the r-th of the n rotated matrices refreshes at offset r * period // n.
      offset = rotated.index(i) * period // len(rotated) if stagger else 0
      key = (_matrix_shape(jnp.shape(leaf)), left, right, period, offset)
      groups.setdefault(key, []).append(i)
    else:
      plain.append(i)
  return _Plan(treedef, tuple(jnp.shape(x) for x in leaves), tuple(plain),
               tuple(_GroupPlan(tuple(members), *key) for key, members in groups.items()))


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


def _given_bases(bases, params, plan):
  """Per group: stacked float32 ``(U, V)`` looked up in a tree of fixed bases by each rotated
  leaf's key path (shapes checked; a subtree may be ``None`` or missing where nothing is rotated)."""
  paths = [path for path, _ in jax.tree_util.tree_leaves_with_path(params)]
  out = []
  for g in plan.groups:
    sides = []
    for side, dim, rotated in ((0, g.shape[0], g.left), (1, g.shape[1], g.right)):
      if not rotated:
        sides.append(None)
        continue
      mats = []
      for i in g.members:
        pair = _lookup(bases, paths[i])
        q = pair[side] if isinstance(pair, (tuple, list)) and len(pair) == 2 else None
        if q is None or jnp.shape(q) != (dim, dim):
          raise ValueError(f"bases: parameter {jax.tree_util.keystr(paths[i])} of shape "
                           f"{plan.shapes[i]} needs a {'left' if side == 0 else 'right'} basis of "
                           f"shape ({dim}, {dim}), got {None if q is None else jnp.shape(q)}")
        mats.append(jnp.asarray(q, jnp.float32))
      sides.append(jnp.stack(mats))
    out.append(tuple(sides))
  return out


def _is_key(x) -> bool:
  return isinstance(x, jax.Array) and jnp.issubdtype(x.dtype, jax.dtypes.prng_key)


def _random_bases(key, plan):
  """Per group: stacked Haar-random orthogonal ``(U, V)`` (``None`` for an unrotated side), one
  independent draw per group and side from ``key``."""
  out = []
  for j, g in enumerate(plan.groups):
    k = len(g.members)
    sides = []
    for side, dim, rotated in ((0, g.shape[0], g.left), (1, g.shape[1], g.right)):
      draw = jax.random.fold_in(jax.random.fold_in(key, j), side)
      sides.append(jax.random.orthogonal(draw, dim, (k,), jnp.float32) if rotated else None)
    out.append(tuple(sides))
  return out


def _check_float_leaves(params):
  """A non-float leaf would get its update cast to an integer (zero, or a wrong step)."""
  for path, x in jax.tree_util.tree_leaves_with_path(params):
    if not jnp.issubdtype(jnp.result_type(x), jnp.floating):
      raise TypeError(f"parameter {jax.tree_util.keystr(path) or 'leaf'} has dtype "
                      f"{jnp.result_type(x)}: this optimizer updates real floating-point leaves only "
                      "(freeze integer leaves, e.g. with optax.masked or optax.set_to_zero; a complex "
                      "parameter can be kept as two real ones)")


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

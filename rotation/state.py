"""The state of basis rotation: the stacked bases and statistics of each rotated leaf, and how that
per-leaf tree sits beside the parameters (Flax NNX Variables and ``None`` leaves included)."""

from __future__ import annotations

import sys
from typing import Any, NamedTuple

import jax
import optax


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
  bases: Any  # the parameters' tree structure: per leaf a tuple of RotationPiece, or None (plain);
  # a zero-size array when the parameters have no leaves.
  inner_state: optax.OptState  # inner's state over parameter-shaped rotated gradients.


def is_variable(x) -> bool:
  """A Flax NNX ``Variable``: a box around one parameter, whose metadata (sharding names) describe
  the parameter, so a basis is never put in one."""
  nnx = sys.modules.get("flax.nnx")
  return nnx is not None and isinstance(x, nnx.Variable)


def per_leaf(params, values):
  """``values`` (one per flattened leaf) in the parameters' structure, without Flax Variables."""
  it = iter(values)
  return jax.tree.map(lambda _: next(it), params, is_leaf=is_variable)


def bases_leaves(bases, params) -> list:
  """One entry of ``bases`` (built by ``per_leaf``) per leaf of ``params``: a tuple of pieces, or
  ``None`` (unrotated). Read against the parameters' structure, so that ``None`` leaves of the
  parameters (other stages' leaves in a per-stage tree) shift nothing."""
  return jax.tree.structure(params, is_leaf=is_variable).flatten_up_to(bases)


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
  for pieces in bases_leaves(state.bases, params):
    if pieces is None:
      out.append(None)
      continue
    pairs = tuple((p.left, p.right) for p in pieces)
    one = len(pieces) == 1 and next(x for x in pairs[0] if x is not None).shape[0] == 1
    out.append(tuple(None if q is None else q[0] for q in pairs[0]) if one else pairs)
  return per_leaf(params, out)

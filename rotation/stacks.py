"""Same-shape matrices run as one stack: the concatenation of many small per-matrix arguments into a
few large ones, and the split back, so that a model of many small kernels costs a few large ops."""

from __future__ import annotations

import math
from collections.abc import Callable

import jax
import jax.numpy as jnp

# Matrices of more elements than this are not concatenated across leaves: one matmul call is
# already efficient at that size, and copying the arguments into a stack and the results out again
# costs more (measured in docs/benchmarks.md, "Figures the code's comments cite").
LARGE = 128 * 128


def stack(arg_list, together: bool) -> tuple[list, Callable]:
  """``(stacks, split)``: when ``together``, the elements of ``arg_list`` of equal structure,
  trailing shapes and dtypes concatenated into one stack each, unless their first argument's
  matrices have more than ``LARGE`` elements (otherwise each element its own stack), and
  ``split``, which takes per-stack results (K-stacked like their stack) back to one per element."""
  if not together:
    return list(arg_list), list
  groups = {}
  for i, a in enumerate(arg_list):
    sig = (jax.tree.structure(a), tuple((x.shape[1:], x.dtype) for x in jax.tree.leaves(a)))
    if math.prod(jax.tree.leaves(a)[0].shape[1:]) > LARGE:
      sig = i  # its own stack: a concatenation of large matrices copies more than it saves
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


def batched(fn, arg_list, together: bool) -> list:
  """``fn`` (a function of K-stacked arguments whose outputs are K-stacked) on each element of
  ``arg_list``; when ``together``, the elements of equal structure, trailing shapes and dtypes run
  as one concatenated stack, split back afterwards (the same numbers per matrix, fewer ops)."""
  stacks, split = stack(arg_list, together)
  return split([fn(x) for x in stacks])


def owned(values, owners, n) -> list:
  """The elements of ``values`` whose owner (the parallel list ``owners``) is ``n``, in order."""
  return [v for v, o in zip(values, owners) if o == n]

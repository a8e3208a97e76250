"""Which axes of a weight form the rotated matrix, and how a weight is cut into the matrices
(blocks) that get bases of their own.

The convention is optax's (``optax.contrib.MuonDimensionNumbers``): a weight ``W`` is used as
``y = x W`` contracted over its *reduction* axes, giving its *output* axes; every other axis is a
*batch* axis, and each index along the batch axes is a matrix of its own, with its own bases and
statistics (a scanned stack's layers, the experts of a stacked MoE). The matrix of one batch index
is ``(prod(reduction sizes), prod(output sizes))``: rows are the input side, columns the output
side, as in a Flax ``(in, out)`` kernel.

A side longer than ``block_size`` is split into blocks of ``block_size`` (the last one shorter), and
each block pair ``(row block, column block)`` is an independent matrix with its own left and right
basis (block-diagonal Kronecker factors, as in distributed Shampoo, Anil et al. 2020, arXiv
2002.09018). Blocks of the same shape are stacked: a leaf becomes at most four *pieces* (full x
full, full x remainder, remainder x full, remainder x remainder), each a ``(K, a, b)`` stack whose
K runs over the batch indices and block pairs.
"""

from __future__ import annotations

import math
from typing import NamedTuple

import jax.numpy as jnp


class RotationDimensionNumbers(NamedTuple):
  """Axes of a weight that form its matrix: ``reduction_axis`` (the rows, the input side) and
  ``output_axis`` (the columns), each an int or a tuple of ints (negative ones count from the end).
  All other axes are batch axes: one matrix, with its own bases, per index along them."""

  reduction_axis: int | tuple[int, ...] = 0
  output_axis: int | tuple[int, ...] = 1


LINEAR = RotationDimensionNumbers(0, 1)
"""``nnx.Linear``'s kernel ``(in, out)`` (and any 2-D ``(in, out)`` matrix)."""

ATTENTION_QKV = RotationDimensionNumbers(reduction_axis=0, output_axis=(1, 2))
"""``nnx.MultiHeadAttention``'s query, key and value kernels ``(in, heads, head_dim)`` (an
``nnx.LinearGeneral`` with ``out_features=(heads, head_dim)``): one ``in x (heads * head_dim)``
matrix."""

ATTENTION_OUT = RotationDimensionNumbers(reduction_axis=(0, 1), output_axis=2)
"""``nnx.MultiHeadAttention``'s output kernel ``(heads, head_dim, out)`` (an ``nnx.LinearGeneral``
over ``axis=(-2, -1)``): one ``(heads * head_dim) x out`` matrix."""


def stacked(spec: RotationDimensionNumbers, layers: int = 1) -> RotationDimensionNumbers:
  """``spec`` for the same weight under ``layers`` leading stacked axes (``nnx.scan`` /
  ``nnx.vmap`` over layers, a ``lax.scan`` stack): its axes shift right, and the new leading axes
  are batch axes, so every layer keeps bases of its own. Negative axes already count from the end
  and are kept."""
  if isinstance(layers, bool) or not isinstance(layers, int) or layers < 0:
    raise ValueError(f"layers must be an int >= 0, got {layers!r}")
  shift = lambda axes: tuple(a + layers if a >= 0 else a for a in _axes(axes))
  return RotationDimensionNumbers(shift(spec.reduction_axis), shift(spec.output_axis))


def _axes(axes) -> tuple[int, ...]:
  return (axes,) if isinstance(axes, int) else tuple(axes)


def is_spec(x) -> bool:
  return isinstance(x, RotationDimensionNumbers)


def check_spec(spec, shape, where: str) -> tuple[tuple[int, ...], tuple[int, ...], tuple[int, ...]]:
  """(batch, reduction, output) axes of a leaf of ``shape`` under ``spec``, non-negative; one clear
  error naming the leaf for an axis out of range, repeated, or a side with no axis."""
  ndim = len(shape)
  sides = []
  for name in ("reduction_axis", "output_axis"):
    raw = getattr(spec, name)
    try:
      axes = _axes(raw)
      if not axes or any(isinstance(a, bool) or not isinstance(a, int) for a in axes):
        raise TypeError
    except TypeError:
      raise ValueError(f"weight_dimension_numbers for {where}: {name} must be an int or a non-empty "
                       f"tuple of ints, got {raw!r}") from None
    for a in axes:
      if not -ndim <= a < ndim:
        raise ValueError(f"weight_dimension_numbers for {where} of shape {tuple(shape)}: {name} {a} "
                         f"is out of range for {ndim} axes")
    sides.append(tuple(a % ndim for a in axes))
  reduction, output = sides
  if len(set(reduction + output)) != len(reduction) + len(output):
    raise ValueError(f"weight_dimension_numbers for {where} of shape {tuple(shape)}: reduction axes "
                     f"{reduction} and output axes {output} repeat an axis")
  batch = tuple(a for a in range(ndim) if a not in reduction + output)
  return batch, reduction, output


class Segment(NamedTuple):
  """``count`` consecutive blocks of ``size`` along one side, starting at ``start``."""

  start: int
  size: int
  count: int


def segments(length: int, block_size: int | None) -> tuple[Segment, ...]:
  """A side of ``length`` as blocks of ``block_size`` (the last one shorter); one block if it fits."""
  if block_size is None or length <= block_size:
    return (Segment(0, length, 1),)
  full, rest = divmod(length, block_size)
  return (Segment(0, block_size, full),) + ((Segment(full * block_size, rest, 1),) if rest else ())


class Layout(NamedTuple):
  """Static layout of one rotated leaf: its canonical view ``(B, m, n)`` (``perm`` puts the batch,
  reduction and output axes in that order) and its block pieces."""

  shape: tuple[int, ...]
  perm: tuple[int, ...]
  batch: int  # B
  m: int  # rows: the product of the reduction sizes
  n: int  # columns: the product of the output sizes
  rows: tuple[Segment, ...]
  cols: tuple[Segment, ...]

  @property
  def pieces(self) -> tuple[tuple[int, int, int], ...]:
    """(K, a, b) of each piece: K = B x row blocks x column blocks matrices of a x b."""
    return tuple((self.batch * r.count * c.count, r.size, c.size) for r in self.rows for c in self.cols)


def layout(shape, batch_axes, reduction, output, block_size) -> Layout:
  perm = tuple(batch_axes) + tuple(reduction) + tuple(output)
  m = math.prod(shape[a] for a in reduction)
  n = math.prod(shape[a] for a in output)
  return Layout(tuple(shape), perm, math.prod(shape[a] for a in batch_axes), m, n,
                segments(m, block_size), segments(n, block_size))


def to_pieces(x, lay: Layout) -> list:
  """A leaf (its own layout) as its pieces, each ``(K, a, b)``."""
  x = jnp.transpose(x, lay.perm).reshape(lay.batch, lay.m, lay.n)
  out = []
  for r in lay.rows:
    for c in lay.cols:
      p = x[:, r.start:r.start + r.size * r.count, c.start:c.start + c.size * c.count]
      p = p.reshape(lay.batch, r.count, r.size, c.count, c.size).transpose(0, 1, 3, 2, 4)
      out.append(p.reshape(-1, r.size, c.size))
  return out


def from_pieces(pieces, lay: Layout):
  """The inverse of ``to_pieces``: the leaf in its own layout."""
  it = iter(pieces)
  row_parts = []
  for r in lay.rows:
    col_parts = []
    for c in lay.cols:
      p = next(it).reshape(lay.batch, r.count, c.count, r.size, c.size).transpose(0, 1, 3, 2, 4)
      col_parts.append(p.reshape(lay.batch, r.count * r.size, c.count * c.size))
    row_parts.append(col_parts[0] if len(col_parts) == 1 else jnp.concatenate(col_parts, axis=2))
  x = row_parts[0] if len(row_parts) == 1 else jnp.concatenate(row_parts, axis=1)
  sizes = [lay.shape[a] for a in lay.perm]
  inverse = tuple(sorted(range(len(lay.perm)), key=lambda i: lay.perm[i]))
  return jnp.transpose(x.reshape(sizes), inverse)

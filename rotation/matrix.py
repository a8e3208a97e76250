"""One matrix's math, as pure functions of its arrays and ``Options``: the rotations in and out, the
second-order statistics, the exact re-expression of the moments across a basis change, and the cold
(step 1) and warm refreshes behind a guard that never installs a non-finite basis.

A refresh takes a ``PieceArgs`` and returns a ``Refreshed``; ``rotation.transform`` lifts these over
stacks with ``vmap`` or ``lax.map``."""

from __future__ import annotations

from typing import Any, NamedTuple

import jax
import jax.numpy as jnp

from rotation import eigenbasis as eb
from rotation.options import Options


class PieceArgs(NamedTuple):
  """One matrix piece (or a K-stack of them) going into a refresh or a rotation: the gradient, the
  bases ``U``, ``V``, the statistics ``L``, ``R`` (a side not rotated, a statistic not kept:
  ``None``), and the inner moments in rotated coordinates (none on the path without a refresh)."""

  g: Any
  left: Any
  right: Any
  stat_left: Any
  stat_right: Any
  firsts: tuple = ()
  seconds: tuple = ()


class Refreshed(NamedTuple):
  """A piece after a refresh (or after none): its bases, its moments re-expressed in them, and the
  gradient rotated in."""

  left: Any
  right: Any
  firsts: tuple
  seconds: tuple
  rotated: Any


def rotate_in(g, ql, qr, precision=eb.HIGHEST):
  """``U^T G V`` (a side that is ``None`` is not rotated)."""
  if ql is not None:
    g = eb.mm(ql.T, g, precision)
  if qr is not None:
    g = eb.mm(g, qr, precision)
  return g


def rotate_out(u, ql, qr, precision=eb.HIGHEST):
  """``U u V^T``, the inverse of ``rotate_in``."""
  if ql is not None:
    u = eb.mm(ql, u, precision)
  if qr is not None:
    u = eb.mm(u, qr.T, precision)
  return u


def statistics(g, sl, sr, decay, precision):
  """The second-order statistics after gradient ``g``: ``L <- d L + (1 - d) G G^T``, ``R <- d R +
  (1 - d) G^T G`` (a statistic not kept stays ``None``)."""
  if sl is not None:
    sl = decay * sl + (1 - decay) * eb.mm(g, g.T, precision)
  if sr is not None:
    sr = decay * sr + (1 - decay) * eb.mm(g.T, g, precision)
  return sl, sr


def reexpress(mu, ql, qr, new_l, new_r):
  """The rotated first moment in the new basis: ``U_new^T U_old M~ V_old^T V_new`` (exact)."""
  if ql is not None:
    mu = eb.mm(eb.mm(new_l.T, ql), mu)
  if qr is not None:
    mu = eb.mm(mu, eb.mm(qr.T, new_r))
  return mu


def rotate_second(nu, ql, qr, new_l, new_r):
  """A second moment's variances in the new basis (``second_moments="rotate"``):
  ``(U_new^T U_old)^2 nu (V_old^T V_new)^2``."""
  if ql is not None:
    nu = eb.mm(jnp.square(eb.mm(new_l.T, ql)), nu)
  if qr is not None:
    nu = eb.mm(nu, jnp.square(eb.mm(qr.T, new_r)))
  return nu


def guarded(refresh, args, second_moments: str):
  """``refresh(args)`` (-> candidate ``(U, V, seconds, rotated gradient or None)``; ``None``: the
  gradient rotated into the new bases, ``U^T G V``, done here once the bases are chosen) made safe: the
  decompositions only ever see finite input, the first moments are re-expressed (and the second
  ones too under ``"rotate"``), and the old bases and moments are kept if the input or the result
  is not finite."""
  g, ql, qr, sl, sr, firsts, seconds = args  # a PieceArgs
  finite = jnp.all(jnp.asarray([jnp.all(jnp.isfinite(x)) for x in (g, sl, sr, *firsts) if x is not None]))
  clean = jax.tree.map(lambda x: jnp.where(finite, x, jnp.zeros_like(x)), args)
  new_l, new_r, new_seconds, g_rot = refresh(clean)
  new_firsts = tuple(reexpress(m, ql, qr, new_l, new_r) for m in firsts)
  if second_moments == "rotate":
    new_seconds = tuple(rotate_second(v, ql, qr, new_l, new_r) for v in seconds)
  ok = finite & jnp.all(jnp.asarray([jnp.all(jnp.isfinite(x))
                                     for x in jax.tree.leaves((new_l, new_r, new_seconds))]))
  pick = lambda new, old: jax.tree.map(lambda a, b: jnp.where(ok, a, b), new, old)
  new_l, new_r, new_firsts, new_seconds = pick((new_l, new_r, new_firsts, new_seconds),
                                                (ql, qr, firsts, seconds))
  if g_rot is None:  # the gradient in whichever bases are kept: one rotation, not one per outcome
    return Refreshed(new_l, new_r, new_firsts, new_seconds, rotate_in(g, new_l, new_r))
  return Refreshed(new_l, new_r, new_firsts, new_seconds, pick(g_rot, rotate_in(g, ql, qr)))


def _cold(args):
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


def cold(args, opts: Options):
  """Step 1: bases and rotated gradient from the SVD of ``G`` (exact; guarded)."""
  return guarded(_cold, args, opts.second_moments)


def _warm(args, opts: Options):
  g, ql, qr, sl, sr, firsts, seconds = args
  if opts.second:
    new_l, new_r, new_seconds = ql, qr, seconds
    if ql is not None:
      new_l, new_seconds = eb.warm_refresh_second(ql, sl, new_seconds, axis=0, method=opts.orthonormalization)
    if qr is not None:
      new_r, new_seconds = eb.warm_refresh_second(qr, sr, new_seconds, axis=1, method=opts.orthonormalization)
  else:
    look_ahead = opts.b1 * rotate_out(firsts[0], ql, qr) + (1 - opts.b1) * g
    new_l, new_r, new_seconds = eb.first_order_bases(look_ahead, ql, qr, seconds, opts.first_order_step,
                                                     opts.orthonormalization)
  return new_l, new_r, new_seconds, None  # guarded rotates the gradient into the bases it keeps


def warm(args, opts: Options):
  """A warm refresh: sort, permute the second moments, one orthogonal-iteration step (guarded)."""
  return guarded(lambda a: _warm(a, opts), args, opts.second_moments)


def rotate_in_stacked(g, ql, qr, precision):
  """``rotate_in`` of every matrix of a K-stack."""
  return jax.vmap(lambda g, ql, qr: rotate_in(g, ql, qr, precision))(g, ql, qr)


def keep(args: PieceArgs, precision) -> Refreshed:
  """No refresh: the bases and moments as they are, the gradient rotated in (``args`` stacked)."""
  return Refreshed(args.left, args.right, args.firsts, args.seconds,
                   rotate_in_stacked(args.g, args.left, args.right, precision))

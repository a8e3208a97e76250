"""Per-matrix eigenbasis estimation: cold start, warm QR power-iteration refresh, sorting.

Everything here works on one float32 matrix side at a time and uses full-precision matmuls
(``Precision.HIGHEST``) so that GPUs do not silently fall back to TF32.

Notation (SPEC section 2): a side's basis ``Q`` has one column per eigenvector, ordered by
*descending* eigenvalue; ``S`` is that side's statistic (``L = E[G G^T]`` or ``R = E[G^T G]`` for
the second-order source; ``M M^T`` or ``M^T M`` of the momentum for the first-order source).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

HIGHEST = jax.lax.Precision.HIGHEST
COLD_START_JITTER = 1e-30


def mm(a, b):
  """Full-precision float32 matrix product."""
  return jnp.matmul(a, b, precision=HIGHEST)


def eigh_descending(stat):
  """Eigenvectors of a symmetric PSD matrix, columns by descending eigenvalue.

  A tiny ``1e-30 * I`` is added so that a zero or rank-deficient statistic (the very first
  gradient) still gives an orthonormal basis.
  """
  eye = jnp.eye(stat.shape[0], dtype=stat.dtype)
  _, vecs = jnp.linalg.eigh(stat + COLD_START_JITTER * eye)
  return vecs[:, ::-1]


def descending_order(q, sq):
  """Permutation sorting ``Q``'s columns by descending Rayleigh quotient.

  Args:
    q: (k, k) basis.
    sq: (k, k) the product ``S @ Q``.

  Returns:
    int32 (k,) permutation.
  """
  lam = jnp.sum(q * sq, axis=0)  # diag(Q^T S Q)
  return jnp.argsort(-lam, stable=True)


def orthonormalize(a):
  """``qr(a).Q`` with a square (complete) Q: one step of orthogonal (power) iteration."""
  return jnp.linalg.qr(a, mode="complete")[0]


def warm_refresh_second(q, stat, nu, axis):
  """Warm refresh of one side from its second-order statistic.

  ``lam = diag(Q^T S Q)``; sort descending; permute ``nu`` along ``axis``; ``Q <- qr(S Q).Q``.

  Returns:
    (new basis, permuted nu).
  """
  sq = mm(stat, q)
  order = descending_order(q, sq)
  return orthonormalize(sq[:, order]), jnp.take(nu, order, axis=axis)  # S (Q P) = (S Q) P


def first_order_bases(m, ql, qr, nu, rotate_left, rotate_right):
  """Warm refresh of both sides from the (look-ahead) momentum ``M`` (m x n).

  Eigenvalue estimates ``||M^T q||^2`` (left) and ``||M q||^2`` (right) sort each side and permute
  ``nu`` along that side's axis. Bilateral: ``Q_L <- qr(M Q_R).Q``, ``Q_R <- qr(M^T Q_L).Q`` (the
  sorted old bases, one simultaneous step, as in the paper). Unilateral: the exact power step
  ``Q <- qr(S Q).Q`` with ``S = M M^T`` (left) or ``M^T M`` (right), formed without ``S``.

  Returns:
    (new left basis, new right basis, permuted nu); an unrotated side is returned unchanged.
  """
  if rotate_left:
    mtq = mm(m.T, ql)  # (n, m)
    order = jnp.argsort(-jnp.sum(mtq * mtq, axis=0), stable=True)
    ql, mtq, nu = ql[:, order], mtq[:, order], jnp.take(nu, order, axis=0)
  if rotate_right:
    mq = mm(m, qr)  # (m, n)
    order = jnp.argsort(-jnp.sum(mq * mq, axis=0), stable=True)
    qr, mq, nu = qr[:, order], mq[:, order], jnp.take(nu, order, axis=1)
  if rotate_left and rotate_right:
    return orthonormalize(mq), orthonormalize(mtq), nu
  if rotate_left:
    return orthonormalize(mm(m, mtq)), qr, nu
  if rotate_right:
    return ql, orthonormalize(mm(m.T, mq)), nu
  return ql, qr, nu


def svd_bases(m, rotate_left, rotate_right):
  """Cold start from the momentum: full SVD, singular vectors by descending singular value."""
  u, _, vt = jnp.linalg.svd(m, full_matrices=True)
  return u if rotate_left else None, vt.T if rotate_right else None

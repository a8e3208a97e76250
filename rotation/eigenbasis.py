"""Per-matrix eigenbasis estimation: cold start, warm QR power-iteration refresh, sorting.

Everything here works on one float32 matrix side at a time and uses full-precision matmuls
(``Precision.HIGHEST``) so that GPUs do not silently fall back to TF32.

Notation (docs/algorithms.md section 2): a side's basis ``Q`` has one column per eigenvector, ordered by
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


def first_order_bases(m, ql, qr, nu, step="paper"):
  """Warm refresh of the rotated sides (``None``: not rotated) from the look-ahead momentum ``M``.

  Each rotated side is sorted by its eigenvalue estimate, ``||M^T q||^2`` (left) or ``||M q||^2``
  (right), and ``nu`` is permuted along that side's axis. Bilateral: ``Q_L <- qr(M Q_R).Q``,
  ``Q_R <- qr(M^T Q_L).Q`` (the sorted old bases, one simultaneous step, as in the paper).
  Unilateral, ``step="paper"`` (the paper's code): ``Q_L <- qr(M[:, columns by descending
  norm]).Q`` (right: the rows of ``M``), i.e. the bilateral step with the other side held at the
  identity; ``step="power"``: ``Q <- qr(S Q).Q`` with ``S = M M^T`` (left) or ``M^T M`` (right),
  formed without ``S``.

  Returns:
    (new left basis, new right basis, permuted nu); ``None`` for a side that is not rotated.
  """
  if ql is not None:
    mtq = mm(m.T, ql)  # (n, m)
    order = jnp.argsort(-jnp.sum(mtq * mtq, axis=0), stable=True)
    ql, mtq, nu = ql[:, order], mtq[:, order], jnp.take(nu, order, axis=0)
  if qr is not None:
    mq = mm(m, qr)  # (m, n)
    order = jnp.argsort(-jnp.sum(mq * mq, axis=0), stable=True)
    qr, mq, nu = qr[:, order], mq[:, order], jnp.take(nu, order, axis=1)
  if ql is not None and qr is not None:
    return orthonormalize(mq), orthonormalize(mtq), nu
  if ql is not None:
    if step == "power":
      return orthonormalize(mm(m, mtq)), None, nu
    cols = jnp.argsort(-jnp.sum(m * m, axis=0), stable=True)
    return orthonormalize(m[:, cols]), None, nu
  if qr is not None:
    if step == "power":
      return None, orthonormalize(mm(m.T, mq)), nu
    rows = jnp.argsort(-jnp.sum(m * m, axis=1), stable=True)
    return None, orthonormalize(m[rows, :].T), nu
  return ql, qr, nu

"""Per-matrix eigenbasis estimation: cold start, warm QR power-iteration refresh, sorting.

Everything here works on one float32 matrix side at a time and uses full-precision matmuls
(``Precision.HIGHEST``) so that GPUs do not silently fall back to TF32. ``nu`` may be one second
moment or a tuple of them (Adam's ``nu`` and AMSGrad's ``nu_max``): each is permuted alike.

Notation (docs/algorithms.md section 2): a side's basis ``Q`` has one column per eigenvector, ordered by
*descending* eigenvalue; ``S`` is that side's statistic (``L = E[G G^T]`` or ``R = E[G^T G]`` for
the second-order source; ``M M^T`` or ``M^T M`` of the momentum for the first-order source).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

HIGHEST = jax.lax.Precision.HIGHEST
COLD_START_JITTER = 1e-30


def mm(a, b, precision=HIGHEST):
  """Matrix product, at full float32 precision unless told otherwise."""
  return jnp.matmul(a, b, precision=precision)


def _take(nu, order, axis):
  """``nu`` (an array or a tuple of them: every second moment of the inner state) permuted along
  ``axis``."""
  return jax.tree.map(lambda v: jnp.take(v, order, axis=axis), nu)


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


ORTHONORMALIZATIONS = ("qr", "cholesky_qr")
CHOLESKY_QR_TOLERANCE = 1e-3  # max |Q^T Q - I| accepted before falling back to QR


def orthonormalize(a, method: str = "qr"):
  """The complete ``Q`` (k, k) of ``a = QR`` for ``a`` (k, n): one step of orthogonal (power)
  iteration. Its first j columns span ``a``'s first j columns (j <= min(k, n)), whichever
  ``method`` (``ORTHONORMALIZATIONS``) computes it; the rest (n < k) complete the basis."""
  if method == "cholesky_qr":
    return cholesky_qr(a)
  return jnp.linalg.qr(a, mode="complete")[0]


def _cholesky_qr_passes(a, passes: int):
  """(q, good): shifted Cholesky-QR of a square or wide ``a`` (k, n >= k) and whether ``q`` is
  finite and orthonormal to ``CHOLESKY_QR_TOLERANCE``. Batched over leading axes."""
  k = a.shape[-2]
  a = a[..., :k]  # the complete Q of a wide matrix depends only on its first k columns
  eye = jnp.eye(k, dtype=a.dtype)
  shift = 11.0 * (k * k + k * (k + 1)) * jnp.finfo(a.dtype).eps * jnp.sum(a * a, axis=(-2, -1))
  t = lambda x: jnp.swapaxes(x, -1, -2)
  q = a
  for i in range(passes):
    gram = mm(t(q), q) + (shift[..., None, None] * eye if i == 0 else 0.0)
    r = t(jnp.linalg.cholesky(gram))  # upper triangular, gram = R^T R
    q = t(jax.scipy.linalg.solve_triangular(r, t(q), trans="T", lower=False))  # q R^{-1}
  error = jnp.max(jnp.abs(mm(t(q), q) - eye), axis=(-2, -1))
  return q, jnp.all(jnp.isfinite(q), axis=(-2, -1)) & (error < CHOLESKY_QR_TOLERANCE)


def _householder(a):
  return jnp.linalg.qr(a, mode="complete")[0]


def _cholesky_qr_checked(a, passes: int = 3):
  """Cholesky-QR with the Householder fallback, per matrix (``lax.cond``)."""
  q, good = _cholesky_qr_passes(a, passes)
  return jax.lax.cond(good, lambda: q, lambda: _householder(a))


@jax.custom_batching.custom_vmap
def _cholesky_qr_batchable(a):
  return _cholesky_qr_checked(a)


@_cholesky_qr_batchable.def_vmap
def _cholesky_qr_square_batched(axis_size, in_batched, a):
  """Under ``vmap``: Householder QR of the whole batch only if some matrix needs the fallback
  (``lax.cond`` on the batch's verdict), instead of the per-matrix ``cond`` that ``vmap`` would
  turn into a ``select`` computing QR for every matrix on every call."""
  del axis_size
  if not in_batched[0]:
    return _cholesky_qr_batchable(a), False
  q, good = _cholesky_qr_passes(a, 3)
  fallback = lambda: jnp.where(good[:, None, None], q, jax.vmap(_householder)(a))
  return jax.lax.cond(jnp.all(good), lambda: q, fallback), True


@jax.custom_jvp
def _cholesky_qr_square(a):
  """The batched-cond version for evaluation; derivatives from the per-matrix one (``custom_vmap``
  has no rule for linearisation, so reverse mode would fail without this)."""
  return _cholesky_qr_batchable(a)


@_cholesky_qr_square.defjvp
def _cholesky_qr_square_jvp(primals, tangents):
  return jax.jvp(_cholesky_qr_checked, primals, tangents)


def cholesky_qr(a, passes: int = 3):
  """``Q`` of ``a = QR`` from matmuls, Cholesky factors and triangular solves (no Householder QR).

  Shifted Cholesky-QR3 (Fukaya, Kannan, Nakatsukasa, Yamamoto, Yanagisawa, SIAM J. Sci. Comput.
  2020): ``G = A^T A + s I`` with ``s = 11 (k^2 + k (k + 1)) u ||A||_F^2``, ``R = chol(G)^T``,
  ``A <- A R^{-1}``, then two unshifted passes. Each ``R`` is upper triangular, so column j of Q
  stays in the span of ``a``'s first j + 1 columns, as with QR; only column signs may differ (the
  rotation re-expresses its moments exactly in any new basis). A tall ``a`` (k, n < k; the first-order
  bilateral step of a non-square matrix) needs k - n completing columns, and the update depends on
  which: it uses QR, whose completion the paper's code has. A result that is not finite or not
  orthonormal to ``CHOLESKY_QR_TOLERANCE`` (``a`` numerically rank-deficient: nothing spans the
  missing directions) falls back to Householder QR under ``lax.cond``; under ``vmap`` the cond is
  taken once for the whole batch (QR runs only when some matrix needs it).
  """
  k, n = a.shape
  if n < k:  # tall: the completing columns are Householder's choice (the paper's), so QR it is
    return _householder(a)
  if passes != 3:
    return _cholesky_qr_checked(a, passes)
  return _cholesky_qr_square(a)


def warm_refresh_second(q, stat, nu, axis, method: str = "qr"):
  """Warm refresh of one side from its second-order statistic.

  ``lam = diag(Q^T S Q)``; sort descending; permute ``nu`` along ``axis``; ``Q <- qr(S Q).Q``.

  Returns:
    (new basis, permuted nu).
  """
  sq = mm(stat, q)
  order = descending_order(q, sq)
  return orthonormalize(sq[:, order], method), _take(nu, order, axis)  # S (Q P) = (S Q) P


def first_order_bases(m, ql, qr, nu, step="paper", method: str = "qr"):
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
    ql, mtq, nu = ql[:, order], mtq[:, order], _take(nu, order, 0)
  if qr is not None:
    mq = mm(m, qr)  # (m, n)
    order = jnp.argsort(-jnp.sum(mq * mq, axis=0), stable=True)
    qr, mq, nu = qr[:, order], mq[:, order], _take(nu, order, 1)
  if ql is not None and qr is not None:
    return orthonormalize(mq, method), orthonormalize(mtq, method), nu
  if ql is not None:
    if step == "power":
      return orthonormalize(mm(m, mtq), method), None, nu
    cols = jnp.argsort(-jnp.sum(m * m, axis=0), stable=True)
    return orthonormalize(m[:, cols], method), None, nu
  if qr is not None:
    if step == "power":
      return None, orthonormalize(mm(m.T, mq), method), nu
    rows = jnp.argsort(-jnp.sum(m * m, axis=1), stable=True)
    return None, orthonormalize(m[rows, :].T, method), nu
  return ql, qr, nu

import jax
import jax.extend
import jax.numpy as jnp
import numpy as np

from rotation import eigenbasis as eb


def _psd(n, ratio, seed):
  rng = np.random.default_rng(seed)
  vecs = np.linalg.qr(rng.normal(size=(n, n)))[0]
  vals = ratio ** -np.arange(n, dtype=np.float64)  # eigenvalue gaps of `ratio`
  return vecs @ np.diag(vals) @ vecs.T, vecs


def test_eigh_descending_handles_zero_and_rank_deficient():
  q = np.asarray(eb.eigh_descending(jnp.zeros((5, 5))))
  np.testing.assert_allclose(q.T @ q, np.eye(5), atol=1e-6)
  g = np.random.default_rng(0).normal(size=(5, 2))
  q = np.asarray(eb.eigh_descending(jnp.asarray(g @ g.T, jnp.float32)))
  np.testing.assert_allclose(q.T @ q, np.eye(5), atol=1e-5)
  vals = np.diag(q.T @ g @ g.T @ q)
  assert np.all(np.diff(vals) <= 1e-5) and vals[2:].max() < 1e-5


def test_warm_refresh_converges_to_eigh_basis_of_fixed_statistic():
  stat, vecs = _psd(6, ratio=4.0, seed=1)
  rng = np.random.default_rng(2)
  q = jnp.asarray(np.linalg.qr(rng.normal(size=(6, 6)))[0], jnp.float32)
  nu = jnp.asarray(np.arange(36.0).reshape(6, 6), jnp.float32)
  step = jax.jit(lambda q, nu: eb.warm_refresh_second(q, jnp.asarray(stat, jnp.float32), nu, axis=0))
  errors = []
  for _ in range(12):
    q, nu = step(q, nu)
    errors.append(np.abs(np.abs(np.asarray(q).T @ vecs) - np.eye(6)).max())
  assert errors[-1] < 1e-3, errors
  assert errors[5] < errors[0]
  # nu rows are only permuted, never mixed.
  assert sorted(map(tuple, np.asarray(nu))) == sorted(map(tuple, np.arange(36.0).reshape(6, 6)))


def test_descending_order_sorts_by_rayleigh_quotient():
  stat = np.diag([1.0, 5.0, 3.0])
  q = jnp.eye(3)
  order = eb.descending_order(q, eb.mm(jnp.asarray(stat, jnp.float32), q))
  np.testing.assert_array_equal(order, [1, 2, 0])


def test_first_order_power_steps_recover_singular_vectors():
  rng = np.random.default_rng(3)
  u = np.linalg.qr(rng.normal(size=(5, 5)))[0]
  v = np.linalg.qr(rng.normal(size=(7, 7)))[0]
  m = u @ np.diag([8.0, 4.0, 2.0, 1.0, 0.5]) @ v[:, :5].T
  ql, qr = jnp.eye(5), jnp.eye(7)
  nu = jnp.zeros((5, 7))
  for _ in range(30):
    ql, qr, nu = eb.first_order_bases(jnp.asarray(m, jnp.float32), ql, qr, nu)
  np.testing.assert_allclose(np.abs(np.asarray(ql).T @ u), np.eye(5), atol=1e-3)
  np.testing.assert_allclose(np.abs(np.asarray(qr)[:, :5].T @ v[:, :5]), np.eye(5), atol=1e-3)


def test_first_order_unilateral_steps():
  """Unilateral, both steps find the left singular vectors of a fixed momentum; the paper's step
  in one go from M's sorted columns, the power step by iterating from any start."""
  rng = np.random.default_rng(4)
  u = np.linalg.qr(rng.normal(size=(5, 5)))[0]
  v = np.linalg.qr(rng.normal(size=(9, 9)))[0]
  m = jnp.asarray(u @ np.diag([8.0, 4.0, 2.0, 1.0, 0.5]) @ v[:, :5].T, jnp.float32)
  paper, none, _ = eb.first_order_bases(m, jnp.eye(5), None, jnp.zeros((5, 9)), "paper")
  assert none is None
  cols = np.argsort(-np.sum(np.asarray(m) ** 2, 0), kind="stable")
  expected = np.linalg.qr(np.asarray(m)[:, cols], mode="complete")[0]
  np.testing.assert_allclose(np.abs(np.asarray(paper)), np.abs(expected), atol=1e-5)
  ql = jnp.eye(5)
  for _ in range(40):
    ql, _, _ = eb.first_order_bases(m, ql, None, jnp.zeros((5, 9)), "power")
  np.testing.assert_allclose(np.abs(np.asarray(ql).T @ u), np.eye(5), atol=1e-3)


def _nested_spans_agree(a, atol):
  """Both orthonormalisations: orthonormal, and Q_qr^T Q_chol is diagonal with entries +-1 on the
  columns that ``a`` spans (the same nested subspaces, up to column signs)."""
  a = jnp.asarray(a, jnp.float32)
  q_qr = np.asarray(eb.orthonormalize(a, "qr"))
  q_ch = np.asarray(jax.jit(eb.cholesky_qr)(a))
  k = min(a.shape)
  np.testing.assert_allclose(q_ch.T @ q_ch, np.eye(a.shape[0]), atol=1e-5)
  np.testing.assert_allclose(np.abs(np.diag(q_qr.T @ q_ch))[:k], 1.0, atol=atol)


def test_cholesky_qr_spans_the_subspaces_of_qr():
  rng = np.random.default_rng(3)
  for shape in ((16, 16), (8, 20), (20, 8)):  # square, wide, tall (QR itself)
    _nested_spans_agree(rng.normal(size=shape), atol=1e-5)
  stat, _ = _psd(24, ratio=1.8, seed=4)  # eigenvalues spread over 1e6: S Q is ill-conditioned
  q0 = np.linalg.qr(rng.normal(size=(24, 24)))[0]
  _nested_spans_agree(stat @ q0, atol=1e-4)


def test_cholesky_qr_falls_back_to_qr_when_rank_deficient():
  a = np.random.default_rng(5).normal(size=(8, 8))
  a[:, 3] = 0.0  # no matmul of a spans a fourth direction: Cholesky-QR fails, QR completes the basis
  q = np.asarray(jax.jit(eb.cholesky_qr)(jnp.asarray(a, jnp.float32)))
  np.testing.assert_allclose(q, np.asarray(eb.orthonormalize(jnp.asarray(a, jnp.float32))), atol=1e-6)


def _primitives(jaxpr, outside_cond):
  """Primitive names of ``jaxpr`` and its sub-jaxprs (those of ``cond`` branches too, unless
  ``outside_cond``)."""
  names = set()
  for eqn in jaxpr.eqns:
    names.add(eqn.primitive.name)
    if not (outside_cond and eqn.primitive.name == "cond"):
      for sub in jax.extend.core.jaxprs_in_params(eqn.params):
        names |= _primitives(sub, outside_cond)
  return names


def test_batched_cholesky_qr_runs_householder_only_when_a_matrix_needs_it():
  rng = np.random.default_rng(6)
  a = jnp.asarray(rng.normal(size=(5, 8, 8)), jnp.float32)
  jaxpr = jax.make_jaxpr(jax.vmap(eb.cholesky_qr))(a).jaxpr
  householder = {"householder_product", "geqrf", "geqp3", "qr"}
  assert not householder & _primitives(jaxpr, outside_cond=True)  # the common path: no QR
  assert householder & _primitives(jaxpr, outside_cond=False)  # the fallback branch has it
  # and the numbers: the batch equals one matrix at a time, with a rank-deficient member too
  bad = np.asarray(a).copy()
  bad[2][:, 3] = 0.0
  for batch in (a, jnp.asarray(bad)):
    got = np.asarray(jax.jit(jax.vmap(eb.cholesky_qr))(batch))
    want = np.stack([np.asarray(jax.jit(eb.cholesky_qr)(m)) for m in batch])
    np.testing.assert_allclose(got, want, atol=1e-5)


def test_cholesky_qr_differentiates_in_reverse_mode_for_every_shape():
  """``jax.grad`` through ``cholesky_qr`` (square, wide and tall inputs, alone and under ``vmap``)
  against central finite differences along random directions, in float64."""
  rng = np.random.default_rng(7)
  loss = lambda x: jnp.sum(eb.cholesky_qr(x) ** 3)
  with jax.enable_x64(True):
    for shape in ((4, 4), (4, 6), (5, 4)):
      x = jnp.asarray(rng.normal(size=shape))
      grad = np.asarray(jax.jit(jax.grad(loss))(x))
      for _ in range(3):
        d = rng.normal(size=shape)
        fd = (float(loss(x + 1e-6 * d)) - float(loss(x - 1e-6 * d))) / 2e-6
        np.testing.assert_allclose(np.sum(grad * d), fd, rtol=1e-5, atol=1e-8)
    xs = jnp.asarray(rng.normal(size=(3, 4, 4)))
    batched = np.asarray(jax.vmap(jax.grad(loss))(xs))
    np.testing.assert_allclose(batched, np.stack([np.asarray(jax.grad(loss)(x)) for x in xs]), rtol=1e-10)

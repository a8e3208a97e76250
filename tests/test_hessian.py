import jax.numpy as jnp
import numpy as np

from experiments import hessian


def _block(h):
  """HVP of 0.5 vec(W)^T H vec(W) for a (2, 3) matrix W (row-major vec)."""
  h = jnp.asarray(h, jnp.float32)
  return lambda z: (h @ z.reshape(-1)).reshape(z.shape)


def test_one_one_norm_matches_exact_values():
  rng = np.random.default_rng(0)
  a = rng.normal(size=(6, 6))
  h = a @ a.T
  total, diag = hessian.one_one_norm(_block(h), (2, 3), samples=4000)
  np.testing.assert_allclose(total, np.abs(h).sum(), rtol=0.1)
  np.testing.assert_allclose(diag, np.abs(np.diag(h)).sum(), rtol=0.15)
  m = hessian.misalignment(total, diag)
  exact = 1 - np.abs(np.diag(h)).sum() / np.abs(h).sum()
  assert abs(m - exact) < 0.1


def test_diagonal_block_is_aligned_and_rotation_is_applied():
  h = np.diag(np.arange(1.0, 7.0))
  total, diag = hessian.one_one_norm(_block(h), (2, 3), samples=2000)
  assert hessian.misalignment(total, diag) < 0.05
  # The same Hessian seen through a random rotation is misaligned.
  rng = np.random.default_rng(1)
  u = jnp.asarray(np.linalg.qr(rng.normal(size=(2, 2)))[0], jnp.float32)
  v = jnp.asarray(np.linalg.qr(rng.normal(size=(3, 3)))[0], jnp.float32)
  total_r, diag_r = hessian.one_one_norm(_block(h), (2, 3), basis=(u, v), samples=2000)
  assert hessian.misalignment(total_r, diag_r) > 0.3


def test_gradient_bases_diagonalise_the_gradient_statistics():
  params = {"w": jnp.ones((3, 4))}
  batches = [jnp.asarray(np.random.default_rng(i).normal(size=(3, 4)), jnp.float32) for i in range(5)]
  loss = lambda p, b: jnp.sum(p["w"] * b)  # gradient = the batch
  u, v = hessian.gradient_bases(loss, params, ("w",), batches)
  left = sum(np.asarray(b) @ np.asarray(b).T for b in batches)
  rotated = np.asarray(u).T @ left @ np.asarray(u)
  assert np.abs(rotated - np.diag(np.diag(rotated))).max() < 1e-4 * np.abs(left).max()

"""The Hessian misalignment diagnostic on synthetic quadratics with known Hessians."""

import re

import jax.numpy as jnp
import numpy as np

from experiments import cli
from experiments.studies import hessian

SHAPE = (6, 8)


def _block(h):
  """HVP of 0.5 vec(W)^T H vec(W) for a matrix W of SHAPE (row-major vec)."""
  h = jnp.asarray(h, jnp.float32)
  return lambda z: (h @ z.reshape(-1)).reshape(z.shape)


def _orth(rng, d):
  return np.linalg.qr(rng.normal(size=(d, d)))[0]


def _kronecker_quadratic(rng):
  """H = A (x) B with known eigenbases (U_A, U_B): f(W) = 0.5 tr(W^T A W B)."""
  ua, ub = _orth(rng, SHAPE[0]), _orth(rng, SHAPE[1])
  a = ua @ np.diag(np.geomspace(10, 0.1, SHAPE[0])) @ ua.T
  b = ub @ np.diag(np.geomspace(5, 0.2, SHAPE[1])) @ ub.T
  return np.kron(a, b), (jnp.asarray(ua, jnp.float32), jnp.asarray(ub, jnp.float32))


def test_exact_block_recovers_the_hessian_in_any_basis():
  rng = np.random.default_rng(0)
  h, (ua, ub) = _kronecker_quadratic(rng)
  np.testing.assert_allclose(hessian.exact_block(_block(h), SHAPE), h, rtol=1e-5, atol=1e-5)
  rotated = hessian.exact_block(_block(h), SHAPE, (ua, ub))
  q = np.kron(np.asarray(ua, np.float64), np.asarray(ub, np.float64))
  np.testing.assert_allclose(rotated, q.T @ h @ q, atol=1e-4)


def test_zero_for_diagonal_and_near_one_for_random_rotation():
  rng = np.random.default_rng(1)
  h, basis = _kronecker_quadratic(rng)
  exact = lambda b: hessian.block_misalignment(_block(h), SHAPE, b)
  assert exact(basis)[1] < 1e-3  # in its Kronecker eigenbasis the block is diagonal
  assert exact(None)[1] > 0.8 and exact(hessian.random_basis(SHAPE))[1] > 0.8
  diag = np.diag(np.geomspace(10, 0.1, 48))
  assert hessian.block_misalignment(_block(diag), SHAPE)[1] == 0.0
  # Normalised (1,1)-norm ||H||_11 / (N ||H||_F): <= 1/sqrt(N) when diagonal, high when dense.
  assert exact(basis)[2] <= 1 / np.sqrt(48) + 1e-6 < 0.3 < exact(hessian.random_basis(SHAPE))[2]
  dense = np.random.default_rng(5).normal(size=(48, 48))
  dense = dense + dense.T
  np.testing.assert_allclose(hessian.block_misalignment(_block(dense), SHAPE)[2], np.sqrt(2 / np.pi),
                             rtol=0.1)


def test_estimator_matches_exact_and_corrects_the_abs_bias():
  rng = np.random.default_rng(2)
  h, basis = _kronecker_quadratic(rng)
  for b in (None, basis):
    total, diag, fro = hessian.exact_norms(hessian.exact_block(_block(h), SHAPE, b))
    est_total, est_diag, est_fro = hessian.one_one_norm(_block(h), SHAPE, b, samples=2000)
    np.testing.assert_allclose(est_total, total, rtol=0.05)
    np.testing.assert_allclose(est_fro, fro, rtol=0.05)
    assert abs(hessian.misalignment(est_total, est_diag) - hessian.misalignment(total, diag)) < 0.03
  # |mean| of a noisy Hutchinson estimate overstates a dense block's diagonal; the corrected one
  # does not (64 probes, as the diagnostic uses on large blocks).
  q = _orth(rng, 48)
  h = q @ np.diag(np.linspace(-1, 1, 48)) @ q.T  # dense, small diagonal (an indefinite Hessian)
  total, diag, _ = hessian.exact_norms(h)
  _, corrected, _ = hessian.one_one_norm(_block(h), SHAPE, None, samples=64)
  rade = np.random.default_rng(3).choice([-1.0, 1.0], size=(64, 48))
  naive = np.abs(np.mean(rade * (rade @ h.T), axis=0)).sum()
  assert naive > 1.2 * diag and abs(corrected - diag) < abs(naive - diag)


def test_gradient_bases_diagonalise_the_gradient_statistics():
  params = {"w": jnp.ones((3, 4))}
  batches = [jnp.asarray(np.random.default_rng(i).normal(size=(3, 4)), jnp.float32) for i in range(5)]
  loss = lambda p, b: jnp.sum(p["w"] * b)  # gradient = the batch
  u, v = hessian.gradient_bases(loss, params, ("w",), batches)
  left = sum(np.asarray(b) @ np.asarray(b).T for b in batches)
  rotated = np.asarray(u).T @ left @ np.asarray(u)
  assert np.abs(rotated - np.diag(np.diag(rotated))).max() < 1e-4 * np.abs(left).max()


def test_bad_run_folders_are_one_line_errors(tmp_path, capsys):
  (tmp_path / "sweep" / "runs" / "some-run").mkdir(parents=True)
  (tmp_path / "file.txt").write_text("x")
  cases = [(tmp_path / "nope", "run folder .*nope' does not exist"),
           (tmp_path / "file.txt", "file.txt' is a file; give a run folder"),
           (tmp_path / "sweep", "is a sweep's results folder; give one of its 1 runs, e.g. .*runs/some-run"),
           (tmp_path / "sweep" / "runs" / "some-run", "holds no finished run")]
  for path, match in cases:
    assert cli.run(hessian.main, [str(path)]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and re.search(match, err), err
  # a folder as the table's file, a missing folder, bad numbers: refused before any run is read
  bad = [(["--markdown", str(tmp_path)], "--markdown .* is a folder, not a file"),
         (["--json", str(tmp_path / "no" / "h.json")], "--json .*the folder .*no' does not exist"),
         (["--markdown", str(tmp_path / "no" / "h.md")], "--markdown .*the folder .*no' does not exist"),
         (["--exact-limit", "-3"], "--exact-limit must be >= 0, got -3"),
         (["--samples", "0"], "--samples must be >= 1, got 0")]
  for flags, match in bad:
    assert cli.run(hessian.main, [str(tmp_path / "nope"), *flags]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and re.search(match, err), err


def test_table_has_one_row_per_run_and_matrix():
  row = {"matrix": "blocks/0/attn/q/kernel", "shape": [32, 32], "basis": "optimizer state",
         "method": "exact", "norm_original": 2.0, "norm_rotated": 1.0}
  for key, base in (("misalignment", 0.9), ("normalised", 0.4)):
    row.update({f"{key}_original": base, f"{key}_rotated": base / 2, f"{key}_random": base + 0.05})
  lines = hessian.table({"run-a": [row, dict(row, matrix="blocks/0/mlp/fc1/kernel")], "run-b": [row]})
  assert len(lines) == 2 + 3
  assert [line.split(" | ")[:2] for line in lines[2:]] == [
      ["| run-a", "blocks/0/attn/q/kernel"], ["| run-a", "blocks/0/mlp/fc1/kernel"],
      ["| run-b", "blocks/0/attn/q/kernel"]]
  assert lines[2].endswith("| 0.4000 / 0.2000 / 0.4500 |")

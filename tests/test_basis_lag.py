"""The basis-lag measurement (experiments/studies/basis_lag.py) on matrices with known answers."""

import jax.numpy as jnp
import numpy as np
import pytest

from experiments.studies import basis_lag


def _rot(theta):
  return np.array([[np.cos(theta), -np.sin(theta)], [np.sin(theta), np.cos(theta)]])


def test_off_diagonal_fraction_of_a_rotated_diagonal_matrix():
  a, b, theta = 3.0, 1.0, 0.3
  s = _rot(theta) @ np.diag([a, b]) @ _rot(theta).T
  assert basis_lag.off_diagonal(_rot(theta), s) == pytest.approx(0.0, abs=1e-12)
  want = np.sqrt(2) * abs(a - b) * abs(np.sin(theta) * np.cos(theta)) / np.sqrt(a * a + b * b)
  assert basis_lag.off_diagonal(np.eye(2), s) == pytest.approx(want, rel=1e-12)
  assert basis_lag.off_diagonal(np.eye(2), np.zeros((2, 2))) == 0.0


def test_checkpoint_lag_motion_noise_and_coordinates():
  rng = np.random.default_rng(0)
  grads = {"a": [jnp.asarray(rng.normal(size=(3, 2))) for _ in range(4)]}
  params = {"a": jnp.zeros((3, 2)), "b": jnp.zeros(2)}
  labels = {"a": 1, "b": 0}
  grad_fn = lambda p, j: {"a": grads["a"][j], "b": jnp.zeros(2)}
  g = np.stack([np.asarray(x) for x in grads["a"]])
  left, right = np.einsum("tij,tkj->ik", g, g) / 4, np.einsum("tji,tjk->ik", g, g) / 4
  exact = (np.linalg.eigh(left)[1], np.linalg.eigh(right)[1])
  # the exact eigenbasis in use: no lag; the same micro-batches as the floor: no noise
  values, eig = basis_lag.checkpoint(grad_fn, params, {"a": exact, "b": None}, labels, [0, 1, 2, 3],
                                     [0, 1, 2, 3], previous={})
  assert list(values) == [1]  # only stage 1 holds a rotated matrix
  assert values[1]["lag"] == pytest.approx(0.0, abs=1e-6)
  assert values[1]["noise"] == pytest.approx(0.0, abs=1e-6)
  assert values[1]["motion"] is None  # no previous checkpoint
  coords = np.mean([basis_lag.off_diagonal(np.eye(3), left), basis_lag.off_diagonal(np.eye(2), right)])
  assert values[1]["coordinates"] == pytest.approx(coords)
  # coordinate bases in use and as the previous checkpoint's eigenbasis: lag = motion = coordinates
  eye = (np.eye(3), np.eye(2))
  values, _ = basis_lag.checkpoint(grad_fn, params, {"a": eye, "b": None}, labels, [0, 1, 2, 3], [0, 1],
                                   previous={0: eye})
  assert values[1]["lag"] == pytest.approx(coords) and values[1]["motion"] == pytest.approx(coords)
  assert values[1]["noise"] > 1e-3  # two micro-batches' eigenbasis is not the four's
  np.testing.assert_allclose(np.abs(eig[0][0]), np.abs(exact[0]), rtol=1e-5)  # exact: float32 stats


def test_summary_averages_past_the_burn_in():
  run = {"config": {"steps": 1000}, "points": [
      {"step": s, "stages": {"0": {"lag": s / 1000, "motion": None if s == 100 else 0.5, "noise": 0.1,
                                   "coordinates": 0.9}}} for s in range(100, 1001, 100)]}
  got = basis_lag.summarise(run)["0"]
  assert got["lag"] == pytest.approx(np.mean([s / 1000 for s in range(300, 1001, 100)]))
  assert got["motion"] == 0.5 and got["noise"] == 0.1 and got["coordinates"] == 0.9


def test_the_summary_alone_rebuilds_the_report(tmp_path):
  points = [{"step": s, "stages": {str(k): {"lag": 0.5 + 0.01 * k, "motion": None if s == 100 else 0.4,
                                             "noise": 0.2, "coordinates": 0.9} for k in range(2)}}
            for s in range(100, 501, 100)]
  measured = [{"decay": d, "config": {"stages": 2, "seed": 0, "steps": 500}, "points": points, "seconds": 1.0}
              for d in (0.999, 0.9)]
  first = basis_lag.write(measured, tmp_path, "cmd")
  report = (tmp_path / "report.md").read_text()
  assert "| 0.9 | 10 | 1 (0) | 0.510 | 0.400 | 0.200 | 0.900 | 1.27 |" in report
  again = basis_lag.rebuild(tmp_path)
  assert again == first and (tmp_path / "report.md").read_text() == report

"""The controlled misalignment x delay study (experiments/studies/misalignment.py) on a tiny grid."""

import numpy as np
import pytest

from experiments.studies import misalignment as mis

TINY = mis.Study(dim=4, thetas=(0.0, 45.0), taus=(0, 2), seeds=(0,), lrs=(0.01, 0.04, 0.16), steps=80)


def test_the_problem_and_the_delay_is_the_librarys():
  a, b, qa, qb, _ = mis.problem(TINY, 45.0)  # (the identity check: test_a_tiny_study_...)
  np.testing.assert_allclose(qa.T @ a @ qa, np.diag(np.diag(qa.T @ a @ qa)), atol=1e-10)
  assert abs(np.degrees(np.max(np.abs(np.angle(np.linalg.eigvals(qa))))) - 45.0) < 1e-6  # the angle
  # the delayed run's first tau losses are W_0's: the pipeline applied the gradient tau steps late
  curves = mis.trajectories(TINY, "adam", 0.0, 2)
  undelayed = mis.trajectories(TINY, "adam", 0.0, 0)
  assert curves.shape == (3, 1, 78) and undelayed.shape == (3, 1, 80)
  np.testing.assert_allclose(curves[:, :, :2], undelayed[:, :, :2], rtol=1e-5)  # W_1, W_2 before any
  assert not np.allclose(curves[:, :, 5], undelayed[:, :, 5])  # stale gradient applied


def test_misalignment_grows_with_the_angle():
  m = [mis.misalignment_of(TINY, t) for t in (0.0, 45.0)]
  assert m[0] <= 0.25 + 1e-6 < m[1]  # a diagonal 16 x 16 Hessian: at most 1 / sqrt(16)


def test_steps_cell_and_slope():
  curves = np.array([[[1.0, 0.5, 0.009, 0.001]], [[1.0, 0.9, 0.8, 0.7]]])
  steps = mis.steps_to_target(curves, 0.01)
  assert steps.tolist() == [[2.0], [np.inf]]
  c = mis.cell(mis.Study(lrs=(0.1, 0.2)), steps)
  assert c["lr"] == 0.1 and c["median"] == 2.0 and not c["interior"]
  value, censored = mis.slope([0, 1, 2], [10, 20, 40])
  assert abs(value - np.log(2)) < 1e-12 and not censored
  assert mis.slope([0, 1], [10, np.inf]) == (None, True)
  value, censored = mis.slope([0, 1], [10, np.inf], caps=[40, 40])  # at least 40 at tau = 1
  assert abs(value - np.log(4)) < 1e-12 and censored


def test_a_winning_edge_rate_extends_the_grid_until_interior(monkeypatch):
  """A fake problem whose best rate is 0.4: from the grid (0.05, 0.1) the cell extends upward to
  0.1 x 2^3 = 0.8, where 0.4 is interior."""
  def fake(study, name, theta, tau):
    lrs = np.asarray(study.lrs)[:, None, None]
    rate = 1 - np.abs(np.log2(lrs / 0.4)) / 8  # fastest at 0.4
    return np.broadcast_to(np.exp(-np.arange(50) * rate), (len(study.lrs), 1, 50))
  monkeypatch.setattr(mis, "trajectories", fake)
  got = mis.best_cell(mis.Study(lrs=(0.05, 0.1), seeds=(0,), target=0.01), "adam", 0.0, 0)
  assert got["lr"] == pytest.approx(0.4) and got["interior"]
  assert got["grid"] == pytest.approx([0.05, 0.1, 0.2, 0.4, 0.8])


def test_a_tiny_study_writes_its_table_and_figure(tmp_path):
  small = mis.Study(dim=4, thetas=(0.0,), taus=(0, 1), seeds=(0,), lrs=(0.02, 0.08), steps=40)
  got = mis.run(small, tmp_path)
  assert (tmp_path / "misalignment.png").stat().st_size > 0
  assert got["identity_check"] == 0.0  # Adam and Adam in the identity basis: one trajectory
  assert "| adam | 0 |" in (tmp_path / "report.md").read_text()
  assert set(got["slopes"]) == {f"{n}/0" for n in mis.OPTIMIZERS}
  lagged = mis.Study(dim=4, thetas=(0.0,), taus=(0, 1), seeds=(0,), lrs=(0.02, 0.08), steps=40,
                     optimizers=("adam",), lag=((0.9, 1),))
  got = mis.run(lagged, tmp_path / "lag")
  assert set(got["slopes"]) == {"adam/0", "rotation:0.9:1/0"}
  assert "| rotation:0.9:1 | 0 |" in (tmp_path / "lag" / "report.md").read_text()
  assert all(len(c["grid"]) >= 2 for c in got["cells"].values())


def test_a_file_as_output_folder_is_refused_before_the_study(tmp_path):
  (tmp_path / "file").write_text("")
  with pytest.raises(ValueError, match="--out .* is a file, not a folder"):
    mis.main(["--out", str(tmp_path / "file")])

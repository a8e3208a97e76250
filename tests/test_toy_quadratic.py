import numpy as np
import optax
import pytest

import rotation
from experiments.studies import toy_quadratic as toy


def test_hessians():
  for angle in (0.0, 45.0):
    h = toy.hessian(angle)
    np.testing.assert_allclose(h, h.T)
    np.testing.assert_allclose(np.linalg.eigvalsh(h), toy.EIGS, rtol=1e-9)
  assert abs(toy.hessian(45.0)[0, 1]) > 1  # rotated: off-diagonal curvature


def test_delay_hurts_adam_on_rotated_hessian_and_rotation_recovers():
  h = toy.hessian(45.0)
  adam = lambda: optax.adam(0.05)
  rot = lambda: rotation.basis_rotation(0.05, weight_decay=0.0, refresh_every=5)
  path, adam_fresh, _ = toy.trajectory(adam(), h, delay=0)
  assert path.shape == (201, 2)
  _, adam_stale, against = toy.trajectory(adam(), h, delay=8)
  _, rot_stale, _ = toy.trajectory(rot(), h, delay=8)
  assert adam_stale[-1] > 5 * adam_fresh[-1]
  assert rot_stale[-1] < 0.5 * adam_stale[-1]
  assert 0.0 < against < 1.0


@pytest.mark.parametrize("kw, message", [({"steps": 0}, "steps must be >= 1, got 0"),
                                         ({"delay": -2}, "delay must be >= 0, got -2")])
def test_bad_lengths_are_refused_by_name(kw, message):
  with pytest.raises(ValueError, match=message):
    toy.trajectory(optax.adam(0.1), toy.hessian(0.0), **{"delay": 1, **kw})


def test_a_folder_as_figure_path_is_refused_before_the_runs(tmp_path):
  with pytest.raises(ValueError, match="--out .* is a folder, not a file"):
    toy.main(["--out", str(tmp_path)])

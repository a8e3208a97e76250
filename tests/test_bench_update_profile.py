"""experiments/bench/update_profile.py: XLA's profile of one update, summed per kind of event."""

import jax
import pytest

import rotation
from experiments.bench import update_profile
from experiments.harness import model as model_lib


def test_events_are_summed_per_kind_and_per_call():
  events = [{"ph": "X", "name": "copy.1", "dur": 300}, {"ph": "X", "name": "copy.22", "dur": 100},
            {"ph": "X", "name": "cond", "dur": 1000}, {"ph": "i", "name": "copy.3", "dur": 5000},
            {"ph": "X", "name": "$profiler.py:307 trace", "dur": 9000},
            {"ph": "X", "name": "add_multiply_fusion.205", "dur": 50}]
  assert update_profile.by_kind(events, calls=2) == {
      "copy": (0.2, 1.0), "cond": (0.5, 0.5), "add_multiply_fusion": (0.025, 0.5)}


def test_rotations_update_runs_a_conditional_that_adamws_does_not(capsys):
  got = update_profile.main(["--model", "cpu-tiny", "--calls", "2", "--top", "5"])
  assert "cond" in got["kinds"]["rotation"] and "cond" not in got["kinds"]["adamw"]
  assert all(v > 0 for v in got["wall"].values())
  assert "| kind | adamw ms (events) | rotation ms (events) |" in capsys.readouterr().out
  assert "geqrf" not in got["kinds"]["rotation"]  # no warm refresh due: LAPACK's QR never runs
  with pytest.raises(ValueError, match="--calls, --top and --refresh-every must be >= 1, got 0"):
    update_profile.main(["--calls", "0"])


def test_a_refresh_every_call_runs_one_lapack_qr_per_rotated_side_per_call():
  _, params = model_lib.init(model_lib.CONFIGS["cpu-tiny"])
  state = rotation.basis_rotation(1e-3, weight_dimension_numbers=model_lib.rotation_dims).init(params)
  is_piece = lambda x: isinstance(x, rotation.RotationPiece)
  sides = sum(x.shape[0] for pc in jax.tree.leaves(state, is_leaf=is_piece) if is_piece(pc)
              for x in (pc.left, pc.right) if x is not None)
  got = update_profile.main(["--model", "cpu-tiny", "--calls", "2", "--top", "5", "--refresh-every", "1"])
  # events per call: Householder QR's two LAPACK kernels, once per rotated side
  assert got["kinds"]["rotation"]["geqrf"][1] == got["kinds"]["rotation"]["householder_product"][1] == sides
  assert sides > 2 and "geqrf" not in got["kinds"]["adamw"]

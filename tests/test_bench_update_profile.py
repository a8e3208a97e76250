"""experiments/bench/update_profile.py: XLA's profile of one update, summed per kind of event."""

import pytest

from experiments.bench import update_profile


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
  with pytest.raises(ValueError, match="--calls and --top must be >= 1, got 0"):
    update_profile.main(["--calls", "0"])

"""experiments/bench/refresh_spike.py: the step after the first refresh, under both rules."""

import pytest

from experiments.bench import refresh_spike


def test_the_first_refresh_spikes_under_the_papers_rule_and_not_when_rotated():
  got = refresh_spike.main(["--steps", "2"])
  # Adam's first steps are sign-like: no element beyond the learning rate
  assert [r["max_over_lr"] for r in got["adamw"]] == pytest.approx([1.0, 1.0], rel=1e-2)
  assert got["rotation, permute"][0] == got["rotation, rotate"][0]  # before any warm refresh: one algorithm
  assert got["rotation, permute"][1]["max_over_lr"] > 50 * got["rotation, rotate"][1]["max_over_lr"]
  with pytest.raises(ValueError, match="need steps >= 1"):
    refresh_spike.main(["--steps", "0"])

import numpy as np
import pytest

from rotation import refresh_budget, stage_aware_refresh


@pytest.mark.parametrize("num_stages", [2, 4, 8, 32])
def test_equal_budget_and_ordering(num_stages):
  delays = [num_stages - 1 - k for k in range(num_stages)]
  uniform = stage_aware_refresh(delays, 10, "uniform")
  prop = stage_aware_refresh(delays, 10, "proportional")
  rev = stage_aware_refresh(delays, 10, "reverse")
  assert uniform == (10,) * num_stages
  target = num_stages / 10
  for periods in (prop, rev):
    assert abs(refresh_budget(periods) - target) / target < 0.1, periods
    assert min(periods) >= 1
  # Staler (earlier) stages refresh more often; reverse is the mirror image.
  assert list(prop) == sorted(prop) and prop[0] < prop[-1]
  assert rev == tuple(reversed(prop))


def test_known_periods():
  assert stage_aware_refresh([3, 2, 1, 0], 10) == (6, 8, 12, 25)


@pytest.mark.parametrize("args,match", [
    (([1, 0], 10, "random"), "unknown allocation 'random'"),
    (([1, 0], 0, "uniform"), "refresh_every must be an int >= 1, got 0"),
    (([1, -1], 10, "uniform"), "delays must be"),
])
def test_bad_input(args, match):
  with pytest.raises(ValueError, match=match):
    stage_aware_refresh(*args)


def test_stage_aware_decay_shortens_each_memory_by_its_delay():
  from rotation import stage_aware_decay
  got = stage_aware_decay([15, 7, 3, 1, 0], 0.999)
  memory = [1 / (1 - b) for b in got]
  np.testing.assert_allclose(memory, [1000 / 16, 1000 / 8, 1000 / 4, 1000 / 2, 1000], rtol=1e-9)
  assert got[-1] == pytest.approx(0.999) and list(got) == sorted(got)  # the undelayed stage: the base
  assert stage_aware_decay([0, 0], 0.95) == pytest.approx((0.95, 0.95))  # P = 1 or 2BW-like: unchanged
  # the floor: a memory of 20 steps over 1 + 15 is 1.25 steps, floored at 10 (decay 0.9)
  assert stage_aware_decay([15, 0], 0.95, min_memory=10) == pytest.approx((0.9, 0.95))
  assert stage_aware_decay([3], 0.99, min_memory=1)[0] == pytest.approx(1 - 4 / 100)


@pytest.mark.parametrize("args,match", [
    (([1, 0], 1.0), "shampoo_beta must be in \\[0, 1\\), got 1.0"),
    (([1, 0], 0.99, 0.5), "min_memory must be a number >= 1 \\(steps\\), got 0.5"),
    (([1, -1], 0.99), "delays must be"),
])
def test_stage_aware_decay_refuses_bad_arguments(args, match):
  from rotation import stage_aware_decay
  with pytest.raises(ValueError, match=match):
    stage_aware_decay(*args)

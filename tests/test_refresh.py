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

"""pipeline_sim.schedules: a schedule is a value; its text is what a run records."""

import pytest

import pipeline_sim as ps


@pytest.mark.parametrize("text,value,delays,versions", [
    ("1f1b", ps.OneFOneB(), {1: (0,), 4: (3, 2, 1, 0)}, None),
    ("2bw", ps.TwoBW(), {1: (0,), 4: (1, 1, 1, 1)}, 1),
    ("uniform-3", ps.UniformDelay(3), {1: (3,), 2: (3, 3)}, 3),
])
def test_a_schedule_is_its_text_its_delays_and_what_devices_keep(text, value, delays, versions):
  assert ps.schedule_of(text) == value and ps.schedule_of(value) is value and value.name == text
  for p, expected in delays.items():
    assert value.delays(p) == expected == ps.stage_delays(p, text)
  assert value.batched == (versions is not None)
  if versions is not None:
    assert value.versions(4) == versions


@pytest.mark.parametrize("bad", ["gpipe", "uniform-0", "uniform-", "uniform-x", "2BW", 3, None])
def test_unknown_texts_are_refused_with_the_forms(bad):
  with pytest.raises(ValueError, match=r"unknown pipeline schedule .*; choose from 1f1b, 2bw, uniform-D"):
    ps.schedule_of(bad)


@pytest.mark.parametrize("bad", [0, -1, 1.5, True])
def test_a_uniform_delay_must_be_a_positive_int(bad):
  with pytest.raises(ValueError, match=f"a uniform delay must be an int >= 1, got delay={bad!r}"):
    ps.UniformDelay(bad)


@pytest.mark.parametrize("bad", [0, 2.0, True])
def test_the_stage_count_is_checked(bad):
  with pytest.raises(ValueError, match="number of stages must be an int >= 1"):
    ps.stage_delays(bad, "uniform-2")

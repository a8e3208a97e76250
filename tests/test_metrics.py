import numpy as np
import pytest

from experiments.report import metrics


def test_centred_smoothing_and_iterations_to_target():
  losses = np.array([5.0, 4.0, 3.0, 2.0, 1.0])
  np.testing.assert_allclose(metrics.smooth(losses, 3), [np.nan, 4.0, 3.0, 2.0, np.nan])
  np.testing.assert_allclose(metrics.smooth(losses, 2), [np.nan, 4.0, 3.0, 2.0, np.nan])  # odd width
  assert metrics.iterations_to(losses, 3.0, 3) == 3  # no lag: the value at step 3 is 3
  assert metrics.iterations_to(losses, 0.5, 3) is None  # never reached: reported, not dropped
  assert metrics.iterations_to([np.inf, np.inf], 1.0, 1) is None
  assert metrics.final_smoothed(losses, 3) == 2.0


def _synthetic(slowdown, steps=1200):
  """A noise-free loss curve whose every target is reached ``slowdown`` times later."""
  t = np.arange(1, steps + 1, dtype=float) / slowdown
  return 2.0 + 3.0 * np.exp(-t / 150.0) + 0.5 / (1 + t / 40.0)


@pytest.mark.parametrize("slowdown", [4.0, 2.0])
def test_known_slowdowns_are_recovered_within_one_percent(slowdown):
  """With the paper-like window (60 of 1,200 steps) a trailing average gave 3.72 and 1.95."""
  curves = {("pipedream", 1): _synthetic(1.0), ("pipedream", 16): _synthetic(slowdown),
            ("rotation", 1): _synthetic(1.0), ("rotation", 16): _synthetic(slowdown)}
  rows = {(r["method"], r["stages"]): r for r in metrics.study_table(curves, ["pipedream"], 60)}
  for method in ("pipedream", "rotation"):
    assert abs(rows[(method, 16)]["slowdown_own"] / slowdown - 1) < 0.01
    assert abs(rows[(method, 16)]["slowdown"] / slowdown - 1) < 0.01


def test_study_table_on_synthetic_curves():
  steps = np.arange(1, 101, dtype=float)
  curve = lambda rate: 1.0 + 4.0 / (1 + rate * steps)  # a faster rate reaches any target sooner
  curves = {("pipedream", 1): curve(1.0), ("pipedream", 4): curve(0.25),
            ("nesterov", 1): curve(0.8), ("nesterov", 4): curve(0.3),
            ("rotation", 1): curve(1.2), ("rotation", 4): curve(0.9),
            ("broken", 1): curve(1.0), ("broken", 4): np.full(100, np.inf)}
  rows = {(r["method"], r["stages"]): r for r in metrics.study_table(curves, ["pipedream", "nesterov"], 1)}
  # The best baseline at P = 4 is nesterov (faster than pipedream): its final loss is the target.
  target = 1.0 + 4.0 / (1 + 0.3 * 100)
  assert rows[("rotation", 4)]["best_baseline"] == "nesterov"
  np.testing.assert_allclose(rows[("rotation", 4)]["target"], target)
  assert rows[("nesterov", 4)]["iters"] == 100
  expected_rot = int(np.ceil((4.0 / (target - 1.0) - 1) / 0.9 - 1e-9))
  assert rows[("rotation", 4)]["iters"] == expected_rot
  expected_rot1 = int(np.ceil((4.0 / (target - 1.0) - 1) / 1.2 - 1e-9))
  np.testing.assert_allclose(rows[("rotation", 4)]["slowdown"], expected_rot / expected_rot1)
  np.testing.assert_allclose(rows[("rotation", 4)]["fewer"], 100 * (1 - expected_rot / 100))
  for field in ("iters", "slowdown", "fewer", "final", "slowdown_own", "slowdown_levels", "advantage"):
    assert rows[("broken", 4)][field] is None


def test_the_best_baseline_is_the_lowest_final_smoothed_training_loss():
  """docs/protocol.md's one definition: the lowest final *smoothed* loss at the largest P, not the
  lowest last value (here "a" ends on a dip below "b" but its smoothed end is higher)."""
  a = np.full(50, 2.0)
  a[-1] = 1.5
  b = np.full(50, 1.85)
  curves = {("a", 1): a - 0.5, ("a", 4): a, ("b", 1): b - 0.5, ("b", 4): b}
  assert metrics.final_smoothed(a, 5) == pytest.approx(1.9) and a[-1] < b[-1]
  rows = metrics.study_table(curves, ["a", "b"], 5)
  assert {r["best_baseline"] for r in rows if r["stages"] == 4} == {"b"}
  assert rows[0]["target"] == pytest.approx(1.35)  # P = 1: "b" too (1.35 against 1.4)


def test_a_run_that_diverges_after_the_target_is_never_credited():
  steps = np.arange(1, 201, dtype=float)
  good = 1.0 + 4.0 / (1 + 0.1 * steps)
  late = good.copy()
  late[150:] = np.nan  # reached every target early, then diverged
  curves = {("pipedream", 1): good, ("pipedream", 4): good * 1.01,
            ("rotation", 1): good, ("rotation", 4): late}
  rows = {(r["method"], r["stages"]): r for r in metrics.study_table(curves, ["pipedream"], 5)}
  assert metrics.iterations_to(late, 5.0, 5) is None
  for field in ("iters", "slowdown", "fewer", "final", "iters_own", "slowdown_own", "slowdown_levels"):
    assert rows[("rotation", 4)][field] is None, field
  assert rows[("pipedream", 4)]["iters"] is not None  # the target itself still stands


def test_aggregate_reports_mean_and_range_across_seeds():
  seed_tables = []
  for slowdown in (2.0, 4.0):
    curves = {("pipedream", 1): _synthetic(1.0), ("pipedream", 8): _synthetic(slowdown)}
    seed_tables.append(metrics.study_table(curves, ["pipedream"], 60))
  rows = {(r["method"], r["stages"]): r for r in metrics.aggregate(seed_tables)}
  r = rows[("pipedream", 8)]
  assert r["seeds"] == 2
  np.testing.assert_allclose([r["slowdown_own_lo"], r["slowdown_own"], r["slowdown_own_hi"]],
                             [2.0, 3.0, 4.0], rtol=0.01)
  # A field some seed has no value for is None, not the mean of the others.
  seed_tables[1][0]["iters"] = None
  key = (seed_tables[1][0]["method"], seed_tables[1][0]["stages"])
  assert {(r["method"], r["stages"]): r for r in metrics.aggregate(seed_tables)}[key]["iters"] is None


def _scaled(speed, steps=1200):
  """A noise-free curve that reaches every level ``1 / speed`` times as late as ``_synthetic(1)``."""
  return _synthetic(1.0 / speed, steps)


def test_own_level_slowdown_and_staleness_gain_are_recovered():
  # PipeDream slows down 4x, rotation 2x; rotation is 1.5x faster than PipeDream at P = 1, so at
  # P = 16 it is 1.5 * 4 / 2 = 3x faster: its advantage grows by 2x with staleness.
  curves = {("pipedream", 1): _scaled(1.0), ("pipedream", 16): _scaled(0.25),
            ("rotation", 1): _scaled(1.5), ("rotation", 16): _scaled(0.75),
            ("broken", 1): _scaled(1.0), ("broken", 16): np.full(1200, np.nan)}
  rows = {(r["method"], r["stages"]): r for r in metrics.study_table(
      curves, ["pipedream"], 60, step_seconds={("rotation", 16): 0.5, ("pipedream", 16): 0.25})}
  assert abs(rows[("pipedream", 16)]["slowdown_levels"] / 4.0 - 1) < 0.02
  assert abs(rows[("rotation", 16)]["slowdown_levels"] / 2.0 - 1) < 0.02
  assert abs(rows[("rotation", 1)]["advantage"] / 1.5 - 1) < 0.02
  assert abs(rows[("rotation", 16)]["advantage"] / 3.0 - 1) < 0.02
  assert abs(rows[("rotation", 16)]["staleness_gain"] / 2.0 - 1) < 0.03
  assert rows[("pipedream", 16)]["advantage"] == 1.0 and rows[("rotation", 1)]["staleness_gain"] == 1.0
  # the per-level slowdowns behind the headline: 20 levels, each about 2x
  per_level = rows[("rotation", 16)]["per_level"]
  assert len(per_level["levels"]) == metrics.NUM_LEVELS
  np.testing.assert_allclose(per_level["ratios"], 2.0, rtol=0.06)  # the first levels: a few steps in
  # a diverged run gets nothing and moves no one else's numbers
  assert rows[("broken", 16)]["slowdown_levels"] is None and rows[("broken", 16)]["advantage"] is None
  # the control: percent fewer to the P = 16 target at P = 1 (rotation 1.5x faster: 33% fewer)
  assert abs(rows[("rotation", 1)]["fewer_top"] - 100 * (1 - 1 / 1.5)) < 1.0
  assert abs(rows[("rotation", 16)]["fewer_top"] - 100 * (1 - 1 / 3.0)) < 1.0
  # wall-clock to the target = iterations x seconds per step
  r = rows[("rotation", 16)]
  assert r["seconds"] == r["iters"] * 0.5 and rows[("rotation", 1)]["seconds"] is None


def test_a_methods_headline_depends_on_its_own_runs_only():
  """Adding a method that starts slowly and ends high (which narrowed every method's levels under
  the old common-level headline) leaves rotation's headline unchanged."""
  pair = {("pipedream", 1): _scaled(1.0), ("pipedream", 16): _scaled(0.25),
          ("rotation", 1): _scaled(1.5), ("rotation", 16): _scaled(0.75)}
  slow = np.maximum(_synthetic(8.0), 3.2)
  everyone = {**pair, ("nesterov", 1): _synthetic(3.0), ("nesterov", 16): slow}
  head = lambda curves: {(r["method"], r["stages"]): r["slowdown_levels"]
                         for r in metrics.study_table(curves, ["pipedream", "nesterov"], 60)}
  alone, with_all = head(pair), head(everyone)
  assert alone[("rotation", 16)] == with_all[("rotation", 16)]
  assert alone[("pipedream", 16)] == with_all[("pipedream", 16)]


def test_interval_is_students_t_of_the_mean():
  iv = metrics.interval([1.11, 0.51, 0.81])
  half = 4.302652729911275 * np.std([1.11, 0.51, 0.81], ddof=1) / np.sqrt(3)  # t(0.975, 2 dof)
  np.testing.assert_allclose(iv["ci95"], [0.81 - half, 0.81 + half])
  assert (iv["min"], iv["max"], iv["seeds"]) == (0.51, 1.11, 3)
  assert metrics.interval([2.0])["ci95"] is None  # one seed: no interval
  assert metrics.interval([1.0, None]) is None and metrics.interval([1.0, np.inf]) is None


def test_common_levels_are_reached_by_every_run():
  curves = [_scaled(1.0), _scaled(0.3), np.maximum(_scaled(1.0), 2.5)]  # the last stops at 2.5
  levels = metrics.common_levels(curves, 60, num_levels=10)
  assert len(levels) == 10 and levels.min() >= 2.5 - 1e-9
  for c in curves[:2]:
    assert np.all(np.isfinite(metrics.times_to(c, levels, 60)))
  assert len(metrics.common_levels([np.full(100, 3.0), np.full(100, 1.0)], 5)) == 0  # no shared range

import numpy as np

from experiments import metrics


def test_smooth_and_iterations_to_target():
  losses = np.array([5.0, 4.0, 3.0, 2.0, 1.0])
  np.testing.assert_allclose(metrics.smooth(losses, 2), [np.nan, 4.5, 3.5, 2.5, 1.5])
  assert metrics.iterations_to(losses, 3.5, 2) == 3
  assert metrics.iterations_to(losses, 0.5, 2) is None  # never reached: reported, not dropped
  assert metrics.iterations_to([np.inf, np.inf], 1.0, 1) is None
  assert metrics.final_smoothed(losses, 2) == 1.5


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
  assert rows[("broken", 4)]["iters"] is None and rows[("broken", 4)]["slowdown"] is None
  assert rows[("broken", 4)]["fewer"] is None
  # Against the sync run (pipedream at P = 1): the stale pipedream never gets there.
  assert rows[("pipedream", 4)]["iters_sync"] is None
  assert rows[("pipedream", 1)]["iters_sync"] == 100

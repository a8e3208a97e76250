import jax.numpy as jnp
import numpy as np
import pytest

import pipeline_sim as ps
from pipeline_sim import buffers as rb


def test_stage_delays():
  assert ps.stage_delays(1) == (0,)
  assert ps.stage_delays(4) == (3, 2, 1, 0)
  assert ps.stage_delays(32)[0] == 31
  with pytest.raises(ValueError, match="got 0"):
    ps.stage_delays(0)


def test_split_merge_roundtrip_and_leaf_delays():
  tree = {"a": jnp.ones(2), "b": [jnp.zeros(3), jnp.full(1, 5.0)]}
  labels = {"a": 0, "b": [1, 0]}
  parts = ps.split_stages(tree, labels, 2)
  assert parts[0]["b"][0] is None and parts[1]["a"] is None
  merged = ps.merge_stages(parts, labels)
  for x, y in zip([merged["a"], *merged["b"]], [tree["a"], *tree["b"]]):
    np.testing.assert_array_equal(x, y)
  assert ps.leaf_delays(labels, 2) == {"a": 1, "b": [0, 1]}
  three = {"a": 0, "b": [1, 2]}
  assert ps.leaf_delays(three, 3, "2bw") == {"a": 1, "b": [1, 1]}  # every stage one update behind
  assert ps.leaf_delays(three, 3, "1f1b") == {"a": 2, "b": [1, 0]}
  with pytest.raises(ValueError, match="unknown pipeline schedule"):
    ps.leaf_delays(three, 3, "gpipe")


def test_ring_buffer_versions():
  buf = rb.ring_init({"w": jnp.zeros(2)}, depth=3)
  assert buf["w"].shape == (3, 2)
  for n in range(1, 6):  # write version n at slot n % 3
    buf = rb.ring_write(buf, n % 3, {"w": jnp.full(2, float(n))})
  # Holds versions 3, 4, 5; version n - 2 = 3 is at slot (5 + 1) % 3 = 0.
  np.testing.assert_array_equal(rb.ring_read(buf, (5 + 1) % 3)["w"], [3.0, 3.0])
  assert rb.tree_bytes(buf) == 3 * 2 * 4

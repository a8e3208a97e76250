"""The FSDP state benchmark's byte counts against closed forms, on cpu-tiny over 4 forced devices
(a subprocess: shapes only, nothing compiled or trained)."""

import jax
import numpy as np

from experiments.bench import fsdp_state as bench_fsdp_state
from experiments.harness import model as model_lib


def test_state_bytes_match_closed_forms_and_are_split_over_the_devices():
  got = bench_fsdp_state.measure(4, "cpu-tiny", temporaries=False)
  rows = got["rows"]
  params = model_lib.abstract_params(model_lib.CONFIGS["cpu-tiny"])
  n = sum(x.size for x in jax.tree.leaves(params))
  assert rows["adamw"]["params"] == 4 * n
  assert 8 * n <= rows["adamw"]["state"] <= 8 * n + 64  # two float32 moments (+ a count)
  # The study's setting: two float32 moments and, per rotated kernel (m x n), two bases and two
  # statistics in float32 (cpu-tiny's sides are far under every block and precond limit).
  mask = jax.tree.leaves(model_lib.rotation_mask(params))
  extra = sum(8 * (x.shape[0] ** 2 + x.shape[1] ** 2) for x, r in zip(jax.tree.leaves(params), mask) if r)
  study = rows["rotation, study (no blocks)"]
  assert 8 * n + extra <= study["state"] <= 8 * n + extra + 64
  assert rows["rotation, 1,024 blocks"]["state"] == study["state"]  # no side over 1,024
  bf16 = rows["rotation, 1,024 blocks, bf16"]
  assert bf16["params"] == 2 * n and bf16["state"] < study["state"]
  for name, r in rows.items():
    # every leaf of cpu-tiny has an axis that 4 divides except the counts: an even split
    assert r["state_per_device"] <= r["state"] / 4 + 64, name
  table = bench_fsdp_state.table(got)
  assert table.count("\n") == 1 + len(rows) and "cpu-tiny under FSDP, 4 devices" in table
  ratio = float(table.splitlines()[2].split("|")[2])
  np.testing.assert_allclose(ratio, rows["adamw"]["state"] / rows["adamw"]["params"], atol=0.005)

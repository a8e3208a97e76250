"""The benchmark's memory report against closed-form byte counts (shapes only, nothing trained)."""

import jax
import numpy as np

import pipeline_sim as ps
from experiments.bench import optimizer as bench_optimizer
from experiments.harness import model as model_lib


def test_memory_report_matches_closed_form():
  cfg = model_lib.CONFIGS["cpu-tiny"]
  params = model_lib.abstract_params(cfg)
  mem = bench_optimizer.memory_report("cpu-tiny", num_stages=4)
  n = sum(x.size for x in jax.tree.leaves(params))
  assert mem["params"] == 4 * n
  assert 8 * n <= mem["adamw"] <= 8 * n + 64  # two float32 moments (+ step counters)
  labels = jax.tree.leaves(model_lib.stage_labels(params, 4))
  sizes = [x.size for x in jax.tree.leaves(params)]
  delays = ps.stage_delays(4)
  assert mem["buffers P=4"] == 4 * sum((delays[k] + 1) * s for k, s in zip(labels, sizes))
  # Rotation adds, per rotated kernel (m x n, one block), two bases and two statistics in float32.
  mask = jax.tree.leaves(model_lib.rotation_mask(params))
  extra = sum(8 * (x.shape[0] ** 2 + x.shape[1] ** 2)
              for x, rotated in zip(jax.tree.leaves(params), mask) if rotated)
  assert extra > 0 and 8 * n + extra <= mem["rotation"] <= 8 * n + extra + 64


def test_account_splits_the_step_by_component():
  seconds = {"adamw": 2.0, "rotation, fixed bases": 2.5, "rotation, no warm refresh": 3.0, "rotation": 4.0}
  parts = bench_optimizer.account(seconds)
  assert parts == {"rotations": 0.25, "statistics": 0.25, "refresh": 0.5, "total": 2.0}
  assert 1 + parts["rotations"] + parts["statistics"] + parts["refresh"] == parts["total"]


def test_step_flops_counts_each_block_by_hand():
  """One (6, 20) matrix cut at block 8 into blocks 6 x 8, 6 x 8 and 6 x 4, and one (5, 5) matrix;
  the 1-D leaf is plain Adam. The count, by hand, per block of a x b: 6 (a^2 b + a b^2) every step;
  per refresh and side d, 4 d^3 + 2 a b d of matmuls and 8/3 d^3 of QR, over the period 5."""
  params = {"w": jax.ShapeDtypeStruct((6, 20), "float32"), "s": jax.ShapeDtypeStruct((5, 5), "float32"),
            "b": jax.ShapeDtypeStruct((20,), "float32")}
  got = bench_optimizer.step_flops(params, None, refresh_every=5, block_size=8)
  blocks = [(6, 8), (6, 8), (6, 4), (5, 5)]
  per_step = sum(6 * (a * a * b + a * b * b) for a, b in blocks)
  refresh = sum(4 * d**3 + 2 * a * b * d for a, b in blocks for d in (a, b)) / 5
  qr = sum(8 / 3 * d**3 for a, b in blocks for d in (a, b)) / 5
  assert got["matmuls"] == per_step
  assert abs(got["refresh_matmuls"] - refresh) < 1e-9 and abs(got["qr"] - qr) < 1e-9
  assert abs(got["total"] - (per_step + refresh + qr)) < 1e-9


def test_piece_shapes_and_the_plain_per_step_program_by_hand():
  """The stacks of the (6, 20) matrix cut at block 8 (two 6 x 8 blocks, one 6 x 4) and the (5, 5) one;
  one step of the plain program on one block against NumPy: identity bases and zero moments, so the
  statistics are (1 - b2) G G^T and G^T G and the update is Adam's first step, rotated by I."""
  params = {"w": jax.ShapeDtypeStruct((6, 20), "float32"), "s": jax.ShapeDtypeStruct((5, 5), "float32")}
  assert sorted(bench_optimizer.piece_shapes(params, None, block_size=8)) == [(1, 5, 5), (1, 6, 4), (2, 6, 8)]
  fn, (block,) = bench_optimizer.plain_step([(1, 3, 2)], b2=0.99)
  g = np.asarray(block[0], np.float64)
  (g1, u, v, sl, sr, m, n), = fn(block)
  np.testing.assert_allclose(sl, 0.01 * g @ g.T, rtol=1e-5, atol=1e-12)
  np.testing.assert_allclose(sr, 0.01 * g.T @ g, rtol=1e-5, atol=1e-12)
  np.testing.assert_allclose(m, 0.1 * g, rtol=1e-6)
  np.testing.assert_allclose(n, 0.01 * g**2, rtol=1e-5)
  np.testing.assert_allclose(g1, g + 1e-3 * (0.1 * g) / (np.sqrt(0.01 * g**2) + 1e-8), rtol=1e-5)
  np.testing.assert_array_equal(u, np.eye(3))
  np.testing.assert_array_equal(v, np.eye(2))


def test_allocator_reads_the_mapped_libraries():
  libc = "7f00-7f01 r-xp 0 08:01 1 /usr/lib/x86_64-linux-gnu/libc.so.6\n"
  assert bench_optimizer.allocator(libc) == "libc"
  jemalloc = "7f02-7f03 r-xp 0 08:01 2 /usr/lib/libjemalloc.so.2\n"
  assert bench_optimizer.allocator(libc + jemalloc) == "jemalloc"
  assert bench_optimizer.allocator("/opt/lib/libtcmalloc_minimal.so.4\n") == "tcmalloc"
  assert bench_optimizer.allocator() in ("libc",) + bench_optimizer.ALLOCATORS  # this process's own


def test_minor_faults_per_call_counts_fresh_pages():
  """A call that maps 16 MiB afresh and writes every page faults about once a page (4,096 pages at
  4 KiB); one that writes the same NumPy buffer again faults almost never."""
  import mmap

  size, page = 16 * 2**20, mmap.PAGESIZE

  def fresh(x):
    with mmap.mmap(-1, size) as m:
      for i in range(0, size, page):
        m[i] = 1
    return (x,)

  kept = np.zeros(size, np.uint8)

  def reuse(x):
    kept[::page] = 1
    return (x,)

  assert bench_optimizer.minor_faults_per_call(fresh, (np.float32(0),), calls=3) >= 0.9 * size / page
  assert bench_optimizer.minor_faults_per_call(reuse, (np.float32(0),), calls=3) < 0.05 * size / page

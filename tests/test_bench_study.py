"""The study benchmark's time account and FLOP count (experiments/bench/study.py)."""

import dataclasses

import jax
import numpy as np
import pytest

from experiments.bench import study as bench_study
from experiments.harness import data as data_lib
from experiments.harness import memory as memory_lib
from experiments.harness import model as model_lib
from experiments.harness.config import RunConfig
from experiments.harness.methods import spec


def test_account_splits_a_runs_wall_time_and_reads_older_results():
  result = {"compile_seconds": 10.0, "seconds": 50.0,
            "overhead_seconds": {"build": 3.0, "eval": 2.0, "checkpoint": 4.0}}
  parts = bench_study.account(result, wall=62.0)
  assert parts == {"first chunk": 10.0, "steady": 40.0, "build": 3.0, "eval": 2.0, "checkpoint": 4.0,
                   "other": 3.0}
  older = bench_study.account({"compile_seconds": 10.0, "seconds": 50.0}, wall=62.0)
  assert older["other"] == 12.0 and older["checkpoint"] == 0.0


def test_flops_per_step_is_one_steps_matmul_work():
  config = RunConfig(optimizer=spec("pipedream"), stages=1, model="cpu-tiny", batch_size=4, chunk=10)
  ds = data_lib.default_corpus(32)
  cfg = config.model_config(ds.vocab_size)
  tokens = config.batch_size * cfg.context
  # Forward + backward of the dense layers: 6 FLOPs per token and weight (4 width^2 attention,
  # 2 * 4 width^2 MLP per block, and the unembedding).
  dense = cfg.num_blocks * 12 * cfg.width**2 + cfg.width * cfg.vocab_size
  attention = cfg.num_blocks * 3 * 2 * 2 * config.batch_size * cfg.context**2 * cfg.width
  flops = bench_study.flops_per_step(config, ds)
  assert 6 * tokens * dense + attention <= flops <= 1.5 * (6 * tokens * dense + attention)
  # The chunk's scan body is counted once: the count does not grow with the chunk.
  assert bench_study.flops_per_step(dataclasses.replace(config, chunk=20), ds) == pytest.approx(flops)


def test_the_floor_program_is_sgd_with_the_models_gradient():
  config = RunConfig(optimizer=spec("pipedream"), stages=1, model="cpu-tiny", batch_size=4, chunk=3)
  ds = data_lib.default_corpus(32)
  chunk, params, batches = bench_study.floor_program(config, ds)
  graphdef, _ = model_lib.init(config.model_config(ds.vocab_size), seed=config.seed)
  loss_fn = model_lib.make_loss(graphdef)
  expected = params
  for i in range(config.chunk):  # step by step, outside any scan
    grads = jax.grad(loss_fn)(expected, jax.tree.map(lambda b: b[i], batches))
    expected = jax.tree.map(lambda x, g: x - 1e-3 * g, expected, grads)
  got = chunk(params, batches)
  for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(expected)):
    np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-7)
  # The same forward and backward work as a training step (the optimizer adds little).
  floor_flops = memory_lib.xla_flops(chunk.lower(params, batches))
  assert 0.8 * bench_study.flops_per_step(config, ds) <= floor_flops <= bench_study.flops_per_step(config, ds)

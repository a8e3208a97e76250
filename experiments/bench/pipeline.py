"""``python -m experiments.bench.pipeline``: step time of the emulated pipeline over plain training.

Measured in one run on the CPU preset model with AdamW: ``weight_stashing`` and
``stale_gradients`` at P = 8 and at the largest P the model allows, as ratios to a plain jitted
training step (same scan, no buffers), plus the ring buffers' memory; and with basis rotation
(refresh every 10), the step and compile time at the largest P against P = 1, for one optimizer run
over every stage's leaves (``Pipeline.merged``) and for P per-stage copies of it.
"""

from __future__ import annotations

import argparse
import time

import jax
import jax.numpy as jnp
import optax

import pipeline_sim as ps
import rotation
from experiments.bench import optimizer as bench_optimizer
from experiments.harness import data as data_lib
from experiments.harness import model as model_lib


def _per_chunk(runs: dict, batches, rounds: int) -> dict:
  """Best seconds per chunk of each ``run(state, batches) -> (state, out)``, ``runs[key] = (run,
  state)``, timed in turns (``bench_optimizer.time_interleaved``)."""
  chained = {key: ((lambda state, _, run=run: run(state, batches)), (state, None))
             for key, (run, state) in runs.items()}
  return bench_optimizer.time_interleaved(chained, steps=1, rounds=rounds)


def plain_run(loss_fn, opt):
  """Ordinary training in the same kind of scan: no stages, no buffers."""

  def step(carry, batch):
    params, opt_state = carry
    loss, grads = jax.value_and_grad(loss_fn)(params, batch)
    updates, opt_state = opt.update(grads, opt_state, params)
    return (optax.apply_updates(params, updates), opt_state), loss

  return jax.jit(lambda carry, batches: jax.lax.scan(step, carry, batches), donate_argnums=0)


def main(argv=None):
  parser = argparse.ArgumentParser(prog="python -m experiments.bench.pipeline", description=__doc__)
  parser.add_argument("--chunk", type=int, default=50)
  parser.add_argument("--repeats", type=int, default=5, help="timed chunks per configuration")
  args = parser.parse_args(argv)
  cfg = model_lib.CONFIGS["cpu-deep"]
  graphdef, params = model_lib.init(cfg)
  loss_fn = model_lib.make_loss(graphdef)
  ds = data_lib.default_corpus(cfg.context)
  batches = ds.batches(0, 0, args.chunk, 16, cfg.context)
  n_params = model_lib.count_params(params)
  print(f"backend: {jax.default_backend()}; cpu-deep ({n_params} parameters), chunk {args.chunk}, "
        f"best of {args.repeats} interleaved chunks")
  opt = optax.adamw(1e-3)
  runs = {"plain": (plain_run(loss_fn, opt), (jax.tree.map(jnp.copy, params), opt.init(params)))}
  buffers = {}
  for stages in (8, cfg.num_blocks):
    for mode in ("weight_stashing", "stale_gradients"):
      pipe = ps.Pipeline(loss_fn, opt, model_lib.stage_labels(params, stages), mode)
      state = pipe.init(params)
      runs[(stages, mode)], buffers[(stages, mode)] = (pipe.run, state), pipe.buffer_bytes(state)
  t = _per_chunk(runs, batches, args.repeats)
  for (stages, mode), nbytes in buffers.items():
    print(f"P={stages:<3d} {mode:<16s} step time / plain = {t[(stages, mode)] / t['plain']:.3f}x; "
          f"buffers {nbytes / 2**20:.2f} MiB = {nbytes / (4 * n_params):.2f} x params")
  rot = rotation.basis_rotation(1e-3, refresh_every=10, weight_dimension_numbers=model_lib.rotation_dims)
  deepest = cfg.num_blocks
  runs, compile_s = {}, {}
  # One optimizer runs once over every stage's leaves (Pipeline.merged); P copies are P updates.
  for key, stages, opt in (("P=1", 1, rot), ("merged", deepest, rot), ("per-stage", deepest, rot)):
    pipe = ps.Pipeline(loss_fn, opt, model_lib.stage_labels(params, stages), "weight_stashing",
                       merged=key != "per-stage")
    state = pipe.init(params)
    t0 = time.perf_counter()
    runs[key] = (pipe.run.lower(state, batches).compile(), state)
    compile_s[key] = time.perf_counter() - t0
  t = _per_chunk(runs, batches, args.repeats)
  for key in ("merged", "per-stage"):
    print(f"rotation, weight stashing, {key} optimizer: step time P={deepest} / P=1 = "
          f"{t[key] / t['P=1']:.3f}x; compile time {compile_s[key] / compile_s['P=1']:.2f}x "
          f"({compile_s[key]:.1f}s vs {compile_s['P=1']:.1f}s)")


if __name__ == "__main__":
  from experiments import cli

  cli.exit_process(cli.run(main))

"""``python -m experiments.bench.study``: the study's throughput on this machine, and where a run's
time goes.

Trains a preset's main-study configurations (default: the ``cpu`` preset, its four methods at P = 1
and 16) for ``--seeds`` (default 0 1), one after another in this process and in a fresh results
folder, exactly as ``python -m experiments.sweep`` trains them (``runs.train``), and prints for each
run and in total:

- wall seconds split into the first chunk (compilation and 100 steps), the steady chunks, building
  the state, evaluation, checkpoints (saving and restoring) and the rest (data, logs);
- training steps per wall-second and per CPU-second (this process's CPU time, every thread);
- XLA's FLOPs per step times steps per wall-second, as a fraction of the machine's plain float32
  matmul rate measured in the same run.

The compilation cache starts empty (``--cache fresh``, a temporary folder), so the first seed
compiles every configuration and later seeds reuse its programs, as in a sweep of several seeds;
``--cache off`` compiles every run. Ratios between lines are the point: absolute times depend on
the machine and on whatever else runs on it.
"""

from __future__ import annotations

import argparse
import dataclasses
import pathlib
import tempfile
import time

import jax

from experiments.bench import optimizer as bench_optimizer
from experiments.harness import data as data_lib
from experiments.harness import memory as memory_lib
from experiments.harness import model as model_lib
from experiments.harness import runs
from experiments.harness.config import RunConfig, run_name
from experiments.sweep import presets as presets_lib

PARTS = ("first chunk", "steady", "build", "eval", "checkpoint", "other")


def flops_per_step(config: RunConfig, ds) -> float:
  """XLA's FLOP count of one training step of ``config`` (forward, backward, optimizer), from the
  lowered chunk (no compilation: a scan's body is counted once)."""
  pipe, state, _, _ = runs.build(config, ds)
  context = config.model_config(ds.vocab_size).context
  batches = ds.batches(config.seed, 0, config.chunk, config.batch_size, context)
  return memory_lib.xla_flops(pipe.run.lower(state, batches))


def floor_program(config: RunConfig, ds):
  """``(chunk, params, batches)``: ``chunk(params, batches)`` runs ``config.chunk`` steps of the
  model's forward, backward and a plain SGD update (rate 1e-3) in one scan, and returns the
  parameters: what any training step of this model costs at least, without the pipeline's rings
  and the method's optimizer."""
  cfg = config.model_config(ds.vocab_size)
  graphdef, params = model_lib.init(cfg, seed=config.seed)
  loss_fn = model_lib.make_loss(graphdef, config.moe_loss_weight, config.dtype)
  batches = ds.batches(config.seed, 0, config.chunk, config.batch_size, cfg.context)

  def step(p, batch):
    return jax.tree.map(lambda x, g: x - 1e-3 * g, p, jax.grad(loss_fn)(p, batch)), None

  return jax.jit(lambda p, b: jax.lax.scan(step, p, b)[0]), params, batches


def floor_rate(config: RunConfig, ds, rounds: int = 3) -> tuple[float, float]:
  """``(steps per second, XLA's FLOPs per step)`` of ``floor_program`` (best of ``rounds`` after
  compiling once)."""
  chunk, params, batches = floor_program(config, ds)
  compiled = chunk.lower(params, batches).compile()
  jax.block_until_ready(compiled(params, batches))
  best = float("inf")
  for _ in range(rounds):
    t0 = time.perf_counter()
    jax.block_until_ready(compiled(params, batches))
    best = min(best, time.perf_counter() - t0)
  return config.chunk / best, memory_lib.xla_flops(compiled)


def account(result: dict, wall: float) -> dict:
  """A run's wall seconds by part (``PARTS``) from its ``result`` (``runs.train``); results of older
  code without ``overhead_seconds`` count those parts under "other"."""
  first = result["compile_seconds"] or 0.0
  parts = {"first chunk": first, "steady": result["seconds"] - first}
  overhead = result.get("overhead_seconds") or {}
  parts.update({k: overhead.get(k, 0.0) for k in ("build", "eval", "checkpoint")})
  parts["other"] = wall - sum(parts.values())
  return parts


def main(argv=None):
  parser = argparse.ArgumentParser(prog="python -m experiments.bench.study", description=__doc__,
                                   formatter_class=argparse.RawDescriptionHelpFormatter)
  parser.add_argument("--preset", default="cpu", choices=sorted(presets_lib.PRESETS),
                      help="whose main study (default cpu)")
  parser.add_argument("--seeds", nargs="+", type=int, default=[0, 1])
  parser.add_argument("--steps", type=int, help="steps per run (default: the preset's)")
  parser.add_argument("--methods", nargs="+", help="default: the preset's")
  parser.add_argument("--cache", choices=("fresh", "off"), default="fresh",
                      help="JAX's compilation cache: empty at the start (default) or off")
  args = parser.parse_args(argv)
  preset = presets_lib.PRESETS[args.preset]
  work = pathlib.Path(tempfile.mkdtemp(prefix="bench_study_"))
  if args.cache == "fresh":
    jax.config.update("jax_compilation_cache_dir", str(work / "jax-cache"))
  else:
    jax.config.update("jax_enable_compilation_cache", False)
  steps = {} if args.steps is None else {"steps": args.steps}
  configs = [preset.config(m, p, s, **steps)
             for s in args.seeds for m in (args.methods or preset.methods) for p in preset.stage_counts]
  ds = data_lib.default_corpus(configs[0].model_config(256).context)
  print(f"backend {jax.default_backend()}; preset {preset.name}, {len(configs)} runs of {configs[0].steps} "
        f"steps, cache {args.cache}, in {work}")
  header = f"{'run':24s} {'wall s':>7s} " + " ".join(f"{p:>11s}" for p in PARTS) + \
      f" {'steps/s':>8s} {'steps/CPU-s':>11s}"
  print(header)
  rows = []
  for config in configs:
    cpu0, t0 = time.process_time(), time.perf_counter()
    result = runs.train(config, ds, work / "runs" / run_name(config, ds.sha256, ds.vocab_size))
    wall, cpu = time.perf_counter() - t0, time.process_time() - cpu0
    parts = account(result, wall)
    rows.append((config, wall, cpu, parts))
    label = f"{config.method} P={config.stages} seed {config.seed}"
    print(f"{label:24s} {wall:7.1f} " + " ".join(f"{parts[p]:11.1f}" for p in PARTS) +
          f" {config.steps / wall:8.1f} {config.steps / cpu:11.1f}", flush=True)
  flops = {}
  for config, *_ in rows:
    key = dataclasses.replace(config, seed=0)
    if key not in flops:
      flops[key] = flops_per_step(config, ds)
  rate = bench_optimizer.matmul_rate([512, 1024])
  print(f"plain float32 matmul: {rate / 1e9:.0f} GFLOP/s")
  for seeds, label in ((args.seeds, "all runs"), (args.seeds[:1], "first seed (compiles)"),
                       (args.seeds[1:], "later seeds (cached programs)")):
    group = [r for r in rows if r[0].seed in seeds]
    if not group:
      continue
    wall = sum(r[1] for r in group)
    cpu = sum(r[2] for r in group)
    steps = sum(r[0].steps for r in group)
    useful = sum(r[0].steps * flops[dataclasses.replace(r[0], seed=0)] for r in group)
    split = ", ".join(f"{p} {sum(r[3][p] for r in group) / wall:.0%}" for p in PARTS)
    print(f"{label}: {steps / wall:.1f} steps per wall-second, {steps / cpu:.1f} per CPU-second, "
          f"{useful / wall / rate:.1%} of plain matmul; wall: {split}")
  # The floor: a study whose compilation, pipeline, optimizer and overheads cost nothing would run
  # every step at the rate of the model's forward + backward + SGD.
  floor, floor_flops = floor_rate(configs[0], ds)
  steady = sum(r[0].steps - r[0].chunk for r in rows) / sum(r[3]["steady"] for r in rows)
  total = sum(r[0].steps for r in rows) / sum(r[1] for r in rows)
  print(f"floor (forward + backward + SGD of the model alone): {floor:.1f} steps/s, "
        f"{floor * floor_flops / rate:.1%} of plain matmul; the runs' steady steps reach "
        f"{steady / floor:.0%} of it, all runs {total / floor:.0%}: nothing but a faster model "
        f"forward and backward can make this study more than {floor / total:.2f}x faster")


if __name__ == "__main__":
  from experiments import cli

  cli.exit_process(cli.run(main))

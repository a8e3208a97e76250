"""A run's compiled cost before it runs: FLOPs per step and memory from the compiled chunk program,
the device's memory, and an estimated time (the sweep's ``--dry-run``)."""

from __future__ import annotations

import os
import time

import jax
import numpy as np
from flax import nnx

from experiments.harness import model as model_lib
from experiments.harness import runs
from experiments.harness.config import RunConfig, memory_options, run_dir
from experiments.harness.data import Dataset


def xla_flops(program) -> float:
  """XLA's FLOP count of a lowered or compiled program (older JAX returns one dict per
  computation: the first is the program's)."""
  analysis = program.cost_analysis()
  analysis = analysis[0] if isinstance(analysis, (list, tuple)) else analysis
  return float(analysis.get("flops", 0.0))


def compile_chunk(config: RunConfig, vocab_size: int, context: int | None = None):
  """The compiled chunk program of an emulated run, from shapes only (nothing allocated, nothing
  run): ``(compiled, seconds to compile)``. Its ``memory_analysis()`` is what a device needs."""
  cfg = config.model_config(vocab_size)
  context = context or cfg.context
  graphdef, params = nnx.split(nnx.eval_shape(lambda: model_lib.Transformer(cfg, nnx.Rngs(0))), nnx.Param)
  params = nnx.to_pure_dict(params)
  pipe = runs.pipeline_of(config, cfg, graphdef, params)
  state = jax.eval_shape(pipe._init, params)
  tokens = jax.ShapeDtypeStruct((config.chunk, config.batch_size, context), np.int32)
  t0 = time.perf_counter()
  compiled = pipe.run.lower(state, (tokens, tokens)).compile()
  return compiled, time.perf_counter() - t0


def memory(compiled) -> dict:
  """Bytes of a compiled program from XLA's memory analysis: arguments, outputs (less those that
  reuse donated arguments), temporaries, and their sum ``total``."""
  m = compiled.memory_analysis()
  get = lambda name: int(getattr(m, name, 0) or 0) if m is not None else 0
  out = {"arguments": get("argument_size_in_bytes"), "temporaries": get("temp_size_in_bytes"),
         "outputs": max(0, get("output_size_in_bytes") - get("alias_size_in_bytes"))}
  out["total"] = sum(out.values())
  return out


def device_memory() -> tuple[int | None, str]:
  """(bytes one device can hold, where that figure comes from): JAX's ``memory_stats()`` on
  accelerators; the machine's physical memory on the CPU backend; ``None`` where neither is known."""
  stats = jax.local_devices()[0].memory_stats() or {}
  if stats.get("bytes_limit"):
    return int(stats["bytes_limit"]), f"{jax.local_devices()[0].device_kind} memory_stats"
  if jax.default_backend() == "cpu" and hasattr(os, "sysconf"):
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES"), "this machine's physical memory"
  return None, "unknown"


def estimate(config: RunConfig, ds: Dataset, time_budget: float = 120.0) -> dict:
  """What one run will cost, without training it: XLA's FLOPs per step and the memory of the
  compiled chunk program (from shapes: nothing allocated), compared with the device's memory; then,
  only if it fits and XLA's FLOPs say a chunk takes at most ``time_budget`` seconds at 1 TFLOP/s, a
  time estimate from one timed chunk. ``skipped`` says why a run was not timed."""
  context = config.model_config(ds.vocab_size).context
  if config.execution == "devices":  # the device pipeline's program is lowered from its real state
    pipe, state, _, _ = runs.build(config, ds)
    batches = ds.batches(config.seed, 0, config.chunk, config.batch_size, context)
    t0 = time.perf_counter()
    compiled = pipe.lower(state, batches).compile()
    compile_seconds, args = time.perf_counter() - t0, (state, batches, True)
  else:
    compiled, compile_seconds = compile_chunk(config, ds.vocab_size, context)
    pipe = args = None
  mem = memory(compiled)
  limit, source = device_memory()
  flops = xla_flops(compiled)  # a scan's body is counted once: one step, ...
  if config.remat is not None:  # ... and one block of a rematerialised model's scan over blocks
    flops = model_lib.train_flops(config.model_config(ds.vocab_size), config.batch_size, remat=True)
  out = {"flops_per_step": flops,
         "memory_bytes": mem["total"], "memory": mem, "device_bytes": limit, "device_source": source,
         "compile_seconds": compile_seconds, "steps_per_second": None, "estimated_seconds": None,
         "skipped": None}
  if limit is not None and mem["total"] > limit:
    out["skipped"] = (f"needs {mem['total'] / 2**30:.1f} GiB, more than the {limit / 2**30:.1f} GiB of "
                      f"{source}: not timed; lower it with {memory_options(config)}")
    return out
  guess = out["flops_per_step"] * config.chunk / 1e12
  if jax.default_backend() == "cpu" and guess > time_budget:
    out["skipped"] = f"not timed: a chunk is {out['flops_per_step'] * config.chunk / 1e12:.0f} TFLOP here"
    return out
  if args is None:
    pipe, state, _, _ = runs.build(config, ds)
    args = (state, ds.batches(config.seed, 0, config.chunk, config.batch_size, context))
  t0 = time.perf_counter()
  jax.block_until_ready(compiled(*args))
  rate = config.chunk / (time.perf_counter() - t0)
  out.update(steps_per_second=rate, estimated_seconds=compile_seconds + config.steps / rate)
  return out


def dry_run(runs_by_group, ds, out) -> list:
  """Prints the plan and, for every unfinished run, its compiled program's FLOPs per step and memory
  (from shapes, before anything runs) against the device's memory, and an estimated time from one
  timed chunk where it fits and is quick enough to time here; returns the rows.

  Args:
    runs_by_group: ``(group, RunConfig)`` pairs (a sweep's plan).
    ds: the dataset.
    out: the sweep's folder (a run with a ``result.json`` there is cached).
  """
  rows, total = [], 0.0
  limit, source = device_memory()
  print(f"device memory: {'unknown' if limit is None else f'{limit / 2**30:.1f} GiB'} ({source})")
  print(f"{'group':<14} {'run':<64} {'state':<8} {'GFLOP/step':>10} {'args GiB':>8} {'temp GiB':>8} "
        f"{'est. s':>8}")
  for group, c in runs_by_group:
    folder = run_dir(c, ds, out)
    done = (folder / "result.json").exists()
    row = {"group": group, "run": folder.name, "cached": done}
    if not done:
      row.update(estimate(c, ds))
      total += row["estimated_seconds"] or 0.0
    rows.append(row)
    cost = ""
    if not done:
      mem = row["memory"]
      timed = f"{row['estimated_seconds']:>8.0f}" if row["estimated_seconds"] is not None else f"{'-':>8}"
      cost = (f"{row['flops_per_step'] / 1e9:>10.3f} {mem['arguments'] / 2**30:>8.2f} "
              f"{mem['temporaries'] / 2**30:>8.2f} {timed}")
    print(f"{group:<14} {c.name:<64} {'cached' if done else 'to run':<8} {cost}", flush=True)
    if row.get("skipped"):
      print(f"{'':<14} {row['skipped']}", flush=True)
  timed = sum(r.get("estimated_seconds") is not None for r in rows)
  print(f"{len(rows)} runs, {sum(not r['cached'] for r in rows)} to run, {timed} timed: estimated "
        f"{total / 60:.1f} min for those (compilation included; measured on this machine now)")
  return rows

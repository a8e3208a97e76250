"""``python -m experiments.bench.optimizer``: cost of basis rotation over AdamW, as ratios.

Measured in one run on this machine: the optimizer update alone and a whole training step (forward,
backward, update) on the CPU preset model, the update alone on the weight shapes of one block of
the paper's 95M model (width 384, MLP 1,536; a small vocabulary so that the unrotated embeddings do
not dominate), XLA's extra FLOPs per step, the fraction of the machine's plain matmul rate the
rotation update reaches, and compile times. Refresh period 10 (the paper's default).
"""

from __future__ import annotations

import argparse
import dataclasses
import time

import jax
import jax.numpy as jnp
import numpy as np
import optax

import pipeline_sim as ps
import rotation
from experiments.harness import data as data_lib
from experiments.harness import memory as memory_lib
from experiments.harness import model as model_lib


def time_interleaved(fns: dict, steps: int, rounds: int = 3) -> dict:
  """Seconds per call of each jitted ``fn(*state) -> state``, ``fns[name] = (fn, state)``, chained
  ``steps`` times (a multiple of the refresh period, so refreshes are amortised); the best of
  ``rounds`` such means. The functions take turns, so that machine drift hits them alike."""
  states = {name: jax.block_until_ready(fn(*state)) for name, (fn, state) in fns.items()}
  means = {name: [] for name in fns}
  for _ in range(rounds):
    for name, (fn, _) in fns.items():
      out = states[name]
      t0 = time.perf_counter()
      for _ in range(steps):
        out = fn(*out)
      states[name] = jax.block_until_ready(out)
      means[name].append((time.perf_counter() - t0) / steps)
  return {name: float(min(m)) for name, m in means.items()}


def optimizers(refresh_every):
  return {"adamw": optax.adamw(1e-3, weight_decay=0.01),
          "rotation": rotation.basis_rotation(1e-3, refresh_every=refresh_every,
                                              weight_dimension_numbers=model_lib.rotation_dims),
          "rotation, cholesky_qr": rotation.basis_rotation(1e-3, refresh_every=refresh_every,
                                                           weight_dimension_numbers=model_lib.rotation_dims,
                                                           orthonormalization="cholesky_qr"),
          # Only the cold start: the per-step work alone (statistics and rotations).
          "rotation, no warm refresh": rotation.basis_rotation(1e-3, refresh_every=10**9,
                                                               weight_dimension_numbers=model_lib.rotation_dims),
          # Fixed (random) bases: no statistics, no refresh; the rotations in and out alone.
          "rotation, fixed bases": rotation.basis_rotation(
              1e-3, weight_dimension_numbers=model_lib.rotation_dims,
                                                           ablation=rotation.Ablation(bases=jax.random.key(0)))}


def account(seconds: dict) -> dict:
  """Rotation's whole-step time over AdamW's, split by component (each a fraction of AdamW's step):
  the rotations in and out (fixed bases - AdamW), the statistics ``G G^T``, ``G^T G`` (no warm
  refresh - fixed bases; the one cold-start refresh is amortised away), and the warm refreshes
  (full - no warm refresh)."""
  a = seconds["adamw"]
  return {"rotations": (seconds["rotation, fixed bases"] - a) / a,
          "statistics": (seconds["rotation, no warm refresh"] - seconds["rotation, fixed bases"]) / a,
          "refresh": (seconds["rotation"] - seconds["rotation, no warm refresh"]) / a,
          "total": seconds["rotation"] / a}


def bench_update(params, refresh_every, steps, rounds=3):
  """Per-step time of the update alone (averaged over a full refresh period), FLOPs, compile s."""
  grads = jax.tree.map(lambda p: 0.01 * jnp.ones_like(p), params)
  out, fns = {}, {}
  for name, tx in optimizers(refresh_every).items():
    def step(p, s, tx=tx):
      u, s = tx.update(grads, s, p)
      return optax.apply_updates(p, u), s
    state = tx.init(params)
    t0 = time.perf_counter()
    compiled = jax.jit(step, donate_argnums=(0, 1)).lower(params, state).compile()
    compile_s = time.perf_counter() - t0
    flops = memory_lib.xla_flops(compiled)
    fns[name] = (compiled, (jax.tree.map(jnp.copy, params), state))
    out[name] = {"flops": flops, "compile": compile_s}
  for name, seconds in time_interleaved(fns, steps, rounds).items():
    out[name]["seconds"] = seconds
  return out


def rotation_flops(params, refresh_every) -> float:
  """Useful FLOPs per step of the default rotation (second order, bilateral), averaged over a
  refresh period, counted from the shapes: per rotated (m, n) matrix and step, the statistics
  ``G G^T``, ``G^T G`` and the rotations in and out, ``6 (m^2 n + m n^2)``; per warm refresh and side
  k, ``S Q`` (2 k^3), Householder QR with its complete Q (8/3 k^3) and re-expressing the first moment
  (2 k^3 + 2 m n k)."""
  total = 0.0
  for leaf, rotate in zip(jax.tree.leaves(params), jax.tree.leaves(model_lib.rotation_mask(params))):
    if not rotate:
      continue
    m, n = leaf.shape
    total += 6.0 * (m * m * n + m * n * n)
    total += sum(2 * k**3 + 8 / 3 * k**3 + 2 * k**3 + 2 * m * n * k for k in (m, n)) / refresh_every
  return total


def matmul_rate(sizes, steps=20) -> float:
  """FLOP/s of plain float32 matmuls (k, k) @ (k, k) over ``sizes``, best size."""
  best = 0.0
  for k in sizes:
    a = jnp.ones((k, k), jnp.float32) / k
    f = jax.jit(lambda x: (jnp.matmul(x, a, precision=jax.lax.Precision.HIGHEST),))
    seconds = time_interleaved({"matmul": (f, (a,))}, steps)["matmul"]
    best = max(best, 2.0 * k**3 / seconds)
  return best


def bench_train_step(cfg, refresh_every, steps, batch_size):
  graphdef, params = model_lib.init(cfg)
  loss_fn = model_lib.make_loss(graphdef)
  ds = data_lib.default_corpus(cfg.context)
  batch = tuple(jnp.asarray(x) for x in ds.batch(0, 0, batch_size, cfg.context))
  fns = {}
  for name, tx in optimizers(refresh_every).items():
    def step(p, s, tx=tx):
      g = jax.grad(loss_fn)(p, batch)
      u, s = tx.update(g, s, p)
      return optax.apply_updates(p, u), s
    state = tx.init(params)
    compiled = jax.jit(step, donate_argnums=(0, 1)).lower(params, state).compile()
    fns[name] = (compiled, (jax.tree.map(jnp.copy, params), state))
  return time_interleaved(fns, steps)


def step_spikes(cfg, refresh_every, batch_size, periods=4):
  """Max / mean per-step time of the whole training step over whole refresh periods, for the
  paper's schedule (every matrix refreshes at t % T == 0) and for staggered refreshes."""
  graphdef, params = model_lib.init(cfg)
  loss_fn = model_lib.make_loss(graphdef)
  ds = data_lib.default_corpus(cfg.context)
  batch = tuple(jnp.asarray(x) for x in ds.batch(0, 0, batch_size, cfg.context))
  out = {}
  for stagger in (False, True):
    tx = rotation.basis_rotation(
        1e-3, refresh_every=refresh_every, weight_dimension_numbers=model_lib.rotation_dims,
                                 stagger=stagger)

    def step(p, s, tx=tx):
      u, s = tx.update(jax.grad(loss_fn)(p, batch), s, p)
      return optax.apply_updates(p, u), s

    run = jax.jit(step, donate_argnums=(0, 1))
    carry = run(jax.tree.map(jnp.copy, params), tx.init(params))  # t = 1 (cold start) and compile
    times = []
    for _ in range(refresh_every * periods + refresh_every - 1):
      t0 = time.perf_counter()
      carry = jax.block_until_ready(run(*carry))
      times.append(time.perf_counter() - t0)
    times = np.asarray(times[refresh_every - 1:])  # whole periods after warming up
    out[stagger] = float(times.max() / times.mean())
  return out


def tree_bytes(tree) -> int:
  return sum(int(x.size) * x.dtype.itemsize for x in jax.tree.leaves(tree))


def memory_report(model: str = "paper-95m", num_stages: int = 32) -> dict:
  """Optimizer-state and pipeline-buffer bytes, from shapes alone (``jax.eval_shape``)."""
  cfg = model_lib.CONFIGS[model]
  params = model_lib.abstract_params(cfg)
  out = {"params": tree_bytes(params)}
  for name, tx in optimizers(10).items():
    if name not in ("rotation, no warm refresh", "rotation, fixed bases"):
      out[name] = tree_bytes(jax.eval_shape(tx.init, params))
  pipe = ps.Pipeline(lambda p, b: 0.0, optax.adamw(1e-3),
                     model_lib.stage_labels(params, num_stages))
  out[f"buffers P={num_stages}"] = tree_bytes(jax.eval_shape(pipe.init, params).buffers)
  return out


def main(argv=None):
  parser = argparse.ArgumentParser(prog="python -m experiments.bench.optimizer", description=__doc__)
  parser.add_argument("--refresh-every", type=int, default=10)
  parser.add_argument("--steps", type=int, default=40, help="timed steps (a multiple of the period)")
  args = parser.parse_args(argv)
  cfg = model_lib.CONFIGS["cpu-deep"]
  print(f"backend: {jax.default_backend()}; refresh_every={args.refresh_every}; "
        f"best of 3 interleaved means over {args.steps} steps")
  for batch in (16, 64):
    train = bench_train_step(cfg, args.refresh_every, args.steps, batch_size=batch)
    parts = account(train)
    print(f"cpu-deep whole training step, batch {batch}: rotation / adamw = {parts['total']:.2f}x "
          f"(without warm refreshes {train['rotation, no warm refresh'] / train['adamw']:.2f}x); "
          f"over AdamW's step: rotations +{parts['rotations']:.0%}, statistics "
          f"+{parts['statistics']:.0%}, warm refreshes +{parts['refresh']:.0%}")
  mem = memory_report()
  gib = lambda b: f"{b / 2**30:.2f} GiB"
  print(f"paper-95m memory (eval_shape, nothing allocated): params {gib(mem['params'])}; optimizer "
        f"state: adamw {gib(mem['adamw'])}, rotation {gib(mem['rotation'])} "
        f"({mem['rotation'] / mem['adamw']:.2f}x); weight-stashing buffers at P=32 "
        f"{gib(mem['buffers P=32'])} ({mem['buffers P=32'] / mem['params']:.1f}x params)")
  spikes = step_spikes(cfg, args.refresh_every, batch_size=16)
  print(f"cpu-deep whole training step, batch 16, max / mean step time: paper's schedule "
        f"{spikes[False]:.2f}, staggered refreshes {spikes[True]:.2f}")
  block = dataclasses.replace(model_lib.CONFIGS["paper-95m"], num_blocks=1, vocab_size=256,
                              context=64)
  cases = [("cpu-deep", model_lib.init(cfg)[1], args.steps, 3),
           ("paper-95m block", model_lib.init(block)[1], args.refresh_every, 2)]
  for name, params, steps, rounds in cases:
    r = bench_update(params, args.refresh_every, steps, rounds)
    a, b, c = r["adamw"], r["rotation"], r["rotation, no warm refresh"]
    ch = r["rotation, cholesky_qr"]
    print(f"{name} update alone: rotation / adamw = {b['seconds'] / a['seconds']:.2f}x "
          f"(without warm refreshes {c['seconds'] / a['seconds']:.2f}x; orthonormalization cholesky_qr "
          f"{ch['seconds'] / a['seconds']:.2f}x); "
          f"XLA FLOPs per step {b['flops']:.3g} vs {a['flops']:.3g} (extra {b['flops'] - a['flops']:.3g}, "
          f"cond branches counted once); compile {b['compile']:.1f}s vs {a['compile']:.1f}s")
    sides = sorted({k for leaf in jax.tree.leaves(params) if leaf.ndim == 2 for k in leaf.shape})
    rate = matmul_rate([k for k in sides if k >= 64][-2:] or sides[-1:])
    useful = rotation_flops(params, args.refresh_every)
    print(f"{name} update alone: {useful:.3g} useful FLOPs per step (shapes; refresh averaged) at "
          f"{useful / b['seconds']:.3g} FLOP/s = {useful / b['seconds'] / rate:.1%} of plain matmul "
          f"({rate:.3g} FLOP/s); with cholesky_qr {useful / ch['seconds'] / rate:.1%}")


if __name__ == "__main__":
  from experiments import cli

  cli.exit_process(cli.run(main))

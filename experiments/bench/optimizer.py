"""``python -m experiments.bench.optimizer``: cost of basis rotation over AdamW, as ratios.

Measured in one run on this machine: the optimizer update alone and a whole training step (forward,
backward, update) on the CPU preset model, the update alone on the weight shapes of one block of
the paper's 95M model (width 384, MLP 1,536; a small vocabulary so that the unrotated embeddings do
not dominate), XLA's extra FLOPs per step, the fraction of the machine's plain matmul rate the
rotation update reaches, and compile times. Refresh period 10 (the paper's default).

The allocator changes these numbers on the CPU backend: XLA takes each call's temporary buffer
from ``malloc``, and the C library's maps a buffer over its limit afresh for every call (and a
non-main thread's over 64 MB always), so every page the call touches is a page fault. The floor
lines print the buffer's size, the faults per call and the allocator in use (docs/benchmarks.md,
"The allocator").
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


def time_interleaved(fns: dict, steps: int, rounds: int = 3, summary=min) -> dict:
  """Seconds per call of each jitted ``fn(*state) -> state``, ``fns[name] = (fn, state)``, chained
  ``steps`` times (a multiple of the refresh period, so refreshes are amortised); ``summary`` (the
  best by default, or ``np.median``) of ``rounds`` such means. The functions take turns, so that
  machine drift hits them alike."""
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
  return {name: float(summary(m)) for name, m in means.items()}


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


def compiled_steps(params, txs: dict, grad_of) -> tuple[dict, dict]:
  """Per optimizer of ``txs``, its step ``(p, s, g) -> (p, s, g)`` applying ``tx.update(grad_of(p,
  g))``, jitted with parameters and state donated and compiled ahead, with its first arguments (as
  ``time_interleaved`` takes them; ``g``, random gradients shaped like ``params``, rides along as an
  argument, so that XLA cannot fold a fixed gradient's products at compile time); and each one's
  compile seconds."""
  fns, compile_seconds = {}, {}
  leaves, treedef = jax.tree.flatten(params)
  keys = jax.random.split(jax.random.key(1), len(leaves))
  given = treedef.unflatten([0.01 * jax.random.normal(k, x.shape, x.dtype) for k, x in zip(keys, leaves)])
  for name, tx in txs.items():
    def step(p, s, g, tx=tx):
      u, s = tx.update(grad_of(p, g), s, p)
      return optax.apply_updates(p, u), s, g
    state = tx.init(params)
    t0 = time.perf_counter()
    compiled = jax.jit(step, donate_argnums=(0, 1)).lower(params, state, given).compile()
    compile_seconds[name] = time.perf_counter() - t0
    fns[name] = (compiled, (jax.tree.map(jnp.copy, params), state, given))
  return fns, compile_seconds


def pair(refresh_every) -> dict:
  """AdamW and the default rotation, of ``optimizers``."""
  return {k: v for k, v in optimizers(refresh_every).items() if k in ("adamw", "rotation")}


ALLOCATORS = ("jemalloc", "tcmalloc", "mimalloc")


def allocator(maps: str | None = None) -> str:
  """The malloc this process runs with, read from its mapped libraries (``maps``: the text of
  ``/proc/self/maps``, read when not given): one of ``ALLOCATORS`` preloaded in place of the C
  library's, or ``"libc"``. On the CPU backend XLA takes each call's temporary buffer from it."""
  if maps is None:
    try:
      with open("/proc/self/maps") as f:
        maps = f.read()
    except OSError:
      maps = ""
  return next((name for name in ALLOCATORS if f"lib{name}" in maps), "libc")


def minor_faults_per_call(fn, state, calls: int) -> float:
  """Minor page faults of this process per call of ``fn(*state) -> state`` (``calls`` chained calls
  after one warm-up): pages the kernel hands out fresh, here mostly XLA's temporary buffer when the
  allocator maps it anew for every call (Unix: ``resource``)."""
  import resource

  state = jax.block_until_ready(fn(*state))
  before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
  for _ in range(calls):
    state = fn(*state)
  jax.block_until_ready(state)
  return (resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before) / calls


def bench_update(params, refresh_every, steps, rounds=3, txs=None, summary=min):
  """Per-step time of the update alone (averaged over a full refresh period), FLOPs, compile s, XLA's
  temporary buffer bytes a call and minor page faults a call (over ``steps`` calls after the timing,
  from a copy of the first state), for each of ``txs`` (default ``optimizers``)."""
  fns, compile_seconds = compiled_steps(params, txs or optimizers(refresh_every), lambda p, g: g)
  fresh = {name: jax.tree.map(jnp.copy, state) for name, (_, state) in fns.items()}  # timing donates
  out = {name: {"flops": memory_lib.xla_flops(fn), "compile": compile_seconds[name],
                "temp_bytes": fn.memory_analysis().temp_size_in_bytes}
         for name, (fn, _) in fns.items()}
  for name, seconds in time_interleaved(fns, steps, rounds, summary).items():
    out[name]["seconds"] = seconds
  for name, (fn, _) in fns.items():
    out[name]["faults_per_call"] = minor_faults_per_call(fn, fresh[name], steps)
  return out


def step_flops(params, weight_dimension_numbers, refresh_every: int,
               block_size: int | None = rotation.DEFAULT_BLOCK_SIZE) -> dict:
  """FLOPs of one step of the default rotation (second-order source, bilateral, Householder QR)
  counted from the shapes, per rotated block of ``a x b`` (``rotation.dims``' pieces, so a side
  longer than ``block_size`` counts as its blocks), warm refreshes averaged over ``refresh_every``:

  - ``matmuls``, every step: the statistics ``G G^T``, ``G^T G`` (2 a^2 b + 2 a b^2) and the
    rotations in and out (the same twice): ``6 (a^2 b + a b^2)``;
  - ``refresh_matmuls``, per warm refresh and side d: ``S Q`` (2 d^3), the change of basis
    ``U_new^T U_old`` (2 d^3) and the first moment re-expressed by it (2 a b d);
  - ``qr``: per warm refresh and side d, Householder QR with its complete Q, ``8/3 d^3`` (LAPACK's
    geqrf and orgqr, not a matmul: counted at the matmul rate it makes the floor optimistic).
  Elementwise work (Adam, the decays, the guards) is left out: a floor, not an estimate."""
  tx = rotation.scale_by_basis_rotation(weight_dimension_numbers=weight_dimension_numbers,
                                        block_size=block_size)
  state = jax.eval_shape(tx.init, params)
  out = {"matmuls": 0.0, "refresh_matmuls": 0.0, "qr": 0.0}
  for piece in jax.tree.leaves(state.bases, is_leaf=lambda x: isinstance(x, rotation.RotationPiece)):
    (k, a, _), b = piece.left.shape, piece.right.shape[-1]  # k blocks of a x b
    out["matmuls"] += k * 6.0 * (a * a * b + a * b * b)
    out["refresh_matmuls"] += k * sum(4.0 * d**3 + 2.0 * a * b * d for d in (a, b)) / refresh_every
    out["qr"] += k * sum(8 / 3 * d**3 for d in (a, b)) / refresh_every
  out["total"] = sum(out.values())
  return out


def piece_shapes(params, weight_dimension_numbers, block_size=rotation.DEFAULT_BLOCK_SIZE) -> list:
  """``(k, a, b)`` of every stack of rotated blocks the default rotation keeps for ``params``."""
  tx = rotation.scale_by_basis_rotation(weight_dimension_numbers=weight_dimension_numbers,
                                        block_size=block_size)
  state = jax.eval_shape(tx.init, params)
  return [(p.left.shape[0], p.left.shape[-1], p.right.shape[-1])
          for p in jax.tree.leaves(state.bases, is_leaf=lambda x: isinstance(x, rotation.RotationPiece))]


def plain_step(shapes, b2: float = 0.999):
  """``(fn, state)`` for ``time_interleaved``: the per-step work of the default rotation between
  refreshes, written plainly per block (``G``, ``U``, ``V``, ``L``, ``R`` and Adam's moments of every
  block of ``shapes`` its own arrays): the statistics, ``U^T G V``, Adam and ``U u V^T``. What XLA
  makes of those matmuls with no stacking across leaves, no ``lax.switch``, no cutting of a leaf into
  blocks and back: the per-step program the library could reach without a refresh."""
  hi = jax.lax.Precision.HIGHEST
  mm = lambda x, y: jnp.matmul(x, y, precision=hi)

  def one(g, u, v, sl, sr, m, n):
    sl = b2 * sl + (1 - b2) * mm(g, g.T)
    sr = b2 * sr + (1 - b2) * mm(g.T, g)
    rotated = mm(mm(u.T, g), v)
    m, n = 0.9 * m + 0.1 * rotated, b2 * n + (1 - b2) * rotated**2
    return g + 1e-3 * mm(mm(u, m / (jnp.sqrt(n) + 1e-8)), v.T), u, v, sl, sr, m, n

  def step(*blocks):
    return tuple(one(*b) for b in blocks)
  key = jax.random.key(0)
  blocks = tuple((0.01 * jax.random.normal(key, (a, b)), jnp.eye(a), jnp.eye(b), jnp.zeros((a, a)),
                  jnp.zeros((b, b)), jnp.zeros((a, b)), jnp.zeros((a, b)))
                 for k, a, b in shapes for _ in range(k))
  return jax.jit(step, donate_argnums=tuple(range(len(blocks)))), blocks


def matmul_rate(sizes, steps=20, rounds=5) -> float:
  """FLOP/s of plain float32 matmuls (k, k) @ (k, k), the best size of ``sizes``, each the median of
  ``rounds`` interleaved means over ``steps`` products (the machine's matmul rate, measured now)."""
  fns = {}
  for k in sizes:
    a = jnp.ones((k, k), jnp.float32) / k
    fns[k] = (jax.jit(lambda x, a=a: (jnp.matmul(x, a, precision=jax.lax.Precision.HIGHEST),)), (a,))
  seconds = time_interleaved(fns, steps, rounds, summary=np.median)
  return max(2.0 * k**3 / seconds[k] for k in sizes)


def block_config(width: int, context: int = 64):
  """One paper-95m Transformer block at ``width`` (MLP 4x, heads of 64) with a small vocabulary, so
  that the unrotated embeddings and head do not dominate."""
  return dataclasses.replace(model_lib.CONFIGS["paper-95m"], num_blocks=1, vocab_size=256, context=context,
                             width=width, num_heads=width // 64)


def block_params(width: int):
  """The weights of ``block_config(width)``."""
  return model_lib.init(block_config(width))[1]


def block_step_report(width: int, refresh_every: int, batch_size: int = 32, context: int = 512,
                      rounds: int = 5) -> dict:
  """Seconds of a whole training step on one paper-95m block at ``width``, micro-batch
  ``batch_size`` x ``context`` tokens, for AdamW and the default rotation: the median of ``rounds``
  interleaved means over one refresh period."""
  seconds = bench_train_step(block_config(width, context), refresh_every, refresh_every, batch_size,
                             pair(refresh_every), rounds, np.median)
  return {"width": width, "tokens": batch_size * context, "seconds": seconds,
          "ratio": seconds["rotation"] / seconds["adamw"]}


def floor_report(width: int, refresh_every: int, rounds: int = 5) -> dict:
  """The default rotation's update alone on one paper-95m block at ``width`` against its matmul floor:
  FLOPs per step (``step_flops``), the machine's matmul rate (``matmul_rate`` at the block sides),
  the floor (FLOPs / rate) and the measured step (median of ``rounds`` interleaved means over one
  refresh period, AdamW beside it), all measured in this run."""
  params = block_params(width)
  flops = step_flops(params, model_lib.rotation_dims, refresh_every)
  txs = {k: v for k, v in optimizers(refresh_every).items()
         if k in ("adamw", "rotation", "rotation, no warm refresh")}
  r = bench_update(params, refresh_every, refresh_every, rounds, txs, np.median)
  seconds = {name: v["seconds"] for name, v in r.items()}
  fn, blocks = plain_step(piece_shapes(params, model_lib.rotation_dims))
  seconds["plain per-step program"] = time_interleaved({"plain": (fn, blocks)}, refresh_every, rounds,
                                                       np.median)["plain"]
  sides = sorted({d for leaf in jax.tree.leaves(params) if leaf.ndim == 2 for d in leaf.shape if d >= 256})
  rate = matmul_rate([min(d, rotation.DEFAULT_BLOCK_SIZE) for d in sides], rounds=rounds)
  floor = flops["total"] / rate
  memory = {"allocator": allocator(), **{k: r["rotation"][k] for k in ("temp_bytes", "faults_per_call")}}
  return {"width": width, "flops": flops, "rate": rate, "floor": floor, "seconds": seconds,
          "ratio": seconds["rotation"] / floor, "memory": memory}


def floor_line(r: dict) -> str:
  f, mem = r["flops"], r["memory"]
  return (f"paper-95m block, width {r['width']}, update alone: {f['total'] / 1e9:.1f} GFLOP per step "
          f"(per-step matmuls {f['matmuls'] / 1e9:.1f}, refresh matmuls {f['refresh_matmuls'] / 1e9:.1f}, "
          f"QR {f['qr'] / 1e9:.1f}); matmul rate {r['rate'] / 1e9:.0f} GFLOP/s; floor "
          f"{r['floor'] * 1e3:.1f} ms; rotation {r['seconds']['rotation'] * 1e3:.1f} ms = "
          f"{r['ratio']:.2f}x its floor (AdamW {r['seconds']['adamw'] * 1e3:.1f} ms); between refreshes "
          f"{r['seconds']['rotation, no warm refresh'] * 1e3:.1f} ms, where the same per-step matmuls "
          f"written plainly per block take {r['seconds']['plain per-step program'] * 1e3:.1f} ms; XLA's "
          f"temporary buffer {mem['temp_bytes'] / 1e6:.0f} MB a call, {mem['faults_per_call']:,.0f} minor "
          f"page faults a call (allocator: {mem['allocator']})")


def bench_train_step(cfg, refresh_every, steps, batch_size, txs=None, rounds=3, summary=min):
  """Seconds of a whole training step (forward, backward, update) of model ``cfg`` on one batch of
  the default corpus, for each of ``txs`` (default ``optimizers``), ``time_interleaved``."""
  graphdef, params = model_lib.init(cfg)
  loss_fn = model_lib.make_loss(graphdef)
  ds = data_lib.default_corpus(cfg.context)
  batch = tuple(jnp.asarray(x) for x in ds.batch(0, 0, batch_size, cfg.context))
  fns, _ = compiled_steps(params, txs or optimizers(refresh_every), lambda p, g: jax.grad(loss_fn)(p, batch))
  return time_interleaved(fns, steps, rounds, summary)


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
  parser.add_argument("--widths", type=int, nargs="+", default=[384, 768], help="paper-95m block "
                      "widths for the floor (384: the paper's model)")
  parser.add_argument("--floor-only", action="store_true", help="only the paper-95m blocks: the update "
                      "against its matmul floor, and the whole step (micro-batch 32 x 512) against AdamW's")
  args = parser.parse_args(argv)
  print(f"backend: {jax.default_backend()}; refresh_every={args.refresh_every}; allocator: {allocator()}")
  for width in args.widths:
    print(floor_line(floor_report(width, args.refresh_every)))
  for width in args.widths[:1]:
    r = block_step_report(width, args.refresh_every)
    print(f"paper-95m block, width {width}, whole training step, micro-batch 32 x 512: rotation "
          f"{r['seconds']['rotation'] * 1e3:.0f} ms / adamw {r['seconds']['adamw'] * 1e3:.0f} ms = "
          f"{r['ratio']:.3f}x (median of 5 interleaved means over one refresh period)")
  if args.floor_only:
    return
  cfg = model_lib.CONFIGS["cpu-deep"]
  print(f"best of 3 interleaved means over {args.steps} steps:")
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
  r = bench_update(model_lib.init(cfg)[1], args.refresh_every, args.steps)
  a, b, c, ch = r["adamw"], r["rotation"], r["rotation, no warm refresh"], r["rotation, cholesky_qr"]
  print(f"cpu-deep update alone: rotation / adamw = {b['seconds'] / a['seconds']:.2f}x "
        f"(without warm refreshes {c['seconds'] / a['seconds']:.2f}x; orthonormalization cholesky_qr "
        f"{ch['seconds'] / a['seconds']:.2f}x); XLA FLOPs per step {b['flops']:.3g} vs {a['flops']:.3g} "
        f"(cond branches counted once); compile {b['compile']:.1f}s vs {a['compile']:.1f}s")


if __name__ == "__main__":
  from experiments import cli

  cli.exit_process(cli.run(main))

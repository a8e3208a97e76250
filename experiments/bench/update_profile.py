"""``python -m experiments.bench.update_profile``: where the time of one optimizer update goes.

The update alone (no forward or backward) of AdamW and of ``rotation.basis_rotation`` on a model of
the harness (default ``cpu-deep``, the study's) or on one paper-95m block (``--block-width 384``),
with rotation past its cold start and no warm
refresh due (``refresh_every`` far away: the per-step path every step runs; ``--refresh-every 1``
profiles a warm refresh in every call instead), each jitted with its
parameters and state donated, as in training. For each, XLA's own profile (``jax.profiler``, its
Perfetto trace) of ``--calls`` calls, summed per kind of event (the HLO instruction's name without
its number: ``copy``, ``concatenate``, ``cond``, one kind per fusion name; and the runtime's own
steps, e.g. ``ParseArguments``), as milliseconds per call and events per call. Events run on
several threads at once, so kinds do not add up to the wall time; the wall time per call
(``time_interleaved``, the two functions taking turns) is printed above the table. Run it on a quiet
machine.
"""

from __future__ import annotations

import argparse
import collections
import glob
import gzip
import json
import re
import tempfile

import jax
import jax.numpy as jnp
import optax

import rotation
from experiments import cli
from experiments.bench.optimizer import block_config, time_interleaved
from experiments.harness import data as data_lib
from experiments.harness import model as model_lib


def by_kind(events, calls: int) -> dict:
  """``{kind: (milliseconds per call, events per call)}`` of complete (``"ph": "X"``) trace events,
  a kind being the event's name without a trailing number (``copy.12`` -> ``copy``); the Python
  tracer's events (named ``$file:line function``) are left out."""
  total, count = collections.Counter(), collections.Counter()
  for e in events:
    if e.get("ph") == "X" and not e.get("name", "").startswith("$"):
      kind = re.sub(r"[.\d]+$", "", e.get("name", ""))
      total[kind] += e.get("dur", 0)  # microseconds
      count[kind] += 1
  return {k: (total[k] / 1e3 / calls, count[k] / calls) for k in total}


def profile(fn, args, calls: int) -> dict:
  """``by_kind`` of ``calls`` chained calls of ``fn(*args) -> args`` (warmed up first)."""
  args = jax.block_until_ready(fn(*args))
  with tempfile.TemporaryDirectory() as d:
    with jax.profiler.trace(d, create_perfetto_trace=True):
      for _ in range(calls):
        args = fn(*args)
      jax.block_until_ready(args)
    (path,) = glob.glob(f"{d}/**/perfetto_trace.json.gz", recursive=True)
    data = json.loads(gzip.decompress(open(path, "rb").read()))
  return by_kind(data["traceEvents"] if isinstance(data, dict) else data, calls)


def main(argv=None) -> dict:
  parser = argparse.ArgumentParser(prog="python -m experiments.bench.update_profile", description=__doc__,
                                   formatter_class=argparse.RawDescriptionHelpFormatter)
  parser.add_argument("--model", default="cpu-deep", choices=sorted(model_lib.CONFIGS))
  parser.add_argument("--block-width", type=int, help="instead of --model: one paper-95m Transformer "
                      "block at this width (experiments.bench.optimizer.block_config; 384: the paper's), "
                      "the shapes the update's matmul floor is judged at")
  parser.add_argument("--calls", type=int, default=10, help="profiled calls per optimizer (default 10)")
  parser.add_argument("--top", type=int, default=20, help="kinds printed, by rotation's time (default 20)")
  parser.add_argument("--refresh-every", type=int, default=10**9,
                      help="rotation's refresh period (default: never past the cold start; 1: every call)")
  args = parser.parse_args(argv)
  if min(args.calls, args.top, args.refresh_every) < 1:
    raise ValueError(f"--calls, --top and --refresh-every must be >= 1, got {args.calls}, {args.top} "
                     f"and {args.refresh_every}")
  cfg = block_config(args.block_width) if args.block_width else model_lib.CONFIGS[args.model]
  graphdef, params = model_lib.init(cfg)
  batch = tuple(jnp.asarray(x) for x in data_lib.default_corpus(cfg.context).batch(0, 0, 16, cfg.context))
  grads = jax.grad(model_lib.make_loss(graphdef))(params, batch)
  txs = {"adamw": optax.adamw(1e-3, weight_decay=0.01),
         "rotation": rotation.basis_rotation(1e-3, refresh_every=args.refresh_every,
                                             weight_dimension_numbers=model_lib.rotation_dims)}
  fns, got = {}, {}
  for name, tx in txs.items():
    def update(p, s, g, tx=tx):  # g an argument: XLA cannot fold the gradient's products at compile time
      u, s = tx.update(g, s, p)
      return optax.apply_updates(p, u), s, g
    fn = jax.jit(update, donate_argnums=(0, 1))
    state = fn(jax.tree.map(jnp.copy, params), tx.init(params), grads)  # rotation: past its cold start
    fns[name] = (fn, jax.tree.map(jnp.copy, state))
    got[name] = profile(fn, state, args.calls)
  wall = time_interleaved(fns, args.calls)
  ratio = wall["rotation"] / wall["adamw"]
  name = f"paper-95m block, width {args.block_width}" if args.block_width else args.model
  print(f"{name}, the update alone, ms per call: " + ", ".join(
      f"{k} {v * 1e3:.2f}" for k, v in wall.items()) + f" (rotation / adamw {ratio:.2f}x)")
  print("| kind | adamw ms (events) | rotation ms (events) |")
  print("|---|---|---|")
  for kind in sorted(got["rotation"], key=lambda k: -got["rotation"][k][0])[:args.top]:
    a = got["adamw"].get(kind)
    a_text = "-" if a is None else f"{a[0]:.3f} ({a[1]:g})"
    print(f"| {kind} | {a_text} | {got['rotation'][kind][0]:.3f} ({got['rotation'][kind][1]:g}) |")
  return {"wall": wall, "kinds": got}


if __name__ == "__main__":
  cli.exit_process(cli.run(main))

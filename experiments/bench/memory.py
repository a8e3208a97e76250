"""``python -m experiments.bench.memory``: what the paper's model needs on an accelerator.

XLA's memory analysis of the chunk program of a preset's runs (default ``gpu-95m``: paper-95m, batch
32, context 512, rotation), compiled from shapes on whatever backend this is (nothing allocated,
nothing run), at each ``--stages`` and vocabulary, without and with the memory options
(``--remat nothing_saveable``, ``--loss-chunk``): arguments (state and batches) and temporaries, in
GiB. The CPU's compiler is a stand-in for the accelerator's: their buffer assignments differ, so the
device's own figure comes from ``--dry-run`` there.
"""

from __future__ import annotations

import argparse
import dataclasses
import time

import jax
import numpy as np

from experiments.harness import memory as memory_lib
from experiments.harness import methods, runs
from experiments.harness import model as model_lib
from experiments.sweep import presets


def main(argv=None) -> list:
  """Prints the table (and the step times); returns its rows (bytes)."""
  parser = argparse.ArgumentParser(prog="python -m experiments.bench.memory", description=__doc__,
                                   formatter_class=argparse.RawDescriptionHelpFormatter)
  parser.add_argument("--preset", default="gpu-95m", help="whose run template (default gpu-95m)")
  parser.add_argument("--method", default="rotation", help="optimizer (default rotation)")
  parser.add_argument("--stages", nargs="+", type=int, default=[1, 32], help="pipeline depths (default 1 32)")
  parser.add_argument("--vocab-sizes", nargs="+", type=int, default=[256, 50257],
                      help="vocabularies (default: bytes, 256, and GPT-2's 50257)")
  parser.add_argument("--chunk", type=int, default=2, help="steps per compiled chunk (memory does not "
                      "depend on it; default 2)")
  parser.add_argument("--time-blocks", type=int, default=4, help="then time a step before and after, "
                      "at P = 1 with this many blocks (the memory options' cost on this machine; "
                      "default 4; 0 skips it)")
  args = parser.parse_args(argv)
  if args.chunk < 1 or args.time_blocks < 0:
    raise ValueError(f"need --chunk >= 1 and --time-blocks >= 0, got {args.chunk}, {args.time_blocks}")
  if args.preset not in presets.PRESETS:
    raise ValueError(f"unknown preset {args.preset!r}; choose from {sorted(presets.PRESETS)}")
  methods.check_method(args.method)
  template = presets.PRESETS[args.preset].template
  if not template.remat and not template.loss_chunk:
    raise ValueError(f"preset {args.preset!r} turns no memory option on: nothing to compare")
  settings = {"before": dict(remat=None, loss_chunk=None),
              "after": dict(remat=template.remat, loss_chunk=template.loss_chunk)}
  optimizer = methods.spec(args.method)
  configs = [(p, v, name, dataclasses.replace(template, optimizer=optimizer, stages=p, chunk=args.chunk,
                                              steps=args.chunk, eval_every=args.chunk,
                                              checkpoint_every=args.chunk, **over))
             for p in args.stages for v in args.vocab_sizes for name, over in settings.items()]
  for *_, c in configs:
    c.validate()
  print(f"{template.model}, batch {template.batch_size}, {args.method}; after = remat "
        f"{template.remat}, loss_chunk {template.loss_chunk}")
  print(f"{'P':>3} {'vocab':>6} {'':<7} {'arguments GiB':>14} {'temporaries GiB':>16} {'compile s':>10}")
  rows = []
  for p, v, name, c in configs:
    t0 = time.perf_counter()
    compiled, _ = memory_lib.compile_chunk(c, v)
    mem = memory_lib.memory(compiled)
    rows.append({"stages": p, "vocab_size": v, "setting": name, **mem})
    print(f"{p:>3} {v:>6} {name:<7} {mem['arguments'] / 2**30:>14.2f} {mem['temporaries'] / 2**30:>16.2f} "
          f"{time.perf_counter() - t0:>10.0f}", flush=True)
  if args.time_blocks:
    print(f"seconds per step at P = 1 with {args.time_blocks} blocks (best of 3 chunks of {args.chunk}):")
    for v in args.vocab_sizes:
      seconds = {}
      for name, over in settings.items():
        c = dataclasses.replace(template, optimizer=optimizer, stages=1, num_blocks=args.time_blocks,
                                chunk=args.chunk, steps=args.chunk, eval_every=args.chunk,
                                checkpoint_every=args.chunk, **over)
        seconds[name] = step_seconds(c, v)
      print(f"  vocab {v:>6}: before {seconds['before']:.3f} s, after {seconds['after']:.3f} s, "
            f"after / before {seconds['after'] / seconds['before']:.2f}x", flush=True)
  return rows


def step_seconds(config, vocab_size: int) -> float:
  """Best of three timed chunks of ``config``'s emulated run on random tokens (after one to compile)."""
  compiled, _ = memory_lib.compile_chunk(config, vocab_size)
  cfg = config.model_config(vocab_size)
  graphdef, params = model_lib.init(cfg, seed=0)
  pipe = runs.pipeline_of(config, cfg, graphdef, params)
  state = pipe.init(params)
  tokens = np.random.default_rng(0).integers(0, vocab_size, (config.chunk, config.batch_size, cfg.context),
                                             dtype=np.int32)
  best = float("inf")
  for i in range(4):
    t0 = time.perf_counter()
    state, out = compiled(state, (tokens, tokens))
    jax.block_until_ready(out)
    if i:
      best = min(best, time.perf_counter() - t0)
  return best / config.chunk


if __name__ == "__main__":
  from experiments import cli

  cli.exit_process(cli.run(main))

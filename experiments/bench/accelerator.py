"""``python -m experiments.bench.accelerator``: the accelerator checks as one prepared command.

Meant for a short lease of a GPU or TPU: in one process, in this order,

1. ``bench_optimizer`` (the whole training step and the update alone, rotation against AdamW);
2. ``bench_pipeline`` (the emulated pipeline's step against plain training, merged optimizer
   against per-stage copies);
3. a short run of the paper-scale preset (default ``--preset gpu-95m --steps 300``, PipeDream and
   rotation at P = 1 and 8, seed 0), each run trained by ``runs.train`` exactly as the sweep trains
   it, in a temporary folder; per run: steps per second after the first chunk, the first chunk's
   seconds (compilation included), XLA's FLOPs per step times the step rate as a fraction of the
   device's plain float32 matmul rate; then rotation / PipeDream at every P and P / P = 1 for every
   method.

Every part prints as it finishes, so a command stopped at its time limit keeps what finished
(``PYTHONUNBUFFERED=1``); ``--skip`` leaves parts out. Ratios are the point: they transfer between
machines of one kind, absolute times do not.
"""

from __future__ import annotations

import argparse
import pathlib
import tempfile
import time

import jax

from experiments.bench import optimizer as bench_optimizer
from experiments.bench import pipeline as bench_pipeline
from experiments.bench import study as bench_study
from experiments.harness import data as data_lib
from experiments.harness import runs
from experiments.harness.config import run_name
from experiments.sweep import presets as presets_lib

PARTS = ("optimizer", "pipeline", "preset")


def preset_configs(preset: presets_lib.Preset, steps: int, stages, methods) -> list:
  """The runs of the preset part (``methods`` x ``stages``, seed 0), each checked: a bad value fails
  before the lease is spent on the other parts."""
  configs = [preset.config(m, p, 0, steps=steps) for m in methods for p in stages]
  for config in configs:
    config.validate()
  return configs


def preset_runs(configs, work: pathlib.Path) -> dict:
  """Trains ``configs`` and returns
  ``{(method, P): {"steps_per_second", "first_chunk_seconds", "flops_per_step"}}``."""
  ds = data_lib.default_corpus(configs[0].model_config(256).context)
  out = {}
  for config in configs:
    result = runs.train(config, ds, work / run_name(config, ds.sha256, ds.vocab_size))
    out[(config.method, config.stages)] = {
        "steps_per_second": result["steps_per_second"],
        "first_chunk_seconds": result["compile_seconds"],
        "flops_per_step": bench_study.flops_per_step(config, ds)}
    row = out[(config.method, config.stages)]
    print(f"{config.method} P={config.stages}: {row['steps_per_second']:.2f} steps/s after the first "
          f"chunk, first chunk {row['first_chunk_seconds']:.1f}s, "
          f"{row['flops_per_step']:.3g} FLOPs per step", flush=True)
  return out


def ratios(rows: dict) -> list[str]:
  """Lines of rotation / PipeDream step time at every P and P / P = 1 for every method."""
  lines = []
  time_of = lambda key: 1.0 / rows[key]["steps_per_second"]
  for (method, p) in sorted(rows):
    if method != "pipedream" and ("pipedream", p) in rows:
      lines.append(f"P={p}: {method} / pipedream step time = "
                   f"{time_of((method, p)) / time_of(('pipedream', p)):.2f}x")
    if p != 1 and (method, 1) in rows:
      lines.append(f"{method}: P={p} / P=1 step time = {time_of((method, p)) / time_of((method, 1)):.2f}x")
  return lines


def main(argv=None) -> dict:
  parser = argparse.ArgumentParser(prog="python -m experiments.bench.accelerator", description=__doc__,
                                   formatter_class=argparse.RawDescriptionHelpFormatter)
  parser.add_argument("--preset", default="gpu-95m", choices=sorted(presets_lib.PRESETS))
  parser.add_argument("--steps", type=int, default=300, help="steps of each preset run (default 300)")
  parser.add_argument("--stages", nargs="+", type=int, default=[1, 8])
  parser.add_argument("--methods", nargs="+", default=["pipedream", "rotation"])
  parser.add_argument("--skip", nargs="*", default=[], choices=PARTS, help="parts to leave out")
  parser.add_argument("--matmul-sizes", nargs="+", type=int, default=[2048, 4096],
                      help="square matmul sizes of the reference FLOP rate (the best one counts)")
  args = parser.parse_args(argv)
  if min(args.matmul_sizes) < 1:
    raise ValueError(f"--matmul-sizes must be >= 1, got {args.matmul_sizes}")
  configs = ([] if "preset" in args.skip else
             preset_configs(presets_lib.PRESETS[args.preset], args.steps, args.stages, args.methods))
  print(f"backend {jax.default_backend()}: {jax.devices()[0].device_kind} x {jax.device_count()}",
        flush=True)
  t0 = time.perf_counter()
  if "optimizer" not in args.skip:
    bench_optimizer.main([])
    print(f"[bench_optimizer done at {time.perf_counter() - t0:.0f}s]", flush=True)
  if "pipeline" not in args.skip:
    bench_pipeline.main([])
    print(f"[bench_pipeline done at {time.perf_counter() - t0:.0f}s]", flush=True)
  rows = {}
  if "preset" not in args.skip:
    with tempfile.TemporaryDirectory(prefix="bench_accelerator_") as work:
      rows = preset_runs(configs, pathlib.Path(work))
    rate = bench_optimizer.matmul_rate(args.matmul_sizes)
    for (method, p), row in sorted(rows.items()):
      print(f"{method} P={p}: {row['flops_per_step'] * row['steps_per_second'] / rate:.1%} of plain "
            f"float32 matmul ({rate:.3g} FLOP/s)")
    print("\n".join(ratios(rows)))
    print(f"[preset runs done at {time.perf_counter() - t0:.0f}s]", flush=True)
  return rows


if __name__ == "__main__":
  from experiments import cli

  cli.exit_process(cli.run(main))

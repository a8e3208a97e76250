"""``python -m experiments.sweep``: the paper's staleness study, resumable, with tables and plots.

Runs every (method, P, seed) of a preset plus the chosen ablations, each as an emulated
asynchronous pipeline, then writes ``results.csv``, ``report.md`` and PNG figures into one folder.
Running the same command again skips finished runs and resumes unfinished ones from their last
checkpoint.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import pathlib
import sys
import time

import numpy as np
from tqdm import tqdm

from experiments import data as data_lib
from experiments import methods as methods_lib
from experiments import model as M
from experiments import presets as presets_lib
from experiments import report, runs

ABLATIONS = {
    "variants": "the 2 x 2 taxonomy (source x geometry) at P = 1 and the largest P",
    "stage-aware": "uniform / proportional / reverse refresh allocation at the largest P, equal budget",
    "no-stashing": "baselines and rotation without weight stashing at P = 1 and the largest P",
    "refresh-period": "rotation with refresh period 100 against 10, at P = 1 and the largest P",
    "moe": "the mixture-of-experts model (cpu-moe) at P = 1 and 8",
    "scaling": "blocks and P grown together (P = blocks = 4, 8, 16) for PipeDream and rotation",
}


def parse_args(argv=None):
  parser = argparse.ArgumentParser(
      prog="python -m experiments.sweep", description=__doc__,
      formatter_class=argparse.RawDescriptionHelpFormatter)
  parser.add_argument("--preset", default="cpu", help=f"one of {sorted(presets_lib.PRESETS)} (default cpu: "
                      "about 11 minutes on a 2-core CPU); gpu-95m is the paper's 95M model")
  parser.add_argument("--methods", nargs="+", help=f"methods to run at every P (default: the preset's); "
                      f"known: {sorted(methods_lib.METHODS)}")
  parser.add_argument("--stages", nargs="+", type=int, help="pipeline depths P (default: the preset's); "
                      "P = 1 is always added as the synchronous reference")
  parser.add_argument("--seeds", nargs="+", type=int, default=[0], help="seeds (curves are averaged)")
  parser.add_argument("--steps", type=int, help="steps per run (a multiple of the preset's chunk)")
  parser.add_argument("--data", help="a text file (bytes) or a nanoGPT-style uint16 .bin token file; "
                      "default: the Python standard library's source")
  parser.add_argument("--vocab-size", type=int, help="vocabulary of a .bin token file (default 50257)")
  parser.add_argument("--mode", default="weight_stashing",
                      choices=["weight_stashing", "stale_gradients", "no_stashing"],
                      help="pipeline emulation of the main study (default weight_stashing, PipeDream)")
  parser.add_argument("--ablations", nargs="*", help="ablation groups (default: the preset's): "
                      + "; ".join(f"{k}: {v}" for k, v in ABLATIONS.items()))
  parser.add_argument("--out", help="results folder (default results/<preset>)")
  parser.add_argument("--tune-lr", action="store_true", help="choose each method's peak learning "
                      "rate from the preset's grid with short runs at P = 1 (choice recorded)")
  return parser.parse_args(argv)


@dataclasses.dataclass(frozen=True)
class Plan:
  preset: presets_lib.Preset
  main: tuple  # RunSpecs of the main study (learning rates may be re-chosen by tuning)
  ablations: tuple  # (group name, RunSpec) pairs


def preset_spec(preset: presets_lib.Preset, method: str, stages: int, seed: int, **overrides):
  """A run of ``method`` at P = ``stages`` with the preset's settings, then ``overrides``."""
  fields = dict(method=method, stages=stages, seed=seed, lr=preset.learning_rate(method),
                steps=preset.steps, batch_size=preset.batch_size, model=preset.model,
                chunk=preset.chunk, eval_every=preset.eval_every, eval_batches=preset.eval_batches,
                checkpoint_every=preset.checkpoint_every, warmup_fraction=preset.warmup_fraction,
                pipemare_fraction=preset.pipemare_fraction)
  return runs.RunSpec(**{**fields, **overrides})


def make_plan(args) -> Plan:
  """All run specs, validated before any training starts."""
  if args.preset not in presets_lib.PRESETS:
    raise ValueError(f"unknown preset {args.preset!r}; choose from {sorted(presets_lib.PRESETS)}")
  preset = presets_lib.PRESETS[args.preset]
  if args.steps is not None:
    if args.steps < preset.chunk or args.steps % preset.chunk:
      raise ValueError(f"--steps {args.steps} must be a positive multiple of the chunk {preset.chunk}")
    every = lambda n: n if args.steps % n == 0 else preset.chunk
    preset = dataclasses.replace(preset, steps=args.steps, eval_every=every(preset.eval_every),
                                 checkpoint_every=every(preset.checkpoint_every))
  method_names = tuple(args.methods or preset.methods)
  for m in method_names:
    methods_lib.check_method(m)
  stages = tuple(sorted(set(args.stages or preset.stages) | {1}))
  ablations = tuple(preset.ablations if args.ablations is None else args.ablations)
  for a in ablations:
    if a not in ABLATIONS:
      raise ValueError(f"unknown ablation {a!r}; choose from {sorted(ABLATIONS)}")

  def spec(method, p, seed, **kw):
    kw.setdefault("mode", args.mode)
    s = preset_spec(preset, method, p, seed, **kw)
    s.validate()
    return s

  main = tuple(spec(m, p, s) for s in args.seeds for m in method_names for p in stages)
  top = max(stages)
  extra = []
  for s in args.seeds:
    for a in ablations:
      if a == "variants":
        extra += [(a, spec(m, p, s)) for m in ("rotation", "rotation-2nd-uni", "rotation-1st-bi",
                                               "rotation-1st-uni") for p in (1, top)]
      elif a == "stage-aware":
        extra += [(a, spec(m, top, s)) for m in ("rotation", "rotation-sa", "rotation-sa-reverse")]
      elif a == "refresh-period":
        extra += [(a, spec(m, p, s)) for m in ("rotation", "rotation-T100") for p in (1, top)]
      elif a == "no-stashing":
        extra += [(a, spec(m, p, s, mode="no_stashing")) for m in presets_lib.BASELINES + ("rotation",)
                  for p in (1, top)]
      elif a == "moe":
        extra += [(a, dataclasses.replace(spec(m, p, s), model="cpu-moe"))
                  for m in presets_lib.BASELINES + ("rotation",) for p in (1, 8)]
      elif a == "scaling":
        extra += [(a, dataclasses.replace(spec(m, 1, s), stages=b, num_blocks=b))
                  for m in ("pipedream", "rotation") for b in (4, 8, 16)]
  for _, s in extra:
    s.validate()
  return Plan(preset, main, tuple(extra))


def tune_learning_rates(plan: Plan, ds, out: pathlib.Path, overall) -> dict:
  """Best peak learning rate per method from short P = 1 runs over the preset's grid."""
  preset = plan.preset
  steps = max(preset.chunk, int(preset.steps * preset.tune_fraction) // preset.chunk * preset.chunk)
  chosen, trials = {}, {}
  names = sorted({s.method for s in plan.main} | {s.method for _, s in plan.ablations})
  for method in names:
    base = preset.learning_rate(method)
    scores = {}
    for mult in preset.tune_grid:
      spec = preset_spec(preset, method, 1, 0, lr=base * mult, steps=steps, eval_every=steps,
                         checkpoint_every=steps, tag="tune")
      result = _run(spec, ds, out, overall)
      window = max(1, int(steps * preset.smooth_fraction))
      final = report.final_loss(result, window)
      scores[spec.lr] = final
    finite = {lr: f for lr, f in scores.items() if np.isfinite(f)}
    chosen[method] = min(finite, key=finite.get) if finite else base
    trials[method] = scores
  (out / "tuning.json").write_text(json.dumps({"chosen": chosen, "trials": {
      m: {str(k): v for k, v in t.items()} for m, t in trials.items()}}, indent=1))
  return chosen


def _run(spec, ds, out, overall):
  with tqdm(total=spec.steps, desc=spec.name[:60], leave=False, unit="step", dynamic_ncols=True) as bar:
    t0 = time.time()
    already = runs.load_result(out / "runs" / spec.name) is not None
    result = runs.train(spec, ds, out / "runs" / spec.name, progress=bar)
  overall.update(1)
  note = "cached" if already else f"{time.time() - t0:.0f}s"
  finite = [x for x in result["losses"] if np.isfinite(x)]
  tqdm.write(f"[{overall.n}/{overall.total}] {spec.name}: {result['status']}, "
             f"last loss {finite[-1] if finite else float('nan'):.4f} ({note})")
  return result


def main(argv=None) -> pathlib.Path:
  args = parse_args(argv)
  plan = make_plan(args)
  preset = plan.preset
  context = M.CONFIGS[preset.model].context
  contexts = {context} | {M.CONFIGS[s.model].context for _, s in plan.ablations}
  ds = data_lib.load(args.data, context=max(contexts), vocab_size=args.vocab_size)
  out = pathlib.Path(args.out or f"results/{preset.name}")
  out.mkdir(parents=True, exist_ok=True)
  print(f"sweep '{preset.name}': {len(plan.main) + len(plan.ablations)} runs -> {out.resolve()}")
  print(f"data: {ds.name} ({ds.num_tokens} tokens, sha256 {ds.sha256[:16]}...)")
  t0 = time.time()
  grid = len(preset.tune_grid) * len({s.method for s in plan.main} | {s.method for _, s in plan.ablations})
  total = len(plan.main) + len(plan.ablations) + (grid if args.tune_lr else 0)
  with tqdm(total=total, desc="sweep", unit="run", dynamic_ncols=True) as overall:
    if args.tune_lr:
      chosen = tune_learning_rates(plan, ds, out, overall)
      plan = dataclasses.replace(
          plan, main=tuple(dataclasses.replace(s, lr=chosen[s.method]) for s in plan.main),
          ablations=tuple((a, dataclasses.replace(s, lr=chosen[s.method])) for a, s in plan.ablations))
    main_results = [_run(s, ds, out, overall) for s in plan.main]
    ablation_results = [(a, _run(s, ds, out, overall)) for a, s in plan.ablations]
  wall = time.time() - t0
  report.write(out, preset, main_results, ablation_results, ds, wall)
  print(f"done in {wall:.0f}s: {out / 'report.md'}")
  return out


if __name__ == "__main__":
  try:
    main()
  except (ValueError, FileNotFoundError) as e:
    sys.exit(f"error: {e}")

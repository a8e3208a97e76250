"""``--tune-lr``: each method's peak learning rate chosen from the preset's grid with short runs at
P = 1 (the choice and every trial recorded in ``tuning.json``)."""

from __future__ import annotations

import pathlib

import numpy as np

from experiments.harness import processes
from experiments.report import tables
from experiments.sweep import workers
from experiments.sweep.plan import Plan


def tune_learning_rates(plan: Plan, ds, out: pathlib.Path, overall) -> dict:
  """Best peak learning rate per method from short P = 1 runs over the preset's grid."""
  preset = plan.preset
  chunk = preset.template.chunk
  steps = max(chunk, int(preset.template.steps * preset.tune_fraction) // chunk * chunk)
  chosen, trials = {}, {}
  names = sorted({c.method for c in plan.main} | {c.method for _, c in plan.ablations})
  for method in names:
    base = preset.learning_rate(method)
    scores = {}
    for mult in preset.tune_grid:
      config = preset.config(method, 1, 0, lr=base * mult, steps=steps, eval_every=steps,
                             checkpoint_every=steps, tag="tune")
      result = workers.run_one(config, ds, out, overall)
      scores[config.lr] = tables.final_loss(result, preset.window(steps))
    finite = {lr: f for lr, f in scores.items() if np.isfinite(f)}
    chosen[method] = min(finite, key=finite.get) if finite else base
    trials[method] = scores
  processes.write_json(out / "tuning.json", {"chosen": chosen, "trials": {
      m: {str(k): v for k, v in t.items()} for m, t in trials.items()}})  # process 0, atomically
  return chosen

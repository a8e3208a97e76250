"""Named sweep presets: model, data size, stages, methods, learning rates, step counts."""

from __future__ import annotations

import dataclasses


@dataclasses.dataclass(frozen=True)
class Preset:
  """Everything a sweep needs besides the command-line overrides.

  Attributes:
    name: preset name.
    model: key of ``experiments.model.CONFIGS``.
    batch_size: micro-batch size (sequences).
    steps: optimizer steps (= micro-batches) per run.
    stages: pipeline depths P to sweep (P = 1 is the synchronous reference).
    methods: methods run at every P.
    learning_rates: peak learning rate per method (``default`` for the rest).
    ablations: ablation groups run by default (see ``experiments.sweep.ABLATIONS``).
    warmup_fraction: linear warm-up from 1e-7 over this fraction, then cosine to 0.1 x peak.
    chunk: steps per jit-compiled scan (progress, checkpoint and evaluation granularity).
    eval_every: steps between validation evaluations (a multiple of ``chunk``).
    eval_batches: validation micro-batches per evaluation.
    checkpoint_every: steps between checkpoints (a multiple of ``chunk``).
    smooth_fraction: moving-average window for targets, as a fraction of ``steps``.
    pipemare_fraction: PipeDream-LR's ``T_c`` as a fraction of ``steps``.
    tune_grid: multipliers of the preset learning rate tried by ``--tune-lr``.
    tune_fraction: fraction of ``steps`` each tuning run trains (at P = 1).
  """

  name: str
  model: str
  batch_size: int
  steps: int
  stages: tuple[int, ...]
  methods: tuple[str, ...]
  learning_rates: tuple[tuple[str, float], ...]
  ablations: tuple[str, ...] = ()
  warmup_fraction: float = 0.05
  chunk: int = 50
  eval_every: int = 250
  eval_batches: int = 4
  checkpoint_every: int = 250
  smooth_fraction: float = 0.05
  pipemare_fraction: float = 0.25
  tune_grid: tuple[float, ...] = (0.5, 1.0, 2.0)
  tune_fraction: float = 0.25

  def learning_rate(self, method: str) -> float:
    table = dict(self.learning_rates)
    return table.get(method, table["default"])


BASELINES = ("pipedream", "pipedream-lr", "nesterov")

PRESETS = {
    "smoke": Preset(
        name="smoke", model="cpu-tiny", batch_size=4, steps=40, stages=(1, 4),
        methods=("pipedream", "rotation"), learning_rates=(("default", 3e-3),),
        chunk=10, eval_every=20, eval_batches=2, checkpoint_every=20, smooth_fraction=0.1),
    "cpu": Preset(
        name="cpu", model="cpu-deep", batch_size=16, steps=1200, stages=(1, 2, 4, 8, 16),
        methods=BASELINES + ("rotation",),
        learning_rates=(("default", 3e-3), ("nesterov", 1.5e-3)),
        chunk=100, eval_every=300, checkpoint_every=300),
    "gpu-95m": Preset(
        name="gpu-95m", model="paper-95m", batch_size=32, steps=10000, stages=(1, 2, 4, 8, 16, 32),
        methods=BASELINES + ("rotation",), learning_rates=(("default", 1e-3),),
        ablations=("variants", "stage-aware", "no-stashing", "refresh-period"),
        chunk=100, eval_every=1000, eval_batches=8, checkpoint_every=1000, smooth_fraction=0.02),
}

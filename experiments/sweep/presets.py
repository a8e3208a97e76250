"""Named sweep presets: a run-config template plus the grid (methods, stages, ablations) around it."""

from __future__ import annotations

import dataclasses
import pathlib

from experiments.harness import methods as methods_lib
from experiments.harness.config import RunConfig
from experiments.harness.optimizers import SETTINGS, Rotation


@dataclasses.dataclass(frozen=True)
class Preset:
  """A sweep: the template every run is made from, and what varies around it.

  Attributes:
    name: preset name.
    template: the run config every run starts from (``dataclasses.replace`` sets the rest).
    stage_counts: pipeline depths P to sweep (P = 1 is the synchronous reference); a run's own P
      is ``RunConfig.stages``.
    methods: methods run at every P.
    learning_rates: peak learning rate per method; rotation variants share ``rotation``'s, the
      rest use ``default``. The main reading: with one ``default`` entry, every method shares it.
    tuned_rates: a method's own tuned rate where it differs from ``learning_rates``: those runs
      (group ``tuned-lr``, every P and seed) are the second reading, and the report makes a tuned
      rate the main one only if it beats the shared rate by more than the seed noise.
    ablations: ablation groups run by default (see ``experiments.report.ablations``).
    seeds: seeds run by default (every table shows their mean [min, max]).
    smooth_fraction: width of the centred moving-average window for targets, as a fraction of
      the steps (see ``experiments.report.metrics``).
    tune_grid: multipliers of the preset learning rate tried by ``--tune-lr``.
    tune_fraction: fraction of the steps each tuning run trains (at P = 1).
    plumbing: a check that the machinery runs, too short for the study's quantities: its report
      gives no verdicts.
    published: the folder (from the repository's root) of this preset's published study: the
      report compares the sweep's runs with its runs of the same names, and draws verdicts only
      with at least as many seeds (``experiments.report.published``).
    data: the corpus when ``--data`` is not given (``experiments.harness.data.load``'s argument;
      ``None``: the default corpus).
    settings: run settings (``experiments.harness.optimizers.SETTINGS``: ``(("b2", 0.99),)``)
      applied to the optimizer of every method that takes them (the sweep's ``--b1``, ``--b2``,
      ``--shampoo-beta``, ...); the others keep their runs.
  """

  name: str
  template: RunConfig
  stage_counts: tuple[int, ...]
  methods: tuple[str, ...]
  learning_rates: tuple[tuple[str, float], ...]
  tuned_rates: tuple[tuple[str, float], ...] = ()
  ablations: tuple[str, ...] = ()
  seeds: tuple[int, ...] = (0,)
  smooth_fraction: float = 0.05
  tune_grid: tuple[float, ...] = (0.5, 1.0, 2.0)
  tune_fraction: float = 0.25
  plumbing: bool = False
  published: str | None = None
  data: str | None = None
  settings: tuple[tuple[str, object], ...] = ()

  def published_folder(self) -> pathlib.Path | None:
    """``published`` in this checkout, if it holds the study's curves (an installed copy may not)."""
    folder = ROOT / self.published if self.published else None
    return folder if folder is not None and (folder / "curves.json.xz").is_file() else None

  def learning_rate(self, method: str) -> float:
    """The method's own entry; else, for a rotation variant, rotation's; else ``default``."""
    table = dict(self.learning_rates)
    if method in table:
      return table[method]
    if isinstance(methods_lib.check_method(method).base, Rotation) and "rotation" in table:
      return table["rotation"]
    return table["default"]

  def config(self, method: str, stages: int, seed: int, **overrides) -> RunConfig:
    """The run of ``method`` at P = ``stages``: the template, the method's rate, its optimizer with
    the preset's ``settings`` it takes, then ``overrides`` (``RunConfig`` fields and run settings,
    which the method must take: ``methods.spec``)."""
    settings = {k: v for k, v in self.settings if methods_lib.check_method(method).takes(k)}
    settings.update({k: overrides.pop(k) for k in list(overrides) if k in SETTINGS})
    fields = dict(optimizer=methods_lib.spec(method, **settings), stages=stages, seed=seed,
                  lr=self.learning_rate(method))
    return dataclasses.replace(self.template, **{**fields, **overrides})

  def window(self, steps: int | None = None) -> int:
    return max(1, int((steps or self.template.steps) * self.smooth_fraction))


ROOT = pathlib.Path(__file__).resolve().parents[2]
_MAIN = methods_lib.BASELINES + ("rotation",)
# The CPU studies add Muon (optax.contrib.muon, RMS-matched to AdamW), the method the follow-up
# (arXiv 2606.30634) finds robust to a one-step delay: both papers' claims in one study.
_CPU = _MAIN + ("muon",)

PRESETS = {
    "smoke": Preset(
        name="smoke", template=RunConfig(model="cpu-tiny", batch_size=4, steps=40, chunk=10,
                                         eval_every=20, eval_batches=2, checkpoint_every=20),
        stage_counts=(1, 4), methods=("pipedream", "rotation"), learning_rates=(("default", 3e-3),),
        smooth_fraction=0.1, plumbing=True),
    # The regime study (python -m experiments.studies.regime) chose the setting: among those that fit 20
    # minutes on 2 cores, the longest training relative to the largest delay (2,400 steps at
    # P = 16). Rates from its P = 1 grid of 0.5x/1x/2x of 3e-3 (its numbers were not committed):
    # 3e-3 was the baselines' best, rotation's 6e-3 ahead of its 3e-3 within one seed's noise, so
    # every method shares 3e-3 and rotation's 6e-3 is the second reading; the report checks whether
    # it beats the shared rate beyond the seed noise. Two seeds by default (24 runs, a reproduction
    # of the published runs of the same names); the published study (``published``) adds seeds with
    # --seeds, and only as many seeds as it has draw verdicts.
    "cpu": Preset(
        name="cpu", template=RunConfig(model="cpu-deep", batch_size=16, steps=2400, chunk=100,
                                       eval_every=1200, checkpoint_every=1200),
        stage_counts=(1, 16), methods=_CPU, seeds=(0, 1), learning_rates=(("default", 3e-3),),
        tuned_rates=(("rotation", 6e-3),), published="docs/results/cpu"),
    # The same regime with the whole P curve.
    "cpu-long": Preset(
        name="cpu-long", template=RunConfig(model="cpu-deep", batch_size=16, steps=2400, chunk=100,
                                            eval_every=1200, checkpoint_every=1200),
        stage_counts=(1, 2, 4, 8, 16), methods=_CPU, seeds=(0, 1, 2), learning_rates=(("default", 3e-3),),
        tuned_rates=(("rotation", 6e-3),)),
    # The width ladder (docs/protocol.md amendment 10): cpu-deep's 16 blocks at --width 32, 64 or
    # 128, the whole standard library seen once (single-pass sampling), 4,800 steps, validation on
    # 32 micro-batches; every (method, P, width) at its tuned rate (--lr), seeds 12-15.
    "ladder": Preset(
        name="ladder", template=RunConfig(model="cpu-deep", batch_size=16, steps=4800, chunk=100,
                                          eval_every=1200, eval_batches=32, checkpoint_every=1200,
                                          warmup_steps=28, sampling="single-pass"),
        stage_counts=(1, 16), methods=("pipedream", "nesterov", "rotation", "muon"), seeds=(12, 13, 14, 15),
        learning_rates=(("default", 3e-3),), data="stdlib-all"),
    "gpu-95m": Preset(
        name="gpu-95m", template=RunConfig(model="paper-95m", batch_size=32, steps=10000, chunk=100,
                                           eval_every=1000, eval_batches=8, checkpoint_every=1000,
                                           remat="nothing_saveable", loss_chunk=2048),
        stage_counts=(1, 2, 4, 8, 16, 32), methods=_MAIN, learning_rates=(("default", 1e-3),),
        ablations=("variants", "stage-aware", "no-stashing", "refresh-period"),
        smooth_fraction=0.02),
}

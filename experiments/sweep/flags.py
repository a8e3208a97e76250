"""The sweep's command line: its flags, and the one table (``CONFIG_FLAGS``) that maps a flag to the
``RunConfig`` field or the run setting it sets.

A flag of ``CONFIG_FLAGS`` sets its field in the preset's template (every run), or its run setting
(``experiments.harness.optimizers.SETTINGS``) in the optimizer of every method that takes it
(``Preset.settings``; the others keep their names and runs). Its range is checked here, naming the
flag; the optimizer's value checks its own, and ``RunConfig.validate`` the rest of every run.
The other flags choose what runs (methods, depths, seeds, rates, ablations) and where results go.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

import pipeline_sim as ps
from experiments import cli
from experiments.harness import methods as methods_lib
from experiments.harness import model as model_lib
from experiments.harness.config import EXECUTIONS, RunConfig
from experiments.harness.optimizers import SETTINGS
from experiments.report import ablations as ablations_lib
from experiments.report import curves
from experiments.sweep import presets as presets_lib

DESCRIPTION = ("``python -m experiments.sweep``: the paper's staleness study, resumable, with tables "
               "and plots." """

Runs every (method, P, seed) of a preset plus the chosen ablations, each as an emulated
asynchronous pipeline, then writes ``results.csv``, ``report.md`` and PNG figures into one folder.
Running the same command again skips finished runs and resumes unfinished ones from their last
checkpoint; a run's folder is named by everything that changes its numbers (settings, data hash,
vocabulary), so a run is never reused with other settings or other data. ``--finished-only
--publish DIR`` reports the runs that have finished so far (of a sweep in progress or interrupted)
into DIR, training nothing.
""")


@dataclasses.dataclass(frozen=True)
class ConfigFlag:
  """A flag that sets one ``RunConfig`` field, or one run setting of the optimizers.

  Attributes:
    flag: the command-line flag, ``--batch-size``.
    field: the ``RunConfig`` field it sets, or the run setting (a key of
      ``experiments.harness.optimizers.SETTINGS``) it sets in every method that takes it.
    help: its help text.
    type: argparse's type (``bool``: a switch).
    minimum: the smallest value allowed, checked here and named by the flag.
    value: the flag's value -> the field's (``--loss-chunk 0`` is ``None``, off).
    choices: argparse's choices.
  """

  flag: str
  field: str
  help: str
  type: type = int
  minimum: float | None = None
  value: Callable = lambda v: v
  choices: tuple | None = None

  @property
  def dest(self) -> str:
    return self.flag[2:].replace("-", "_")

  def check(self, value) -> None:
    if self.minimum is not None and not value >= self.minimum:
      raise ValueError(f"{self.flag} must be >= {self.minimum:g}{self._off()}, got {value}")

  def _off(self) -> str:
    return " (0: off)" if self.minimum == 0 and self.value(0) is None else ""


# Every flag that sets a RunConfig field, in --help's order within its group.
_STUDY = (
    ConfigFlag("--batch-size", "batch_size", "micro-batch size (default: the preset's)", minimum=1),
    ConfigFlag("--model", "model", f"model config, one of {sorted(model_lib.CONFIGS)} (default: the "
               "preset's)", type=str),
    ConfigFlag("--blocks", "num_blocks", "Transformer blocks (default: the model's; a multiple of every "
               "P)", minimum=1),
    ConfigFlag("--width", "width", "model width (default: the model's), with heads of the model's head "
               "size", minimum=1),
    ConfigFlag("--refresh-every", "refresh_every", "basis refresh period of rotation methods (default: "
               "each method's own, 10)", minimum=1),
    ConfigFlag("--sampling", "sampling", "training batches: 'random' windows (default) or "
               "'single-pass' (no training token seen twice: the runs must fit in one pass over the "
               "data's training split; --data stdlib-all holds about 28M training tokens)", type=str,
               choices=("random", "single-pass")),
)
_TRAINING = (
    ConfigFlag("--warmup", "warmup_fraction", "warm-up fraction of training (default: the preset's, "
               "0.012 as in the paper)", type=float),
    ConfigFlag("--warmup-steps", "warmup_steps", "warm-up length in steps (instead of --warmup's "
               "fraction)"),
    ConfigFlag("--b2", "b2", "second-moment decay of every method (default 0.999; rotation's L, R "
               "statistics follow it)", type=float),
    ConfigFlag("--shampoo-beta", "shampoo_beta", "decay of rotation's L, R statistics, for the rotation "
               "methods of the sweep only (default: b2); the estimation-lag study", type=float),
    ConfigFlag("--predict-scale", "predict_scale", "weight prediction's scale s for the '+predict' "
               "methods of the sweep (default 1.0: extrapolate over the whole delay)", type=float),
    ConfigFlag("--dc-lambda", "dc_lambda", "delay compensation's lambda for the '+dc' methods of the "
               "sweep (default 1.0, adaptive form)", type=float),
    ConfigFlag("--b1", "b1", "first-moment (momentum) decay of every method (default: each method's "
               "own: 0.9; Nesterov 0.99; Muon 0.95)", type=float),
    ConfigFlag("--dtype", "dtype", "activations and matmuls (default float32; bfloat16 keeps float32 "
               "parameters and optimizer states)", type=str, choices=model_lib.DTYPES),
    ConfigFlag("--remat", "remat", "rematerialise each Transformer block with this "
               "jax.checkpoint_policies policy, e.g. nothing_saveable (default: the preset's; gpu "
               "presets: nothing_saveable; 'none' turns it off); memory, not numbers", type=str,
               value=lambda v: None if v == "none" else v),
    ConfigFlag("--loss-chunk", "loss_chunk", "tokens per chunk of the output head and loss, so that the "
               "full logits never exist (default: the preset's; gpu presets: 2048; 0 turns it off)",
               minimum=0, value=lambda v: v or None),
)
_PIPELINE = (
    ConfigFlag("--mode", "mode", "pipeline emulation of the main study (default weight_stashing, "
               "PipeDream)", type=str, choices=ps.MODES),
    ConfigFlag("--schedule", "schedule", "asynchronous schedule (default 1f1b, PipeDream: stage k lags "
               "P - 1 - k updates; 2bw, PipeDream-2BW: every stage one update, whatever P; uniform-D: "
               "every stage D updates, P = 1 included; 2bw and uniform-D need mode weight_stashing)",
               type=str, value=lambda v: ps.schedule_of(v).name),
    ConfigFlag("--execution", "execution", "emulated (default: one program computes every stage) or "
               "devices (stage k on device k, 1F1B with ppermute; the device count must be a multiple "
               "of every P)", type=str, choices=EXECUTIONS),
    ConfigFlag("--fsdp", "fsdp", "shard the emulated pipeline's state over the data devices (fully "
               "sharded data parallelism) instead of replicating it", type=bool),
)
_DIAGNOSTICS = (
    ConfigFlag("--diagnose-every", "diagnose_every", "log update diagnostics every N steps (a multiple "
               "of the chunk; opt-in, emulated weight_stashing/no_stashing runs): per stage, the cosine "
               "of stale and fresh updates and the sign-flip rate along the top eigenvectors, over "
               "--diagnose-steps trial steps (the run's numbers do not change)"),
    ConfigFlag("--diagnose-steps", "diagnose_steps", "length of each diagnostic window (default 16)"),
)
CONFIG_FLAGS = _STUDY + _TRAINING + _PIPELINE + _DIAGNOSTICS
assert {f.field for f in CONFIG_FLAGS} <= {f.name for f in dataclasses.fields(RunConfig)} | set(SETTINGS)


def _add(parser, flags) -> None:
  for f in flags:
    if f.type is bool:
      parser.add_argument(f.flag, action="store_true", default=None, help=f.help)
    else:
      parser.add_argument(f.flag, type=f.type, choices=f.choices, help=f.help)


def _study_flags(parser) -> None:
  """What the sweep trains: the preset, methods, depths, seeds, steps, rates and model."""
  parser.add_argument("--preset", default="cpu", help=f"one of {sorted(presets_lib.PRESETS)} (default cpu: "
                      "24 runs, seeds 0 and 1, the published runs of those seeds again); gpu-95m is "
                      "the paper's 95M model")
  parser.add_argument("--methods", nargs="+", help=f"methods to run at every P (default: the preset's); "
                      f"known: {sorted(methods_lib.METHODS)}")
  parser.add_argument("--stages", nargs="+", type=int, help="pipeline depths P (default: the preset's); "
                      "P = 1 is always added as the synchronous reference (a remedy's: its optimizer's; "
                      "rotation-stage-decay's: rotation's)")
  parser.add_argument("--no-reference", action="store_true", help="train the --stages given only, "
                      "without the P = 1 reference (for P = 1 runs trained in a sweep of their own, at "
                      "other rates; this sweep's report then has no slowdowns)")
  parser.add_argument("--seeds", nargs="+", type=int, help="seeds (default: the preset's; tables: "
                      "mean and range over seeds)")
  parser.add_argument("--steps", type=int, help="steps per run (a multiple of the preset's chunk)")
  parser.add_argument("--lr", nargs="+", help="peak learning rate: one value for every method, or "
                      "METHOD=VALUE pairs (default: the preset's)")
  _add(parser, _STUDY)


def _training_flags(parser) -> None:
  """How each run trains: warm-up, decays, the remedies' settings, precision, memory and data."""
  _add(parser, _TRAINING[:2])
  parser.add_argument("--warmup-delays", type=float, help="warm-up length as a multiple of the largest "
                      "delay of the sweep, tau_max = max(P) - 1, in steps, for every run (P = 1 too, so "
                      "that every P shares one schedule)")
  _add(parser, _TRAINING[2:])
  parser.add_argument("--data", help="'stdlib-all' (every standard-library .py file, about 30 MiB), "
                      "a text file (bytes) or a nanoGPT-style uint16 .bin token file; "
                      "default: the first 8 MiB of the Python standard library's source")
  parser.add_argument("--vocab-size", type=int, help="vocabulary of a .bin token file (default 50257)")


def _pipeline_flags(parser) -> None:
  """The pipeline: its mode, schedule, execution and the ablation groups."""
  _add(parser, _PIPELINE)
  groups = "; ".join(f"{k}: {v.description.rstrip('.')}" for k, v in ablations_lib.ABLATIONS.items())
  parser.add_argument("--ablations", nargs="*", help="ablation groups (default: the preset's): "
                      + groups.replace("%", "%%"))  # argparse %-formats help strings


def _output_flags(parser) -> None:
  """Where results go and how the sweep runs: folders, publishing, restore, diagnostics, jobs."""
  parser.add_argument("--out", help="results folder (default results/<preset>)")
  parser.add_argument("--publish", help="also copy report.md, summary.json, the curves "
                      "file and the figures into this "
                      "folder (for example docs/results/cpu), after the report is written")
  parser.add_argument("--restore-from", nargs="+", default=[], metavar="FOLDER", help="before training, "
                      "write the result of every run of this sweep that is missing in --out but published "
                      f"in one of these folders' {curves.FILE} (its docs/results folder, say), so that a "
                      "sweep moved to a new machine trains only what never finished (a run is matched by "
                      "its folder name: its settings, data and vocabulary)")
  parser.add_argument("--dry-run", action="store_true", help="print the plan (every run, cached or "
                      "not) with each unfinished run's compiled FLOPs per step, memory and estimated "
                      "time from one timed chunk; trains nothing")
  parser.add_argument("--finished-only", action="store_true", help="report the plan's runs that have "
                      "finished in --out into the --publish folder (required), training nothing: a look "
                      "at a sweep in progress (another process may be training in --out), or the "
                      "finished part of an interrupted one. The report's seed statistics count only "
                      "the seeds that hold every method's runs (--methods narrows that)")
  _add(parser, _DIAGNOSTICS)
  parser.add_argument("--jobs", type=int, help="runs trained at once, each in its own process, "
                      "with the same numbers as one at a time (default on one host's CPU: one per "
                      "usable core; else 1). One run keeps little more than one core busy (many "
                      "small XLA ops); runs trained together count each other's load in their seconds "
                      "per step, so the report then shows no wall-clock to target (--jobs 1 times "
                      "every run alone)")
  parser.add_argument("--keep-checkpoints", action="store_true", help="keep each finished run's "
                      "checkpoints (its trained state, which `python -m experiments.studies.hessian` "
                      "reads); by default they are deleted when the run finishes (a run checkpoints "
                      "at least every tenth of its steps while it trains, to resume from)")
  parser.add_argument("--tune-lr", action="store_true", help="choose each method's peak learning "
                      "rate from the preset's grid with short runs at P = 1 (choice recorded)")


def parse_args(argv=None):
  parser = cli.Parser(prog="python -m experiments.sweep", description=DESCRIPTION)
  for add in (_study_flags, _training_flags, _pipeline_flags, _output_flags):
    add(parser)
  return parser.parse_args(argv)


def given(args) -> dict:
  """``{ConfigFlag: field value}`` of the config flags on the command line, each checked."""
  out = {}
  for f in CONFIG_FLAGS:
    value = getattr(args, f.dest)
    if value is not None:
      f.check(value)
      try:
        out[f] = f.value(value)
      except ValueError as e:
        raise ValueError(f"{f.flag}: {e}") from None
  return out


def template_fields(args, template: RunConfig) -> dict:
  """The template's fields that the command line sets (flags that apply to every run); ``--steps``
  also moves evaluation and checkpoints to multiples of the new length."""
  over = {f.field: v for f, v in given(args).items() if f.field not in SETTINGS}
  if args.steps is not None:
    if args.steps < template.chunk or args.steps % template.chunk:
      raise ValueError(f"--steps {args.steps} must be a positive multiple of the chunk {template.chunk}")
    every = lambda n: n if args.steps % n == 0 else template.chunk
    over.update(steps=args.steps, eval_every=every(template.eval_every),
                checkpoint_every=every(template.checkpoint_every))
  if "model" in over and over["model"] not in model_lib.CONFIGS:
    raise ValueError(f"--model {over['model']!r} is unknown; choose from {sorted(model_lib.CONFIGS)}")
  named = [n for n in ("--warmup", "--warmup-steps", "--warmup-delays")
           if getattr(args, n[2:].replace("-", "_")) is not None]
  if len(named) > 1:
    raise ValueError(f"give one of {' and '.join(named)}: each sets the warm-up")
  if "warmup_fraction" in over and not 0 <= over["warmup_fraction"] < 1:
    raise ValueError(f"--warmup must be in [0, 1), got {over['warmup_fraction']}")
  if args.warmup_delays is not None and not args.warmup_delays >= 0:
    raise ValueError(f"--warmup-delays must be >= 0, got {args.warmup_delays}")
  return over


def settings(args) -> tuple:
  """The run settings that the command line sets (``Preset.settings``)."""
  return tuple((f.field, v) for f, v in given(args).items() if f.field in SETTINGS)


def learning_rates(preset, values):
  """``--lr`` values -> the preset's learning-rate table with them applied.

  At most one plain value (every method's rate) and at most one ``METHOD=VALUE`` per method, in any
  order: a per-method value wins over the plain one."""
  plain, per_method = None, {}
  for v in values or ():
    method, _, rate = v.rpartition("=")
    try:
      rate = float(rate)
    except ValueError:
      raise ValueError(f"--lr {v!r}: not a number or METHOD=NUMBER") from None
    if not rate > 0:
      raise ValueError(f"--lr {v!r}: a learning rate must be > 0")
    if method:
      methods_lib.check_method(method)
      if method in per_method:
        raise ValueError(f"--lr gives {method} two rates ({per_method[method]:g} and {rate:g})")
      per_method[method] = rate
    elif plain is not None:
      raise ValueError(f"--lr gives two plain rates ({plain:g} and {rate:g}); give one, and "
                       "METHOD=VALUE for the others")
    else:
      plain = rate
  table = {"default": plain} if plain is not None else dict(preset.learning_rates)
  return tuple({**table, **per_method}.items())


def make_preset(args) -> presets_lib.Preset:
  """The preset with the command line's overrides applied to its template."""
  if args.preset not in presets_lib.PRESETS:
    raise ValueError(f"unknown preset {args.preset!r}; choose from {sorted(presets_lib.PRESETS)}")
  preset = presets_lib.PRESETS[args.preset]
  return dataclasses.replace(preset, template=dataclasses.replace(
      preset.template, **template_fields(args, preset.template)),
      settings=(*preset.settings, *settings(args)),
      learning_rates=learning_rates(preset, args.lr),
      # a chosen rate replaces the preset's tuned readings
      tuned_rates=() if args.lr or args.tune_lr else preset.tuned_rates)

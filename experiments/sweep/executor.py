"""``python -m experiments.sweep``: the paper's staleness study, resumable, with tables and plots.

Runs every (method, P, seed) of a preset plus the chosen ablations, each as an emulated
asynchronous pipeline, then writes ``results.csv``, ``report.md`` and PNG figures into one folder.
Running the same command again skips finished runs and resumes unfinished ones from their last
checkpoint; a run's folder is named by everything that changes its numbers (settings, data hash,
vocabulary), so a run is never reused with other settings or other data. ``--finished-only
--publish DIR`` reports the runs that have finished so far (of a sweep in progress or interrupted)
into DIR, training nothing.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import fcntl
import pathlib
import re
import shutil
import sys
import time
import warnings

import jax
import numpy as np
from tqdm import tqdm

import pipeline_sim as ps
from experiments import cli
from experiments.harness import data as data_lib
from experiments.harness import memory as memory_lib
from experiments.harness import methods as methods_lib
from experiments.harness import model as model_lib
from experiments.harness import processes, provenance, runs
from experiments.harness.config import EXECUTIONS, run_dir
from experiments.report import ablations as ablations_lib
from experiments.report import build as report
from experiments.report import curves, metrics, tables
from experiments.sweep import presets as presets_lib
from experiments.sweep import workers


def _study_flags(parser) -> None:
  """What the sweep trains: the preset, methods, depths, seeds, steps, rates and model."""
  parser.add_argument("--preset", default="cpu", help=f"one of {sorted(presets_lib.PRESETS)} (default cpu: "
                      "24 runs, seeds 0 and 1, about 25 minutes on a 2-core CPU); gpu-95m is the "
                      "paper's 95M model")
  parser.add_argument("--methods", nargs="+", help=f"methods to run at every P (default: the preset's); "
                      f"known: {sorted(methods_lib.METHODS)}")
  parser.add_argument("--stages", nargs="+", type=int, help="pipeline depths P (default: the preset's); "
                      "P = 1 is always added as the synchronous reference (a remedy's: its optimizer's; "
                      "rotation-stage-decay's: rotation's)")
  parser.add_argument("--seeds", nargs="+", type=int, help="seeds (default: the preset's; tables: "
                      "mean and range over seeds)")
  parser.add_argument("--steps", type=int, help="steps per run (a multiple of the preset's chunk)")
  parser.add_argument("--lr", nargs="+", help="peak learning rate: one value for every method, or "
                      "METHOD=VALUE pairs (default: the preset's)")
  parser.add_argument("--batch-size", type=int, help="micro-batch size (default: the preset's)")
  parser.add_argument("--model", help=f"model config, one of {sorted(model_lib.CONFIGS)} "
                      "(default: the preset's)")
  parser.add_argument("--blocks", type=int, help="Transformer blocks (default: the model's; a "
                      "multiple of every P)")
  parser.add_argument("--width", type=int, help="model width (default: the model's), with heads of the "
                      "model's head size")
  parser.add_argument("--refresh-every", type=int, help="basis refresh period of rotation methods "
                      "(default: each method's own, 10)")


def _training_flags(parser) -> None:
  """How each run trains: warm-up, decays, the remedies' settings, precision, memory and data."""
  parser.add_argument("--warmup", type=float, help="warm-up fraction of training (default: the "
                      "preset's, 0.012 as in the paper)")
  parser.add_argument("--warmup-steps", type=int, help="warm-up length in steps (instead of --warmup's "
                      "fraction)")
  parser.add_argument("--warmup-delays", type=float, help="warm-up length as a multiple of the largest "
                      "delay of the sweep, tau_max = max(P) - 1, in steps, for every run (P = 1 too, so "
                      "that every P shares one schedule)")
  parser.add_argument("--b2", type=float, help="second-moment decay of every method (default 0.999; "
                      "rotation's L, R statistics follow it)")
  parser.add_argument("--shampoo-beta", type=float, help="decay of rotation's L, R statistics, for "
                      "the rotation methods of the sweep only (default: b2); the estimation-lag study")
  parser.add_argument("--predict-scale", type=float, help="weight prediction's scale s for the "
                      "'+predict' methods of the sweep (default 1.0: extrapolate over the whole delay)")
  parser.add_argument("--dc-lambda", type=float, help="delay compensation's lambda for the '+dc' "
                      "methods of the sweep (default 1.0, adaptive form)")
  parser.add_argument("--b1", type=float, help="first-moment (momentum) decay of every method "
                      "(default: each method's own: 0.9; Nesterov 0.99; Muon 0.95)")
  parser.add_argument("--dtype", choices=model_lib.DTYPES, help="activations and matmuls (default "
                      "float32; bfloat16 keeps float32 parameters and optimizer states)")
  parser.add_argument("--remat", help="rematerialise each Transformer block with this "
                      "jax.checkpoint_policies policy, e.g. nothing_saveable (default: the preset's; gpu "
                      "presets: nothing_saveable; 'none' turns it off); memory, not numbers")
  parser.add_argument("--loss-chunk", type=int, help="tokens per chunk of the output head and loss, so "
                      "that the full logits never exist (default: the preset's; gpu presets: 2048; 0 "
                      "turns it off)")
  parser.add_argument("--data", help="a text file (bytes) or a nanoGPT-style uint16 .bin token file; "
                      "default: the Python standard library's source")
  parser.add_argument("--vocab-size", type=int, help="vocabulary of a .bin token file (default 50257)")


def _pipeline_flags(parser) -> None:
  """The pipeline: its mode, schedule, execution and the ablation groups."""
  parser.add_argument("--mode", default="weight_stashing", choices=ps.MODES,
                      help="pipeline emulation of the main study (default weight_stashing, PipeDream)")
  parser.add_argument("--schedule", choices=ps.SCHEDULES, help="asynchronous schedule (default 1f1b, "
                      "PipeDream: stage k lags P - 1 - k updates; 2bw, PipeDream-2BW: every stage one "
                      "update, whatever P; mode weight_stashing, emulated)")
  parser.add_argument("--execution", choices=EXECUTIONS, help="emulated (default: one program "
                      "computes every stage) or devices (stage k on device k, 1F1B with ppermute; the "
                      "device count must be a multiple of every P)")
  parser.add_argument("--fsdp", action="store_true", help="shard the emulated pipeline's state over "
                      "the data devices (fully sharded data parallelism) instead of replicating it")
  groups = "; ".join(f"{k}: {v.description.rstrip('.')}" for k, v in ablations_lib.ABLATIONS.items())
  parser.add_argument("--ablations", nargs="*", help="ablation groups (default: the preset's): "
                      + groups.replace("%", "%%"))  # argparse %-formats help strings


def _output_flags(parser) -> None:
  """Where results go and how the sweep runs: folders, publishing, restore, diagnostics, jobs."""
  parser.add_argument("--out", help="results folder (default results/<preset>)")
  parser.add_argument("--publish", help="also copy report.md, results.csv, summary.json, the curves "
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
  parser.add_argument("--diagnose-every", type=int, help="log update diagnostics every N steps (a "
                      "multiple of the chunk; opt-in, emulated weight_stashing/no_stashing runs): per "
                      "stage, the cosine of stale and fresh updates and the sign-flip rate along the top "
                      "eigenvectors, over --diagnose-steps trial steps (the run's numbers do not change)")
  parser.add_argument("--diagnose-steps", type=int, help="length of each diagnostic window (default 16)")
  parser.add_argument("--jobs", type=int, help="runs trained at once, each in its own process, "
                      "with the same numbers as one at a time (default on one host's CPU: one per "
                      "usable core; else 1). One run keeps little more than one core busy (many "
                      "small XLA ops), so on 2 cores two at a time finish a sweep about 1.4x sooner; "
                      "their seconds per step include the others' load, so the report then shows no "
                      "wall-clock to target (--jobs 1 times every run alone)")
  parser.add_argument("--tune-lr", action="store_true", help="choose each method's peak learning "
                      "rate from the preset's grid with short runs at P = 1 (choice recorded)")


def parse_args(argv=None):
  parser = argparse.ArgumentParser(
      prog="python -m experiments.sweep", description=__doc__,
      formatter_class=argparse.RawDescriptionHelpFormatter)
  for add in (_study_flags, _training_flags, _pipeline_flags, _output_flags):
    add(parser)
  return parser.parse_args(argv)


@dataclasses.dataclass(frozen=True)
class Plan:
  preset: presets_lib.Preset
  main: tuple  # RunConfigs of the main study (learning rates may be re-chosen by tuning)
  ablations: tuple  # (group name, RunConfig) pairs
  stages: tuple  # the main study's P values (1 included)
  jobs: int = 1  # runs trained at once (``resolve_jobs``)


def resolve_jobs(jobs: int | None, template) -> int:
  """``--jobs``: ``None`` means one run per usable core where runs can share the host (one process,
  CPU backend, emulated execution without ``fsdp``), else 1; an explicit value is checked."""
  shared = (jax.default_backend() == "cpu" and jax.process_count() == 1
            and template.execution != "devices" and not template.fsdp)
  if jobs is None:
    return len(provenance.usable_cores()) if shared else 1
  if jobs < 1:
    raise ValueError(f"--jobs must be >= 1, got {jobs}")
  if jobs > 1 and not shared:
    raise ValueError(f"--jobs {jobs} trains several runs at once on one host's CPU; on "
                     "accelerators, several hosts, --execution devices or --fsdp every run needs the "
                     "devices to itself: use --jobs 1")
  return jobs


def _learning_rates(preset, values):
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
  t = preset.template
  over = {}
  if args.steps is not None:
    if args.steps < t.chunk or args.steps % t.chunk:
      raise ValueError(f"--steps {args.steps} must be a positive multiple of the chunk {t.chunk}")
    every = lambda n: n if args.steps % n == 0 else t.chunk
    over.update(steps=args.steps, eval_every=every(t.eval_every), checkpoint_every=every(t.checkpoint_every))
  if args.batch_size is not None:
    if args.batch_size < 1:
      raise ValueError(f"--batch-size must be >= 1, got {args.batch_size}")
    over["batch_size"] = args.batch_size
  if args.model is not None:
    if args.model not in model_lib.CONFIGS:
      raise ValueError(f"--model {args.model!r} is unknown; choose from {sorted(model_lib.CONFIGS)}")
    over["model"] = args.model
  for flag, field in (("blocks", "num_blocks"), ("width", "width")):
    value = getattr(args, flag)
    if value is not None:
      if value < 1:
        raise ValueError(f"--{flag} must be >= 1, got {value}")
      over[field] = value
  if args.refresh_every is not None:
    if args.refresh_every < 1:
      raise ValueError(f"--refresh-every must be >= 1, got {args.refresh_every}")
    over["refresh_every"] = args.refresh_every
  if args.dtype is not None:
    over["dtype"] = args.dtype
  if args.remat is not None:
    over["remat"] = None if args.remat == "none" else args.remat  # RunConfig.validate checks the name
  if args.loss_chunk is not None:
    if args.loss_chunk < 0:
      raise ValueError(f"--loss-chunk must be >= 0 (0: off), got {args.loss_chunk}")
    over["loss_chunk"] = args.loss_chunk or None
  if args.execution is not None:
    over["execution"] = args.execution
  if args.schedule is not None:
    over["schedule"] = args.schedule
  if args.fsdp:
    over["fsdp"] = True
  given = [n for n, v in (("--warmup", args.warmup), ("--warmup-steps", args.warmup_steps),
                          ("--warmup-delays", args.warmup_delays)) if v is not None]
  if len(given) > 1:
    raise ValueError(f"give one of {' and '.join(given)}: each sets the warm-up")
  if args.warmup is not None:
    if not 0 <= args.warmup < 1:
      raise ValueError(f"--warmup must be in [0, 1), got {args.warmup}")
    over["warmup_fraction"] = args.warmup
  if args.warmup_steps is not None:
    over["warmup_steps"] = args.warmup_steps  # RunConfig.validate checks it against the steps
  if args.warmup_delays is not None and not args.warmup_delays >= 0:
    raise ValueError(f"--warmup-delays must be >= 0, got {args.warmup_delays}")
  if args.b2 is not None:
    over["b2"] = args.b2
  if args.b1 is not None:
    over["b1"] = args.b1
  if args.diagnose_every is not None:
    over["diagnose_every"] = args.diagnose_every
  if args.diagnose_steps is not None:
    over["diagnose_steps"] = args.diagnose_steps
  return dataclasses.replace(preset, template=dataclasses.replace(t, **over),
                             learning_rates=_learning_rates(preset, args.lr),
                             # a chosen rate replaces the preset's tuned readings
                             tuned_rates=() if args.lr or args.tune_lr else preset.tuned_rates)


def make_plan(args) -> Plan:
  """All run configs, validated before any training starts."""
  if args.finished_only and (not args.publish or args.tune_lr or args.dry_run):
    raise ValueError("--finished-only writes its report into --publish (required) and cannot be "
                     "combined with --tune-lr or --dry-run")
  if args.restore_from and (args.finished_only or args.dry_run):
    raise ValueError("--restore-from writes finished runs into --out before training and cannot be "
                     "combined with --finished-only or --dry-run")
  for folder in args.restore_from:
    path = pathlib.Path(folder)
    if not (path / curves.FILE).is_file() and not (path.is_file() and path.name == curves.FILE):
      raise ValueError(f"--restore-from {folder!r} holds no {curves.FILE} (give a sweep's --out or a "
                       "docs/results folder)")
  preset = make_preset(args)
  method_names = tuple(args.methods or preset.methods)
  for m in method_names:
    methods_lib.check_method(m)
  seeds = tuple(preset.seeds if args.seeds is None else args.seeds)
  if any(s < 0 for s in seeds):
    raise ValueError(f"--seeds must be >= 0, got {list(seeds)}")
  if len(set(seeds)) != len(seeds):
    raise ValueError(f"--seeds has duplicates: {list(seeds)}")
  stages = tuple(sorted(set(args.stages or preset.stages) | {1}))
  if args.warmup_delays is not None:
    preset = dataclasses.replace(preset, template=dataclasses.replace(
        preset.template, warmup_steps=round(args.warmup_delays * (max(stages) - 1))))
  names = tuple(preset.ablations if args.ablations is None else args.ablations)
  chosen = [(a, ablations_lib.check_ablation(a)) for a in names]

  def make(seed):
    def config(method, p, **kw):
      kw.setdefault("mode", args.mode)
      if args.shampoo_beta is not None and methods_lib.check_method(method).kind == "rotation":
        kw.setdefault("shampoo_beta", args.shampoo_beta)  # baselines keep their names (and runs)
      remedy = methods_lib.check_method(method).remedy
      if args.predict_scale is not None and remedy == "predict":
        kw.setdefault("predict_scale", args.predict_scale)
      if args.dc_lambda is not None and remedy == "dc":
        kw.setdefault("dc_lambda", args.dc_lambda)
      c = preset.config(method, p, seed, **kw)
      c.validate()
      return c
    return config

  def at_p1(m):  # the reference's P = 1 run stands for m's where it trains at m's rate
    ref = methods_lib.reference(m)
    return ref if preset.learning_rate(ref) == preset.learning_rate(m) else m

  main = tuple(dict.fromkeys(make(s)(at_p1(m) if p == 1 else m, p)
                             for s in seeds for m in method_names for p in stages))
  tuned = tuple((report.TUNED, make(s)(m, p, lr=lr)) for s in seeds for m, lr in preset.tuned_rates
                if m in method_names and lr != preset.learning_rate(m) for p in stages)
  extra = tuned + tuple((a, c) for s in seeds for a, ab in chosen for c in ab.runs(make(s), max(stages)))
  used = {c.method for c in main} | {c.method for _, c in extra}
  unused = sorted({m for m, _ in preset.learning_rates} - used - {"default"})
  if args.lr and unused:
    given = {v.rpartition("=")[0] for v in args.lr} - {""}
    for m in sorted(given & set(unused)):
      warnings.warn(f"--lr {m}=...: {m} is not among this sweep's methods ({sorted(used)})", stacklevel=2)
  jobs = resolve_jobs(args.jobs, preset.template)
  if preset.template.fsdp and jax.device_count() == 1:
    raise ValueError("--fsdp shards the state over the data devices, and there is only 1 device here "
                     "(on CPU: XLA_FLAGS=--xla_force_host_platform_device_count=N)")
  if preset.template.execution == "devices":
    n = jax.local_device_count()
    bad = sorted({c.stages for c in main + tuple(c for _, c in extra) if n % c.stages})
    if bad:
      raise ValueError(f"--execution devices puts stage k on device k: P = {bad} do not divide the "
                       f"{n} local devices")
  return Plan(preset, main, extra, stages, jobs)


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


def check_folder(path: pathlib.Path, flag: str) -> pathlib.Path:
  """A folder the tool writes into (perhaps hours later): a file in its place is an error now."""
  if path.exists() and not path.is_dir():
    raise ValueError(f"{flag} {str(path)!r} is a file, not a folder")
  return path


def check_file(path: pathlib.Path, flag: str) -> pathlib.Path:
  """A file the tool writes (perhaps hours later): a folder in its place is an error now."""
  if path.is_dir():
    raise ValueError(f"{flag} {str(path)!r} is a folder, not a file")
  return path


def prepare_out(path: pathlib.Path) -> pathlib.Path:
  """Creates the results folder; a clear error when that is impossible."""
  check_folder(path, "--out")
  error = None
  if processes.is_primary():  # several processes share the folder: process 0 writes, the others wait
    try:
      path.mkdir(parents=True, exist_ok=True)
      probe = path / ".write-test"
      probe.write_text("")
      probe.unlink()
    except OSError as e:
      error = e.strerror or str(e)
  if processes.agree(error is not None):  # every process learns process 0's failure (none waits for ever)
    raise ValueError(f"--out {str(path)!r} cannot be written" + (f": {error}" if error else
                                                                 " (process 0 could not write it)"))
  processes.barrier(f"results folder {path}")
  return path


@contextlib.contextmanager
def exclusive(out: pathlib.Path):
  """Holds ``out/.lock`` so that two sweeps never write into one results folder at once."""
  with open(out / ".lock", "w") as f:
    try:
      fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
      raise ValueError(f"another sweep is writing into {str(out)!r}; wait for it or use another "
                       "--out") from None
    yield


def _clear_figures(target: pathlib.Path) -> None:
  """Creates ``target`` and removes its figures (another report's would be left beside this one's)."""
  target.mkdir(parents=True, exist_ok=True)
  for old in target.glob("*.png"):
    old.unlink()


def publish(out: pathlib.Path, target: pathlib.Path, files=None) -> None:
  """Copies a sweep's report, table and the figures its report shows (not its runs, nor figures
  left in ``out`` by other sweeps), or ``files`` (a report first, then figures), into ``target``,
  replacing older figures there, so that a reader sees them without running anything."""
  if not files:
    shown = re.findall(r"!\[[^\]]*\]\(([^)/]+\.png)\)", (out / "report.md").read_text())
    files = [out / "report.md", out / "results.csv", out / "summary.json", out / curves.FILE,
             *(out / f for f in dict.fromkeys(shown))]
  _clear_figures(target)
  for f in files:
    shutil.copyfile(f, target / f.name)
  figures = sum(f.suffix == ".png" for f in files)
  print(f"published {files[0]} and {figures} figures to {target}")


def deviations(preset, ds, stages) -> list:
  """How this preset's runs differ from the paper's setup (listed in the report)."""
  t = preset.template
  cfg = t.model_config(ds.vocab_size)
  paper = model_lib.CONFIGS["paper-95m"]
  out = []
  if (cfg.num_blocks, cfg.width, cfg.num_heads, cfg.context) != (paper.num_blocks, paper.width,
                                                                  paper.num_heads, paper.context):
    out.append(f"model: {cfg.num_blocks} blocks, width {cfg.width}, {cfg.num_heads} heads, context "
               f"{cfg.context} (paper: 32 blocks, width 384, 6 heads, context 512)")
  out.append("model details: q/k/v/output and MLP layers carry biases (Flax nnx.Linear default); "
             "the paper's nanoGPT-style model may not")
  out.append(f"data: {ds.name}, vocabulary {ds.vocab_size} (paper: OpenWebText, about 1B tokens, "
             "GPT-2 BPE vocabulary 50257)")
  out.append(f"training: {t.steps} steps of batch {t.batch_size} x {cfg.context} tokens (paper: "
             "250 epochs of its data at P up to 32)")
  out.append(f"learning rates: {dict(preset.learning_rates)} at every P (the cpu presets': one "
             "shared rate from `python -m experiments.studies.regime`'s P = 1 grid; paper: 1e-3 at 95M, its "
             "baselines' rates not published)")
  if max(stages) < 32:
    out.append(f"largest P = {max(stages)} (paper: 32)")
  return out


def study_meta(preset, ds, stages, command: str) -> dict:
  """The study's description in its curves file (``experiments.report.curves``): what a rebuilt report
  says of how the runs were made."""
  t = preset.template
  window = preset.window()
  warmup = f"{t.warmup_steps} steps" if t.warmup_steps is not None else f"{t.warmup_fraction:.1%}"
  own_b1 = "each method's own"
  setting = [
      f"data: `{ds.name}`, {ds.num_tokens} tokens, vocabulary {ds.vocab_size}, sha256 `{ds.sha256}`",
      f"model `{t.model}`, {t.steps} steps of batch {t.batch_size}, warm-up {warmup} then cosine to "
      f"{t.final_lr_fraction:g} x peak, b2 {t.b2:g}, b1 "
      f"{own_b1 if t.b1 is None else format(t.b1, 'g')}, PipeDream-LR T_c = {t.pipemare_fraction:.1%} of "
      f"training; learning rates {dict(preset.learning_rates)}"
      + (f", tuned (second reading) {dict(preset.tuned_rates)}" if preset.tuned_rates else ""),
      f"smoothing: centred window of {2 * metrics.half_window(window) + 1} steps; a diverged or "
      "unfinished run is credited with nothing; with several seeds: mean [min, max] over seeds and "
      "Student's t 95% interval"]
  return {"preset": preset.name, "command": command, "code": provenance.code_version(), "window": window,
          "setting": setting, "deviations": deviations(preset, ds, stages), "plumbing": preset.plumbing}


def restore_finished(plan, ds, out: pathlib.Path, sources) -> int:
  """Restores into ``out`` (``runs.restore``) every run of ``plan`` that has no result there and is
  published in one of ``sources``' curves files; returns how many."""
  configs = list(plan.main) + [c for _, c in plan.ablations]
  folders = {f.name: f for f in (run_dir(c, ds, out) for c in configs)}
  restored = 0
  for source in sources:
    for record in curves.read(source)["runs"]:
      folder = folders.get(record["name"])
      if folder is not None and runs.load_result(folder) is None:
        runs.restore(record, folder, ds, str(source))
        restored += 1
  return restored


def report_finished(plan, ds, out: pathlib.Path, target: pathlib.Path, command: str) -> pathlib.Path:
  """Writes the curves file and the report of the runs of ``plan`` that have finished in ``out`` into
  ``target``; trains nothing and writes nothing in ``out`` (a sweep may be training there)."""
  every = [("main", c) for c in plan.main] + list(plan.ablations)
  records = [curves.record(group, result) for group, c in every
             if (result := runs.load_result(run_dir(c, ds, out))) is not None]
  if not records:
    raise ValueError(f"--finished-only: no run of this plan has finished in {str(out)!r}")
  _clear_figures(target)
  curves.write(target / curves.FILE, study_meta(plan.preset, ds, plan.stages, command), records)
  report.build(target, command=command)
  print(f"{len(records)} of {len(every)} runs finished: {target / 'report.md'}")
  return target


def main(argv=None) -> pathlib.Path:
  args = parse_args(argv)
  provenance.code_version()  # read now (cached): a commit made while the sweep runs is not this code
  processes.initialize_distributed()  # several hosts: see the README's "Many devices"
  plan = make_plan(args)
  if args.publish:
    check_folder(pathlib.Path(args.publish), "--publish")
  preset = plan.preset
  contexts = {c.model_config(256).context for c in plan.main} | {
      c.model_config(256).context for _, c in plan.ablations}
  ds = data_lib.load(args.data, context=max(contexts), vocab_size=args.vocab_size)
  out = pathlib.Path(args.out or f"results/{preset.name}")
  if args.dry_run:
    memory_lib.dry_run([("main", c) for c in plan.main] + list(plan.ablations), ds, out)
    return out
  command = ("python -m experiments.sweep " + " ".join(sys.argv[1:] if argv is None else argv)).strip()
  if args.finished_only:
    return report_finished(plan, ds, out, pathlib.Path(args.publish), command)
  out = prepare_out(out)
  with exclusive(out) if processes.is_primary() else contextlib.nullcontext():
    print(f"sweep '{preset.name}': {len(plan.main) + len(plan.ablations)} runs -> {out.resolve()}")
    print(f"data: {ds.name} ({ds.num_tokens} tokens, vocabulary {ds.vocab_size}, "
          f"sha256 {ds.sha256[:16]}...)")
    if args.restore_from:
      n = restore_finished(plan, ds, out, args.restore_from)
      print(f"restored {n} finished run(s) from {', '.join(args.restore_from)}")
    t0 = time.time()
    methods = {c.method for c in plan.main} | {c.method for _, c in plan.ablations}
    tuning = len(preset.tune_grid) * len(methods) if args.tune_lr else 0
    total = len(plan.main) + len(plan.ablations) + tuning
    with tqdm(total=total, desc="sweep", unit="run", dynamic_ncols=True) as overall:
      if args.tune_lr:
        chosen = tune_learning_rates(plan, ds, out, overall)
        plan = dataclasses.replace(
            plan, main=tuple(dataclasses.replace(c, lr=chosen[c.method]) for c in plan.main),
            ablations=tuple((a, dataclasses.replace(c, lr=chosen[c.method])) for a, c in plan.ablations))
      every = workers.run_all(list(plan.main) + [c for _, c in plan.ablations], ds, out, overall, plan.jobs)
      main_results = every[:len(plan.main)]
      ablation_results = [(a, r) for (a, _), r in zip(plan.ablations, every[len(plan.main):])]
    wall = time.time() - t0
    if processes.is_primary():
      meta = study_meta(preset, ds, plan.stages, command)
      records = [curves.record("main", r) for r in main_results]
      records += [curves.record(a, r) for a, r in ablation_results]
      curves.write(out / curves.FILE, meta, records)
      report.build(out, command=command)
      if args.publish:
        publish(out, pathlib.Path(args.publish))
  print(f"done in {wall:.0f}s: {out / 'report.md'}")
  return out


if __name__ == "__main__":
  cli.exit_process(cli.run(main))

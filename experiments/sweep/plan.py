"""The plan of a sweep: every run config of the preset and the command line, validated before any
training starts, and how many train at once."""

from __future__ import annotations

import dataclasses
import pathlib
import warnings

import jax

from experiments.harness import methods as methods_lib
from experiments.harness import provenance
from experiments.report import ablations as ablations_lib
from experiments.report import build as report
from experiments.report import curves
from experiments.sweep import flags
from experiments.sweep import presets as presets_lib


@dataclasses.dataclass(frozen=True)
class Plan:
  preset: presets_lib.Preset
  main: tuple  # RunConfigs of the main study (learning rates may be re-chosen by tuning)
  ablations: tuple  # (group name, RunConfig) pairs
  stage_counts: tuple  # the main study's P values (1 included unless --no-reference)
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
  preset = flags.make_preset(args)
  method_names = tuple(args.methods or preset.methods)
  for m in method_names:
    methods_lib.check_method(m)
  seeds = tuple(preset.seeds if args.seeds is None else args.seeds)
  if any(s < 0 for s in seeds):
    raise ValueError(f"--seeds must be >= 0, got {list(seeds)}")
  if len(set(seeds)) != len(seeds):
    raise ValueError(f"--seeds has duplicates: {list(seeds)}")
  stages = tuple(sorted(set(args.stages or preset.stage_counts) | (set() if args.no_reference else {1})))
  if args.warmup_delays is not None:
    preset = dataclasses.replace(preset, template=dataclasses.replace(
        preset.template, warmup_steps=round(args.warmup_delays * (max(stages) - 1))))
  names = tuple(preset.ablations if args.ablations is None else args.ablations)
  chosen = [(a, ablations_lib.check_group(a)) for a in names]

  def make(seed):
    def config(method, p, **kw):
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

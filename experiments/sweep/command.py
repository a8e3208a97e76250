"""``python -m experiments.sweep``: plan every run (``plan``), train what has not finished
(``workers``), and write the report (``experiments.report``); ``flags.DESCRIPTION`` is its ``--help``."""

from __future__ import annotations

import contextlib
import dataclasses
import pathlib
import sys
import time

from experiments.harness import data as data_lib
from experiments.harness import memory as memory_lib
from experiments.harness import processes, provenance, runs
from experiments.harness.config import run_dir
from experiments.report import build as report
from experiments.report import curves
from experiments.sweep import description, folders, tuning, workers
from experiments.sweep.flags import parse_args
from experiments.sweep.plan import make_plan


def report_finished(plan, ds, out: pathlib.Path, target: pathlib.Path, command: str) -> pathlib.Path:
  """Writes the curves file and the report of the runs of ``plan`` that have finished in ``out`` into
  ``target``; trains nothing and writes nothing in ``out`` (a sweep may be training there)."""
  every = [("main", c) for c in plan.main] + list(plan.ablations)
  records = [curves.record(group, result) for group, c in every
             if (result := runs.load_result(run_dir(c, ds, out))) is not None]
  if not records:
    raise ValueError(f"--finished-only: no run of this plan has finished in {str(out)!r}")
  folders.clear_figures(target)
  meta = description.study_meta(plan.preset, ds, plan.stage_counts, command)
  curves.write(target / curves.FILE, meta, records)
  report.build(target, command=command, published=plan.preset.published_folder())
  print(f"{len(records)} of {len(every)} runs finished: {target / 'report.md'}")
  return target


def main(argv=None) -> pathlib.Path:
  args = parse_args(argv)
  provenance.code_version()  # read now (cached): a commit made while the sweep runs is not this code
  processes.initialize_distributed()  # several hosts: see the README's "Many devices"
  plan = make_plan(args)
  if args.publish:
    folders.check_folder(pathlib.Path(args.publish), "--publish")
  preset = plan.preset
  contexts = {c.model_config(256).context for c in plan.main} | {
      c.model_config(256).context for _, c in plan.ablations}
  ds = data_lib.load(args.data or preset.data, context=max(contexts), vocab_size=args.vocab_size)
  for c in [c for c in plan.main] + [c for _, c in plan.ablations]:
    if c.sampling == "single-pass":  # before anything trains
      ds.check_single_pass(c.steps, c.batch_size, c.model_config(ds.vocab_size).context)
  out = pathlib.Path(args.out or f"results/{preset.name}")
  if args.dry_run:
    memory_lib.dry_run([("main", c) for c in plan.main] + list(plan.ablations), ds, out)
    return out
  command = ("python -m experiments.sweep " + " ".join(sys.argv[1:] if argv is None else argv)).strip()
  if args.finished_only:
    return report_finished(plan, ds, out, pathlib.Path(args.publish), command)
  out = folders.prepare_out(out)
  with folders.exclusive(out) if processes.is_primary() else contextlib.nullcontext():
    print(f"sweep '{preset.name}': {len(plan.main) + len(plan.ablations)} runs -> {out.resolve()}")
    print(f"data: {ds.name} ({ds.num_tokens} tokens, vocabulary {ds.vocab_size}, "
          f"sha256 {ds.sha256[:16]}...)")
    if args.restore_from:
      n = folders.restore_finished(plan, ds, out, args.restore_from)
      print(f"restored {n} finished run(s) from {', '.join(args.restore_from)}")
    t0 = time.time()
    methods = {c.method for c in plan.main} | {c.method for _, c in plan.ablations}
    trials = len(preset.tune_grid) * len(methods) if args.tune_lr else 0
    total = len(plan.main) + len(plan.ablations) + trials
    with workers.overall_bar(total) as overall:
      if args.tune_lr:
        chosen = tuning.tune_learning_rates(plan, ds, out, overall)
        plan = dataclasses.replace(
            plan, main=tuple(dataclasses.replace(c, lr=chosen[c.method]) for c in plan.main),
            ablations=tuple((a, dataclasses.replace(c, lr=chosen[c.method])) for a, c in plan.ablations))
      every = workers.run_all(list(plan.main) + [c for _, c in plan.ablations], ds, out, overall, plan.jobs,
                              keep_checkpoints=args.keep_checkpoints)
      main_results = every[:len(plan.main)]
      ablation_results = [(a, r) for (a, _), r in zip(plan.ablations, every[len(plan.main):])]
    wall = time.time() - t0
    if processes.is_primary():
      meta = description.study_meta(preset, ds, plan.stage_counts, command)
      records = [curves.record("main", r) for r in main_results]
      records += [curves.record(a, r) for a, r in ablation_results]
      curves.write(out / curves.FILE, meta, records)
      report.build(out, command=command, published=preset.published_folder())
      if args.publish:
        folders.publish(out, pathlib.Path(args.publish))
  print(f"done in {wall:.0f}s: {out / 'report.md'}")
  return out

"""The sweep end to end on the smoke preset, resume after an interrupt, and bad input."""

import dataclasses
import io
import json
import os
import pathlib
import queue as queue_lib
import signal

import numpy as np
import pytest
import tqdm as tqdm_lib

from experiments import cli
from experiments.harness import data as data_lib
from experiments.harness import memory as memory_lib
from experiments.harness import methods as methods_lib
from experiments.harness import provenance, runs
from experiments.harness.config import RunConfig, identity, run_dir, run_name
from experiments.report import build as report_lib
from experiments.report import curves
from experiments.sweep import command as sweep
from experiments.sweep import folders, presets, workers


def test_smoke_sweep_end_to_end(tmp_path, monkeypatch):
  # Two runs at a time, each in a worker process (--jobs 2); a run trained here equals its worker's.
  out = sweep.main(["--preset", "smoke", "--jobs", "2", "--out", str(tmp_path / "s")])
  plan = sweep.make_plan(sweep.parse_args(["--preset", "smoke"]))
  ds = data_lib.load(None, context=plan.main[0].model_config(256).context)
  here = runs.train(plan.main[0], ds, tmp_path / "here")  # pipedream at P = 1
  there = json.loads((run_dir(plan.main[0], ds, out) / "result.json").read_text())
  assert here["losses"] == there["losses"] and here["val_losses"] == there["val_losses"]
  for name in ("results.csv", "report.md", "summary.json", "curves.json.xz", "main_loss.png",
               "main_slowdown.png", "main_levels.png"):
    assert (out / name).stat().st_size > 0, name
  results = [json.loads(p.read_text()) for p in (out / "runs").glob("*/result.json")]
  assert len(results) == 4 and all(r["status"] == "finished" for r in results)
  for r in results:
    assert len(r["losses"]) == 40 and np.all(np.isfinite(r["losses"]))
    assert r["data"]["sha256"] and r["versions"]["jax"] and r["config"]["lr"] == 3e-3
    # The machine the numbers depend on: the CPU and the cores the worker could use.
    assert r["versions"]["host"] == {"cpu": provenance.host()["cpu"], "cores": len(provenance.usable_cores())}
  report = (out / "report.md").read_text()
  assert "| pipedream | 1.00 |" in report and "| rotation |" in report
  assert "this preset is a plumbing check" in report and "**reproduced**" not in report
  # The report is rebuilt from the curves file alone, to the same numbers.
  summary = json.loads((out / "summary.json").read_text())
  rebuilt = report_lib.build(out, tmp_path / "rebuilt")
  assert rebuilt["headline"] == summary["headline"] and rebuilt["claims"] == [] == summary["claims"]
  # Runs trained two at a time are not timed alone: the report shows no wall-clock for them.
  assert here["jobs"] == 1 and all(r["jobs"] == 2 for r in results)
  assert "Not measured: runs were trained 2 at a time" in report
  assert len((out / "results.csv").read_text().strip().splitlines()) == 5
  # Running again skips every finished run (nothing recomputed), rewrites the report, and with
  # --publish copies it with its figures and curves (a folder a reader can open).
  before = {p: p.stat().st_mtime_ns for p in (out / "runs").glob("*/result.json")}
  (out / "another_sweeps_figure.png").write_bytes(b"not this report's")  # left by another sweep
  sweep.main(["--preset", "smoke", "--out", str(out), "--publish", str(tmp_path / "pub")])
  assert {p: p.stat().st_mtime_ns for p in before} == before
  published = sorted(p.name for p in (tmp_path / "pub").iterdir())
  assert published == ["curves.json.xz", "main_levels.png", "main_loss.png", "main_slowdown.png",
                       "report.md", "summary.json"]  # results.csv: rebuilt from the curves
  header = (tmp_path / "pub" / "report.md").read_text().splitlines()[2]
  assert header.startswith(f"- made by `python -m experiments.sweep --preset smoke --out {out} --publish")
  assert f"commit(s) {str(provenance.code_version()['commit'])[:12]}" in header
  assert "s of training over 4 distinct runs" in header
  # A sweep moved to a new machine (an empty --out) restores its published runs and trains none of
  # them: the same curves, so the same report numbers; a second restore finds nothing missing.
  moved = tmp_path / "moved"
  monkeypatch.setattr(runs, "train", lambda *a, **k: pytest.fail("a published run was trained again"))
  sweep.main(["--preset", "smoke", "--out", str(moved), "--restore-from", str(tmp_path / "pub")])
  assert json.loads((moved / "summary.json").read_text())["headline"] == summary["headline"]
  restored = [json.loads(p.read_text()) for p in (moved / "runs").glob("*/result.json")]
  assert sorted(r["name"] for r in restored) == sorted(r["name"] for r in results)
  assert all(r["restored_from"] == str(tmp_path / "pub") for r in restored)
  by_name = {r["name"]: r for r in results}
  for r in restored:  # the losses at the curves file's 4 decimals
    assert np.allclose(r["losses"], by_name[r["name"]]["losses"], atol=5e-5, rtol=0)
    assert r["val_losses"] == [round(v, 5) for v in by_name[r["name"]]["val_losses"]]
  assert folders.restore_finished(sweep.make_plan(sweep.parse_args(["--preset", "smoke"])), ds, moved,
                                [tmp_path / "pub"]) == 0
  with pytest.raises(ValueError, match="cannot be restored into folder 'other'"):
    runs.restore(curves.read(tmp_path / "pub")["runs"][0], tmp_path / "other", ds, "pub")
  # --finished-only reports the finished runs of a plan (here seed 1 has none) into --publish,
  # training nothing and writing nothing in --out (a sweep may be training there).
  files = {p: p.stat().st_mtime_ns for p in out.rglob("*") if p.is_file()}
  sweep.main(["--preset", "smoke", "--seeds", "0", "1", "--out", str(out), "--finished-only",
              "--publish", str(tmp_path / "part")])
  assert {p: p.stat().st_mtime_ns for p in out.rglob("*") if p.is_file()} == files
  part = json.loads((tmp_path / "part" / "summary.json").read_text())
  assert part["headline"] == summary["headline"]
  assert "--finished-only" in (tmp_path / "part" / "report.md").read_text().splitlines()[2]
  with pytest.raises(ValueError, match="no run of this plan has finished"):
    sweep.main(["--preset", "smoke", "--seeds", "5", "--out", str(out), "--finished-only",
                "--publish", str(tmp_path / "none")])
  with pytest.raises(ValueError, match="--publish"):
    sweep.main(["--preset", "smoke", "--out", str(out), "--finished-only"])


class _Interrupt(Exception):
  pass


class _Progress:
  """A progress bar that 'presses Ctrl-C' once ``stop_at`` steps are done."""

  def __init__(self, stop_at):
    self.n, self.stop_at = 0, stop_at

  def reset(self, total):
    self.n = 0

  def set_postfix(self, *args, **kwargs):
    pass

  def update(self, k):
    self.n += k
    if self.n >= self.stop_at:
      raise _Interrupt


def test_interrupt_and_resume_equals_uninterrupted(tmp_path):
  spec = RunConfig(optimizer=methods_lib.spec("rotation"), stages=2, seed=0, lr=3e-3, steps=40, batch_size=4,
                   model="cpu-tiny", chunk=10, eval_every=20, eval_batches=2, checkpoint_every=20)
  ds = data_lib.default_corpus(32)
  clean = runs.train(spec, ds, tmp_path / "clean")
  with pytest.raises(_Interrupt):
    runs.train(spec, ds, tmp_path / "resumed", progress=_Progress(stop_at=30))
  assert not (tmp_path / "resumed" / "result.json").exists()
  resumed = runs.train(spec, ds, tmp_path / "resumed")
  assert resumed["losses"] == clean["losses"]
  assert resumed["val_losses"] == clean["val_losses"]


def test_diverged_run_is_recorded(tmp_path, monkeypatch):
  build = runs.build

  def nan_after_first_chunk(spec, ds, devices=None):
    pipe, state, graphdef, loss_fn = build(spec, ds, devices)
    run, calls = pipe.run, []

    def poisoned(state, batches):
      calls.append(1)
      state, (losses, norms) = run(state, batches)
      return state, (losses * (np.nan if len(calls) > 1 else 1.0), norms)

    pipe.run = poisoned
    return pipe, state, graphdef, loss_fn

  monkeypatch.setattr(runs, "build", nan_after_first_chunk)
  spec = RunConfig(optimizer=methods_lib.spec("pipedream"), stages=1, seed=0, lr=3e-3, steps=40, batch_size=4,
                   model="cpu-tiny", chunk=10, eval_every=20, eval_batches=1, checkpoint_every=20)
  result = runs.train(spec, data_lib.default_corpus(32), tmp_path / "d")
  assert result["status"] == "diverged" and result["steps_done"] == 20
  assert np.all(np.isfinite(result["losses"][:10])) and np.isnan(result["losses"][10])
  assert (tmp_path / "d" / "result.json").exists()  # recorded; a sweep moves on


def test_other_data_never_reuses_a_run(tmp_path):
  """Same --out, other data: new runs (not "cached"), and the report's losses are the new data's."""
  text = tmp_path / "corpus.txt"
  text.write_bytes(bytes(range(32, 127)) * 400)
  argv = ["--preset", "smoke", "--methods", "pipedream", "--stages", "1", "--steps", "20",
          "--out", str(tmp_path / "o")]
  out = sweep.main(argv + ["--data", str(text)])
  sweep.main(argv)
  results = [json.loads(p.read_text()) for p in (out / "runs").glob("*/result.json")]
  assert len(results) == 2 and len({r["data"]["sha256"] for r in results}) == 2
  assert len({tuple(r["losses"]) for r in results}) == 2


def test_two_sweeps_on_one_out_are_refused(tmp_path):
  out = folders.prepare_out(tmp_path / "busy")
  with folders.exclusive(out):
    with pytest.raises(ValueError, match="another sweep is writing into"):
      with folders.exclusive(out):
        pass


def test_cli_errors_are_one_line(tmp_path, capsys):
  (tmp_path / "file").write_text("")
  cases = [
      (["--out", str(tmp_path / "file")], "is a file, not a folder"),
      (["--publish", str(tmp_path / "file")], "--publish '" + str(tmp_path / "file") + "' is a file"),
      (["--seeds", "0", "0"], "--seeds has duplicates"),
      (["--seeds", "-1"], "--seeds must be >= 0"),
      (["--vocab-size", "0", "--data", str(tmp_path / "t.bin")], "does not exist"),
      (["--vocab-size", "300"], "--vocab-size 300 applies to .bin token files only"),
      (["--data", str(tmp_path)], "is a folder"),
      (["--lr", "fast"], "--lr 'fast': not a number"),
      (["--lr", "sgd=1e-3"], "unknown method 'sgd'"),
      (["--model", "huge"], "--model 'huge' is unknown"),
      (["--refresh-every", "0"], "--refresh-every must be >= 1"),
      (["--execution", "devices"], "P = [4] do not divide the 1 local devices"),
      (["--execution", "devices", "--mode", "stale_gradients"], "mode 'stale_gradients' has no device"),
  ]
  for argv, match in cases:
    assert cli.run(sweep.main, ["--preset", "smoke"] + argv) == 2
    err = capsys.readouterr().err.strip()
    assert match in err and len(err.splitlines()) == 1, (argv, err)
  bin_file = tmp_path / "t.bin"
  np.arange(1000, dtype=np.uint16).tofile(bin_file)
  assert cli.run(sweep.main, ["--preset", "smoke", "--data", str(bin_file), "--vocab-size", "0"]) == 2
  assert "must be in [1, 65536], got 0" in capsys.readouterr().err


def test_overrides_reach_every_run_and_its_identity():
  args = sweep.parse_args(["--preset", "smoke", "--lr", "1e-3", "rotation=2e-3", "--batch-size", "2",
                           "--refresh-every", "5", "--warmup", "0.1", "--model", "cpu-tiny"])
  plan = sweep.make_plan(args)
  by = {c.method: c for c in plan.main}
  assert by["pipedream"].lr == 1e-3 and by["rotation"].lr == 2e-3
  assert all(c.batch_size == 2 and c.warmup_fraction == 0.1 for c in plan.main)
  # a rotation setting reaches rotation's runs only: the others keep their identities
  assert by["rotation"].optimizer.refresh_every == 5 and not by["pipedream"].optimizer.takes("refresh_every")
  plain = {c.method: c for c in sweep.make_plan(sweep.parse_args(["--preset", "smoke"])).main}
  assert by["pipedream"].optimizer == plain["pipedream"].optimizer
  assert by["rotation"].optimizer == plain["rotation"].optimizer.overridden(refresh_every=5)


@pytest.mark.parametrize("argv,match", [
    (["--preset", "huge"], "unknown preset 'huge'"),
    (["--preset", "smoke", "--methods", "sgd"], "unknown method 'sgd'"),
    (["--preset", "smoke", "--stages", "3"], "4 blocks cannot be split into 3 equal stages"),
    (["--preset", "smoke", "--stages", "8"], "8 stages is more than the model's 4 blocks"),
    (["--preset", "smoke", "--ablations", "everything"], "unknown ablation 'everything'"),
    (["--preset", "smoke", "--steps", "15"], "multiple of the chunk 10"),
    (["--preset", "smoke", "--restore-from", "no-such-folder"], "--restore-from 'no-such-folder' holds no"),
    (["--preset", "smoke", "--restore-from", "docs/results/cpu", "--dry-run"], "cannot be combined"),
])
def test_bad_input_fails_before_training(tmp_path, argv, match):
  with pytest.raises(ValueError, match=match):
    sweep.main(argv + ["--out", str(tmp_path / "x")])
  assert not (tmp_path / "x").exists()


def test_missing_data_file(tmp_path):
  with pytest.raises(FileNotFoundError, match="nope.txt"):
    sweep.main(["--preset", "smoke", "--data", str(tmp_path / "nope.txt"), "--out", str(tmp_path / "y")])


def test_tune_lr_records_and_uses_the_choice(tmp_path):
  out = sweep.main(["--preset", "smoke", "--methods", "pipedream", "--stages", "1", "--tune-lr",
                    "--out", str(tmp_path / "t")])
  tuning = json.loads((out / "tuning.json").read_text())
  grid = {3e-3 * m for m in (0.5, 1.0, 2.0)}
  chosen = tuning["chosen"]["pipedream"]
  assert any(abs(chosen - g) < 1e-12 for g in grid) and len(tuning["trials"]["pipedream"]) == 3
  finals = {float(k): v for k, v in tuning["trials"]["pipedream"].items()}
  assert finals[chosen] == min(finals.values())
  main = [json.loads(p.read_text()) for p in (out / "runs").glob("*/result.json")
          if "_tune" not in p.parent.name]
  assert len(main) == 1 and main[0]["config"]["lr"] == chosen


def test_an_unknown_flag_is_one_line_with_a_pointer_to_help(capsys):
  assert cli.run(sweep.main, ["--preset", "smoke", "--no-such-flag"]) == 2
  err = capsys.readouterr().err.strip()
  assert err == ("error: unrecognized arguments: --no-such-flag (`python -m experiments.sweep --help` lists "
                 "the flags)")
  assert cli.run(sweep.main, ["--jobs"]) == 2  # a flag without its value
  assert capsys.readouterr().err.strip().startswith("error: argument --jobs: expected one argument")


def test_ctrl_c_is_one_line(monkeypatch, capsys):
  def interrupted(argv=None):
    raise KeyboardInterrupt

  monkeypatch.setattr(sweep, "main", interrupted)
  assert cli.run(sweep.main, []) == 130
  assert capsys.readouterr().err.strip() == "interrupted; run the same command again to resume"


def test_dry_run_plans_and_estimates_without_training(tmp_path, capsys):
  out = sweep.main(["--preset", "smoke", "--methods", "pipedream", "--stages", "1", "--dry-run",
                    "--out", str(tmp_path / "d")])
  printed = capsys.readouterr().out
  assert "1 runs, 1 to run, 1 timed: estimated" in printed and "GFLOP/step" in printed
  assert not out.exists()  # nothing trained, nothing written


def test_a_dry_run_reports_memory_before_running_and_skips_what_cannot_fit(tmp_path, capsys, monkeypatch):
  ran = []
  monkeypatch.setattr(runs, "build", lambda *a, **k: ran.append(a) or (_ for _ in ()).throw(AssertionError))
  monkeypatch.setattr(memory_lib, "device_memory", lambda: (1024, "a 1 KiB test device"))
  plan = sweep.make_plan(sweep.parse_args(["--preset", "smoke", "--methods", "pipedream", "--stages", "1"]))
  rows = memory_lib.dry_run([("main", c) for c in plan.main], data_lib.load(None, context=32), tmp_path)
  printed = capsys.readouterr().out
  assert not ran  # nothing allocated, nothing executed
  assert all(r["estimated_seconds"] is None and r["memory"]["total"] > 1024 for r in rows)
  assert printed.count("more than the 0.0 GiB of a 1 KiB test device: not timed; lower it with "
                       "--remat nothing_saveable, --loss-chunk 2048") == 1
  assert "1 runs, 1 to run, 0 timed" in printed


def test_rotation_variants_share_rotations_learning_rate():
  preset = presets.PRESETS["cpu"]
  preset = dataclasses.replace(preset, learning_rates=(("default", 1e-3), ("rotation", 2e-3)))
  for m in ("rotation-2nd-uni", "rotation-1st-bi", "rotation-1st-uni", "rotation-sa", "rotation-T100"):
    assert preset.learning_rate(m) == 2e-3, m
  assert preset.learning_rate("pipedream-lr") == 1e-3


def test_the_cpu_preset_shares_one_rate_and_adds_the_tuned_reading():
  plan = sweep.make_plan(sweep.parse_args(["--preset", "cpu", "--seeds", "0", "1"]))
  assert {c.lr for c in plan.main} == {3e-3}
  assert {c.method for c in plan.main} == {"pipedream", "pipedream-lr", "nesterov", "rotation", "muon"}
  assert len(plan.main) == 20 and len(plan.ablations) == 4  # the default: 24 runs
  tuned = [(c.method, c.stages, c.seed, c.lr) for g, c in plan.ablations if g == "tuned-lr"]
  assert sorted(tuned) == [("rotation", p, s, 6e-3) for p in (1, 16) for s in (0, 1)]
  plan = sweep.make_plan(sweep.parse_args(["--preset", "cpu", "--lr", "rotation=6e-3"]))
  assert not [g for g, _ in plan.ablations]  # a chosen rate replaces the readings
  assert not plan.preset.tuned_rates  # and the report does not name them


@pytest.mark.parametrize("values,expected", [
    (["rotation=3e-3", "2e-3"], {"pipedream": 2e-3, "rotation": 3e-3}),  # order does not matter
    (["2e-3", "rotation=3e-3"], {"pipedream": 2e-3, "rotation": 3e-3}),
    (["pipedream=1e-3"], {"pipedream": 1e-3, "rotation": 3e-3}),  # the rest: the preset's
])
def test_lr_values_are_order_independent(values, expected):
  plan = sweep.make_plan(sweep.parse_args(["--preset", "smoke", "--lr", *values]))
  assert {c.method: c.lr for c in plan.main} == expected


def test_lr_conflicts_are_errors_and_unused_methods_warn(capsys):
  for values, match in ((["1e-3", "2e-3"], "two plain rates (0.001 and 0.002)"),
                        (["rotation=1e-3", "rotation=2e-3"], "gives rotation two rates")):
    assert cli.run(sweep.main, ["--preset", "smoke", "--dry-run", "--lr", *values]) == 2
    err = capsys.readouterr().err.strip()
    assert match in err and len(err.splitlines()) == 1, err
  with pytest.warns(UserWarning, match="nesterov is not among this sweep's methods"):
    sweep.make_plan(sweep.parse_args(["--preset", "smoke", "--lr", "nesterov=1e-3"]))


def test_no_reference_trains_the_stages_given_only():
  plan = lambda *extra: sweep.make_plan(sweep.parse_args(["--preset", "smoke", "--stages", "4", *extra]))
  assert {c.stages for c in plan().main} == {1, 4} and plan().stage_counts == (1, 4)
  alone = plan("--no-reference")
  assert {c.stages for c in alone.main} == {4} and alone.stage_counts == (4,)
  assert set(alone.main) < set(plan().main)  # the same runs, less P = 1


def test_fsdp_on_one_device_is_an_error():
  with pytest.raises(ValueError, match="--fsdp shards the state over the data devices, and there is only 1"):
    sweep.make_plan(sweep.parse_args(["--preset", "smoke", "--fsdp"]))


def test_a_p1_only_sweep_claims_nothing_about_staleness(tmp_path):
  out = sweep.main(["--preset", "smoke", "--methods", "pipedream", "--stages", "1", "--steps", "10",
                    "--out", str(tmp_path / "p1")])
  report = (out / "report.md").read_text()
  assert "largest P = 1 (paper: 32)" in report and "largest P = 4" not in report
  assert "from P = 1 to P = 1" not in report and "**reproduced**" not in report
  with pytest.raises(ValueError, match="--jobs must be >= 1, got 0"):
    sweep.make_plan(sweep.parse_args(["--preset", "smoke", "--jobs", "0"]))


def test_progress_shows_the_whole_name_and_a_resumption(tmp_path, monkeypatch):
  class Recorder(_Progress):
    def __init__(self, stop_at):
      super().__init__(stop_at)
      self.postfixes = []

    def set_postfix(self, *args, **kwargs):
      self.postfixes.append(dict(args[0]) if args else kwargs)

  spec = RunConfig(optimizer=methods_lib.spec("pipedream"), stages=2, steps=30, batch_size=4,
                   model="cpu-tiny", chunk=10, eval_every=10, eval_batches=1, checkpoint_every=10)
  ds = data_lib.default_corpus(32)
  run_dir = tmp_path / "out" / "runs" / run_name(spec, ds.sha256, ds.vocab_size, 1)
  with pytest.raises(_Interrupt):
    runs.train(spec, ds, run_dir, progress=Recorder(stop_at=20))
  bar = Recorder(stop_at=10**9)
  runs.train(spec, ds, run_dir, progress=bar)
  assert bar.postfixes[0] == {"resumed at": 10} and all(p["resumed at"] == 10 for p in bar.postfixes)
  lines = []
  monkeypatch.setattr(workers.tqdm, "write", lambda text, *args, **kwargs: lines.append(text))
  overall = workers.overall_bar(1)
  workers.run_one(spec, ds, tmp_path / "out", overall)  # the finished run above: nothing trains
  assert lines == [f"[1/1] {spec.name}: " + lines[0].split(": ", 1)[1]] and "(cached)" in lines[0]
  assert len(spec.name) > 48  # the whole name, not cut
  assert overall.n == 1 and overall.initial == 1  # counted, and left out of the rate (the time left)


def test_a_runs_plain_progress_says_where_it_starts_resumes_and_each_tenth(monkeypatch):
  """Output that is not a terminal (a log file) gets plain lines, not bars: a fresh run's start, a
  resumed run's step, each tenth of the run; no line for the last step (the sweep writes the end)."""
  lines = []
  monkeypatch.setattr(workers.tqdm, "write", lambda text, *args, **kwargs: lines.append(text))
  monkeypatch.setattr(workers, "on_terminal", lambda: False)

  def train(bar, start):  # what runs.train does with its progress (runs._progress_start, each chunk)
    bar.reset(total=100)
    bar.update(start)
    if start:
      bar.set_postfix({"resumed at": start}, refresh=True)
    for _ in range(start, 100, 10):
      bar.set_postfix({"resumed at": start, "loss": "1.500"} if start else {"loss": "1.500"})
      bar.update(10)

  train(workers.RunBar("fresh", 100), 0)
  tenths = [f"  fresh: step {n}/100, loss 1.500" for n in range(10, 100, 10)]
  assert lines == ["  fresh: starts (100 steps)"] + tenths
  lines.clear()
  train(workers.RunBar("again", 100), 40)
  assert lines == ["  again: resumes from step 40 of 100 (its last checkpoint)"] + [
      f"  again: step {n}/100, loss 1.500" for n in range(50, 100, 10)]
  lines.clear()
  with workers.RunBar("long", 1000) as bar:  # a tenth is 100 steps: chunks of 30 print at most once each
    bar.reset(total=1000)
    bar.update(0)
    for _ in range(33):
      bar.update(30)
  crossed = (120, 210, 300, 420, 510, 600, 720, 810, 900)
  assert [line.split("step ")[1] for line in lines[1:]] == [f"{n}/1000" for n in crossed]


def test_ctrl_c_during_compilation_exits_cleanly(tmp_path, sigint_from_a_terminal):
  """A real SIGINT while the first run compiles: exit 130 and the one line, never a crash."""
  import os
  import signal
  import subprocess
  import sys
  import time

  env = {**os.environ, "PYTHONUNBUFFERED": "1"}
  proc = subprocess.Popen([sys.executable, "-m", "experiments.sweep", "--preset", "smoke", "--methods",
                           "rotation", "--stages", "4", "--out", str(tmp_path / "c")],
                          cwd=pathlib.Path(sweep.__file__).parents[2], env=env,
                          stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
  line = ""
  while "sweep 'smoke'" not in line:  # the plan is printed right before the first compilation
    line = proc.stdout.readline()
    assert line or proc.poll() is None, proc.stderr.read()
  time.sleep(1.0)
  proc.send_signal(signal.SIGINT)
  _, err = proc.communicate(timeout=120)
  assert proc.returncode == 130, err[-2000:]
  assert "interrupted; run the same command again to resume" in err and "Fatal Python error" not in err


def _children(pid: int) -> list:
  """PIDs of the running processes whose parent is ``pid`` (Linux /proc)."""
  out = []
  for stat in pathlib.Path("/proc").glob("[0-9]*/stat"):
    try:
      fields = stat.read_text().rsplit(")", 1)[1].split()
    except OSError:
      continue
    if int(fields[1]) == pid and fields[0] != "Z":
      out.append(int(stat.parent.name))
  return out


def test_sigterm_stops_the_sweep_and_its_workers(tmp_path):
  """SIGTERM (a scheduler's kill, ``timeout``) unwinds like Ctrl-C: exit 130, no worker left training."""
  import os
  import signal
  import subprocess
  import sys
  import time

  proc = subprocess.Popen([sys.executable, "-m", "experiments.sweep", "--preset", "smoke", "--methods",
                           "pipedream", "rotation", "--stages", "4", "--jobs", "2", "--out",
                           str(tmp_path / "t")], cwd=pathlib.Path(sweep.__file__).parents[2],
                          env={**os.environ, "PYTHONUNBUFFERED": "1"}, stdout=subprocess.PIPE,
                          stderr=subprocess.PIPE, text=True)
  deadline, workers = time.time() + 120, []
  while len(workers) < 2 and time.time() < deadline:  # two spawned workers (and the resource tracker)
    time.sleep(0.5)
    workers = [c for c in _children(proc.pid)
               if b"spawn_main" in pathlib.Path(f"/proc/{c}/cmdline").read_bytes()]
  assert len(workers) == 2, proc.stderr.read() if proc.poll() is not None else "no workers"
  time.sleep(2.0)  # past start(), which sends each worker its run (a signal inside it can break that)
  proc.send_signal(signal.SIGTERM)
  _, err = proc.communicate(timeout=120)
  assert proc.returncode == 130, err[-2000:]
  assert "interrupted; run the same command again to resume" in err
  # Terminated by the sweep on its way out (one still starting when the signal came ends on its own:
  # its sweep is gone); none keeps training.
  def running(pid):
    try:
      return pathlib.Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:  # gone
      return False
  alive = lambda: [pid for pid in workers if running(pid)]
  deadline = time.time() + 60
  while alive() and time.time() < deadline:
    time.sleep(0.5)
  assert not alive(), f"workers {alive()} still run"


WORKER_STARTING = """
import signal, threading
from experiments.sweep import workers
signal.signal(signal.SIGINT, signal.default_int_handler)  # as a sweep started from a terminal
signal.pthread_sigmask(signal.SIG_BLOCK, workers.HELD)  # what a worker inherits while it starts
# a Ctrl-C that arrives then, held until the worker runs (sent to this thread: the process's other
# threads, started by imports, do not block it here as a real worker's do)
signal.pthread_kill(threading.main_thread().ident, signal.SIGINT)


class Queue:
  def put(self, message):
    print("put", message[0], flush=True)


workers._worker(Queue(), 0, None, None, None, 1, {"not-a-source-file": "x"}, False)
print("returned", flush=True)
"""


def test_a_ctrl_c_while_a_worker_starts_is_dropped_not_raised():
  """The race of a Ctrl-C during a worker's start: the sweep (which terminates its workers) handles
  it; the worker drops it, runs on to report by run (here: refusing other code), no traceback."""
  import subprocess
  import sys

  proc = subprocess.run([sys.executable, "-c", WORKER_STARTING], cwd=pathlib.Path(sweep.__file__).parents[2],
                        capture_output=True, text=True, timeout=120)
  assert proc.returncode == 0 and "Traceback" not in proc.stderr, proc.stderr[-2000:]
  assert proc.stdout.split() == ["put", "error", "returned"]


def test_ctrl_c_to_the_whole_process_group_mid_run_is_one_line(tmp_path, sigint_from_a_terminal):
  """A terminal's Ctrl-C reaches the sweep and every worker at once: exit 130, the one line, no
  traceback from any process, no worker left."""
  import os
  import signal
  import subprocess
  import sys
  import time

  proc = subprocess.Popen([sys.executable, "-m", "experiments.sweep", "--preset", "smoke", "--methods",
                           "pipedream", "rotation", "--stages", "4", "--jobs", "2", "--out",
                           str(tmp_path / "g")], cwd=pathlib.Path(sweep.__file__).parents[2],
                          env={**os.environ, "PYTHONUNBUFFERED": "1"}, stdout=subprocess.PIPE,
                          stderr=subprocess.PIPE, text=True, start_new_session=True)
  deadline, workers_ = time.time() + 120, []
  while len(workers_) < 2 and time.time() < deadline:
    time.sleep(0.5)
    workers_ = [c for c in _children(proc.pid)
                if b"spawn_main" in pathlib.Path(f"/proc/{c}/cmdline").read_bytes()]
  time.sleep(3.0)  # the workers import and compile: mid-run
  os.killpg(proc.pid, signal.SIGINT)
  _, err = proc.communicate(timeout=120)
  assert proc.returncode == 130, err[-2000:]
  assert "interrupted; run the same command again to resume" in err and "Traceback" not in err, err[-3000:]


def test_warmup_in_delays_and_b2_reach_every_run():
  plan = sweep.make_plan(sweep.parse_args(["--preset", "smoke", "--warmup-delays", "2.5", "--b2", "0.99"]))
  # warm-up 2.5 x tau_max (P = 4: 3)
  assert all(c.warmup_steps == 8 and c.optimizer.setting("b2") == 0.99 for c in plan.main)
  assert {c.stages for c in plan.main} == {1, 4}  # P = 1 shares the schedule
  c = plan.main[0]
  assert runs.learning_rates.warmup_cosine(c)(8) == c.lr  # the peak is reached after the warm-up
  assert "-wu8-b2_0.99" in c.name
  with pytest.raises(ValueError, match="give one of --warmup and --warmup-delays"):
    sweep.make_plan(sweep.parse_args(["--preset", "smoke", "--warmup", "0.1", "--warmup-delays", "2"]))
  with pytest.raises(ValueError, match=r"warmup_steps must be in \[0, steps=40\), got 50"):
    sweep.make_plan(sweep.parse_args(["--preset", "smoke", "--warmup-steps", "50"]))
  opt = runs.methods.run_optimizers(c)[0]  # b2 reaches the optimizer: Adam's second moment
  import jax.numpy as jnp
  state = opt.init({"w": jnp.zeros(3)})
  _, state = opt.update({"w": jnp.full(3, 0.1)}, state, {"w": jnp.zeros(3)})  # norm < 1: not clipped
  nu = [x for x in __import__("jax").tree.leaves(state) if getattr(x, "shape", ()) == (3,)]
  assert any(abs(float(v[0]) - 1e-4) < 1e-9 for v in nu)  # (1 - b2) g^2 with b2 = 0.99


def test_jobs_default_to_one_per_usable_core_on_a_cpu_host():
  plan = sweep.make_plan(sweep.parse_args(["--preset", "smoke"]))
  assert plan.jobs == len(provenance.usable_cores()) and plan.main[0].seed == 0
  assert sweep.make_plan(sweep.parse_args(["--preset", "smoke", "--jobs", "1"])).jobs == 1
  seeds = {c.seed for c in sweep.make_plan(sweep.parse_args(["--preset", "cpu", "--dry-run"])).main}
  assert seeds == set(presets.PRESETS["cpu"].seeds)
  with pytest.raises(ValueError, match=r"--seeds has duplicates: \[1, 1\]"):
    sweep.make_plan(sweep.parse_args(["--preset", "smoke", "--seeds", "1", "1"]))



def test_configs_naming_one_run_folder_train_it_once(tmp_path, monkeypatch):
  plan = sweep.make_plan(sweep.parse_args(["--preset", "smoke"]))
  ds = data_lib.load(None, context=plan.main[0].model_config(256).context)
  a, b = plan.main[0], plan.main[1]
  same_as_a = dataclasses.replace(a, num_blocks=a.model_config(256).num_blocks)  # canonical(): a's folder
  trained = []
  monkeypatch.setattr(workers, "run_one", lambda c, *_: trained.append(c) or {"name": c.name})
  monkeypatch.setattr(workers, "_run_parallel",
                      lambda todo, *_: {i: trained.append(c) or {"name": c.name} for i, c, _ in todo})
  for jobs in (1, 2):
    trained.clear()
    with tqdm_lib.tqdm(total=4, disable=True) as overall:
      got = workers.run_all([a, b, same_as_a, a], ds, tmp_path, overall, jobs=jobs)
    assert trained == [a, b] and [r["name"] for r in got] == [a.name, b.name, a.name, a.name]


class _KilledRun:
  """A run whose worker is killed (SIGKILL) as it starts, as one killed for memory would be."""

  name, steps = "the-killed-run", 40

  def validate(self):
    os.kill(os.getpid(), signal.SIGKILL)


def test_a_dead_worker_ends_only_its_own_run_and_failures_are_named(tmp_path):
  plan = sweep.make_plan(sweep.parse_args(["--preset", "smoke"]))
  ds = data_lib.load(None, context=plan.main[0].model_config(256).context)
  good = plan.main[0]
  bad = dataclasses.replace(good, mode="no-such-mode")
  todo = [(0, _KilledRun(), tmp_path / "killed"), (1, bad, tmp_path / "bad"),
          (2, good, run_dir(good, ds, tmp_path))]
  with tqdm_lib.tqdm(total=3, file=io.StringIO()) as overall:
    with pytest.raises(cli.RunFailed, match=r"2 run\(s\) failed: .*the-killed-run.*the others finished"):
      workers._run_parallel(todo, ds, overall, jobs=2)
    assert overall.n == 3
  # the run beside them trained to the end, with the numbers of a run trained alone
  result = runs.load_result(run_dir(good, ds, tmp_path))
  assert result["status"] == "finished" and len(result["losses"]) == good.steps
  assert cli.run(sweep.main, ["--preset", "smoke", "--methods", "no-such-method"]) == 2


def test_a_worker_refuses_to_train_code_other_than_the_sweeps(tmp_path):
  plan = sweep.make_plan(sweep.parse_args(["--preset", "smoke"]))
  ds = data_lib.load(None, context=plan.main[0].model_config(256).context)
  started = {**provenance.source_files(), "experiments/harness/runs.py": "0" * 64}  # edited since it began
  q = queue_lib.Queue()
  workers._worker(q, 7, plan.main[0], ds, tmp_path / "run", 1, started)
  kind, index, message = q.get_nowait()
  assert (kind, index) == ("error", 7)
  assert "source changed since the sweep began (experiments/harness/runs.py)" in message
  assert not (tmp_path / "run").exists()  # nothing trained


def test_a_2bw_sweep_shares_its_p1_runs_with_1f1b_and_refuses_other_modes():
  plan = sweep.make_plan(sweep.parse_args(["--preset", "smoke", "--schedule", "2bw"]))
  ds = data_lib.load(None, context=plan.main[0].model_config(256).context)
  base = sweep.make_plan(sweep.parse_args(["--preset", "smoke"]))
  names = lambda p: {c.stages: run_name(c, ds.sha256, ds.vocab_size)
                     for c in p.main if c.method == "pipedream"}
  two, one = names(plan), names(base)
  assert two[1] == one[1] and two[4] != one[4] and "-2bw_" in two[4]
  assert identity(base.main[0], "x", 256)["config"].get("schedule") is None  # old runs keep their names
  assert cli.run(sweep.main, ["--preset", "smoke", "--schedule", "2bw", "--mode", "no_stashing",
                              "--dry-run"]) == 2
  # on devices 2BW splits a batch into P micro-batches: a batch size P does not divide is refused
  assert cli.run(sweep.main, ["--preset", "smoke", "--schedule", "2bw", "--execution", "devices",
                              "--batch-size", "6", "--dry-run"]) == 2


def test_shampoo_beta_and_b1_reach_their_runs_and_leave_the_baselines_names():
  ds = data_lib.load(None, context=64)
  plan = lambda *extra: sweep.make_plan(sweep.parse_args(["--preset", "smoke", "--methods", "pipedream",
                                                          "rotation", *extra]))
  names = lambda p: {(c.method, c.stages): (c, run_name(c, ds.sha256, ds.vocab_size)) for c in p.main}
  base, lag, b1 = names(plan()), names(plan("--shampoo-beta", "0.95")), names(plan("--b1", "0.95"))
  for key, (c, name) in lag.items():
    if key[0] == "rotation":
      assert c.optimizer.shampoo_beta == 0.95 and name != base[key][1] and "-sb0.95" in name
    else:
      assert not c.optimizer.takes("shampoo_beta") and name == base[key][1]  # the cached baseline is reused
  assert all(c.optimizer.setting("b1") == 0.95 and "-b1_0.95" in n for c, n in b1.values())
  assert cli.run(sweep.main, ["--preset", "smoke", "--b1", "1.5", "--dry-run"]) == 2

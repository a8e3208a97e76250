"""The sweep end to end on the smoke preset, resume after an interrupt, and bad input."""

import json

import numpy as np
import pytest

from experiments import data as data_lib
from experiments import runs, sweep


def test_smoke_sweep_end_to_end(tmp_path):
  out = sweep.main(["--preset", "smoke", "--out", str(tmp_path / "s")])
  for name in ("results.csv", "report.md", "main_loss.png", "main_slowdown.png"):
    assert (out / name).stat().st_size > 0, name
  results = [json.loads(p.read_text()) for p in (out / "runs").glob("*/result.json")]
  assert len(results) == 4 and all(r["status"] == "finished" for r in results)
  for r in results:
    assert len(r["losses"]) == 40 and np.all(np.isfinite(r["losses"]))
    assert r["data"]["sha256"] and r["versions"]["jax"] and r["spec"]["lr"] == 3e-3
  report = (out / "report.md").read_text()
  assert "| pipedream | 1.00 |" in report and "| rotation |" in report
  assert len((out / "results.csv").read_text().strip().splitlines()) == 5
  # Running again skips every finished run (nothing recomputed) and rewrites the same report.
  before = {p: p.stat().st_mtime_ns for p in (out / "runs").glob("*/result.json")}
  sweep.main(["--preset", "smoke", "--out", str(out)])
  assert {p: p.stat().st_mtime_ns for p in before} == before


class _Interrupt(Exception):
  pass


class _Progress:
  """A progress bar that 'presses Ctrl-C' once ``stop_at`` steps are done."""

  def __init__(self, stop_at):
    self.n, self.stop_at = 0, stop_at

  def reset(self, total):
    self.n = 0

  def update(self, k):
    self.n += k
    if self.n >= self.stop_at:
      raise _Interrupt


def test_interrupt_and_resume_equals_uninterrupted(tmp_path):
  spec = runs.RunSpec(method="rotation", stages=2, seed=0, lr=3e-3, steps=40, batch_size=4,
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

  def nan_after_first_chunk(spec, ds):
    pipe, state, graphdef, loss_fn = build(spec, ds)
    run, calls = pipe.run, []

    def poisoned(state, batches):
      calls.append(1)
      state, losses = run(state, batches)
      return state, losses * (np.nan if len(calls) > 1 else 1.0)

    pipe.run = poisoned
    return pipe, state, graphdef, loss_fn

  monkeypatch.setattr(runs, "build", nan_after_first_chunk)
  spec = runs.RunSpec(method="pipedream", stages=1, seed=0, lr=3e-3, steps=40, batch_size=4,
                      model="cpu-tiny", chunk=10, eval_every=20, eval_batches=1, checkpoint_every=20)
  result = runs.train(spec, data_lib.default_corpus(32), tmp_path / "d")
  assert result["status"] == "diverged" and result["steps_done"] == 20
  assert np.all(np.isfinite(result["losses"][:10])) and np.isnan(result["losses"][10])
  assert (tmp_path / "d" / "result.json").exists()  # recorded; a sweep moves on


@pytest.mark.parametrize("argv,match", [
    (["--preset", "huge"], "unknown preset 'huge'"),
    (["--preset", "smoke", "--methods", "sgd"], "unknown method 'sgd'"),
    (["--preset", "smoke", "--stages", "3"], "4 blocks cannot be split into 3 equal stages"),
    (["--preset", "smoke", "--stages", "8"], "8 stages is more than the model's 4 blocks"),
    (["--preset", "smoke", "--ablations", "everything"], "unknown ablation 'everything'"),
    (["--preset", "smoke", "--steps", "15"], "multiple of the chunk 10"),
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
  main = [json.loads(p.read_text()) for p in (out / "runs").glob("*/result.json") if "_tune" not in p.parent.name]
  assert len(main) == 1 and main[0]["spec"]["lr"] == chosen

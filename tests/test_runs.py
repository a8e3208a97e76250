"""One run's identity, damaged files and resumption (experiments/runs.py)."""

import dataclasses
import json
import shutil

import jax
import numpy as np
import pytest

from experiments import data as data_lib
from experiments import runs

CONFIG = runs.RunConfig(method="pipedream", stages=2, seed=0, lr=3e-3, steps=30, batch_size=4,
                        model="cpu-tiny", chunk=10, eval_every=10, eval_batches=1, checkpoint_every=10)


@pytest.fixture(scope="module")
def corpus():
  return data_lib.default_corpus(32)


@pytest.fixture(scope="module")
def trained(tmp_path_factory, corpus):
  """One finished run, shared (its folder is copied before anything damages it)."""
  run_dir = tmp_path_factory.mktemp("runs") / "clean"
  return run_dir, runs.train(CONFIG, corpus, run_dir)


def test_identity_names_every_setting_and_the_data(corpus):
  name = runs.run_name(CONFIG, corpus.sha256, corpus.vocab_size)
  assert name.startswith(CONFIG.name)
  assert runs.run_name(CONFIG, "other-sha", corpus.vocab_size) != name
  assert runs.run_name(CONFIG, corpus.sha256, 300) != name
  for field, value in (("clip_norm", 0.5), ("weight_decay", 0.1), ("warmup_fraction", 0.05),
                       ("moe_loss_weight", 0.0), ("refresh_every", 5), ("pipemare_fraction", 0.5),
                       ("dtype", "bfloat16"), ("context", 64), ("execution", "devices")):
    assert runs.run_name(dataclasses.replace(CONFIG, **{field: value}), corpus.sha256, 256) != name, field
  # options at their "not used" value leave the identity (and the folders of older runs) unchanged
  assert "execution" not in runs.identity(CONFIG, corpus.sha256, 256)["config"]


def test_a_folder_of_another_run_is_refused(tmp_path, corpus):
  runs.check_identity(tmp_path, runs.identity(CONFIG, corpus.sha256, 256))
  other = runs.identity(dataclasses.replace(CONFIG, lr=1e-3), "abc", 256)
  with pytest.raises(ValueError, match="lr, data_sha256 differ"):
    runs.check_identity(tmp_path, other)


def test_damaged_files_fall_back_and_the_run_ends_as_if_uninterrupted(tmp_path, corpus, trained):
  clean_dir, clean = trained
  run_dir = tmp_path / "damaged"
  shutil.copytree(clean_dir, run_dir)
  # Damage everything of a finished run: the result, and the newest checkpoint's array files.
  (run_dir / "result.json").write_text('{"name": "trunc')
  newest = max(int(p.name) for p in (run_dir / "checkpoints").iterdir() if p.name.isdigit())
  for f in (run_dir / "checkpoints" / str(newest)).rglob("*"):
    if f.is_file() and f.stat().st_size > 0 and "metadata" not in f.name:
      f.write_bytes(f.read_bytes()[: f.stat().st_size // 3])
  with pytest.warns(UserWarning) as caught:
    again = runs.train(CONFIG, corpus, run_dir)
  messages = " ".join(str(w.message) for w in caught)
  assert "result.json: damaged" in messages and f"checkpoints/{newest}" in messages
  assert again["losses"] == clean["losses"] and again["status"] == "finished"
  assert (run_dir / "result.damaged").exists()
  log = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
  assert [r["step"] for r in log] == list(range(1, 31))  # resumed: no line twice
  assert [r["loss"] for r in log] == clean["losses"]
  assert all(r["lr"] > 0 and r["grad_norm"] > 0 for r in log)


def test_metrics_are_written_while_training(trained):
  run_dir, result = trained
  log = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
  np.testing.assert_allclose([r["loss"] for r in log], result["losses"], rtol=1e-6)
  lr = runs.methods.schedule(CONFIG)
  np.testing.assert_allclose([r["lr"] for r in log], [float(lr(i)) for i in range(30)], rtol=1e-5)
  assert [r["step"] for r in log if "val_loss" in r] == [10, 20, 30] and result["compile_seconds"] > 0
  # The steady-state rate excludes the first (compiling) chunk.
  assert result["steps_per_second"] > 20 / result["seconds"]
  assert (run_dir / "identity.json").exists()


def test_bfloat16_activations_train_with_float32_state(tmp_path, corpus, trained):
  config = dataclasses.replace(CONFIG, dtype="bfloat16")
  result = runs.train(config, corpus, tmp_path / "bf16")
  losses, f32 = np.asarray(result["losses"]), np.asarray(trained[1]["losses"])
  assert np.all(np.isfinite(losses)) and losses[-5:].mean() < losses[:5].mean() - 0.5
  assert abs(losses[-5:].mean() - f32[-5:].mean()) < 0.1  # bf16 rounding, not another model
  assert not np.array_equal(losses, f32)
  pipe, state, _, _ = runs.build(config, corpus)
  assert all(x.dtype == np.float32 for x in jax.tree.leaves(state.params))

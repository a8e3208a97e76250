"""One run's identity, damaged files and resumption (experiments/harness/runs.py)."""

import dataclasses
import json
import logging
import pathlib
import shutil

import jax
import jax.numpy as jnp
import numpy as np
import orbax.checkpoint as ocp
import pytest

from experiments.harness import checkpoints, provenance, runs
from experiments.harness import data as data_lib
from experiments.harness.config import OutOfMemory, RunConfig, identity, memory_options, run_name
from experiments.harness.methods import spec

CONFIG = RunConfig(optimizer=spec("pipedream"), stages=2, seed=0, lr=3e-3, steps=30, batch_size=4,
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
  name = run_name(CONFIG, corpus.sha256, corpus.vocab_size)
  assert name.startswith(CONFIG.name)
  assert run_name(CONFIG, "other-sha", corpus.vocab_size) != name
  assert run_name(CONFIG, corpus.sha256, 300) != name
  for field, value in (("clip_norm", 0.5), ("weight_decay", 0.1), ("warmup_fraction", 0.05),
                       ("moe_loss_weight", 0.0), ("pipemare_fraction", 0.5), ("dtype", "bfloat16"),
                       ("context", 64), ("execution", "devices"), ("optimizer", spec("pipedream", b1=0.8)),
                       ("optimizer", spec("pipedream-lr")), ("optimizer", spec("rotation", refresh_every=5))):
    assert run_name(dataclasses.replace(CONFIG, **{field: value}), corpus.sha256, 256) != name, field
  # options at their "not used" value leave the identity (and the folders of older runs) unchanged
  assert "execution" not in identity(CONFIG, corpus.sha256, 256)["config"]


def test_a_folder_of_another_run_is_refused(tmp_path, corpus):
  runs.check_identity(tmp_path, identity(CONFIG, corpus.sha256, 256))
  other = identity(dataclasses.replace(CONFIG, lr=1e-3), "abc", 256)
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


def test_the_state_is_checkpointed_packed_and_per_array_checkpoints_still_restore(tmp_path, corpus,
                                                                                   trained):
  run_dir, result = trained
  ckpt = checkpoints._Checkpoints(run_dir / "checkpoints")
  step = max(ckpt.manager.all_steps())
  assert set(ckpt.manager.item_metadata(step).tree["packed"]) == {"float32", "int32"}
  _, template, _, _ = runs.build(CONFIG, corpus)
  tables = np.zeros(30, np.float32), np.zeros(4, np.float32)
  got_step, state, losses, _ = ckpt.restore(template, *tables, read_only=True)
  assert got_step == step and list(losses) == result["losses"]
  # A checkpoint of earlier code, one Orbax array per leaf, restores to the same state.
  legacy = checkpoints._Checkpoints(tmp_path / "legacy")
  legacy.manager.save(step, args=ocp.args.StandardSave({"state": state, "losses": losses, "val": tables[1]}))
  legacy.manager.wait_until_finished()
  _, old, _, _ = legacy.restore(template, *tables, read_only=True)
  for a, b, t in zip(jax.tree.leaves(state), jax.tree.leaves(old), jax.tree.leaves(template)):
    np.testing.assert_array_equal(a, b)
    assert a.dtype == b.dtype == t.dtype and a.sharding == t.sharding
  # ... and it is the trained state, not the initial one.
  assert not np.array_equal(state.params["embed"]["tok"]["embedding"],
                            template.params["embed"]["tok"]["embedding"])
  assert result["overhead_seconds"]["checkpoint"] > 0 and result["overhead_seconds"]["build"] > 0


def test_metrics_are_written_while_training(trained):
  run_dir, result = trained
  log = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
  np.testing.assert_allclose([r["loss"] for r in log], result["losses"], rtol=1e-6)
  lr = runs.learning_rates.warmup_cosine(CONFIG)
  np.testing.assert_allclose([r["lr"] for r in log], [float(lr(i)) for i in range(30)], rtol=1e-5)
  assert [r["step"] for r in log if "val_loss" in r] == [10, 20, 30] and result["compile_seconds"] > 0
  # The steady-state rate excludes the first (compiling) chunk.
  assert result["steps_per_second"] > 20 / result["seconds"]
  assert (run_dir / "identity.json").exists()


def test_update_diagnostics_are_opt_in_and_change_no_number(tmp_path, corpus, trained):
  # (diagnose consumes nothing: tests/test_driver.py replays the run from the diagnosed state)
  _, plain = trained
  config = dataclasses.replace(CONFIG, diagnose_every=20, diagnose_steps=2)
  assert "-diag20" in config.name and run_name(config, "x", 256) != run_name(CONFIG, "x", 256)
  result = runs.train(config, corpus, tmp_path / "diag")
  assert result["losses"] == plain["losses"] and result["val_losses"] == plain["val_losses"]
  assert [d["step"] for d in result["diagnostics"]] == [20]  # not at step 0
  for d in result["diagnostics"]:
    assert len(d["cosine"]) == len(d["flip_rate"]) == 2 and all(-1 <= c <= 1 for c in d["cosine"])
  with pytest.raises(ValueError, match="diagnose_every=15 must be a positive multiple of chunk=10"):
    dataclasses.replace(CONFIG, diagnose_every=15).validate()


def test_bfloat16_activations_train_with_float32_state(tmp_path, corpus, trained):
  config = dataclasses.replace(CONFIG, dtype="bfloat16")
  result = runs.train(config, corpus, tmp_path / "bf16")
  losses, f32 = np.asarray(result["losses"]), np.asarray(trained[1]["losses"])
  assert np.all(np.isfinite(losses)) and losses[-5:].mean() < losses[:5].mean() - 0.5
  assert abs(losses[-5:].mean() - f32[-5:].mean()) < 0.1  # bf16 rounding, not another model
  assert not np.array_equal(losses, f32)
  pipe, state, _, _ = runs.build(config, corpus)
  assert all(x.dtype == np.float32 for x in jax.tree.leaves(state.params))


class _Stop(Exception):
  pass


class _StopAt:
  """A progress bar that interrupts the run once ``stop_at`` steps are done; records where it
  resumed (its first ``update``)."""

  def __init__(self, stop_at):
    self.n, self.stop_at, self.first = 0, stop_at, None

  def reset(self, total):
    self.n = 0

  def set_postfix(self, *args, **kwargs):
    pass

  def update(self, k):
    self.first = k if self.first is None else self.first
    self.n += k
    if self.n >= self.stop_at:
      raise _Stop


def _damage_checkpoints(run_dir):
  for f in (run_dir / "checkpoints").rglob("*"):
    if f.is_file() and f.stat().st_size > 0 and "metadata" not in f.name and f.parent.name != "checkpoints":
      f.write_bytes(f.read_bytes()[: f.stat().st_size // 3])


def test_two_interruptions_after_damaged_checkpoints_lose_only_the_last_chunk(tmp_path, corpus, trained):
  # Every checkpoint (10, 20) damaged: the run restarts from 0. Orbax refuses to save a step at or
  # below its newest, so unless the damaged ones are set aside no progress would be saved before
  # step 30, and a second interruption would restart from 0 again.
  run_dir = tmp_path / "run"
  with pytest.raises(_Stop):
    runs.train(CONFIG, corpus, run_dir, progress=_StopAt(30))  # checkpoints 10, 20; stopped at 30
  _damage_checkpoints(run_dir)
  with pytest.warns(UserWarning, match="cannot be restored"):
    with pytest.raises(_Stop):
      runs.train(CONFIG, corpus, run_dir, progress=_StopAt(30))  # restarts at 0, saves 10 and 20
  assert sorted(p.name for p in (run_dir / "checkpoints.damaged").iterdir()) == ["10", "20"]
  bar = _StopAt(10**9)
  resumed = runs.train(CONFIG, corpus, run_dir, progress=bar)
  assert bar.first == 20  # resumed at the newest checkpoint of the second try
  assert resumed["losses"] == trained[1]["losses"] and resumed["status"] == "finished"


def test_checkpoints_of_other_code_are_not_resumed(tmp_path, corpus, monkeypatch):
  run_dir = tmp_path / "run"
  with pytest.raises(_Stop):
    runs.train(CONFIG, corpus, run_dir, progress=_StopAt(20))  # checkpoint 10
  assert json.loads((run_dir / "checkpoints" / "code.json").read_text()) == provenance.code_version()
  # the same commit with an uncommitted edit (or a pip install of other code): other source
  edited = {**provenance.code_version(), "source": "0123456789abcdef"}
  monkeypatch.setattr(provenance, "code_version", lambda: edited)
  bar = _StopAt(10**9)
  with pytest.warns(UserWarning, match="written by other code.*restarting the run from step 0"):
    result = runs.train(CONFIG, corpus, run_dir, progress=bar)
  assert bar.first == 0 and result["status"] == "finished"
  assert result["versions"]["code"]["source"] == "0123456789abcdef"
  assert (run_dir / "checkpoints.other-code" / "10").is_dir()


def test_the_code_identity_is_a_hash_of_the_source_files():
  files = provenance.source_files()
  assert "rotation/transform.py" in files and "experiments/harness/runs.py" in files
  assert provenance.code_version()["source"] == provenance.source_hash(files)
  edited = {**files, "rotation/transform.py": "0" * 64}
  assert provenance.source_hash(edited) != provenance.source_hash(files)
  assert provenance.same_code(provenance.code_version())
  assert not provenance.same_code({**provenance.code_version(), "source": provenance.source_hash(edited)})
  pip_install = {"version": provenance.code_version()["version"], "commit": None}
  assert not provenance.same_code(pip_install)
  assert provenance.changed_files(edited) == ["rotation/transform.py"]


def test_only_the_numbers_code_is_the_code_identity(tmp_path):
  """A copy of the project: editing a report, plot, study, sweep or benchmark module leaves the
  code identity (and so a checkpoint's resumption) alone; editing the model, the methods or a
  library changes it."""
  import shutil
  root = pathlib.Path(provenance.__file__).resolve().parents[2]
  for package in ("rotation", "pipeline_sim", "experiments"):
    shutil.copytree(root / package, tmp_path / package, ignore=shutil.ignore_patterns("__pycache__"))
  before = provenance.source_hash(provenance.source_files(tmp_path))
  assert before == provenance.code_version()["source"]  # the copy is this code
  for module in ("report/plots.py", "report/sections.py", "studies/horizon.py", "sweep/command.py",
                 "bench/optimizer.py", "cli.py"):
    with open(tmp_path / "experiments" / module, "a") as f:
      f.write("\n# an edit\n")
    assert provenance.source_hash(provenance.source_files(tmp_path)) == before, module
  for module in ("experiments/harness/model.py", "experiments/harness/methods.py", "experiments/__init__.py",
                 "rotation/transform.py", "pipeline_sim/driver.py"):
    target = tmp_path / module
    original = target.read_text()
    target.write_text(original + "\n# an edit\n")
    assert provenance.source_hash(provenance.source_files(tmp_path)) != before, module
    target.write_text(original)
  assert provenance.source_hash(provenance.source_files(tmp_path)) == before


def test_a_packed_checkpoint_is_never_restored_into_another_layout(tmp_path):
  ckpt = checkpoints._Checkpoints(tmp_path / "checkpoints")
  losses, val = np.zeros(4, np.float32), np.zeros(2, np.float32)
  ckpt.save(10, {"mu": jnp.arange(6.0), "nu": jnp.full(4, 9.0)}, losses, val)
  for template in ({"mu": jnp.zeros(3), "nu": jnp.zeros(3)},  # smaller: was sliced silently
                   {"mu": jnp.zeros(6), "nu": jnp.zeros(6)},  # larger: was set aside as damaged
                   {"a": jnp.zeros(6), "b": jnp.zeros(4)}):  # same sizes, other names
    with pytest.raises(checkpoints.LayoutError, match="holds a state of layout"):
      ckpt.restore(template, losses, val, read_only=True)
  with pytest.warns(UserWarning, match="cannot be restored.*holds a state of layout"):
    assert ckpt.restore({"mu": jnp.zeros(3), "nu": jnp.zeros(3)}, losses, val) is None
  assert (tmp_path / "checkpoints.other-code" / "10").is_dir()  # not "damaged": it is readable
  with pytest.raises(checkpoints.LayoutError, match="holds 6 float32 values, the state needs 8"):
    checkpoints.unpack({"float32": np.zeros(6, np.float32)}, {"a": jnp.zeros(8)})


def test_code_json_is_written_before_the_first_checkpoint_and_stale_saves_are_removed(tmp_path, corpus,
                                                                                     monkeypatch):
  run_dir = tmp_path / "run"
  stale = run_dir / "checkpoints" / "30.orbax-checkpoint-tmp-1234"
  stale.mkdir(parents=True)  # an interrupted save
  seen = []
  save = ocp.CheckpointManager.save

  def spy(self, step, *args, **kwargs):
    seen.append((step, (pathlib.Path(self.directory) / "code.json").exists()))
    return save(self, step, *args, **kwargs)

  monkeypatch.setattr(ocp.CheckpointManager, "save", spy)
  with pytest.raises(_Stop):
    runs.train(CONFIG, corpus, run_dir, progress=_StopAt(20))
  assert seen == [(10, True)] and not stale.exists()


def test_device_count_is_part_of_the_identity(corpus):
  one = run_name(CONFIG, corpus.sha256, 256)
  assert run_name(CONFIG, corpus.sha256, 256, devices=1) == one  # older runs keep their folders
  assert run_name(CONFIG, corpus.sha256, 256, devices=4) != one
  assert identity(CONFIG, corpus.sha256, 256, 4)["devices"] == 4
  assert provenance.code_version()["version"] == "0.1.0"


def test_the_models_own_block_count_is_the_same_run_and_another_is_not():
  own = dataclasses.replace(CONFIG, num_blocks=4)  # cpu-tiny has 4 blocks
  assert run_name(own, "x", 256) == run_name(CONFIG, "x", 256)
  assert identity(own, "x", 256) == identity(CONFIG, "x", 256)
  deeper = dataclasses.replace(CONFIG, num_blocks=8)
  assert run_name(deeper, "x", 256) != run_name(CONFIG, "x", 256)
  assert "-B8" in run_name(deeper, "x", 256)


def test_width_override_scales_heads_and_the_models_own_width_is_the_same_run():
  wide = dataclasses.replace(CONFIG, width=64)
  cfg = wide.model_config(256)
  assert (cfg.width, cfg.num_heads) == (64, 4)  # cpu-tiny: 2 heads of 16
  assert "-W64" in wide.name and "-W" not in dataclasses.replace(CONFIG, width=32).name
  assert run_name(dataclasses.replace(CONFIG, width=32), "x", 256) == run_name(CONFIG, "x", 256)
  assert run_name(wide, "x", 256) != run_name(CONFIG, "x", 256)
  with pytest.raises(ValueError, match="width 40 must be a positive multiple of the model's head size 16"):
    dataclasses.replace(CONFIG, width=40).validate()


@pytest.mark.parametrize("field, value", [("seed", -3), ("context", 0), ("num_blocks", 0)])
def test_bad_values_are_refused_by_name(field, value):
  lower = 0 if field == "seed" else 1
  with pytest.raises(ValueError, match=f"{field} must be >= {lower}, got {value}"):
    dataclasses.replace(CONFIG, **{field: value}).validate()


def test_orbax_warnings_stay_out_of_the_output(tmp_path, monkeypatch, caplog):
  from absl import logging as absl_logging
  ckpt = checkpoints._Checkpoints(tmp_path / "checkpoints")
  wait = ckpt.manager.wait_until_finished

  def slow_wait():  # what Orbax says when a save waited for the previous one
    absl_logging.warning("Waiting for previous save to complete took 3.03 seconds")
    return wait()

  monkeypatch.setattr(ckpt.manager, "wait_until_finished", slow_wait)
  with caplog.at_level(logging.WARNING):
    ckpt.save(10, {"w": jnp.ones(3)}, np.zeros(2, np.float32), np.zeros(1, np.float32))
    assert not [r for r in caplog.records if "Waiting for previous save" in r.getMessage()]
    absl_logging.warning("an absl warning outside a save still shows")
    assert [r for r in caplog.records if "outside a save still shows" in r.getMessage()]


def test_a_run_out_of_device_memory_ends_in_one_line_naming_it(tmp_path, corpus, monkeypatch):
  def exhausted(*args):
    raise jax.errors.JaxRuntimeError("RESOURCE_EXHAUSTED: Out of memory allocating 37281745816 bytes.")

  monkeypatch.setattr(runs.ps.Pipeline, "advance", exhausted)
  with pytest.raises(OutOfMemory) as e:
    runs.train(CONFIG, corpus, tmp_path / "run")
  message = str(e.value)
  assert len(message.splitlines()) == 1 and "run run ran out of device memory" in message
  assert "34.7 GiB more" in message and "--remat nothing_saveable" in message and "--loss-chunk" in message
  # a run that uses them already is pointed at the others
  config = dataclasses.replace(CONFIG, remat="nothing_saveable", loss_chunk=64)
  assert memory_options(config).startswith("a smaller --batch-size")
  assert isinstance(e.value, ValueError)  # the sweep's cli prints a ValueError as one line (exit 2)


def test_a_run_checkpoints_every_tenth_and_drops_its_checkpoints_when_asked(tmp_path, corpus, trained):
  """Checkpoints come at least every tenth of the run (whole chunks), whatever ``checkpoint_every``
  says, so an interruption loses at most about a tenth; a finished run keeps them only when asked."""
  assert runs.save_every(dataclasses.replace(CONFIG, steps=2400, chunk=100, checkpoint_every=1200)) == 200
  assert runs.save_every(dataclasses.replace(CONFIG, steps=2400, chunk=100, checkpoint_every=100)) == 100
  assert runs.save_every(dataclasses.replace(CONFIG, steps=40, chunk=10, checkpoint_every=20)) == 10
  sparse = dataclasses.replace(CONFIG, steps=100, checkpoint_every=100)  # a tenth: 10 steps
  run_dir = tmp_path / "run"
  with pytest.raises(_Stop):
    runs.train(sparse, corpus, run_dir, progress=_StopAt(50))  # stopped before step 50 is saved
  bar = _StopAt(10**9)
  done = runs.train(sparse, corpus, run_dir, progress=bar, keep_checkpoints=False)
  assert bar.first == 40 and done["status"] == "finished"
  assert not (run_dir / "checkpoints").exists() and (run_dir / "result.json").exists()
  assert (trained[0] / "checkpoints").is_dir()  # the default keeps them (its trained state)

"""One training run: model, data, per-stage optimizers, emulated pipeline, checkpoints, result.

A run lives in its own folder, named by its identity (``run_name``: the settings and a hash of the
config, the data's sha256 and the vocabulary), and holds ``identity.json`` from its first step.
``result.json`` is written (atomically) only when the run ends, so its presence means "finished":
a sweep skips such runs. Until then an Orbax checkpoint of the whole pipeline state and the loss
history is saved every ``checkpoint_every`` steps; a restarted run resumes from it and, since
batches are a pure function of (seed, step) and chunks are the same, ends with exactly the numbers
of an uninterrupted run. ``metrics.jsonl`` gets one line per step (step, loss, learning rate,
gradient norm, seconds) while the run trains.
"""

from __future__ import annotations

import json
import os
import pathlib
import shutil
import time
import warnings

import jax
import jax.numpy as jnp
import numpy as np

import pipeline_sim as ps
from experiments.harness import learning_rates, methods, provenance
from experiments.harness import model as model_lib
from experiments.harness.checkpoints import _Checkpoints
from experiments.harness.config import OutOfMemory, RunConfig, identity, out_of_memory, record
from experiments.harness.data import Dataset
from experiments.harness.processes import DamagedFileError, _read_json, barrier, is_primary, write_json


def load_result(run_dir) -> dict | None:
  """The finished run's result, or ``None`` (unfinished, or a damaged result that process 0 sets
  aside as ``result.damaged``)."""
  path = pathlib.Path(run_dir) / "result.json"
  try:
    return _read_json(path)
  except DamagedFileError as e:
    if is_primary():
      warnings.warn(f"{e}; the run will be resumed from its checkpoint or restarted", stacklevel=2)
      os.replace(path, path.with_suffix(".damaged"))
    return None


def restore(record: dict, folder: pathlib.Path, ds: Dataset, source: str) -> dict:
  """Writes the ``result.json`` of a finished run from its published curves record (``record``, as
  ``experiments.report.curves.read`` returns it; ``folder``: the run's folder, whose name must be the
  record's), so that a sweep on a new machine skips the run instead of training it again.

  The result holds what the curves file stores: training losses at its 4 decimals (a run published
  as block means comes back as those means, repeated per step), validation losses, timing, CPU, code
  version and diagnostics; it names its source (``restored_from``) and has no checkpoint (a study
  that needs the trained state retrains the run)."""
  folder = pathlib.Path(folder)
  if record["name"] != folder.name:
    raise ValueError(f"run {record['name']!r} cannot be restored into folder {folder.name!r}: "
                     "a run's folder is named by its identity")
  result = {
      "name": record["name"], "config": record["config"], "status": record["status"],
      "steps_done": len(record["losses"]), "losses": [float(x) for x in record["losses"]],
      "val_steps": list(record["val_steps"]), "val_losses": [float(x) for x in record["val_losses"]],
      "seconds": record.get("seconds"), "compile_seconds": None,
      "steps_per_second": record.get("steps_per_second"), "jobs": record.get("jobs"),
      "data": {"name": ds.name, "sha256": ds.sha256, "tokens": ds.num_tokens, "vocab_size": ds.vocab_size},
      "versions": {"host": record.get("host"), "code": record.get("code")}, "restored_from": source}
  if record.get("model_revision") is not None:
    result["identity"] = {"model_revision": record["model_revision"]}
  if record.get("diagnostics"):
    result["diagnostics"] = record["diagnostics"]
  if is_primary():
    folder.mkdir(parents=True, exist_ok=True)
  write_json(folder / "result.json", result)
  return result


def _staged(config: RunConfig, cfg) -> ps.Staged:
  w = config.moe_loss_weight
  return ps.Staged(model_lib.stage_functions(cfg, config.stages, config.dtype),
                   loss_of=lambda out, batch: model_lib.cross_entropy(out[0], batch[1]) + w * out[1])


def pipeline_of(config: RunConfig, cfg, graphdef, params) -> ps.Pipeline:
  """The emulated ``Pipeline`` of a config (``params``: arrays or shapes, for the stage labels)."""
  loss_fn = model_lib.make_loss(graphdef, config.moe_loss_weight, config.dtype)
  return ps.Pipeline(loss_fn, methods.run_optimizers(config), model_lib.stage_labels(params, config.stages),
                     mode=config.mode, staged=_staged(config, cfg) if config.mode == "no_stashing" else None,
                     grad_norms=True, schedule=config.schedule, predict=methods.predict_scale(config))


def build(config: RunConfig, ds: Dataset, devices=None):
  """Returns (pipeline, initial state, graphdef, loss_fn) for a config: an emulated ``Pipeline``, or
  with ``execution="devices"`` a ``DevicePipeline`` over ``devices`` (default: every local one)."""
  cfg = config.model_config(ds.vocab_size)
  graphdef, params = model_lib.init(cfg, seed=config.seed)
  loss_fn = model_lib.make_loss(graphdef, config.moe_loss_weight, config.dtype)
  if config.execution == "devices":
    pipe = ps.DevicePipeline(_staged(config, cfg), methods.run_optimizers(config),
                             model_lib.stage_labels(params, config.stages), mode=config.mode,
                             mesh=ps.pipeline_mesh(config.stages, devices), schedule=config.schedule)
  else:
    pipe = pipeline_of(config, cfg, graphdef, params)
  example = ds.batch(config.seed, 0, config.batch_size, cfg.context)
  return pipe, pipe.init(params, example), graphdef, loss_fn


def check_identity(run_dir: pathlib.Path, ident: dict) -> None:
  """Raises if ``run_dir`` belongs to a run with another identity (config, data or vocabulary)."""
  try:
    saved = _read_json(run_dir / "identity.json")
  except DamagedFileError:
    saved = None  # rewritten below; the folder name already carries the identity's hash
  if saved is None:
    write_json(run_dir / "identity.json", ident)
    return
  if saved != ident:
    keys = set(ident["config"]) | set(saved.get("config", {}))
    diff = sorted(k for k in keys if saved.get("config", {}).get(k) != ident["config"].get(k))
    diff += [k for k in ("data_sha256", "vocab_size", "model_revision") if saved.get(k) != ident.get(k)]
    raise ValueError(f"{run_dir} holds a run with other settings ({', '.join(diff)} differ); "
                     "use another --out or remove that folder")


class _Record:
  """What one run writes as it trains: its losses, validation losses, timing and logs (the metrics
  log, the diagnostics log), each method one step of the bookkeeping ``train`` does."""

  def __init__(self, config: RunConfig, run_dir: pathlib.Path, evaluate_loss):
    self.config, self.evaluate_loss = config, evaluate_loss
    self.losses = np.full(config.steps, np.nan, np.float32)
    self.val_losses = np.full(config.steps // config.eval_every + 1, np.nan, np.float32)
    # Seconds of the chunks (compile_seconds: the first one's, with compilation) and, outside them,
    # of building the state, evaluating and checkpointing (restoring included); summed over resumes.
    self.timing = {"seconds": 0.0, "steady_seconds": 0.0, "steady_steps": 0, "compile_seconds": None,
                   "build_seconds": 0.0, "eval_seconds": 0.0, "checkpoint_seconds": 0.0}
    self.run_dir = run_dir
    self.log, self.diag_log = run_dir / "metrics.jsonl", run_dir / "diagnostics.jsonl"
    self.lr_at = learning_rates.warmup_cosine(config)
    self.compiled = False  # this process has run a chunk (compiled the step)

  def evaluate(self, params) -> float:
    t0 = time.perf_counter()
    loss = float(self.evaluate_loss(params))
    self.timing["eval_seconds"] += time.perf_counter() - t0
    return loss

  def save(self, ckpt, step, state) -> None:
    t0 = time.perf_counter()
    ckpt.save(step, state, self.losses, self.val_losses)
    self.timing["checkpoint_seconds"] += time.perf_counter() - t0

  def start(self, restored, in_flight: int):
    """A fresh log, or the restored losses and timing with the logs cut back to the checkpoint.
    Returns the step to start at and the restored state (``None``: fresh)."""
    if restored is None:
      if is_primary():
        self.log.write_text("")
        if self.config.diagnose_every:
          self.diag_log.write_text("")
      return 0, None
    step, state, losses, val_losses = restored
    self.losses, self.val_losses = losses.copy(), val_losses.copy()
    self.timing.update(_read_json(self.run_dir / "timing.json") or {})
    _truncate_log(self.log, step - in_flight)
    _truncate_log(self.diag_log, step - 1)  # the window at ``step`` is logged again
    return step, state

  def chunk_seconds(self, elapsed: float) -> None:
    """A chunk's seconds; this process's first chunk includes compilation and is kept out of the
    steady-state rate."""
    self.timing["seconds"] += elapsed
    if not self.compiled:
      self.compiled = True
      self.timing["compile_seconds"] = self.timing["compile_seconds"] or elapsed
    else:
      self.timing["steady_seconds"] += elapsed
      self.timing["steady_steps"] += self.config.chunk

  def steps(self, done, chunk_losses, grad_norms, seconds, val_loss=None) -> bool:
    """Logs the completed steps; whether their losses are all finite."""
    self.losses[done] = chunk_losses
    lrs = np.asarray(self.lr_at(done))
    records = [{"step": int(j) + 1, "loss": float(x), "lr": float(r), "grad_norm": float(g),
                "seconds": seconds} for j, x, r, g in zip(done, chunk_losses, lrs, grad_norms)]
    if val_loss is not None and records:
      records[-1]["val_loss"] = val_loss
    if is_primary():
      with open(self.log, "a") as f:
        f.writelines(json.dumps(r) + "\n" for r in records)
    return bool(np.all(np.isfinite(chunk_losses)))

  def diagnose(self, pipe, state, ds: Dataset, step: int, context: int, mesh) -> None:
    c = self.config
    trial = ds.batches(c.seed, step, c.diagnose_steps, c.batch_size, context)
    found = ps.diagnose(pipe, state, ps.shard_batches(trial, mesh))
    if is_primary():
      with open(self.diag_log, "a") as f:
        f.write(json.dumps({"step": step, "cosine": found["cosine"].mean(axis=0).tolist(),
                            "gradient_cosine": found["gradient_cosine"].mean(axis=0).tolist(),
                            "flip_rate": found["flip_rate"].tolist()}) + "\n")

  def result(self, run_dir, ident, status, step, pipe, state, ds, mesh, jobs) -> dict:
    c, timing = self.config, self.timing
    steady = timing["steady_steps"] / timing["steady_seconds"] if timing["steady_seconds"] else None
    result = {
        "name": run_dir.name, "config": record(c), "identity": ident,
        "status": status, "steps_done": int(step), "losses": [float(x) for x in self.losses],
        "val_steps": [i * c.eval_every for i in range(len(self.val_losses))],
        "val_losses": [float(x) for x in self.val_losses],
        "seconds": timing["seconds"], "compile_seconds": timing["compile_seconds"],
        "steps_per_second": steady, "jobs": jobs,
        "overhead_seconds": {k: timing[f"{k}_seconds"] for k in ("build", "eval", "checkpoint")},
        "buffer_bytes": pipe.buffer_bytes(state),
        "num_params": model_lib.count_params(pipe.params(state)),
        "data": {"name": ds.name, "sha256": ds.sha256, "tokens": ds.num_tokens,
                 "vocab_size": ds.vocab_size},
        "versions": provenance.versions(), "devices": mesh.size,
    }
    if c.diagnose_every:
      result["diagnostics"] = [json.loads(line) for line in self.diag_log.read_text().splitlines()]
    return result


def _validation(config: RunConfig, ds: Dataset, loss_fn, context: int, mesh):
  """``params -> mean validation loss`` over the run's ``eval_batches`` validation batches."""
  valid = [ds.batch(10_000 + config.seed, j, config.batch_size, context, split="valid")
           for j in range(config.eval_batches)]
  valid = ps.shard_batches(jax.tree.map(lambda *xs: np.stack(xs), *valid), mesh)
  mean_loss = jax.jit(lambda params, valid: jnp.mean(jax.lax.map(lambda b: loss_fn(params, b), valid)))
  return lambda params: mean_loss(params, valid)  # valid is an argument: it may span several hosts


def _advance(pipe, state, batches, config: RunConfig, run_name: str):
  """One chunk; running out of device memory is one line naming the run and what to change."""
  try:
    return pipe.advance(state, batches)
  except jax.errors.JaxRuntimeError as e:
    if "RESOURCE_EXHAUSTED" not in str(e):
      raise
    raise OutOfMemory(out_of_memory(config, run_name, e)) from None


def _checked_identity(config: RunConfig, ds: Dataset, run_dir: pathlib.Path, devices, mesh) -> dict:
  """The run's identity (its config, data, vocabulary and device count), checked against what
  ``run_dir`` already holds."""
  local = jax.local_device_count() if devices is None else len(list(devices))
  ident = identity(config, ds.sha256, ds.vocab_size, local if config.execution == "devices" else mesh.size)
  check_identity(run_dir, ident)
  return ident


def _progress_start(progress, total: int, step: int, note: dict) -> None:
  progress.reset(total=total)
  progress.update(step)
  if note:
    progress.set_postfix(note, refresh=True)


def _flush(pipe, state, rec: _Record):
  """The batches still in flight completed and logged, with the last evaluation after them where
  the pipeline flushes. Returns ``(state, whether their losses are finite)``."""
  config = rec.config
  state, (done, tail_losses, tail_norms) = pipe.finish(state)
  val_loss = None
  if pipe.flushes and config.steps % config.eval_every == 0 and np.all(np.isfinite(tail_losses)):
    val_loss = rec.val_losses[-1] = rec.evaluate(pipe.params(state))
  return state, rec.steps(done, tail_losses, tail_norms, 0.0, val_loss)


def save_every(config: RunConfig) -> int:
  """Steps between checkpoints: ``checkpoint_every``, or a tenth of the run if that is fewer
  (rounded down to whole chunks), so that an interruption loses at most about a tenth of a run.
  Where a run saves does not change its numbers (a resumed run equals an uninterrupted one), so
  this is not part of its identity."""
  tenth = max(config.chunk, config.steps // 10 // config.chunk * config.chunk)
  return min(config.checkpoint_every, tenth)


def train(config: RunConfig, ds: Dataset, run_dir, progress=None, devices=None,
          jobs: int = 1, keep_checkpoints: bool = True) -> dict:
  """Trains (or resumes, or just loads) one run; returns its result dict.

  Every micro-batch is sharded along a ``data`` mesh axis over ``devices`` (default: every local
  device) and the pipeline state is replicated (``pipeline_sim.sharding``); on one device nothing
  changes. Results agree across device counts to float32 round-off (reduction order), not bitwise.
  ``run_dir`` is the run's folder (created; see ``run_name``); ``progress`` an optional ``tqdm``-like
  bar advanced by steps; ``devices`` the data mesh's (default ``jax.devices()``; the device pipeline
  uses the local ones); ``jobs`` the runs trained at once on this host (a sweep's ``--jobs``),
  recorded in the result: above 1, its seconds include the others' load. ``keep_checkpoints``:
  a finished run keeps its checkpoints (its trained state, for ``restore_state``), else drops them.
  """
  run_dir = pathlib.Path(run_dir)
  config.validate()
  if is_primary():
    run_dir.mkdir(parents=True, exist_ok=True)
  barrier(f"run folder {run_dir}")
  mesh = ps.data_mesh(devices)
  ident = _checked_identity(config, ds, run_dir, devices, mesh)
  done = load_result(run_dir)
  if done is not None:
    return done
  _check_batches(config, ds, mesh)
  t0 = time.perf_counter()
  pipe, state, _, loss_fn = build(config, ds, devices)
  state = jax.block_until_ready(pipe.place(state, mesh, config.fsdp))
  built = time.perf_counter() - t0
  context = config.model_config(ds.vocab_size).context
  rec = _Record(config, run_dir, _validation(config, ds, loss_fn, context, mesh))
  ckpt = _Checkpoints(run_dir / "checkpoints")
  t0 = time.perf_counter()
  restored = ckpt.restore(state, rec.losses, rec.val_losses)
  restore_seconds = time.perf_counter() - t0
  status = "finished"
  if restored is None:
    rec.val_losses[0] = rec.evaluate(pipe.params(state))
  step, resumed = rec.start(restored, pipe.in_flight)
  state = state if resumed is None else resumed
  rec.timing["build_seconds"] += built
  rec.timing["checkpoint_seconds"] += restore_seconds
  note = {} if restored is None else {"resumed at": step}
  if progress is not None:
    _progress_start(progress, config.steps, step, note)
  while step < config.steps:
    if config.diagnose_every and step and step % config.diagnose_every == 0:
      rec.diagnose(pipe, state, ds, step, context, mesh)
    batches = ds.batches(config.seed, step, config.chunk, config.batch_size, context, config.sampling)
    batches = pipe.place_batches(batches, mesh)
    t0 = time.perf_counter()
    state, (done, chunk_losses, grad_norms) = _advance(pipe, state, batches, config, run_dir.name)
    elapsed = time.perf_counter() - t0
    rec.chunk_seconds(elapsed)
    step += config.chunk
    finite = bool(np.all(np.isfinite(chunk_losses)))
    # A pipeline that flushes evaluates last after the flush (every stage at every update).
    val_loss = None
    if finite and step % config.eval_every == 0 and not (pipe.flushes and step == config.steps):
      val_loss = rec.val_losses[step // config.eval_every] = rec.evaluate(pipe.params(state))
    rec.steps(done, chunk_losses, grad_norms, elapsed / config.chunk, val_loss)
    if progress is not None:
      progress.set_postfix({**note, "loss": f"{np.mean(chunk_losses):.3f}" if len(done) else "-"},
                           refresh=False)
      progress.update(config.chunk)
    if not finite:
      status = "diverged"
      break
    if step % save_every(config) == 0 and step < config.steps:
      rec.save(ckpt, step, state)
      write_json(run_dir / "timing.json", rec.timing)
  if status == "finished":
    state, finite = _flush(pipe, state, rec)
    status = "finished" if finite else "diverged"
  if status == "finished" and keep_checkpoints:
    rec.save(ckpt, step, state)  # the trained state, for diagnostics
  result = rec.result(run_dir, ident, status, step, pipe, state, ds, mesh, jobs)
  write_json(run_dir / "result.json", result)
  if not keep_checkpoints:
    _drop_checkpoints(ckpt, run_dir)
  return result


def _check_batches(config: RunConfig, ds: Dataset, mesh) -> None:
  """The batches the run will draw exist: one pass holds them (``single-pass``), and the mesh
  divides each micro-batch."""
  if config.sampling == "single-pass":
    ds.check_single_pass(config.steps, config.batch_size, config.model_config(ds.vocab_size).context)
  if config.batch_size % mesh.size:
    raise ValueError(f"batch_size {config.batch_size} is not divisible by the {mesh.size} devices; "
                     "choose a multiple (--batch-size)")


def _drop_checkpoints(ckpt: _Checkpoints, run_dir: pathlib.Path) -> None:
  """A finished run's checkpoints deleted (its result is written), by process 0."""
  if is_primary():
    ckpt.close()
    shutil.rmtree(run_dir / "checkpoints", ignore_errors=True)


def _truncate_log(log: pathlib.Path, step: int) -> None:
  """Drops lines past ``step`` (written after the checkpoint a run resumes from)."""
  if not log.exists() or not is_primary():
    return
  keep = []
  for line in log.read_text().splitlines():
    try:
      if json.loads(line)["step"] <= step:
        keep.append(line)
    except (json.JSONDecodeError, KeyError):
      break
  log.write_text("".join(x + "\n" for x in keep))


def restore_state(config: RunConfig, ds: Dataset, run_dir):
  """(pipeline, trained pipeline state, loss_fn) of a run, from its last checkpoint."""
  run_dir = pathlib.Path(run_dir)
  saved = _read_json(run_dir / "identity.json") or {}
  check_identity(run_dir, identity(config, ds.sha256, ds.vocab_size, saved.get("devices", 1)))
  if config.execution != "emulated":
    raise ValueError(f"{run_dir} ran with execution {config.execution!r}; only emulated runs can be restored")
  pipe, state, _, loss_fn = build(config, ds)
  losses = np.zeros(config.steps, np.float32)
  val = np.zeros(config.steps // config.eval_every + 1, np.float32)
  restored = _Checkpoints(run_dir / "checkpoints").restore(state, losses, val, read_only=True)
  if restored is None:
    raise FileNotFoundError(f"no readable checkpoint under {str(run_dir)!r}")
  return pipe, restored[1], loss_fn

"""One training run: model, data, per-stage optimizers, emulated pipeline, checkpoints, result.

A run lives in its own folder. ``result.json`` is written (atomically) only when the run ends, so
its presence means "finished": a sweep skips such runs. Until then an Orbax checkpoint of the
pipeline state and the loss history is saved every ``checkpoint_every`` steps; a restarted run
resumes from it and, since batches are a pure function of (seed, step) and chunks are the same,
ends with exactly the numbers of an uninterrupted run.
"""

from __future__ import annotations

import dataclasses
import json
import os
import pathlib
import platform
import time
from importlib import metadata
from typing import Optional

import jax
import jax.numpy as jnp
import numpy as np
import orbax.checkpoint as ocp

import pipeline_sim as ps
from experiments import methods
from experiments import model as M
from experiments.data import Dataset


@dataclasses.dataclass(frozen=True)
class RunSpec:
  """Full configuration of one run (saved in its result)."""

  method: str
  stages: int
  seed: int
  lr: float
  steps: int
  batch_size: int
  model: str
  num_blocks: Optional[int] = None  # overrides the named config (model-size scaling)
  mode: str = "weight_stashing"
  chunk: int = 50
  eval_every: int = 250
  eval_batches: int = 4
  checkpoint_every: int = 250
  warmup_fraction: float = 0.05
  pipemare_fraction: float = 0.25
  tag: str = ""

  @property
  def name(self) -> str:
    blocks = f"-B{self.num_blocks}" if self.num_blocks else ""
    tag = f"_{self.tag}" if self.tag else ""
    return (f"{self.model}{blocks}_{self.mode}_{self.method}_P{self.stages}_lr{self.lr:g}"
            f"_n{self.steps}_s{self.seed}{tag}")

  def model_config(self, vocab_size: int) -> M.ModelConfig:
    cfg = M.CONFIGS[self.model]
    return dataclasses.replace(cfg, vocab_size=vocab_size, num_blocks=self.num_blocks or cfg.num_blocks)

  def validate(self) -> None:
    """Every check that can fail before training starts."""
    methods.check_method(self.method)
    if self.model not in M.CONFIGS:
      raise ValueError(f"unknown model {self.model!r}; choose from {sorted(M.CONFIGS)}")
    if self.mode not in ps.MODES:
      raise ValueError(f"unknown mode {self.mode!r}; choose from {ps.MODES}")
    M.blocks_per_stage(self.num_blocks or M.CONFIGS[self.model].num_blocks, self.stages)
    for name in ("eval_every", "checkpoint_every", "steps"):
      if getattr(self, name) % self.chunk:
        raise ValueError(f"{name}={getattr(self, name)} is not a multiple of chunk={self.chunk}")


def versions() -> dict:
  out = {"python": platform.python_version(), "jax_backend": jax.default_backend()}
  for pkg in ("jax", "jaxlib", "optax", "flax", "orbax-checkpoint", "numpy"):
    try:
      out[pkg] = metadata.version(pkg)
    except metadata.PackageNotFoundError:
      pass
  return out


def _write_json(path: pathlib.Path, obj) -> None:
  tmp = path.with_suffix(".tmp")
  tmp.write_text(json.dumps(obj, indent=1))
  os.replace(tmp, path)  # atomic: a crash never leaves a half-written result


def load_result(run_dir) -> Optional[dict]:
  path = pathlib.Path(run_dir) / "result.json"
  return json.loads(path.read_text()) if path.exists() else None


def build(spec: RunSpec, ds: Dataset):
  """Returns (pipeline, initial state, graphdef, loss_fn) for a spec."""
  cfg = spec.model_config(ds.vocab_size)
  graphdef, params = M.init(cfg, seed=spec.seed)
  labels = M.stage_labels(params, spec.stages)
  loss_fn = M.make_loss(graphdef)
  staged = None
  if spec.mode == "no_stashing":
    staged = ps.Staged(M.stage_functions(cfg, spec.stages),
                       loss_of=lambda out, batch: M.cross_entropy(out[0], batch[1]) + 0.01 * out[1])
  opts = methods.stage_optimizers(spec.method, spec.lr, spec.stages, spec.steps,
                                  spec.warmup_fraction, spec.pipemare_fraction)
  pipe = ps.Pipeline(loss_fn, opts, labels, spec.stages, spec.mode, staged)
  return pipe, pipe.init(params), graphdef, loss_fn


class _Checkpoints:
  """Orbax checkpoints of (non-empty state leaves, loss history) at chunk boundaries."""

  def __init__(self, directory: pathlib.Path):
    self.manager = ocp.CheckpointManager(directory.absolute(),
                                         options=ocp.CheckpointManagerOptions(max_to_keep=1))

  @staticmethod
  def _pack(state, losses, val_losses):
    leaves = [x for x in jax.tree.leaves(state) if x.size]  # Orbax cannot store empty arrays
    return {"leaves": leaves, "losses": losses, "val": val_losses}

  def save(self, step, state, losses, val_losses):
    self.manager.save(step, args=ocp.args.StandardSave(self._pack(state, losses, val_losses)))
    self.manager.wait_until_finished()

  def restore(self, template, losses, val_losses):
    step = self.manager.latest_step()
    if step is None:
      return None
    packed = self._pack(template, losses, val_losses)
    abstract = jax.tree.map(ocp.utils.to_shape_dtype_struct, packed)
    got = self.manager.restore(step, args=ocp.args.StandardRestore(abstract))
    it = iter(got["leaves"])
    leaves = [next(it) if x.size else x for x in jax.tree.leaves(template)]
    state = jax.tree.unflatten(jax.tree.structure(template), leaves)
    return step, state, np.asarray(got["losses"]), np.asarray(got["val"])


def train(spec: RunSpec, ds: Dataset, run_dir, progress=None) -> dict:
  """Trains (or resumes, or just loads) one run; returns its result dict.

  Args:
    spec: the run.
    ds: the dataset.
    run_dir: the run's folder (created).
    progress: optional ``tqdm`` bar advanced by steps.
  """
  run_dir = pathlib.Path(run_dir)
  done = load_result(run_dir)
  if done is not None:
    return done
  spec.validate()
  run_dir.mkdir(parents=True, exist_ok=True)
  pipe, state, graphdef, loss_fn = build(spec, ds)
  context = spec.model_config(ds.vocab_size).context
  valid = [ds.batch(10_000 + spec.seed, j, spec.batch_size, context, split="valid")
           for j in range(spec.eval_batches)]
  valid = jax.tree.map(lambda *xs: jnp.stack(xs), *valid)
  evaluate = jax.jit(lambda params: jnp.mean(jax.lax.map(lambda b: loss_fn(params, b), valid)))

  losses = np.full(spec.steps, np.nan, np.float32)
  val_losses = np.full(spec.steps // spec.eval_every + 1, np.nan, np.float32)
  ckpt = _Checkpoints(run_dir / "checkpoints")
  restored = ckpt.restore(state, losses, val_losses)
  step, status, seconds = 0, "finished", 0.0
  if restored is None:
    val_losses[0] = float(evaluate(state.params))
  else:
    step, state, losses, val_losses = restored
    losses, val_losses = losses.copy(), val_losses.copy()
    timing = run_dir / "timing.json"
    seconds = float(json.loads(timing.read_text())["seconds"]) if timing.exists() else 0.0
  if progress is not None:
    progress.reset(total=spec.steps)
    progress.update(step)
  first_chunk_seconds = None
  while step < spec.steps:
    batches = ds.batches(spec.seed, step, spec.chunk, spec.batch_size, context)
    t0 = time.perf_counter()
    state, chunk_losses = pipe.run(state, batches)
    chunk_losses = np.asarray(chunk_losses)
    elapsed = time.perf_counter() - t0
    seconds += elapsed
    first_chunk_seconds = elapsed if first_chunk_seconds is None else first_chunk_seconds
    losses[step:step + spec.chunk] = chunk_losses
    step += spec.chunk
    if progress is not None:
      progress.update(spec.chunk)
    if not np.all(np.isfinite(chunk_losses)):
      status = "diverged"
      break
    if step % spec.eval_every == 0:
      val_losses[step // spec.eval_every] = float(evaluate(state.params))
    if step % spec.checkpoint_every == 0 and step < spec.steps:
      ckpt.save(step, state, losses, val_losses)
      _write_json(run_dir / "timing.json", {"seconds": seconds})
  if status == "finished":
    ckpt.save(step, state, losses, val_losses)  # the trained state, for diagnostics
  result = {
      "name": spec.name, "spec": dataclasses.asdict(spec), "status": status,
      "steps_done": int(step), "losses": [float(x) for x in losses],
      "val_steps": [i * spec.eval_every for i in range(len(val_losses))],
      "val_losses": [float(x) for x in val_losses],
      "seconds": seconds, "first_chunk_seconds": first_chunk_seconds,
      "buffer_bytes": pipe.buffer_bytes(state),
      "num_params": M.count_params(state.params),
      "data": {"name": ds.name, "sha256": ds.sha256, "tokens": ds.num_tokens},
      "versions": versions(),
  }
  _write_json(run_dir / "result.json", result)
  return result


def restore_state(spec: RunSpec, ds: Dataset, run_dir):
  """(pipeline, trained pipeline state, loss_fn) of a run, from its last checkpoint."""
  pipe, state, _, loss_fn = build(spec, ds)
  losses = np.zeros(spec.steps, np.float32)
  val = np.zeros(spec.steps // spec.eval_every + 1, np.float32)
  restored = _Checkpoints(pathlib.Path(run_dir) / "checkpoints").restore(state, losses, val)
  if restored is None:
    raise FileNotFoundError(f"no checkpoint under {str(run_dir)!r}")
  return pipe, restored[1], loss_fn

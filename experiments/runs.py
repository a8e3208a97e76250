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

import contextlib
import dataclasses
import functools
import hashlib
import json
import logging
import os
import pathlib
import platform
import re
import shutil
import subprocess
import time
import warnings
from importlib import metadata

import jax
import jax.numpy as jnp
import numpy as np
import orbax.checkpoint as ocp
from flax import nnx
from jax.experimental import multihost_utils

import pipeline_sim as ps
from experiments import methods
from experiments import model as model_lib
from experiments.data import Dataset

EXECUTIONS = ("emulated", "devices")


@dataclasses.dataclass(frozen=True)
class RunConfig:
  """Every setting of one run: a preset holds a template, a run is ``dataclasses.replace`` of it.

  The whole config is saved in the run's ``result.json``; together with the data's sha256 and
  vocabulary it is the run's identity (``identity``), which names its folder, so that a run is
  never reused or resumed with other settings or other data.

  Attributes:
    method: key of ``experiments.methods.METHODS``.
    stages: pipeline depth P (P = 1: synchronous training).
    seed: parameter initialisation and batch stream.
    mode: pipeline emulation, one of ``pipeline_sim.MODES``.
    schedule: ``"1f1b"`` (PipeDream: stage k lags ``P - 1 - k`` updates) or ``"2bw"``
      (PipeDream-2BW: every stage one update, whatever P; emulated, mode ``weight_stashing``).
    execution: ``"emulated"`` (one program computes every stage: ``pipeline_sim.Pipeline``) or
      ``"devices"`` (P stages on P devices, 1F1B with ``ppermute``: ``pipeline_sim.DevicePipeline``,
      modes ``weight_stashing`` and ``no_stashing``). Same trajectory to float round-off.
    model: key of ``experiments.model.CONFIGS``.
    num_blocks: overrides the named model's block count (model-size scaling); ``None`` keeps it.
    context: overrides the named model's context length; ``None`` keeps it.
    width: overrides the named model's width, with heads of the named model's head size
      (width-scaling studies); ``None`` keeps it.
    steps: optimizer steps (= micro-batches) of the run.
    batch_size: micro-batch size (sequences).
    lr: peak learning rate.
    warmup_fraction: linear warm-up from ``warmup_start`` over this fraction of ``steps`` (the
      paper's code: 3 of 250 epochs = 1.2%), then cosine decay to ``final_lr_fraction * lr``.
    warmup_steps: the warm-up in steps instead of the fraction (``None``: the fraction). The sweep's
      ``--warmup-delays K`` sets it to ``K`` times the largest delay of the sweep for every run, so
      that a study can measure warm-up in units of the delay.
    b2: second-moment decay of every method (Adam's moments, Nesterov's, and rotation's ``L``, ``R``
      statistics and moments).
    warmup_start: learning rate at step 0.
    final_lr_fraction: the cosine decay's end, as a fraction of the peak.
    pipemare_fraction: PipeDream-LR's transition ``T_c`` as a fraction of ``steps`` (the paper's
      code: 7 of 250 epochs = 2.8%).
    clip_norm: per-stage gradient-norm clipping.
    weight_decay: decoupled weight decay of every method.
    moe_loss_weight: weight of the mixture-of-experts load-balancing loss.
    refresh_every: basis refresh period of rotation methods; ``None`` uses the method's own.
    fsdp: shard the emulated pipeline's state (weights, optimizer states, rings) over the data
      devices instead of replicating it (``pipeline_sim.fsdp``); same numbers to float round-off.
    dtype: activations and matmuls, ``float32`` or ``bfloat16`` (parameters and optimizer states
      stay float32).
    chunk: steps per jit-compiled scan (progress, checkpoint and evaluation granularity).
    eval_every: steps between validation evaluations (a multiple of ``chunk``).
    eval_batches: validation micro-batches per evaluation.
    checkpoint_every: steps between checkpoints (a multiple of ``chunk``).
    tag: free label, part of the name (for example ``tune``).
    diagnose_every: every this many steps (a multiple of ``chunk``; ``None``: never), log update
      diagnostics (``pipeline_sim.Pipeline.diagnose``: per stage, the cosine of the stale and the
      fresh update, and the sign-flip rate along the top eigenvectors) over the next
      ``diagnose_steps`` micro-batches as trial steps; the run's own numbers do not change.
    diagnose_steps: length of each diagnostic window.
    remat: rematerialise each Transformer block with this ``jax.checkpoint_policies`` policy
      (``ModelConfig.remat``; ``None``: keep every activation). Memory, not numbers.
    loss_chunk: tokens per chunk of the output head and loss (``ModelConfig.loss_chunk``; ``None``:
      the full logits). Memory, not numbers (to float32 round-off).
  """

  method: str = "pipedream"
  stages: int = 1
  seed: int = 0
  mode: str = "weight_stashing"
  schedule: str = "1f1b"
  execution: str = "emulated"
  model: str = "cpu-deep"
  num_blocks: int | None = None
  context: int | None = None
  width: int | None = None
  steps: int = 1200
  batch_size: int = 16
  lr: float = 3e-3
  warmup_fraction: float = 0.012
  warmup_steps: int | None = None
  warmup_start: float = 1e-7
  final_lr_fraction: float = 0.1
  pipemare_fraction: float = 0.028
  clip_norm: float = 1.0
  weight_decay: float = 0.01
  b2: float = 0.999
  moe_loss_weight: float = 0.01
  refresh_every: int | None = None
  dtype: str = "float32"
  fsdp: bool = False
  chunk: int = 50
  eval_every: int = 250
  eval_batches: int = 4
  checkpoint_every: int = 250
  tag: str = ""
  diagnose_every: int | None = None
  diagnose_steps: int = 16
  remat: str | None = None
  loss_chunk: int | None = None

  @property
  def name(self) -> str:
    """A readable name (not unique: ``run_name`` adds the identity hash)."""
    blocks = f"-B{self.num_blocks}" if self.num_blocks else ""
    blocks += f"-C{self.context}" if self.context else ""
    blocks += f"-W{self.width}" if self.width not in (None, model_lib.CONFIGS[self.model].width) else ""
    blocks += "-bf16" if self.dtype == "bfloat16" else ""
    blocks += "-devices" if self.execution == "devices" else ""
    blocks += "-2bw" if self.schedule == "2bw" and self.stages > 1 else ""
    blocks += "-fsdp" if self.fsdp else ""
    blocks += f"-wu{self.warmup_steps}" if self.warmup_steps is not None else ""
    blocks += f"-b2_{self.b2:g}" if self.b2 != 0.999 else ""
    blocks += f"-diag{self.diagnose_every}" if self.diagnose_every else ""
    blocks += "-remat" if self.remat else ""
    blocks += f"-lc{self.loss_chunk}" if self.loss_chunk else ""
    tag = f"_{self.tag}" if self.tag else ""
    return (f"{self.model}{blocks}_{self.mode}_{self.method}_P{self.stages}_lr{self.lr:g}"
            f"_n{self.steps}_s{self.seed}{tag}")

  def model_config(self, vocab_size: int) -> model_lib.ModelConfig:
    cfg = model_lib.CONFIGS[self.model]
    width = self.width or cfg.width
    return dataclasses.replace(cfg, vocab_size=vocab_size, num_blocks=self.num_blocks or cfg.num_blocks,
                               context=self.context or cfg.context, width=width,
                               num_heads=max(1, width // (cfg.width // cfg.num_heads)),
                               remat=self.remat, loss_chunk=self.loss_chunk)

  def validate(self) -> None:
    """Every check that can fail before training starts."""
    methods.check_method(self.method)
    if self.model not in model_lib.CONFIGS:
      raise ValueError(f"unknown model {self.model!r}; choose from {sorted(model_lib.CONFIGS)}")
    if self.mode not in ps.MODES:
      raise ValueError(f"unknown mode {self.mode!r}; choose from {ps.MODES}")
    if self.schedule not in ps.SCHEDULES:
      raise ValueError(f"unknown schedule {self.schedule!r}; choose from {ps.SCHEDULES}")
    if self.schedule == "2bw" and (self.mode != "weight_stashing" or self.execution != "emulated"):
      raise ValueError(f"schedule '2bw' runs emulated with mode 'weight_stashing' (its two weight "
                       f"versions are the stash), got mode {self.mode!r}, execution {self.execution!r}")
    if self.execution not in EXECUTIONS:
      raise ValueError(f"unknown execution {self.execution!r}; choose from {EXECUTIONS}")
    if self.execution == "devices" and self.fsdp:
      raise ValueError("fsdp applies to the emulated execution (on devices each stage holds its own state)")
    if self.execution == "devices" and self.mode not in ps.DEVICE_MODES:
      raise ValueError(f"mode {self.mode!r} has no device execution; choose from {ps.DEVICE_MODES}")
    model_lib.blocks_per_stage(self.num_blocks or model_lib.CONFIGS[self.model].num_blocks, self.stages)
    for name in ("steps", "batch_size", "chunk", "eval_every", "eval_batches", "checkpoint_every"):
      if getattr(self, name) < 1:
        raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
    for name in ("steps", "eval_every", "checkpoint_every"):
      if getattr(self, name) % self.chunk:
        raise ValueError(f"{name}={getattr(self, name)} is not a multiple of chunk={self.chunk}")
    for name in ("context", "num_blocks"):  # None: the model's own
      if getattr(self, name) is not None and getattr(self, name) < 1:
        raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
    if self.seed < 0:
      raise ValueError(f"seed must be >= 0, got {self.seed}")
    if not self.lr > 0:
      raise ValueError(f"lr must be > 0, got {self.lr}")
    if not 0 <= self.warmup_fraction < 1 or not 0 < self.pipemare_fraction <= 1:
      raise ValueError(f"need 0 <= warmup_fraction < 1 and 0 < pipemare_fraction <= 1, got "
                       f"{self.warmup_fraction}, {self.pipemare_fraction}")
    head = model_lib.CONFIGS[self.model].width // model_lib.CONFIGS[self.model].num_heads
    if self.width is not None and (self.width < head or self.width % head):
      raise ValueError(f"width {self.width} must be a positive multiple of the model's head size {head}")
    if self.width is None or not (self.width < head or self.width % head):
      self.model_config(256)  # the model's own checks (remat policy, loss_chunk)
    if self.dtype not in model_lib.DTYPES:
      raise ValueError(f"unknown dtype {self.dtype!r}; choose from {model_lib.DTYPES}")
    if self.warmup_steps is not None and not 0 <= self.warmup_steps < self.steps:
      raise ValueError(f"warmup_steps must be in [0, steps={self.steps}), got {self.warmup_steps}")
    if not 0 < self.b2 < 1:
      raise ValueError(f"b2 must be in (0, 1), got {self.b2}")
    if self.refresh_every is not None and self.refresh_every < 1:
      raise ValueError(f"refresh_every must be >= 1, got {self.refresh_every}")
    if self.diagnose_every is not None:
      if self.diagnose_every < 1 or self.diagnose_every % self.chunk:
        raise ValueError(f"diagnose_every={self.diagnose_every} must be a positive multiple of "
                         f"chunk={self.chunk}")
      if self.execution != "emulated" or self.mode == "stale_gradients" or self.diagnose_steps < 2:
        raise ValueError("update diagnostics need the emulated pipeline, mode weight_stashing or "
                         f"no_stashing and diagnose_steps >= 2 (got {self.execution}, {self.mode}, "
                         f"{self.diagnose_steps})")


# Options added after runs were recorded, left out of the identity while at the value that means
# "not used", so that adding an option never invalidates finished runs that do not use it.
OPTIONAL_FIELDS = {"dtype": "float32", "execution": "emulated", "fsdp": False, "warmup_steps": None,
                   "b2": 0.999, "diagnose_every": None, "diagnose_steps": 16, "width": None,
                   "remat": None, "loss_chunk": None, "schedule": "1f1b"}

# The model's numerics, part of every run's identity: 1 for runs made with the model's own einsum
# attention (every run published before December 2026), 2 since attention is
# ``jax.nn.dot_product_attention`` (the same numbers to float32 round-off, so another trajectory:
# another run, never one name for two sets of numbers).
MODEL_REVISION = 2


def device_count(config: RunConfig) -> int:
  """Devices a run of ``config`` uses here: every device of the data mesh (all processes') for the
  emulator, the local ones for the device pipeline (``P`` stages x the rest on ``data``)."""
  return jax.local_device_count() if config.execution == "devices" else jax.device_count()


def canonical(config: RunConfig) -> RunConfig:
  """``config`` with a width or block count equal to the named model's own written as ``None``
  (the same run, so the same identity and folder)."""
  cfg = model_lib.CONFIGS[config.model]
  return dataclasses.replace(config, width=None if config.width == cfg.width else config.width,
                             schedule="1f1b" if config.stages == 1 else config.schedule,
                             num_blocks=None if config.num_blocks == cfg.num_blocks else config.num_blocks)


def identity(config: RunConfig, data_sha256: str, vocab_size: int, devices: int = 1) -> dict:
  """Everything that changes a run's numbers: its config, the data's hash, the vocabulary and the
  device count (the data-parallel reduction order; on devices also the state's ``(P, D)``
  layout, which a checkpoint must match). One device is left out, so that the folders of runs
  recorded before the count was part of the identity keep their names.

  The code's version is not part of it (every commit would orphan every finished run): a finished
  run is reused and records the code that made it (``result.json``), and a checkpoint written by
  other code is never resumed (``train`` restarts the run, with a warning).
  """
  config = canonical(config)
  fields = {k: v for k, v in dataclasses.asdict(config).items()
            if not (k in OPTIONAL_FIELDS and v == OPTIONAL_FIELDS[k])}
  out = {"config": fields, "data_sha256": data_sha256, "vocab_size": vocab_size,
         "model_revision": MODEL_REVISION}
  if devices != 1:
    out["devices"] = int(devices)
  return out


def run_name(config: RunConfig, data_sha256: str, vocab_size: int, devices: int = 1) -> str:
  """The run's folder name: readable settings plus a hash of its whole identity."""
  blob = json.dumps(identity(config, data_sha256, vocab_size, devices), sort_keys=True)
  return f"{canonical(config).name}_{hashlib.sha256(blob.encode()).hexdigest()[:10]}"


SOURCE_PACKAGES = ("rotation", "pipeline_sim", "experiments")  # the code that computes a run


def source_files() -> dict:
  """``{relative path: sha256}`` of every Python file of the packages a run's numbers depend on, as
  they are on disk now (a pip install's site-packages or a checkout, edited or not)."""
  root = pathlib.Path(__file__).resolve().parents[1]
  return {str(f.relative_to(root)): hashlib.sha256(f.read_bytes()).hexdigest()
          for package in SOURCE_PACKAGES for f in sorted((root / package).rglob("*.py"))}


@functools.cache
def started_files() -> dict:
  """``source_files()`` as this process first read them (the code it runs: modules already loaded)."""
  return source_files()


def source_hash(files: dict) -> str:
  return hashlib.sha256(json.dumps(files, sort_keys=True).encode()).hexdigest()[:16]


@functools.cache
def code_version() -> dict:
  """This project's version, its commit in a git checkout (``None`` elsewhere), and ``source``: a
  hash of its Python files (``source_files``), read once per process. ``source`` decides whether a
  checkpoint is this code's (``same_code``): it sees uncommitted edits and pip installs, where the
  commit does not."""
  try:
    version = metadata.version("staleness-rotation")
  except metadata.PackageNotFoundError:
    version = None
  root = pathlib.Path(__file__).resolve().parents[1]
  commit = None
  if (root / ".git").exists():
    try:
      commit = subprocess.run(["git", "rev-parse", "HEAD"], cwd=root, capture_output=True, text=True,
                              timeout=10).stdout.strip() or None
    except (OSError, subprocess.SubprocessError):
      commit = None
  return {"version": version, "commit": commit, "source": source_hash(started_files())}


def same_code(saved: dict | None) -> bool:
  """Whether a run's recorded code (``code.json``) is this process's code (by source hash)."""
  return bool(saved) and saved.get("source") == code_version()["source"]


def changed_files(since: dict) -> list:
  """The source files on disk now that differ from ``since`` (a ``source_files()`` taken earlier)."""
  now = source_files()
  return sorted(f for f in set(now) | set(since) if now.get(f) != since.get(f))


def usable_cores() -> list[int]:
  """The CPU cores this process may run on (its affinity where the OS reports one)."""
  if hasattr(os, "sched_getaffinity"):
    return sorted(os.sched_getaffinity(0))
  return list(range(os.cpu_count() or 1))


@functools.cache
def host() -> dict:
  """The CPU model and the cores this process may use: on the CPU backend a run's numbers depend on
  both (XLA's kernels round differently per CPU and split their work by the usable cores)."""
  cpu = platform.processor() or platform.machine()
  try:
    with open("/proc/cpuinfo") as f:
      cpu = next((line.split(":", 1)[1].strip() for line in f if line.startswith("model name")), cpu)
  except OSError:
    pass
  return {"cpu": cpu, "cores": len(usable_cores())}


def versions() -> dict:
  out = {"python": platform.python_version(), "jax_backend": jax.default_backend(),
         "code": code_version(), "host": host()}
  for pkg in ("jax", "jaxlib", "optax", "flax", "orbax-checkpoint", "numpy"):
    try:
      out[pkg] = metadata.version(pkg)
    except metadata.PackageNotFoundError:
      pass
  return out


def is_primary() -> bool:
  """Process 0 writes the run's files; with several processes (hosts) the others only compute."""
  return jax.process_index() == 0


def barrier(name: str) -> None:
  """With several processes: wait until every process gets here (after process 0 changed files
  that the others then read); a no-op in one process."""
  if jax.process_count() > 1:
    multihost_utils.sync_global_devices(name)


def agree(value: int) -> int:
  """Process 0's ``value`` (an int), in every process: a decision taken once, where each process
  looking for itself could conclude differently (a file moved between two looks)."""
  if jax.process_count() == 1:
    return int(value)
  return int(multihost_utils.broadcast_one_to_all(np.int64(value)))


def agree_list(values: list) -> list:
  """Process 0's list of ints, in every process."""
  n = agree(len(values))
  if jax.process_count() == 1 or n == 0:
    return list(values[:n])
  mine = np.zeros(n, np.int64)
  mine[:min(n, len(values))] = values[:n]
  return [int(x) for x in multihost_utils.broadcast_one_to_all(mine)]


def everyone(flag: bool) -> bool:
  """Whether ``flag`` holds in every process."""
  if jax.process_count() == 1:
    return bool(flag)
  return bool(np.all(multihost_utils.process_allgather(np.int32(bool(flag)))))


def initialize_distributed(environ=os.environ) -> bool:
  """``jax.distributed.initialize()`` when the environment describes several processes.

  ``JAX_COORDINATOR_ADDRESS`` (host:port of process 0) with ``JAX_NUM_PROCESSES`` and
  ``JAX_PROCESS_ID``; or a cluster that JAX detects by itself (SLURM, Open MPI, Cloud TPU) with more
  than one task. On CPU the processes talk through Gloo. Returns whether it initialised.
  """
  tasks = max(int(environ.get(k, "1") or 1) for k in ("JAX_NUM_PROCESSES", "SLURM_NTASKS",
                                                       "OMPI_COMM_WORLD_SIZE"))
  if "JAX_COORDINATOR_ADDRESS" not in environ and tasks <= 1:
    return False
  if environ.get("JAX_PLATFORMS", "") == "cpu":
    jax.config.update("jax_cpu_collectives_implementation", "gloo")
  kwargs = {}
  if "JAX_NUM_PROCESSES" in environ:
    kwargs = {"num_processes": int(environ["JAX_NUM_PROCESSES"]),
              "process_id": int(environ["JAX_PROCESS_ID"])}
  jax.distributed.initialize(**kwargs)
  return True


def write_json(path: pathlib.Path, obj) -> None:
  """Writes ``obj`` as JSON, atomically, from process 0 only."""
  if not is_primary():
    return
  tmp = path.with_suffix(".tmp")
  tmp.write_text(json.dumps(obj, indent=1))
  os.replace(tmp, path)  # atomic: a crash never leaves a half-written result


def _read_json(path: pathlib.Path) -> dict | None:
  """A JSON file's content, ``None`` if it is missing; a damaged file is an error naming it."""
  try:
    return json.loads(path.read_text())
  except FileNotFoundError:  # (also when process 0 just set it aside)
    return None
  except (json.JSONDecodeError, UnicodeDecodeError) as e:
    raise DamagedFileError(f"{path}: damaged ({e})") from e


class DamagedFileError(ValueError):
  """A run's file that cannot be read (truncated or corrupted)."""


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


def _staged(config: RunConfig, cfg) -> ps.Staged:
  w = config.moe_loss_weight
  return ps.Staged(model_lib.stage_functions(cfg, config.stages, config.dtype),
                   loss_of=lambda out, batch: model_lib.cross_entropy(out[0], batch[1]) + w * out[1])


def pipeline_of(config: RunConfig, cfg, graphdef, params) -> ps.Pipeline:
  """The emulated ``Pipeline`` of a config (``params``: arrays or shapes, for the stage labels)."""
  loss_fn = model_lib.make_loss(graphdef, config.moe_loss_weight, config.dtype)
  return ps.Pipeline(loss_fn, methods.stage_optimizers(config), model_lib.stage_labels(params, config.stages),
                     mode=config.mode, staged=_staged(config, cfg) if config.mode == "no_stashing" else None,
                     grad_norms=True, schedule=config.schedule)


def build(config: RunConfig, ds: Dataset, devices=None):
  """Returns (pipeline, initial state, graphdef, loss_fn) for a config: an emulated ``Pipeline``, or
  with ``execution="devices"`` a ``DevicePipeline`` over ``devices`` (default: every local one)."""
  cfg = config.model_config(ds.vocab_size)
  graphdef, params = model_lib.init(cfg, seed=config.seed)
  loss_fn = model_lib.make_loss(graphdef, config.moe_loss_weight, config.dtype)
  if config.execution == "devices":
    pipe = ps.DevicePipeline(_staged(config, cfg), methods.stage_optimizers(config),
                             model_lib.stage_labels(params, config.stages), mode=config.mode,
                             mesh=ps.pipeline_mesh(config.stages, devices))
    example = ds.batch(config.seed, 0, config.batch_size, cfg.context)
    return pipe, pipe.init(params, example), graphdef, loss_fn
  pipe = pipeline_of(config, cfg, graphdef, params)
  return pipe, pipe.init(params), graphdef, loss_fn


def _advance(pipe, state, batches, step):
  """One chunk: (state, indices of the steps that completed, their losses, their gradient norms).

  The emulator completes the chunk's own steps; the device pipeline completes steps ``P - 1``
  behind (the micro-batches still in flight finish in the next chunk or in ``_drain``)."""
  if isinstance(pipe, ps.DevicePipeline):
    state, out = pipe.run(state, batches)
    steps, losses, norms = (np.asarray(x) for x in out)
    keep = steps >= 0
    return state, steps[keep], losses[keep], norms[keep]
  state, (losses, norms) = pipe.run(state, batches)
  losses = np.asarray(losses)
  return state, np.arange(step, step + len(losses)), losses, np.asarray(norms)


def _drain(pipe, state):
  """Completes the steps still in flight (device pipeline); the emulator has none."""
  if isinstance(pipe, ps.DevicePipeline):
    return pipe.finish(state)
  return state, (np.zeros(0, int), np.zeros(0), np.zeros(0))


def _params(pipe, state):
  return pipe.params(state) if isinstance(pipe, ps.DevicePipeline) else state.params


def _lag(pipe) -> int:
  return pipe.num_stages - 1 if isinstance(pipe, ps.DevicePipeline) else 0


TMP_CHECKPOINT = "*.orbax-checkpoint-tmp*"  # Orbax's folder for a save in progress


@contextlib.contextmanager
def _quiet_orbax():
  """Orbax's absl warnings (``Waiting for previous save to complete took 3.03 seconds``) kept out
  of a sweep's output while it saves or restores; errors still show."""
  logger = logging.getLogger("absl")
  level = logger.level
  logger.setLevel(max(level, logging.ERROR))
  try:
    yield
  finally:
    logger.setLevel(level)


def layout(tree) -> str:
  """A fingerprint of a state's tree structure, leaf shapes and dtypes (32 hex digits)."""
  leaves, treedef = jax.tree_util.tree_flatten_with_path(tree)
  desc = [str(treedef)] + [[jax.tree_util.keystr(p), list(np.shape(x)), np.dtype(x.dtype).name]
                           for p, x in leaves]
  return hashlib.sha256(json.dumps(desc).encode()).hexdigest()[:32]


_ASIDE = {"damaged": "checkpoints.damaged", "other": "checkpoints.other-code"}  # verdict -> folder


class LayoutError(ValueError):
  """A checkpoint that holds a state of another layout than the one asked for."""


class _Checkpoints:
  """Orbax checkpoints of (pipeline state, loss history, the state's ``layout``) at chunk
  boundaries.

  The two newest are kept, with ``code.json`` naming the code that wrote them (written atomically
  before the first checkpoint commits). A checkpoint is restored only into a state of the layout it
  records (never sliced into another); one of other code or another layout is moved to
  ``checkpoints.other-code/``, one that cannot be read (a truncated file) to
  ``checkpoints.damaged/`` (else Orbax would refuse to save any step up to it), and the previous one
  is used; with none left the run restarts from step 0. Folders of interrupted saves are removed
  when the run starts again. With several processes, process 0 decides every restore and set-aside
  and the others follow (``agree``), with a barrier before any file moves.

  The state is written packed, one flat vector per dtype (``pack``), when this process holds all
  of it: Orbax writes one file per array, and a pipeline state has thousands of small ones (a P =
  16 AdamW state: 1,097 arrays, 3 s per save and 3 s per restore, against 0.1-0.4 s and 0.04 s
  packed). A state spread over several processes is written array by array, and both layouts
  restore.
  """

  def __init__(self, directory: pathlib.Path):
    self.directory = directory.absolute()
    if is_primary() and self.directory.is_dir():
      for tmp in self.directory.glob(TMP_CHECKPOINT):
        shutil.rmtree(tmp, ignore_errors=True)
    barrier(f"stale checkpoint folders removed in {self.directory}")
    self.manager = ocp.CheckpointManager(self.directory,
                                         options=ocp.CheckpointManagerOptions(max_to_keep=2),
                                         item_handlers=ocp.StandardCheckpointHandler())

  def save(self, step, state, losses, val_losses):
    packed = pack(state)
    item = {"state": state} if packed is None else {"packed": packed}
    self.directory.mkdir(parents=True, exist_ok=True)
    write_json(self.directory / "code.json", code_version())  # before any checkpoint of this code
    with _quiet_orbax():
      self.manager.save(step, args=ocp.args.StandardSave({**item, "losses": losses, "val": val_losses}),
                        custom_metadata={"layout": layout(state)})
      self.manager.wait_until_finished()

  def _set_aside(self, steps, where: str) -> None:
    """Moves the checkpoints of ``steps`` out of Orbax's folder: every process has stopped reading
    (barrier), process 0 moves them, the others wait."""
    barrier(f"before setting checkpoints aside in {self.directory}")
    if is_primary():
      for step in steps:
        target = self.directory.parent / where / str(step)
        n = 1
        while target.exists():
          target, n = target.with_name(f"{step}.{n}"), n + 1
        target.parent.mkdir(exist_ok=True)
        if (self.directory / str(step)).exists():
          os.replace(self.directory / str(step), target)
    barrier(f"checkpoints set aside in {self.directory}")
    self.manager.reload()

  def _verdict(self, step, template) -> tuple[str, str]:
    """Process 0's look at one checkpoint, without reading its arrays (no collective): ``("ok",
    "")``, ``("other", why)`` when it records another state layout, or ``("damaged", why)``."""
    try:
      recorded = (self.manager.metadata(step).custom_metadata or {}).get("layout")
      self.manager.item_metadata(step)
    except Exception as e:  # noqa: BLE001 - orbax/tensorstore raise many types for damaged files
      return "damaged", _first_line(e)
    if recorded is not None and recorded != layout(template):
      return "other", (f"checkpoint {self.directory / str(step)} holds a state of layout {recorded}, "
                       f"not the {layout(template)} of this run's state (other code wrote it)")
    return "ok", ""

  def _restore_step(self, step, template, tables):
    """The state and tables of one checkpoint (a collective with several processes)."""
    if "packed" in self.manager.item_metadata(step).tree:
      item = {"packed": pack(template, shapes_only=True), **tables}
    else:
      item = {"state": template, **tables}
    with _quiet_orbax():
      got = self.manager.restore(step, args=ocp.args.StandardRestore(
          jax.tree.map(ocp.utils.to_shape_dtype_struct, item)))
    if "packed" in got:
      got["state"] = unpack(got["packed"], template)
    return got

  def restore(self, template, losses, val_losses, read_only=False):
    """(step, state, losses, val_losses) of the newest readable checkpoint, or ``None``.

    ``read_only`` (diagnostics of a trained run): any code's checkpoints, nothing set aside, and a
    checkpoint of another layout is an error (``LayoutError``)."""
    steps = agree_list(sorted(self.manager.all_steps(), reverse=True))
    try:
      code = _read_json(self.directory / "code.json")
    except DamagedFileError:
      code = None
    if agree(bool(steps) and not same_code(code) and not read_only):
      warnings.warn(f"the checkpoints in {self.directory} were written by other code ({code}, now "
                    f"{code_version()}); restarting the run from step 0", stacklevel=2)
      self._set_aside(steps, _ASIDE["other"])
      return None
    tables = {"losses": losses, "val": val_losses}
    kinds = ("ok", "other", "damaged")
    aside = {kind: [] for kind in _ASIDE}
    for step in steps:
      kind, why = self._verdict(step, template) if is_primary() else ("ok", "")
      kind = kinds[agree(kinds.index(kind))]  # process 0 decides for every process
      if kind == "ok":
        got = None
        try:
          got = self._restore_step(step, template, tables)
        except Exception as e:  # noqa: BLE001
          why = _first_line(e)
        if everyone(got is not None):
          self._set_aside_all(aside, read_only)
          return step, got["state"], np.asarray(got["losses"]), np.asarray(got["val"])
        kind = "damaged"
      if kind == "other" and read_only:
        raise LayoutError(why)
      aside[kind].append(step)
      moved = "" if read_only else f"set aside in {self.directory.parent / _ASIDE[kind]}, "
      warnings.warn(f"checkpoint {self.directory / str(step)} cannot be restored "
                    f"({why or 'another process could not read it'}); {moved}trying an older one",
                    stacklevel=2)
    self._set_aside_all(aside, read_only)
    return None

  def _set_aside_all(self, aside, read_only):
    for kind, where in _ASIDE.items():
      if aside[kind] and not read_only:
        self._set_aside(aside[kind], where)


def _first_line(e: Exception) -> str:
  return str(e).strip().splitlines()[0][:200] if str(e).strip() else type(e).__name__


def pack(tree, shapes_only: bool = False) -> dict | None:
  """The leaves of ``tree`` concatenated into one flat NumPy vector per dtype (in leaf order), or
  ``None`` when some leaf is not wholly in this process (a state sharded over several hosts).

  ``shapes_only`` returns the packed vectors' shapes (``jax.ShapeDtypeStruct``, a restore
  template) without reading the arrays."""
  leaves = jax.tree.leaves(tree)
  if not all(getattr(x, "is_fully_addressable", True) for x in leaves):
    return None
  groups = {}
  for x in leaves:
    groups.setdefault(np.dtype(x.dtype).name, []).append(x)
  if shapes_only:
    return {k: jax.ShapeDtypeStruct((sum(int(np.prod(x.shape)) for x in v),), k) for k, v in groups.items()}
  return {k: np.concatenate([np.asarray(x).ravel() for x in v]) for k, v in groups.items()}


def unpack(packed: dict, template):
  """Inverse of ``pack``: ``template``'s tree with its leaves read from the packed vectors, each
  placed with the template leaf's sharding."""
  leaves, treedef = jax.tree.flatten(template)
  sizes = pack(template, shapes_only=True)
  for name in set(sizes) | set(packed):
    have = int(np.size(packed[name])) if name in packed else 0
    need = sizes[name].shape[0] if name in sizes else 0
    if have != need:
      raise LayoutError(f"packed state holds {have} {name} values, the state needs {need}")
  offsets = dict.fromkeys(packed, 0)
  out = []
  for x in leaves:
    name, size = np.dtype(x.dtype).name, int(np.prod(x.shape))
    part = np.asarray(packed[name])[offsets[name]:offsets[name] + size].reshape(x.shape)
    offsets[name] += size
    out.append(jax.device_put(part, x.sharding) if isinstance(x, jax.Array) else part)
  return jax.tree.unflatten(treedef, out)


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


def train(config: RunConfig, ds: Dataset, run_dir, progress=None, devices=None,
          jobs: int = 1) -> dict:
  """Trains (or resumes, or just loads) one run; returns its result dict.

  Every micro-batch is sharded along a ``data`` mesh axis over ``devices`` (default: every local
  device) and the pipeline state is replicated (``pipeline_sim.sharding``); on one device nothing
  changes. Results agree across device counts to float32 round-off (reduction order), not bitwise.

  Args:
    config: the run.
    ds: the dataset.
    run_dir: the run's folder (created); see ``run_name``.
    progress: optional ``tqdm``-like bar (``reset``, ``update``, ``set_postfix``) advanced by steps.
    devices: the devices of the data mesh (default ``jax.devices()``: every process's; the device
      pipeline uses the local ones).
    jobs: runs trained at once on this host, this one included (a sweep's ``--jobs``), recorded
      in the result: above 1, its seconds include the others' load.
  """
  run_dir = pathlib.Path(run_dir)
  config.validate()
  if is_primary():
    run_dir.mkdir(parents=True, exist_ok=True)
  barrier(f"run folder {run_dir}")
  mesh = ps.data_mesh(devices)
  if config.execution == "devices":
    count = jax.local_device_count() if devices is None else len(list(devices))
  else:
    count = mesh.size
  ident = identity(config, ds.sha256, ds.vocab_size, count)
  check_identity(run_dir, ident)
  done = load_result(run_dir)
  if done is not None:
    return done
  if config.batch_size % mesh.size:
    raise ValueError(f"batch_size {config.batch_size} is not divisible by the {mesh.size} devices; "
                     "choose a multiple (--batch-size)")
  t0 = time.perf_counter()
  pipe, state, graphdef, loss_fn = build(config, ds, devices)
  on_devices = isinstance(pipe, ps.DevicePipeline)
  if not on_devices:
    state = ps.fsdp(state, mesh) if config.fsdp else ps.replicate(state, mesh)
  jax.block_until_ready(state)
  built = time.perf_counter() - t0
  context = config.model_config(ds.vocab_size).context
  valid = [ds.batch(10_000 + config.seed, j, config.batch_size, context, split="valid")
           for j in range(config.eval_batches)]
  valid = ps.shard_batches(jax.tree.map(lambda *xs: np.stack(xs), *valid), mesh)
  mean_loss = jax.jit(lambda params, valid: jnp.mean(jax.lax.map(lambda b: loss_fn(params, b), valid)))

  def evaluate(params):  # valid is an argument: it may span several hosts
    t0 = time.perf_counter()
    loss = float(mean_loss(params, valid))
    timing["eval_seconds"] += time.perf_counter() - t0
    return loss

  def save(step):
    t0 = time.perf_counter()
    ckpt.save(step, state, losses, val_losses)
    timing["checkpoint_seconds"] += time.perf_counter() - t0

  lr_at = methods.schedule(config)

  losses = np.full(config.steps, np.nan, np.float32)
  val_losses = np.full(config.steps // config.eval_every + 1, np.nan, np.float32)
  ckpt = _Checkpoints(run_dir / "checkpoints")
  t0 = time.perf_counter()
  restored = ckpt.restore(state, losses, val_losses)
  restore_seconds = time.perf_counter() - t0
  step, status = 0, "finished"
  # Seconds of the chunks (compile_seconds: the first one's, with compilation) and, outside them,
  # of building the state, evaluating and checkpointing (restoring included); summed over resumes.
  timing = {"seconds": 0.0, "steady_seconds": 0.0, "steady_steps": 0, "compile_seconds": None,
            "build_seconds": 0.0, "eval_seconds": 0.0, "checkpoint_seconds": 0.0}
  log = run_dir / "metrics.jsonl"
  diag_log = run_dir / "diagnostics.jsonl"
  if restored is None:
    val_losses[0] = evaluate(_params(pipe, state))
    if is_primary():
      log.write_text("")
      if config.diagnose_every:
        diag_log.write_text("")
  else:
    step, state, losses, val_losses = restored
    losses, val_losses = losses.copy(), val_losses.copy()
    timing.update(_read_json(run_dir / "timing.json") or {})
    _truncate_log(log, step - _lag(pipe))
    _truncate_log(diag_log, step - 1)  # the window at ``step`` is logged again
  timing["build_seconds"] += built
  timing["checkpoint_seconds"] += restore_seconds
  note = {} if restored is None else {"resumed at": step}
  if progress is not None:
    progress.reset(total=config.steps)
    progress.update(step)
    if note:
      progress.set_postfix(note, refresh=True)
  first_chunk = True

  def log_steps(done, chunk_losses, grad_norms, seconds, val_loss=None):
    losses[done] = chunk_losses
    lrs = np.asarray(lr_at(done))
    records = [{"step": int(j) + 1, "loss": float(x), "lr": float(r), "grad_norm": float(g),
                "seconds": seconds} for j, x, r, g in zip(done, chunk_losses, lrs, grad_norms)]
    if val_loss is not None and records:
      records[-1]["val_loss"] = val_loss
    if is_primary():
      with open(log, "a") as f:
        f.writelines(json.dumps(r) + "\n" for r in records)
    return bool(np.all(np.isfinite(chunk_losses)))

  while step < config.steps:
    if config.diagnose_every and step and step % config.diagnose_every == 0:
      trial = ds.batches(config.seed, step, config.diagnose_steps, config.batch_size, context)
      found = pipe.diagnose(state, ps.shard_batches(trial, mesh))
      if is_primary():
        with open(diag_log, "a") as f:
          f.write(json.dumps({"step": step, "cosine": found["cosine"].mean(axis=0).tolist(),
                              "flip_rate": found["flip_rate"].tolist()}) + "\n")
    batches = ds.batches(config.seed, step, config.chunk, config.batch_size, context)
    if not on_devices:
      batches = ps.shard_batches(batches, mesh)
    t0 = time.perf_counter()
    try:
      state, done, chunk_losses, grad_norms = _advance(pipe, state, batches, step)
    except jax.errors.JaxRuntimeError as e:
      if "RESOURCE_EXHAUSTED" not in str(e):
        raise
      raise OutOfMemory(out_of_memory(config, run_dir.name, e)) from None
    elapsed = time.perf_counter() - t0
    timing["seconds"] += elapsed
    if first_chunk:  # includes compilation: kept out of the steady-state rate
      timing["compile_seconds"] = timing["compile_seconds"] or elapsed
      first_chunk = False
    else:
      timing["steady_seconds"] += elapsed
      timing["steady_steps"] += config.chunk
    step += config.chunk
    finite = bool(np.all(np.isfinite(chunk_losses)))
    # On devices the last evaluation waits for the drain (every stage at every update).
    val_loss = None
    if finite and step % config.eval_every == 0 and not (on_devices and step == config.steps):
      val_loss = val_losses[step // config.eval_every] = evaluate(_params(pipe, state))
    log_steps(done, chunk_losses, grad_norms, elapsed / config.chunk, val_loss)
    if progress is not None:
      progress.set_postfix({**note, "loss": f"{np.mean(chunk_losses):.3f}" if len(done) else "-"},
                           refresh=False)
      progress.update(config.chunk)
    if not finite:
      status = "diverged"
      break
    if step % config.checkpoint_every == 0 and step < config.steps:
      save(step)
      write_json(run_dir / "timing.json", timing)
  if status == "finished":
    state, (done, tail_losses, tail_norms) = _drain(pipe, state)
    val_loss = None
    if on_devices and config.steps % config.eval_every == 0 and np.all(np.isfinite(tail_losses)):
      val_loss = val_losses[-1] = evaluate(_params(pipe, state))
    if not log_steps(done, tail_losses, tail_norms, 0.0, val_loss):
      status = "diverged"
  if status == "finished":
    save(step)  # the trained state, for diagnostics
  steady = timing["steady_steps"] / timing["steady_seconds"] if timing["steady_seconds"] else None
  result = {
      "name": run_dir.name, "config": dataclasses.asdict(config), "identity": ident,
      "status": status, "steps_done": int(step), "losses": [float(x) for x in losses],
      "val_steps": [i * config.eval_every for i in range(len(val_losses))],
      "val_losses": [float(x) for x in val_losses],
      "seconds": timing["seconds"], "compile_seconds": timing["compile_seconds"],
      "steps_per_second": steady, "jobs": jobs,
      "overhead_seconds": {k: timing[f"{k}_seconds"] for k in ("build", "eval", "checkpoint")},
      "buffer_bytes": pipe.buffer_bytes(state),
      "num_params": model_lib.count_params(_params(pipe, state)),
      "data": {"name": ds.name, "sha256": ds.sha256, "tokens": ds.num_tokens,
               "vocab_size": ds.vocab_size},
      "versions": versions(), "devices": mesh.size,
  }
  if config.diagnose_every:
    result["diagnostics"] = [json.loads(line) for line in diag_log.read_text().splitlines()]
  write_json(run_dir / "result.json", result)
  return result


def xla_flops(program) -> float:
  """XLA's FLOP count of a lowered or compiled program (older JAX returns one dict per
  computation: the first is the program's)."""
  analysis = program.cost_analysis()
  analysis = analysis[0] if isinstance(analysis, (list, tuple)) else analysis
  return float(analysis.get("flops", 0.0))


class OutOfMemory(ValueError):
  """A run that does not fit the device's memory (one line: the run, the bytes, what lowers them)."""


def memory_options(config: RunConfig) -> str:
  """The settings that lower a run's memory, those it does not use yet first."""
  options = [] if config.remat else ["--remat nothing_saveable"]
  options += [] if config.loss_chunk else ["--loss-chunk 2048"]
  options += ["a smaller --batch-size", "--execution devices (one stage per device)", "--fsdp"]
  return ", ".join(options)


def out_of_memory(config: RunConfig, name: str, error) -> str:
  found = re.search(r"allocating (\d+) bytes", str(error))
  needed = f"{int(found.group(1)) / 2**30:.1f} GiB more" if found else "more memory"
  return (f"run {name} ran out of device memory (it needed {needed} than the device had); lower it "
          f"with {memory_options(config)}")


def compile_chunk(config: RunConfig, vocab_size: int, context: int | None = None):
  """The compiled chunk program of an emulated run, from shapes only (nothing allocated, nothing
  run): ``(compiled, seconds to compile)``. Its ``memory_analysis()`` is what a device needs."""
  cfg = config.model_config(vocab_size)
  context = context or cfg.context
  graphdef, params = nnx.split(nnx.eval_shape(lambda: model_lib.Transformer(cfg, nnx.Rngs(0))), nnx.Param)
  params = nnx.to_pure_dict(params)
  pipe = pipeline_of(config, cfg, graphdef, params)
  state = jax.eval_shape(pipe._init, params)
  tokens = jax.ShapeDtypeStruct((config.chunk, config.batch_size, context), np.int32)
  t0 = time.perf_counter()
  compiled = pipe.run.lower(state, (tokens, tokens)).compile()
  return compiled, time.perf_counter() - t0


def memory(compiled) -> dict:
  """Bytes of a compiled program from XLA's memory analysis: arguments, outputs (less those that
  reuse donated arguments), temporaries, and their sum ``total``."""
  m = compiled.memory_analysis()
  get = lambda name: int(getattr(m, name, 0) or 0) if m is not None else 0
  out = {"arguments": get("argument_size_in_bytes"), "temporaries": get("temp_size_in_bytes"),
         "outputs": max(0, get("output_size_in_bytes") - get("alias_size_in_bytes"))}
  out["total"] = sum(out.values())
  return out


def device_memory() -> tuple[int | None, str]:
  """(bytes one device can hold, where that figure comes from): JAX's ``memory_stats()`` on
  accelerators; the machine's physical memory on the CPU backend; ``None`` where neither is known."""
  stats = jax.local_devices()[0].memory_stats() or {}
  if stats.get("bytes_limit"):
    return int(stats["bytes_limit"]), f"{jax.local_devices()[0].device_kind} memory_stats"
  if jax.default_backend() == "cpu" and hasattr(os, "sysconf"):
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES"), "this machine's physical memory"
  return None, "unknown"


def estimate(config: RunConfig, ds: Dataset, time_budget: float = 120.0) -> dict:
  """What one run will cost, without training it: XLA's FLOPs per step and the memory of the
  compiled chunk program (from shapes: nothing allocated), compared with the device's memory; then,
  only if it fits and XLA's FLOPs say a chunk takes at most ``time_budget`` seconds at 1 TFLOP/s, a
  time estimate from one timed chunk. ``skipped`` says why a run was not timed."""
  context = config.model_config(ds.vocab_size).context
  if config.execution == "devices":  # the device pipeline's program is lowered from its real state
    pipe, state, _, _ = build(config, ds)
    batches = ds.batches(config.seed, 0, config.chunk, config.batch_size, context)
    t0 = time.perf_counter()
    compiled = pipe.lower(state, batches).compile()
    compile_seconds, args = time.perf_counter() - t0, (state, batches, True)
  else:
    compiled, compile_seconds = compile_chunk(config, ds.vocab_size, context)
    pipe = args = None
  mem = memory(compiled)
  limit, source = device_memory()
  flops = xla_flops(compiled)  # a scan's body is counted once: one step, ...
  if config.remat is not None:  # ... and one block of a rematerialised model's scan over blocks
    flops = model_lib.train_flops(config.model_config(ds.vocab_size), config.batch_size, remat=True)
  out = {"flops_per_step": flops,
         "memory_bytes": mem["total"], "memory": mem, "device_bytes": limit, "device_source": source,
         "compile_seconds": compile_seconds, "steps_per_second": None, "estimated_seconds": None,
         "skipped": None}
  if limit is not None and mem["total"] > limit:
    out["skipped"] = (f"needs {mem['total'] / 2**30:.1f} GiB, more than the {limit / 2**30:.1f} GiB of "
                      f"{source}: not timed; lower it with {memory_options(config)}")
    return out
  guess = out["flops_per_step"] * config.chunk / 1e12
  if jax.default_backend() == "cpu" and guess > time_budget:
    out["skipped"] = f"not timed: a chunk is {out['flops_per_step'] * config.chunk / 1e12:.0f} TFLOP here"
    return out
  if args is None:
    pipe, state, _, _ = build(config, ds)
    args = (state, ds.batches(config.seed, 0, config.chunk, config.batch_size, context))
  t0 = time.perf_counter()
  jax.block_until_ready(compiled(*args))
  rate = config.chunk / (time.perf_counter() - t0)
  out.update(steps_per_second=rate, estimated_seconds=compile_seconds + config.steps / rate)
  return out


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

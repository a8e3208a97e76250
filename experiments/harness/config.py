"""The run config (``RunConfig``) and its identity: everything that changes a run's numbers, hashed
into the name of its folder (``run_name``), and the errors of a run that does not fit its device."""

from __future__ import annotations

import dataclasses
import hashlib
import json
import pathlib
import re

import jax

import pipeline_sim as ps
from experiments.harness import data as data_lib
from experiments.harness import methods
from experiments.harness import model as model_lib
from experiments.harness.optimizers import Spec, describe, name_format

EXECUTIONS = ("emulated", "devices")
NAME = "name"  # a RunConfig field's metadata key: its format in the run's name


LATER = "added_later"  # a field's metadata key: an option added after runs were recorded (OPTIONAL_FIELDS)


def _named(fmt: str, default=None, later: bool = True):
  """A field that names a run (``NAME``: its format); ``later``: added after runs were recorded."""
  return dataclasses.field(default=default, metadata={NAME: fmt, LATER: later})


def _later(default):
  """A field added after runs were recorded that does not name a run."""
  return dataclasses.field(default=default, metadata={LATER: True})


def _settings_text(value: Spec) -> str:
  """The run settings that make ``value`` from its method (``methods.settings``), as run names
  write them (``optimizers.name_format``, in ``Spec.run_settings``' order)."""
  own = methods.settings(value) or {}
  return "".join(name_format(k).format(v) for k, v in own.items() if name_format(k) and v is not None)


@dataclasses.dataclass(frozen=True)
class RunConfig:
  """Every setting of one run: a preset holds a template, a run is ``dataclasses.replace`` of it.

  The whole config is saved in the run's ``result.json``; together with the data's sha256 and
  vocabulary it is the run's identity (``identity``), which names its folder, so that a run is
  never reused or resumed with other settings or other data.

  Attributes:
    optimizer: the run's optimizer, a value (``experiments.harness.optimizers``): a method's
      (``methods.spec("rotation", b1=0.95)``, ``methods.METHODS``) or one built by hand. Its
      ``name`` labels the run (``method``); the run settings that make it from that method
      (``--b1``, ``--b2``, ``--shampoo-beta``, ``--refresh-every``, ``--predict-scale``,
      ``--dc-lambda``) are written in the run's name.
    stages: pipeline depth P (P = 1: synchronous training).
    seed: parameter initialisation and batch stream.
    mode: pipeline emulation, one of ``pipeline_sim.MODES``.
    schedule: the text of a ``pipeline_sim.schedules.Schedule``: ``"1f1b"`` (PipeDream: stage k
      lags ``P - 1 - k`` updates), ``"2bw"`` (PipeDream-2BW: every stage one update, whatever P)
      or ``"uniform-D"`` (every stage D updates, P = 1 included). The batched ones (2BW, uniform)
      need mode ``weight_stashing``, and on devices split each batch into P micro-batches, so
      ``batch_size`` must be a multiple of P.
    execution: ``"emulated"`` (one program computes every stage: ``pipeline_sim.Pipeline``) or
      ``"devices"`` (P stages on P devices, 1F1B or 2BW with ``ppermute``:
      ``pipeline_sim.DevicePipeline``, modes ``weight_stashing`` and ``no_stashing``). Same
      trajectory to float round-off.
    model: key of ``experiments.harness.model.CONFIGS``.
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
    warmup_start: learning rate at step 0.
    final_lr_fraction: the cosine decay's end, as a fraction of the peak.
    pipemare_fraction: PipeDream-LR's transition ``T_c`` as a fraction of ``steps`` (the paper's
      code: 7 of 250 epochs = 2.8%).
    clip_norm: per-stage gradient-norm clipping.
    weight_decay: decoupled weight decay of every method.
    moe_loss_weight: weight of the mixture-of-experts load-balancing loss.
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
      diagnostics (``pipeline_sim.diagnose``: per stage, the cosine of the stale and the
      fresh update, and the sign-flip rate along the top eigenvectors) over the next
      ``diagnose_steps`` micro-batches as trial steps; the run's own numbers do not change.
    diagnose_steps: length of each diagnostic window.
    remat: rematerialise each Transformer block with this ``jax.checkpoint_policies`` policy
      (``ModelConfig.remat``; ``None``: keep every activation). Memory, not numbers.
    loss_chunk: tokens per chunk of the output head and loss (``ModelConfig.loss_chunk``; ``None``:
      the full logits). Memory, not numbers (to float32 round-off).
    sampling: how training batches are drawn (``data.SAMPLINGS``): ``random`` windows, or
      ``single-pass`` (no training token predicted twice; the run must fit in one pass).
  """

  stages: int = 1
  seed: int = 0
  mode: str = "weight_stashing"
  model: str = "cpu-deep"
  # The fields that name a run (``name``), in the order they appear in it: each one's ``NAME``
  # format is written when it differs from its default (a format without ``{}`` marks the setting).
  num_blocks: int | None = _named("-B{}", later=False)
  context: int | None = _named("-C{}", later=False)
  width: int | None = _named("-W{}")
  dtype: str = _named("-bf16", "float32")
  execution: str = _named("-devices", "emulated")
  schedule: str = _named("-{}", "1f1b")
  fsdp: bool = _named("-fsdp", False)
  warmup_steps: int | None = _named("-wu{}")
  optimizer: Spec = _named(_settings_text, methods.METHODS["pipedream"], later=False)
  diagnose_every: int | None = _named("-diag{}")
  remat: str | None = _named("-remat")
  loss_chunk: int | None = _named("-lc{}")
  sampling: str = _named("-1pass", "random")
  steps: int = 1200
  batch_size: int = 16
  lr: float = 3e-3
  warmup_fraction: float = 0.012
  warmup_start: float = 1e-7
  final_lr_fraction: float = 0.1
  pipemare_fraction: float = 0.028
  clip_norm: float = 1.0
  weight_decay: float = 0.01
  moe_loss_weight: float = 0.01
  chunk: int = 50
  eval_every: int = 250
  eval_batches: int = 4
  checkpoint_every: int = 250
  tag: str = ""
  diagnose_steps: int = _later(16)

  def __post_init__(self):
    if not isinstance(self.optimizer, Spec):
      raise ValueError(f"optimizer must be an optimizer value (experiments.harness.optimizers, e.g. "
                       f"methods.spec('rotation')), got {self.optimizer!r}")

  @property
  def method(self) -> str:
    """The run's label: the name of the method its optimizer was made from (``Spec.label``)."""
    return self.optimizer.label

  @property
  def name(self) -> str:
    """A readable name (not unique: ``run_name`` adds the identity hash): the model, every named
    field that differs from its default (``NAME``), then mode, method, P, rate, steps, seed, tag."""
    c = canonical(self)
    named = "".join(_name_part(f, getattr(c, f.name)) for f in dataclasses.fields(c) if NAME in f.metadata)
    tag = f"_{c.tag}" if c.tag else ""
    return f"{c.model}{named}_{c.mode}_{c.method}_P{c.stages}_lr{c.lr:g}_n{c.steps}_s{c.seed}{tag}"

  def model_config(self, vocab_size: int) -> model_lib.ModelConfig:
    cfg = model_lib.CONFIGS[self.model]
    width = self.width or cfg.width
    return dataclasses.replace(cfg, vocab_size=vocab_size, num_blocks=self.num_blocks or cfg.num_blocks,
                               context=self.context or cfg.context, width=width,
                               num_heads=max(1, width // (cfg.width // cfg.num_heads)),
                               remat=self.remat, loss_chunk=self.loss_chunk)

  def validate(self) -> None:
    """Every check that can fail before training starts."""
    optimizer = self.optimizer  # a value, its settings checked when it was made
    if optimizer.remedy is not None:
      if self.execution != "emulated":
        raise ValueError(f"method {self.method!r} (a staleness remedy) runs in the emulated pipeline only, "
                         f"got execution {self.execution!r}")
      if self.mode == "stale_gradients" or (optimizer.remedy == "predict" and self.mode != "weight_stashing"):
        raise ValueError(f"method {self.method!r} cannot mean mode {self.mode!r}: weight prediction needs "
                         "'weight_stashing', delay compensation 'weight_stashing' or 'no_stashing'")
    if self.model not in model_lib.CONFIGS:
      raise ValueError(f"unknown model {self.model!r}; choose from {sorted(model_lib.CONFIGS)}")
    if self.mode not in ps.MODES:
      raise ValueError(f"unknown mode {self.mode!r}; choose from {ps.MODES}")
    schedule = ps.schedule_of(self.schedule)
    if schedule.batched and self.mode != "weight_stashing":
      raise ValueError(f"schedule {self.schedule!r} needs mode 'weight_stashing' (its weight versions are "
                       f"the stash), got mode {self.mode!r}")
    if schedule.batched and self.execution == "devices" and self.batch_size % self.stages:
      raise ValueError(f"schedule {self.schedule!r} on devices splits each batch into P = {self.stages} "
                       f"micro-batches: batch_size={self.batch_size} is not a multiple of {self.stages}")
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
    if self.sampling not in data_lib.SAMPLINGS:
      raise ValueError(f"unknown sampling {self.sampling!r}; choose from {data_lib.SAMPLINGS}")
    if self.dtype not in model_lib.DTYPES:
      raise ValueError(f"unknown dtype {self.dtype!r}; choose from {model_lib.DTYPES}")
    if self.warmup_steps is not None and not 0 <= self.warmup_steps < self.steps:
      raise ValueError(f"warmup_steps must be in [0, steps={self.steps}), got {self.warmup_steps}")
    if self.diagnose_every is not None:
      if self.diagnose_every < 1 or self.diagnose_every % self.chunk:
        raise ValueError(f"diagnose_every={self.diagnose_every} must be a positive multiple of "
                         f"chunk={self.chunk}")
      if self.execution != "emulated" or self.mode == "stale_gradients" or self.diagnose_steps < 2:
        raise ValueError("update diagnostics need the emulated pipeline, mode weight_stashing or "
                         f"no_stashing and diagnose_steps >= 2 (got {self.execution}, {self.mode}, "
                         f"{self.diagnose_steps})")


def _name_part(field, value) -> str:
  fmt = field.metadata[NAME]
  if callable(fmt):
    return fmt(value)
  return "" if value in (field.default, None) else fmt.format(value)


# Options added after runs were recorded (``LATER`` in a field's metadata, and the recorded run
# settings but refresh_every, ``methods.RECORDED``), left out of the identity while at their
# default, the value that means "not used", so that adding an option never invalidates finished runs
# that do not use it. A new option: a field with ``_named`` or ``_later``.
OPTIONAL_FIELDS = {**{f.name: f.default for f in dataclasses.fields(RunConfig) if f.metadata.get(LATER)},
                   **{k: v for k, v in methods.RECORDED.items() if k != "refresh_every"}}


def record(config: RunConfig) -> dict:
  """``config`` as plain data, as a run's ``result.json`` records it: its fields, with the optimizer
  as ``methods.record`` writes it (its label, its run settings and the whole value)."""
  fields = {f.name: getattr(config, f.name) for f in dataclasses.fields(config) if f.name != "optimizer"}
  return {**methods.record(config.optimizer), **fields}


def recorded(config: dict) -> RunConfig:
  """The ``RunConfig`` of a config recorded in a run's ``result.json`` or a curves file (a field it
  predates takes its default; the optimizer is ``methods.recorded``'s)."""
  names = {f.name for f in dataclasses.fields(RunConfig)} - {"optimizer"}
  return RunConfig(**{k: v for k, v in config.items() if k in names}, optimizer=methods.recorded(config))


def optimizer_of(config: dict):
  """The optimizer value of a recorded run (``RunConfig.optimizer``): what a study reads of it, with
  every default resolved there, never by the study."""
  return methods.recorded(config)


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
  """``config`` with a width or block count equal to the named model's own written as ``None``, and
  a schedule without delay at P = 1 (2BW's) as 1F1B (the same run, so the same identity and
  folder)."""
  cfg = model_lib.CONFIGS[config.model]
  synchronous = config.stages == 1 and ps.stage_delays(1, config.schedule) == (0,)
  return dataclasses.replace(config, width=None if config.width == cfg.width else config.width,
                             schedule="1f1b" if synchronous else config.schedule,
                             num_blocks=None if config.num_blocks == cfg.num_blocks else config.num_blocks)


def identity(config: RunConfig, data_sha256: str, vocab_size: int, devices: int = 1) -> dict:
  """Everything that changes a run's numbers: its config, the data's hash, the vocabulary and the
  device count (the data-parallel reduction order; on devices also the state's ``(P, D)``
  layout, which a checkpoint must match). One device is left out, so that the folders of runs
  recorded before the count was part of the identity keep their names.

  The code's version is not part of it (every commit would orphan every finished run): a finished
  run is reused and records the code that made it (``result.json``), and a checkpoint written by
  other code is never resumed (``train`` restarts the run, with a warning). The optimizer is there
  as its method's name and run settings, as every published run recorded it, where the method means
  what it meant then (``methods.published``); else as the whole value too (``optimizer``): an edited
  method's, a new one's and a hand-built value's runs get folders of their own.
  """
  config = canonical(config)
  fields = {k: v for k, v in record(config).items()
            if k != "optimizer" and not (k in OPTIONAL_FIELDS and v == OPTIONAL_FIELDS[k])}
  out = {"config": fields, "data_sha256": data_sha256, "vocab_size": vocab_size,
         "model_revision": MODEL_REVISION}
  if not methods.published(config.optimizer):
    out["optimizer"] = describe(config.optimizer)
  if devices != 1:
    out["devices"] = int(devices)
  return out


def run_name(config: RunConfig, data_sha256: str, vocab_size: int, devices: int = 1) -> str:
  """The run's folder name: readable settings plus a hash of its whole identity."""
  blob = json.dumps(identity(config, data_sha256, vocab_size, devices), sort_keys=True)
  return f"{canonical(config).name}_{hashlib.sha256(blob.encode()).hexdigest()[:10]}"


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


def run_dir(config: RunConfig, ds, out) -> pathlib.Path:
  """The folder of ``config``'s run on dataset ``ds`` in a sweep's folder ``out``: ``out/runs/<name>``."""
  return pathlib.Path(out) / "runs" / run_name(config, ds.sha256, ds.vocab_size, device_count(config))

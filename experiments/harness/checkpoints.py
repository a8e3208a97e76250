"""Orbax checkpoints of a run's whole pipeline state, packed one vector per dtype, with the state's
layout and the code that wrote them; restored only into the same layout and code."""

from __future__ import annotations

import contextlib
import hashlib
import json
import logging
import os
import pathlib
import shutil
import warnings

import jax
import numpy as np
import orbax.checkpoint as ocp

from experiments.harness import provenance
from experiments.harness.processes import (
  DamagedFileError,
  _read_json,
  agree,
  agree_list,
  barrier,
  everyone,
  is_primary,
  write_json,
)

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
  of it: Orbax writes one file per array, and a pipeline state has thousands of small ones (the
  cost: docs/benchmarks.md, "Figures the code's comments cite"). A state spread over several
  processes is written array by array, and both layouts restore.
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

  def close(self) -> None:
    """Ends the manager's background work (before its folder is deleted)."""
    self.manager.close()

  def save(self, step, state, losses, val_losses):
    packed = pack(state)
    item = {"state": state} if packed is None else {"packed": packed}
    self.directory.mkdir(parents=True, exist_ok=True)
    write_json(self.directory / "code.json", provenance.code_version())  # before any checkpoint of this code
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
    if agree(bool(steps) and not provenance.same_code(code) and not read_only):
      warnings.warn(f"the checkpoints in {self.directory} were written by other code ({code}, now "
                    f"{provenance.code_version()}); restarting the run from step 0", stacklevel=2)
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

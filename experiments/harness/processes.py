"""Several processes (hosts) of one run: process 0 decides and writes, the others follow
(``agree``, ``barrier``); and the atomic JSON files every process reads."""

from __future__ import annotations

import json
import os
import pathlib

import jax
import numpy as np
from jax.experimental import multihost_utils


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

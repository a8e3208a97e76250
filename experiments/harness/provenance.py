"""Which code and which machine computed a run: the hash of the source files, the commit, library
versions, the CPU and the usable cores (on the CPU backend a run's numbers depend on both)."""

from __future__ import annotations

import functools
import hashlib
import json
import os
import pathlib
import platform
import subprocess
from importlib import metadata

import jax

# The code that computes a run: the libraries, the harness, and the package's start-up (its thread
# policy). The sweep, the report, the studies and the benchmarks are not in it: editing them
# neither restarts nor invalidates a run.
SOURCE_PACKAGES = ("rotation", "pipeline_sim", "experiments/harness", "experiments/__init__.py")


def source_files(root: pathlib.Path | None = None) -> dict:
  """``{relative path: sha256}`` of every Python file of the packages a run's numbers depend on
  (``SOURCE_PACKAGES``), as they are on disk now in ``root`` (default: this checkout or install)."""
  root = pathlib.Path(__file__).resolve().parents[2] if root is None else pathlib.Path(root)
  return {str(f.relative_to(root)): hashlib.sha256(f.read_bytes()).hexdigest()
          for package in SOURCE_PACKAGES
          for f in ([root / package] if package.endswith(".py") else sorted((root / package).rglob("*.py")))}


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
  root = pathlib.Path(__file__).resolve().parents[2]
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


def cpu_type() -> dict:
  """The CPU's model name with its family and model numbers (``/proc/cpuinfo``): one name can cover
  CPUs that round differently (protocol amendment 9), so a study that must stay on one type
  compares all three. ``None`` where the file does not say."""
  fields = {"model name": "cpu", "cpu family": "family", "model": "model"}
  out = {"cpu": host()["cpu"], "family": None, "model": None}
  try:
    with open("/proc/cpuinfo") as f:
      for line in f:
        key, _, value = line.partition(":")
        name = fields.get(key.strip())
        if name in ("family", "model") and out[name] is None:
          out[name] = int(value) if value.strip().isdigit() else value.strip()
        if not line.strip():
          break  # the first processor's block is enough
  except OSError:
    pass
  return out


def register_cpu_type(path) -> dict:
  """This machine's ``cpu_type``, recorded in the JSON file ``path`` (``{name: type}``) of a study
  that must stay on one type per name; an error if the file already holds this name with another
  family or model (protocol amendment 9: the run records keep the name only)."""
  path, mine = pathlib.Path(path), cpu_type()
  known = json.loads(path.read_text()) if path.exists() else {}
  if known.setdefault(mine["cpu"], mine) != mine:
    raise ValueError(f"refused: {mine} is not the {known[mine['cpu']]} whose runs carry this name "
                     "(protocol amendment 9)")
  path.parent.mkdir(parents=True, exist_ok=True)
  path.write_text(json.dumps(known, indent=1, sort_keys=True) + "\n")
  return mine


def versions() -> dict:
  out = {"python": platform.python_version(), "jax_backend": jax.default_backend(),
         "code": code_version(), "host": host()}
  for pkg in ("jax", "jaxlib", "optax", "flax", "orbax-checkpoint", "numpy"):
    try:
      out[pkg] = metadata.version(pkg)
    except metadata.PackageNotFoundError:
      pass
  return out

"""A study's committed curves: one compressed file from which every published number is rebuilt.

``curves.json.gz`` holds what the report needs and nothing it does not: the study's description
(``meta``: command, preset, window, deviations, data, learning-rate readings) and, per run, its
group (``main``, ``tuned-lr`` or an ablation's name), name, config, status, per-step training loss
and validation losses (rounded to 5 decimals: the report is computed from the rounded values, so
a rebuild gives the published numbers exactly), its timing, the CPU it trained on and the code
version. About 40 KB per 2,400-step run.
"""

from __future__ import annotations

import gzip
import json
import pathlib

FILE = "curves.json.gz"
DECIMALS = 5


def _round(values) -> list:
  return [round(float(v), DECIMALS) if v == v and abs(v) != float("inf") else None for v in values]


def record(group: str, result: dict) -> dict:
  """One run of the curves file from a run's ``result.json`` (``runs.train``)."""
  versions = result.get("versions") or {}
  out = {"group": group, "name": result["name"], "config": result["config"],
         "status": result["status"], "losses": _round(result["losses"]),
         "val_steps": result.get("val_steps", []), "val_losses": _round(result.get("val_losses", [])),
         "seconds": result.get("seconds"), "steps_per_second": result.get("steps_per_second"),
         "jobs": result.get("jobs"), "host": versions.get("host"), "code": versions.get("code")}
  if result.get("diagnostics"):
    out["diagnostics"] = result["diagnostics"]
  return out


def write(path: pathlib.Path, meta: dict, runs: list) -> None:
  """Writes ``{"meta", "runs"}`` (``runs``: ``record``s) atomically, byte-identical for the same
  content (no timestamp in the gzip header)."""
  data = json.dumps({"meta": meta, "runs": runs}, sort_keys=True, separators=(",", ":")).encode()
  tmp = path.with_name(path.name + ".tmp")
  with open(tmp, "wb") as f:
    f.write(gzip.compress(data, mtime=0))
  tmp.replace(path)


def read(path: pathlib.Path) -> dict:
  """``{"meta", "runs"}`` with each run's missing losses (non-finite in training) back as ``inf``
  (never credited, ``metrics.credited``)."""
  path = pathlib.Path(path)
  if path.is_dir():
    path = path / FILE
  if not path.is_file():
    raise FileNotFoundError(f"{str(path)!r} does not exist: give a folder holding {FILE} (a sweep's "
                            "--out or a docs/results folder) or the file itself")
  data = json.loads(gzip.decompress(path.read_bytes()))
  for r in data["runs"]:
    for key in ("losses", "val_losses"):
      r[key] = [float("inf") if v is None else v for v in r[key]]
  return data


def hosts_of(runs) -> list:
  """The distinct CPUs (``{"cpu", "cores"}``) the runs trained on, sorted."""
  return [json.loads(h) for h in sorted({json.dumps(r["host"], sort_keys=True) for r in runs
                                          if r.get("host")})]

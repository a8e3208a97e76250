"""A study's committed curves: one compressed file from which every published number is rebuilt.

``curves.json.xz`` holds what the report needs and nothing it does not: the study's description
(``meta``: command, preset, window, deviations, data, learning-rate readings) and, per run, its
group (``main``, ``tuned-lr`` or an ablation's name), name, config, model revision (where the run
recorded one), status, training loss (rounded to ``LOSS_DECIMALS`` = 4 decimals: a step's loss
varies by about 0.15 from batch to batch, 3,000 times the rounding) and validation losses (5
decimals, as quoted), its timing, the CPU it trained on and the code version. The report is computed from the
stored values, so a rebuild gives the published numbers exactly. The training loss is stored per
step up to ``MAX_POINTS`` steps; a longer run stores the means over consecutive blocks of
``loss_every = ceil(steps / MAX_POINTS)`` steps, which ``read`` repeats back to one value per step
(so every metric still sees one loss per step, at a resolution of ``loss_every`` steps). The
training losses are stored as integers (the loss times ``loss_scale``, written in the file: 10^4,
or 10^5 in files written before the 4-decimal rule) in a binary block after the JSON, little-endian
int32 laid out byte plane by byte plane (``loss_layout``: every value's lowest byte, then every
value's next byte, ...; files written before it hold the int32 values one after the other), which
xz compresses about 10% better: about 4 KB per 2,400-step run. A run whose losses are not all such
values keeps them in the JSON.
``read`` marks a run stored as block means with ``stored_every`` (the block), so that ``write``, and
hence ``merge`` and ``--add``, store it as those blocks again rather than as the repeated values.
``read`` also reads files whose losses are all in the JSON.
A run another published study already holds, exactly, can be stored as a link to that study's folder
(``write(..., link=...)``, a study's ``--link``): ``read`` fetches it, so each run is published once.
"""

from __future__ import annotations

import json
import lzma
import math
import os
import pathlib
import re

import numpy as np

from experiments.harness import config as config_lib
from experiments.harness import model as model_lib
from experiments.harness.config import OPTIONAL_FIELDS

FILE = "curves.json.xz"
DECIMALS = 5  # validation losses
LOSS_DECIMALS = 4  # training losses
MAX_POINTS = 2400
_SCALE = 10**LOSS_DECIMALS
_MISSING = np.iinfo(np.int32).min  # a non-finite loss (read back as inf)
PLANES = "byte-planes"  # ``loss_layout`` of the binary block (absent: int32 values in sequence)


# Modules that moved after studies stored their names (in ``meta``'s text): a report names the
# module as it is now, so that every command it cites runs as printed; the stored text is unchanged.
MOVED = {"python -m experiments.regime": "python -m experiments.studies.regime",
         "python -m experiments.misalignment": "python -m experiments.studies.misalignment"}


def current_commands(text: str) -> str:
  """``text`` with every moved module (``MOVED``) named as it is now."""
  for old, new in MOVED.items():
    text = re.sub(re.escape(old) + r"(?![\w.])", new, text)
  return text


def _round(values, decimals=DECIMALS) -> list:
  return [round(float(v), decimals) if v == v and abs(v) != float("inf") else None for v in values]


def _blocks(losses) -> tuple[list, int]:
  """``(stored values, loss_every)``: per step, or block means past ``MAX_POINTS`` steps (a block
  holding a non-finite loss stores ``None``, as a non-finite step does)."""
  x = np.asarray(losses, np.float64)
  every = max(1, math.ceil(len(x) / MAX_POINTS))
  return _round([x[i:i + every].mean() for i in range(0, len(x), every)], LOSS_DECIMALS), every


def record(group: str, result: dict) -> dict:
  """One run of the curves file from a run's ``result.json`` (``runs.train``)."""
  versions = result.get("versions") or {}
  losses, every = _blocks(result["losses"])
  out = {"group": group, "name": result["name"], "config": result["config"],
         "status": result["status"], "losses": losses,
         "val_steps": result.get("val_steps", []), "val_losses": _round(result.get("val_losses", [])),
         "seconds": result.get("seconds"), "steps_per_second": result.get("steps_per_second"),
         "jobs": result.get("jobs"), "host": versions.get("host"), "code": versions.get("code")}
  revision = (result.get("identity") or {}).get("model_revision")
  if revision is not None:
    out["model_revision"] = revision
  if every > 1:
    out["loss_every"], out["num_losses"] = every, len(result["losses"])
  if result.get("diagnostics"):
    out["diagnostics"] = result["diagnostics"]
  return out


def _as_integers(losses) -> np.ndarray | None:
  """``losses`` as int32 multiples of 10^-``LOSS_DECIMALS`` (``_MISSING`` for ``None`` or inf), or
  ``None`` where that would change a value (more decimals, NaN, -inf, out of range)."""
  out = np.empty(len(losses), np.int32)
  for i, v in enumerate(losses):
    if v is None or v == float("inf"):
      out[i] = _MISSING
      continue
    if not math.isfinite(v) or abs(v) * _SCALE >= 2**31 - 1:
      return None
    n = round(v * _SCALE)
    if n / _SCALE != v:
      return None
    out[i] = n
  return out


def write(path: pathlib.Path, meta: dict, runs: list, link=()) -> None:
  """Writes ``{"meta", "runs"}`` (``runs``: ``record``s, or runs as ``read`` returns them: one
  longer than ``MAX_POINTS`` steps is stored as block means again) atomically, byte-identical for
  the same content: the JSON (``loss_scale``, ``loss_layout`` and each run's training losses replaced
  by their count, ``losses_int32``, where they are ``LOSS_DECIMALS``-decimal values), a newline, then
  those losses as little-endian int32 in byte planes, all xz.
  ``link``: folders holding curves files (published studies). A run that one of them already holds,
  exactly as ``read`` would return it here (name, config, losses, everything but its group), is stored
  as a link, ``meta["linked"]``: ``{folder relative to path's: [[group, name], ...]}``, and ``read``
  fetches it from there; each run is published once."""
  path = pathlib.Path(path)
  meta = {k: v for k, v in meta.items() if k != "linked"}  # (as read: its runs are in ``runs``)
  if link:
    meta, runs = _linked(path, meta, runs, link)
  tmp = path.with_name(path.name + ".tmp")
  with open(tmp, "wb") as f:
    f.write(lzma.compress(_encode(meta, runs), preset=9 | lzma.PRESET_EXTREME))
  tmp.replace(path)


def _linked(path: pathlib.Path, meta: dict, runs: list, link) -> tuple[dict, list]:
  """``(meta with "linked", the runs stored here)``: ``write``'s links to runs held in ``link``."""
  back = _decode(_encode(meta, runs), path)["runs"]  # each run as ``read`` will return it
  held = {}
  for folder in link:
    rel = os.path.relpath(pathlib.Path(folder).resolve(), path.resolve().parent)
    if rel == ".":
      raise ValueError(f"--link {str(folder)!r} is the folder being written: link to another study's")
    for r in read(folder)["runs"]:
      held.setdefault(r["name"], (rel, {k: v for k, v in r.items() if k != "group"}))
  linked, own = {}, []
  for run, r in zip(runs, back):
    rel, other = held.get(r["name"], (None, None))
    if other is not None and other == {k: v for k, v in r.items() if k != "group"}:
      linked.setdefault(rel, []).append([r["group"], r["name"]])
    else:
      own.append(run)
  return ({**meta, "linked": linked} if linked else meta), own


def _encode(meta: dict, runs: list) -> bytes:
  """``write``'s content before compression."""
  stored, blocks = [], []
  for r in runs:
    # as ``read`` returns a run stored as block means (or one too long for per-step values): blocks
    every = r.get("stored_every") or math.ceil(len(r["losses"]) / MAX_POINTS)
    if "loss_every" not in r and every > 1:
      r = compact({**r, "losses": [math.inf if v is None else v for v in r["losses"]]}, every)
    ints = _as_integers(r["losses"])
    if ints is None:
      stored.append(r)
      continue
    stored.append({**{k: v for k, v in r.items() if k != "losses"}, "losses_int32": len(ints)})
    blocks.append(ints.astype("<i4").tobytes())
  data = json.dumps({"loss_layout": PLANES, "loss_scale": _SCALE, "meta": meta, "runs": stored},
                    sort_keys=True, separators=(",", ":")).encode()
  return data + b"\n" + np.frombuffer(b"".join(blocks), np.uint8).reshape(-1, 4).T.tobytes()


def read(path: pathlib.Path) -> dict:
  """``{"meta", "runs"}`` with each run's missing losses (non-finite in training) back as ``inf``
  (never credited, ``metrics.credited``), block means repeated to one loss per step, and the runs
  ``meta["linked"]`` names fetched from their folders (after this file's own, under its groups)."""
  path = pathlib.Path(path)
  if path.is_dir():
    path = path / FILE
  if not path.is_file():
    raise FileNotFoundError(f"{str(path)!r} does not exist: give a folder holding {FILE} (a sweep's "
                            "--out or a docs/results folder) or the file itself")
  try:
    data = _decode(lzma.decompress(path.read_bytes()), path)
  except (lzma.LZMAError, OSError, EOFError, ValueError, KeyError, TypeError, AttributeError) as e:
    # (a truncated or foreign file, or JSON without the runs: xz raises LZMAError/EOFError, JSON
    # ValueError, a missing field KeyError)
    raise ValueError(f"{str(path)!r} is not a readable curves file ({type(e).__name__}: {e}); "
                     f"rewrite it from its runs (a sweep writes {FILE} into its --out folder)") from e
  for folder, names in data["meta"].get("linked", {}).items():
    there = {r["name"]: r for r in read(path.parent / folder)["runs"]}
    missing = [name for _, name in names if name not in there]
    if missing:
      raise ValueError(f"{str(path)!r} links {len(missing)} runs that {folder!r} does not hold "
                       f"(first {missing[0]!r}): restore that study's {FILE}")
    data["runs"] += [{**there[name], "group": group} for group, name in names]
  return data


def _decode(content: bytes, path) -> dict:
  """``write``'s content (before compression) as ``read`` returns it, links not fetched."""
  text, _, blob = content.partition(b"\n")
  data = json.loads(text)
  scale = data.pop("loss_scale", 10**5)
  layout = data.pop("loss_layout", None)
  if layout == PLANES:
    blob = np.frombuffer(blob, np.uint8).reshape(4, -1).T.tobytes()
  elif layout is not None:
    raise ValueError(f"unknown loss_layout {layout!r}")
  ints, at = np.frombuffer(blob, "<i4"), 0
  for r in data["runs"]:
    if "losses_int32" in r:
      n = r.pop("losses_int32")
      if at + n > len(ints):
        raise ValueError(f"{str(path)!r}: the binary losses end early")
      chunk = ints[at:at + n]
      r["losses"] = np.where(chunk == _MISSING, np.inf, chunk / scale).tolist()
      at += n
    for key in ("losses", "val_losses"):
      r[key] = [float("inf") if v is None else v for v in r[key]]
    every = r.pop("loss_every", 1)
    if every > 1:
      r["losses"] = np.repeat(r["losses"], every)[:r.pop("num_losses")].tolist()
      r["stored_every"] = every  # ``write`` stores the run as these block means again
  return data


def compact(run: dict, block: int) -> dict:
  """``run`` (as ``read`` returns it) with its training loss stored as means over blocks of
  ``block`` steps (``read`` repeats them back; a block holding a non-finite loss stores ``None``),
  for studies that read final validation losses only; compacting twice gives the same run."""
  x = np.asarray(run["losses"], np.float64)
  means = [float(x[i:i + block].mean()) for i in range(0, len(x), block)]
  out = {k: v for k, v in run.items() if k not in ("losses", "loss_every", "num_losses", "stored_every")}
  out["val_losses"] = [None if not math.isfinite(v) else v for v in run["val_losses"]]
  return {**out, "losses": _round(means, LOSS_DECIMALS),
          "loss_every": block, "num_losses": len(x)}


def at_blocks(run: dict, block: int) -> dict:
  """``run`` with its training loss as ``block``-step block means repeated back to one value per step:
  what ``read`` gives of a file that stores the run at that block (``compact``), so that a study reads
  a run alike from a full-resolution copy and from its published block means."""
  if "loss_every" in run:
    run = {**run, "losses": np.repeat(run["losses"], run["loss_every"])[:run["num_losses"]].tolist()}
  c = compact(run, block)
  return {**c, "losses": np.repeat(c["losses"], block)[:c["num_losses"]].tolist()}


def regime(meta: dict, config: dict) -> dict | None:
  """What a run trained, for an answer's first sentence: its model's parameters (at the run's width,
  depth and context), tokens a step, the training split's tokens (the corpus's, as ``meta``'s
  ``setting`` line records them, less the 10% validation split) and how many times its horizon
  passes over them; ``None`` for runs that record no corpus size or no named model."""
  found = re.search(r"(\d+) tokens, vocabulary (\d+)", " ".join(meta.get("setting", [])))
  if not found or config.get("model") not in model_lib.CONFIGS:
    return None
  total, vocab = int(found.group(1)), int(found.group(2))
  train = total - int(total * 0.1)  # data._split's validation fraction
  run = config_lib.recorded(config)
  cfg = run.model_config(vocab)
  per_step = run.batch_size * cfg.context
  return {"parameters": model_lib.count_params(model_lib.abstract_params(cfg)), "tokens_per_step": per_step,
          "training_tokens": train, "passes": round(run.steps * per_step / train, 2)}


def setting(config: dict, free) -> str:
  """What a study holds fixed, as a comparable key: ``config`` without the fields in ``free``;
  options recorded after a run was trained read as their "not used" value (``OPTIONAL_FIELDS``), and
  P = 1 is one run under either schedule. The optimizer is compared by its method and settings (the
  whole value, recorded since December 2026, is not in the runs recorded before)."""
  c = {**OPTIONAL_FIELDS, **config}
  c.pop("optimizer", None)
  if c.get("stages") == 1:
    c["schedule"] = "1f1b"
  return json.dumps({k: v for k, v in c.items() if k not in free}, sort_keys=True)


def merge(paths, block: int | None = None, steps: int | None = None, cpu: str | None = None,
          only=None) -> dict:
  """The curves files of ``paths`` as one study: the first file's ``meta`` (its window must be every
  file's; with ``steps``, each file's window for runs of that length, its ``meta["windows"]`` where a
  study of several horizons stores one per T) with ``meta["sweeps"]`` listing every sweep command, and
  each run once per group (an ablation lists main runs again, as its own group's records; a run in
  several files must be the same run: the same config, and losses equal to one unit of the stored
  precision, since a run stored before the 4-decimal rule was rounded twice; the first file's copy is
  kept).
  Training losses are rounded to ``LOSS_DECIMALS``.
  ``block``: every run ``compact``ed (the runs are then as ``write`` stores them, not as ``read``
  returns them); ``only``, a predicate of a run (as ``read`` returns it), limits that to the runs it
  holds for. ``cpu``: only the runs trained on that CPU (``host["cpu"]``), so that one run trained
  on two CPUs (two trajectories) merges once per CPU."""
  merged, meta, sweeps = {}, None, []
  for path in paths:
    data = read(path)
    for r in data["runs"]:
      r["losses"] = [round(v, LOSS_DECIMALS) if math.isfinite(v) else v for v in r["losses"]]
    if cpu is not None:
      data["runs"] = [r for r in data["runs"] if (r.get("host") or {}).get("cpu") == cpu]
    if block is not None:
      data["runs"] = [compact(r, block) if only is None or only(r) else r for r in data["runs"]]
    window = data["meta"].get("windows", {}).get(str(steps), data["meta"]["window"])
    meta = meta or {**data["meta"], "window": window}
    if window != meta["window"]:
      raise ValueError(f"{str(path)!r} smooths with window {window}, the first file with "
                       f"{meta['window']}: not one study")
    sweeps += [c for c in data["meta"].get("sweeps", [data["meta"].get("command")]) if c not in sweeps]
    for r in data["runs"]:
      held = merged.setdefault((r.get("group"), r["name"]), r)
      if not _same_run(held, r):
        raise ValueError(f"run {r['name']!r} differs between the files: rerun or drop one of them")
  return {"meta": {**meta, "sweeps": sweeps}, "runs": list(merged.values())}


def _same_run(a: dict, b: dict) -> bool:
  x, y = np.asarray(a["losses"], np.float64), np.asarray(b["losses"], np.float64)
  if a["config"] != b["config"] or x.shape != y.shape:
    return False
  with np.errstate(invalid="ignore"):  # inf - inf: the equal non-finite steps pass by ``x == y``
    return bool(np.all((x == y) | (np.abs(x - y) <= 1.000001 * 10.0**-LOSS_DECIMALS)))


def revision_lines(runs) -> list:
  """A report line (``- ...``) when ``runs`` hold more than one model revision (run identity's
  ``model_revision``, ``experiments.harness.config.MODEL_REVISION``: the same model to float32
  round-off, another trajectory), counting the runs of each; none otherwise."""
  counts = {}
  for r in runs:
    counts[r.get("model_revision")] = counts.get(r.get("model_revision"), 0) + 1
  if len(counts) < 2:
    return []
  name = lambda v: "unrecorded" if v is None else f"revision {v}"
  return ["- **runs of more than one model revision** (the same model to float32 round-off, "
          "another trajectory): " + ", ".join(f"{name(v)} ({n} runs)" for v, n in
                                              sorted(counts.items(), key=lambda kv: str(kv[0])))]


def hosts_text(hosts) -> str:
  """``hosts`` (``hosts_of``) as one line of a report: ``"AMD EPYC (2 cores); ..."``."""
  return "; ".join(f"{h.get('cpu')} ({h.get('cores')} cores)" for h in hosts)


def hosts_of(runs) -> list:
  """The distinct CPUs (``{"cpu", "cores"}``) the runs trained on, sorted."""
  return [json.loads(h) for h in sorted({json.dumps(r["host"], sort_keys=True) for r in runs
                                          if r.get("host")})]


def cpus_of(paths) -> list:
  """The distinct CPU names of the runs in the curves files of ``paths``, sorted: ``merge(paths,
  cpu=c)`` for each gives one study per CPU (a run name trained on two CPUs is two runs)."""
  return [h["cpu"] for h in hosts_of([r for p in paths for r in read(p)["runs"]])]

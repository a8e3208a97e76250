"""From runs to tables: per-step curves of results, per-seed study tables (``metrics.study_table``)
and their Markdown cells (``mean [min, max]`` over seeds)."""

from __future__ import annotations

import collections

import numpy as np

from experiments.harness import model as model_lib
from experiments.harness.methods import BASELINES, METHODS, reference
from experiments.report import metrics


def curve_of(result: dict) -> np.ndarray:
  """Per-step losses of a run; a run that diverged or did not finish gets ``inf`` where it has no
  finite loss, so that it is never credited (``metrics.credited``)."""
  losses = np.asarray(result["losses"], np.float64)
  if result["status"] != "finished":
    losses = np.where(np.isfinite(losses), losses, np.inf)
    if np.all(np.isfinite(losses)):
      losses[-1] = np.inf
  return losses


def final_loss(result: dict, window: int) -> float:
  return metrics.final_smoothed(curve_of(result), window)


def curves_by(results, key=lambda config: config["method"]) -> dict:
  """``{(key, P): {seed: per-step losses}}``."""
  groups = collections.defaultdict(dict)
  for r in results:
    c = r["config"]
    groups[(key(c), c["stages"])][c["seed"]] = curve_of(r)
  return with_references(dict(groups))


def with_references(groups: dict) -> dict:
  """``groups`` (``{(method, P): values}``) with a delayed method's missing P = 1 entry taken from
  its reference's (``methods.reference``: a remedy's optimizer, a staleness-aware memory's uniform
  one); one that has no reference run stays missing."""
  for name, p in list(groups):
    if p > 1 and name in METHODS and (name, 1) not in groups and (reference(name), 1) in groups:
      groups[(name, 1)] = groups[(reference(name), 1)]
  return groups


def mean_curves(curves: dict) -> dict:
  """Seed-averaged curves (a diverged seed makes the mean diverge), for the figures."""
  return {k: np.mean(list(v.values()), axis=0) for k, v in curves.items()}


def step_seconds_by(results, key=lambda config: config["method"]) -> dict:
  """``{(key, P): {seed: steady-state seconds per step}}`` (runs that measured it alone: a run
  trained beside others, ``jobs`` > 1, is left out)."""
  groups = collections.defaultdict(dict)
  for r in results:
    c = r["config"]
    if r.get("steps_per_second") and (r.get("jobs") or 1) == 1:
      groups[(key(c), c["stages"])][c["seed"]] = 1.0 / r["steps_per_second"]
  return dict(groups)


def seed_tables(curves: dict, window: int, baselines=BASELINES, seconds: dict | None = None) -> list:
  """One study table (``metrics.study_table``) per seed that every curve shares; ``seconds``
  (``step_seconds_by``) adds the wall-clock to target."""
  seeds = sorted(set.intersection(*(set(v) for v in curves.values()))) if curves else []
  seconds = seconds or {}
  return [metrics.study_table({k: v[s] for k, v in curves.items()}, baselines, window,
                              step_seconds={k: v[s] for k, v in seconds.items() if s in v})
          for s in seeds]


def study_rows(curves: dict, window: int, baselines=BASELINES, seconds: dict | None = None) -> list:
  """Per-seed study tables aggregated over the seeds every curve shares."""
  return metrics.aggregate(seed_tables(curves, window, baselines, seconds))


def fmt(x, spec="{:.2f}", none="never"):
  if x is None:
    return none
  if isinstance(x, float) and not np.isfinite(x):
    return "diverged"
  return spec.format(x)


def mean_range(mean, lo, hi, seeds: int, spec="{:.2f}", none="never") -> str:
  """``mean``, or over several seeds ``mean [min, max]``: how every table prints a per-seed value."""
  text = fmt(mean, spec, none)
  return text + (f" [{spec.format(lo)}, {spec.format(hi)}]" if seeds > 1 else "")


def spread(values, spec="{:.2f}", none="never") -> str:
  """``mean_range`` of per-seed ``values``; ``none`` if any seed has no value."""
  if not values or any(v is None for v in values):
    return none
  return mean_range(float(np.mean(values)), min(values), max(values), len(values), spec, none)


def cell(row, field, spec="{:.2f}", none="never", ci=False):
  """``mean_range`` of an aggregated row's ``field`` (``ci``: and the 95% t interval); a value some
  seeds lack says in how many (``none``, e.g. "never in 1 of 3 seeds")."""
  if row[field] is None:
    per_seed = row.get(field + "_seeds") or []
    missing = sum(v is None or not np.isfinite(v) for v in per_seed)
    return none + (f" in {missing} of {len(per_seed)} seeds" if 0 < missing < len(per_seed) else "")
  text = mean_range(row[field], row.get(field + "_lo"), row.get(field + "_hi"), row.get("seeds", 1), spec,
                    none)
  if row.get("seeds", 1) > 1:
    if ci and row.get(field + "_ci"):
      lo, hi = row[field + "_ci"]
      text += f", CI {spec.format(lo)} to {spec.format(hi)}"
  return text


def pivot(rows, field, spec="{:.2f}", none="never", ci=False, stages=None):
  """A method x P table of one field (``stages``: the P columns, default every P of ``rows``)."""
  stages = stages or sorted({r["stages"] for r in rows})
  methods = sorted({r["method"] for r in rows}, key=lambda m: (m not in BASELINES, m))
  lines = ["| method | " + " | ".join(f"P={p}" for p in stages) + " |",
           "|---|" + "---|" * len(stages)]
  by = {(r["method"], r["stages"]): r for r in rows}
  for m in methods:
    lines.append(f"| {m} | " + " | ".join(
        cell(by[(m, p)], field, spec, none, ci) if (m, p) in by else "" for p in stages) + " |")
  return "\n".join(lines)


def width_of(result) -> int:
  """A result's model width (its config's override, else the named model's)."""
  c = result["config"]
  return c.get("width") or model_lib.CONFIGS[c["model"]].width


def blocks_of(result) -> int:
  """A result's block count (its config's override, else the named model's)."""
  c = result["config"]
  return c.get("num_blocks") or model_lib.CONFIGS[c["model"]].num_blocks


def stage_aware_rows(curves, methods: tuple, window: int):
  """Per allocation: iterations to the worst final smoothed loss of the allocations (per seed) and
  the speed-up over the first (uniform) allocation, as mean and [min, max] over seeds."""
  top = max(p for _, p in curves)
  seeds = sorted(set.intersection(*(set(v) for v in curves.values())))
  per_seed = []
  for s in seeds:
    finals = [metrics.final_smoothed(v[s], window) for v in curves.values()]
    target = max(finals) if all(np.isfinite(finals)) else None
    per_seed.append({m: metrics.iterations_to(curves[(m, top)][s], target, window)
                     for m in methods if (m, top) in curves})
  rows = {}
  for m in methods:
    its = [it.get(m) for it in per_seed]
    speeds = [metrics.ratio(it.get(methods[0]), it.get(m)) for it in per_seed]
    row = {"seeds": len(seeds)}
    for field, vals in (("iters", its), ("speed", [None if v is None else 100 * (v - 1) for v in speeds])):
      ok = bool(vals) and all(v is not None for v in vals)
      row[field] = float(np.mean(vals)) if ok else None
      row[field + "_lo"], row[field + "_hi"] = (min(vals), max(vals)) if ok else (None, None)
    row["per_seed"] = speeds
    rows[m] = row
  return top, rows

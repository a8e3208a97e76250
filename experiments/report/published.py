"""A sweep's runs beside the published study of the same preset (``build(..., published=FOLDER)``).

The main job reproduces published runs: a run's folder name holds its settings, data and seed, so a
published run of the same name is the same run trained elsewhere (its numbers part from the
published ones by round-off from the first steps on another CPU, then by chaos). The report shows,
per run, the final smoothed training loss against the published one and, per claim, the user's
per-seed values against the range of the published seeds. With fewer seeds than the published
verdicts used, the report draws no verdict and prints no t interval (with one or two degrees of
freedom it spans orders of magnitude): the section says how many seeds a verdict needs.
"""

from __future__ import annotations

import os

import numpy as np

from experiments.report import curves as curves_lib
from experiments.report.tables import final_loss


def shown(folder) -> str:
  """``folder`` as a reader finds it: relative to the working folder when it lies below it."""
  relative = os.path.relpath(folder)
  return relative if not relative.startswith("..") else str(folder)


def seeds_of(runs) -> list:
  """The seeds of the main runs (the verdicts' unit)."""
  return sorted({r["config"]["seed"] for r in runs if r["group"] == "main"})


def compare_runs(mine: list, window: int, theirs: list, their_window: int) -> dict:
  """Per run of ``mine`` that ``theirs`` holds by name (and group): both final smoothed training
  losses and the difference; with the median and the largest absolute difference."""
  held = {(r["group"], r["name"]): r for r in theirs}
  rows = []
  for r in mine:
    other = held.get((r["group"], r["name"]))
    if other is not None:
      a, b = final_loss(r, window), final_loss(other, their_window)
      rows.append({"name": r["name"], "group": r["group"], "mine": a, "published": b, "difference": a - b})
  diffs = np.abs([x["difference"] for x in rows if np.isfinite(x["difference"])])
  largest = max((x for x in rows if np.isfinite(x["difference"])), key=lambda x: abs(x["difference"]),
                default=None)
  return {"runs": rows, "matched": len(rows), "total": len(mine),
          "median": float(np.median(diffs)) if len(diffs) else None,
          "largest": None if largest is None else {"name": largest["name"],
                                                   "difference": largest["difference"]}}


def compare_claims(mine: list, theirs: list) -> list:
  """Per claim of ``mine`` (``claims.Claim``, by its text): the user's per-seed values, the range
  of the published seeds' values, whether every value of the user's lies inside it, and the
  published verdict."""
  held = {c.claim: c for c in theirs}
  out = []
  for c in mine:
    other = held.get(c.claim)
    numbers = lambda values: [float(v) for v in values if isinstance(v, (int, float)) and np.isfinite(v)]
    ours, published = numbers(c.values), numbers(other.values) if other else []
    span = [min(published), max(published)] if published else None
    inside = (bool(ours) and len(ours) == len(c.values) and span is not None
              and all(span[0] <= v <= span[1] for v in ours))
    out.append({"claim": c.claim, "values": [v if isinstance(v, (int, float)) else str(v) for v in c.values],
                "published_range": span, "inside": inside,
                "published_verdict": other.verdict if other else None, "spec": c.spec})
  return out


def _number(x, spec="{:.4f}") -> str:
  return "-" if x is None or not np.isfinite(x) else spec.format(x)


def runs_section(compared: dict, folder, their_command: str, their_seeds: list) -> list:
  if not compared["matched"]:
    return ["## Your runs against the published ones", "",
            f"None of these {compared['total']} runs has a published run of the same name in `{folder}` "
            "(other settings, data or seeds).", ""]
  largest = compared["largest"]
  lines = ["## Your runs against the published ones", "",
           f"`{folder}` holds the published study of this preset "
           f"(`{curves_lib.current_commands(their_command)}`, seeds {', '.join(map(str, their_seeds))}). "
           f"{compared['matched']} of your {compared['total']} "
           "runs have a published run of the same name (the same settings, data and seed). Final smoothed "
           f"training loss, yours minus published: median |difference| {_number(compared['median'])}, "
           f"largest {_number(largest['difference'], '{:+.4f}')} ({largest['name']}). A run trained on "
           "another CPU parts from the published one from its first steps (round-off), so differences of "
           "the size of the seeds' spread are what a faithful reproduction gives.", "",
           "| run | yours | published | difference |", "|---|---|---|---|"]
  for x in compared["runs"]:
    lines.append(f"| {x['name']} | {_number(x['mine'])} | {_number(x['published'])} | "
                 f"{_number(x['difference'], '{:+.4f}')} |")
  return lines + [""]


def claims_section(compared: list, seeds: list, needed: int | None) -> list:
  """The claims on the user's seeds beside the published seeds' range; a verdict only where the
  seeds suffice (``needed``: the published verdicts' seed count; ``None``: the table of verdicts
  stands above)."""
  if needed is not None and len(seeds) < needed:
    head = (f"## The claims on your {len(seeds)} seed{'s' if len(seeds) != 1 else ''} (no verdict: the "
            f"published verdicts used {needed})")
    text = (f"With {len(seeds)} seed{'s' if len(seeds) != 1 else ''} a claim's t interval has "
            f"{max(len(seeds) - 1, 0)} degree{'s' if len(seeds) != 2 else ''} of freedom and decides "
            "nothing, "
            f"so none is drawn: each claim's per-seed values (seeds {', '.join(map(str, seeds))}) beside the "
            f"range of the published seeds' values and the published verdict. A verdict of your own needs "
            f"{needed} seeds (`--seeds {' '.join(map(str, range(needed)))}`).")
  else:
    head, text = ("## The claims against the published seeds", "Each claim's per-seed values beside the "
                  "range of the published seeds' values (the verdicts are in the table above).")
  lines = [head, "", text, "",
           "| claim | your seeds | published seeds' range | all inside | published verdict |",
           "|---|---|---|---|---|"]
  for c in compared:
    spec = c["spec"]
    values = ", ".join(v if isinstance(v, str) else spec.format(v) for v in c["values"])
    span = "-" if c["published_range"] is None else (f"{spec.format(c['published_range'][0])} to "
                                                       f"{spec.format(c['published_range'][1])}")
    lines.append(f"| {c['claim']} | {values} | {span} | {'yes' if c['inside'] else 'no'} | "
                 f"{c['published_verdict'] or '-'} |")
  return lines + [""]

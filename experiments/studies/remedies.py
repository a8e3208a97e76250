"""``python -m experiments.studies.remedies SOURCE [SOURCE ...] --out DIR``: the staleness remedies.

Weight prediction (``<optimizer>+predict``, scale ``s``) and delay compensation (``<optimizer>+dc``,
``lambda``) on top of PipeDream (AdamW), Muon and rotation, under the seeds and claims fixed in
docs/protocol.md (amendment 2). Each SOURCE holds ``curves.json.xz`` (a sweep's ``--finished-only
--publish`` folder, a published study, or this study's ``--out``); runs are read by final validation
loss, keyed by method, schedule, P, the remedy's scale and seed.

1. **Scales** (the protocol's pipedream grid at P = 16, 1F1B): per remedy and scale the final
   validation loss at the largest P; the chosen scale is the lowest seed-mean, then used for every
   optimizer. Stated, not claimed.
2. **Gap closed**: per schedule, optimizer and remedy at the chosen scale, per seed, the fraction of
   the optimizer's staleness gap (final validation loss at the largest P minus at P = 1) that the
   remedy closes, ``1 - gap(remedy) / gap(optimizer)``; at P = 1 a remedy is the optimizer itself
   (no delay: nothing to predict or compensate), so both gaps share the optimizer's P = 1 run. One
   claim per row, "> 0", Holm-corrected over the table (final validation losses do not depend on
   the smoothing window, so the window rule has nothing to move).

Writes ``report.md``, ``summary.json`` and the merged runs as ``curves.json.xz`` (block means of the
training loss; ``--out`` as the only SOURCE rebuilds it).
"""

from __future__ import annotations

import argparse
import json
import pathlib

import numpy as np

from experiments import cli
from experiments.harness import methods
from experiments.report import claims, curves, metrics

BLOCK = 100  # training-loss block mean stored per run
SCALE = {"predict": "predict_scale", "dc": "dc_lambda"}
DEFAULT = {"predict": methods.PREDICT_SCALE, "dc": methods.DC_LAMBDA}


def key(config: dict) -> tuple:
  """``(method, schedule, P, scale)`` of a run; P = 1 is one run under either schedule."""
  remedy = methods.check_method(config["method"]).remedy
  scale = None if remedy is None else config.get(SCALE[remedy])
  scale = DEFAULT[remedy] if remedy is not None and scale is None else scale
  schedule = "1f1b" if config["stages"] == 1 else config.get("schedule", "1f1b")
  return config["method"], schedule, config["stages"], scale


def final_vals(runs) -> dict:
  """``{key: {seed: final validation loss or None}}``."""
  out = {}
  for r in runs:
    out.setdefault(key(r["config"]), {})[r["config"]["seed"]] = metrics.final_val(r)
  return out


def _mean(by_seed: dict) -> float | None:
  vals = list(by_seed.values())
  return float(np.mean(vals)) if vals and all(v is not None for v in vals) else None


def scale_rows(vals: dict, top: int) -> tuple[list, dict]:
  """``(rows, {remedy: chosen scale})`` from the ``pipedream+<remedy>`` runs at P = ``top``, 1F1B."""
  rows, chosen = [], {}
  for remedy in methods.REMEDIES:
    cells = {k[3]: v for k, v in vals.items() if k[:3] == (f"pipedream+{remedy}", "1f1b", top)}
    for scale in sorted(cells):
      seeds = sorted(cells[scale])
      rows.append({"remedy": remedy, "scale": scale, "seeds": seeds, "final_val": _mean(cells[scale]),
                   "per_seed": [cells[scale][s] for s in seeds]})
    done = [r for r in rows if r["remedy"] == remedy and r["final_val"] is not None]
    if done:
      chosen[remedy] = min(done, key=lambda r: r["final_val"])["scale"]
  return rows, chosen


def gap_rows(vals: dict, top: int, chosen: dict) -> list:
  """Per schedule, optimizer and remedy: the per-seed fraction of the optimizer's gap it closes."""
  rows = []
  for schedule in ("1f1b", "2bw"):
    for base in methods.REMEDY_BASES:
      one, stale = vals.get((base, "1f1b", 1, None), {}), vals.get((base, schedule, top, None), {})
      for remedy in methods.REMEDIES:
        scale = chosen.get(remedy, DEFAULT[remedy])
        fixed = vals.get((f"{base}+{remedy}", schedule, top, scale), {})
        seeds = sorted(set(one) & set(stale) & set(fixed))
        if not seeds:
          continue
        per_seed = []
        for s in seeds:
          if None in (one[s], stale[s], fixed[s]) or stale[s] <= one[s]:
            per_seed.append("no gap to close (a run diverged or P = 1 is not better)")
          else:
            per_seed.append(1.0 - (fixed[s] - one[s]) / (stale[s] - one[s]))
        rows.append({"schedule": schedule, "optimizer": base, "remedy": remedy, "scale": scale, "P": top,
                     "seeds": seeds, "per_seed": per_seed})
  return rows


def study(runs) -> tuple:
  vals = final_vals(runs)
  top = max((k[2] for k in vals), default=1)
  scales, chosen = scale_rows(vals, top)
  gaps = gap_rows(vals, top, chosen)
  decided = claims.holm([claims.check(
      f"{r['optimizer']}+{r['remedy']} closes part of {r['optimizer']}'s staleness gap "
      f"({r['schedule']}, P = {r['P']}, scale {r['scale']:g})", "the remedy's own papers (> 0)",
      r["per_seed"], 0.0, context=f"fraction of the gap closed, seeds {r['seeds']}: ") for r in gaps])
  return scales, chosen, gaps, decided


def write(scales, chosen, gaps, decided, meta, out: pathlib.Path, command: str) -> dict:
  out.mkdir(parents=True, exist_ok=True)
  lines = ["# The staleness remedies: weight prediction and delay compensation", "",
           f"- made by `{command}`", "- the sweeps: " + "; ".join(f"`{c}`" for c in meta["sweeps"]), "",
           "## Scales (pipedream, 1F1B, the largest P)", "",
           "| remedy | scale | seeds | final validation loss (seed mean) | chosen |", "|---|---|---|---|---|"]
  for r in scales:
    val = "-" if r["final_val"] is None else f"{r['final_val']:.4f}"
    lines.append(f"| {r['remedy']} | {r['scale']:g} | {len(r['seeds'])} | {val} | "
                 f"{'**yes**' if chosen.get(r['remedy']) == r['scale'] else ''} |")
  lines += ["", "## Fraction of the optimizer's staleness gap closed", ""]
  if gaps:
    lines += ["| schedule | optimizer | remedy | scale | seeds | fraction closed |",
              "|---|---|---|---|---|---|"]
    for r in gaps:
      nums = [v for v in r["per_seed"] if not isinstance(v, str)]
      iv = metrics.interval(nums) if len(nums) == len(r["per_seed"]) else None
      text = claims.describe(r["per_seed"], iv, "{:+.2f}")
      lines.append(f"| {r['schedule']} | {r['optimizer']} | {r['remedy']} | {r['scale']:g} | "
                   f"{len(r['seeds'])} | {text} |")
    lines += [""] + claims.section(decided, heading="Claims, checked")
  else:
    lines += ["No optimizer holds its runs at P = 1 and at the largest P beside a remedy's yet.", ""]
  (out / "report.md").write_text("\n".join(lines))
  summary = {"command": command, "sweeps": meta["sweeps"], "chosen": chosen, "scales": scales,
             "gaps": gaps, "claims": [c.summary() for c in decided]}
  (out / "summary.json").write_text(json.dumps(summary, indent=1) + "\n")
  return summary


def main(argv=None):
  parser = argparse.ArgumentParser(prog="python -m experiments.studies.remedies", description=__doc__,
                                   formatter_class=argparse.RawDescriptionHelpFormatter)
  parser.add_argument("sources", nargs="+", help=f"folders holding {curves.FILE}")
  parser.add_argument("--out", required=True,
                      help=f"where to write report.md, summary.json and {curves.FILE}")
  args = parser.parse_args(argv)
  data = curves.merge(args.sources, block=BLOCK)
  scales, chosen, gaps, decided = study(data["runs"])
  out = pathlib.Path(args.out)
  command = f"python -m experiments.studies.remedies {args.out} --out {args.out}"  # rebuilds from --out
  summary = write(scales, chosen, gaps, decided, data["meta"], out, command)
  curves.write(out / curves.FILE, data["meta"], data["runs"])
  print(f"wrote {out / 'report.md'}: chosen scales {chosen}")
  return summary


if __name__ == "__main__":
  cli.exit_process(cli.run(main))

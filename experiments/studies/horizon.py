"""``python -m experiments.studies.horizon SOURCE [SOURCE ...] --out DIR``: the staleness study against the
training horizon T.

Each SOURCE is a study folder holding ``curves.json.xz`` (``experiments.report.curves``). Their main runs
are grouped by their length T; per T, every number is computed per seed as in the study's own
report (``metrics.study_table``) at the largest P of that T: each method's headline slowdown,
rotation's staleness gain over the best baseline with its 95% interval and verdict
(``claims.judge``: reproduced above 1, refuted below, inconclusive otherwise), and each method's
final smoothed loss at P = 1 and at P with their gap. Writes ``report.md``, ``horizon.png`` (the
gain against ``T / tau_max`` with its interval, the paper's regime marked) and ``summary.json``
with ``gain_vs_horizon: [{"T", "P", "method", "gain": {"mean", "min", "max", "ci95"}, "seeds",
"verdict", "per_seed"}]`` (``per_seed``: the gain of each seed, in seed order).
"""

from __future__ import annotations

import argparse
import json
import pathlib
import sys

from experiments import cli
from experiments.report import claims, curves, metrics, plots
from experiments.report.tables import curves_by, seed_tables

PAPER_T_PER_DELAY = 8000  # about 50 x the cpu preset's 2,400 / 15 (the paper's 95M runs at P = 32)


def by_horizon(runs) -> dict:
  """``{T: main runs of that length}``."""
  out = {}
  for r in runs:
    if r["group"] == "main":
      out.setdefault(r["config"]["steps"], []).append(r)
  return dict(sorted(out.items()))


def horizon_rows(sources) -> tuple[list, list]:
  """Per T: the rows of the report and of ``gain_vs_horizon``, and the hosts of every run."""
  runs = []
  for source in sources:
    data = curves.read(source)
    runs += [{**r, "window": data["meta"]["window"]} for r in data["runs"]]  # one T per study
  rows = []
  for steps, group in by_horizon(runs).items():
    tables = seed_tables(curves_by(group), group[0]["window"])
    if not tables:
      continue
    top = max(r["stages"] for r in tables[0])
    aggregated = metrics.aggregate(tables)
    at = {r["method"]: r for r in aggregated if r["stages"] == top}
    first = {r["method"]: r for r in aggregated if r["stages"] == 1}
    gains = [next((r["staleness_gain"] for r in t if r["method"] == "rotation" and r["stages"] == top),
                  None) for t in tables]
    verdict, iv, why = claims.judge(gains, 1.0)
    rows.append({"T": steps, "P": top, "tau_max": top - 1, "seeds": len(tables), "gains": gains,
                 "gain": iv, "verdict": verdict, "why": why, "at": at, "first": first})
  return rows, curves.hosts_of(runs)


def write(rows, hosts, out: pathlib.Path, command: str) -> dict:
  out.mkdir(parents=True, exist_ok=True)
  methods = sorted({m for r in rows for m in r["at"]})
  lines = ["# The staleness study against the training horizon", "",
           f"- made by `{command}`",
           "- runs from " + ("one CPU: " if len(hosts) == 1 else "**more than one CPU**: ")
           + "; ".join(f"{h.get('cpu')} ({h.get('cores')} cores)" for h in hosts), "",
           "Per horizon T: rotation's staleness gain over the best baseline at the largest P (> 1: "
           "its lead grows with staleness; Student's t 95% interval over seeds), each method's headline "
           "slowdown from P = 1 and its final smoothed loss at P = 1 and at P.", "",
           "| T | P | T / tau_max | seeds | rotation's staleness gain | verdict | "
           + " | ".join(f"{m} slowdown" for m in methods) + " | "
           + " | ".join(f"{m} final P=1 / P (gap)" for m in methods) + " |",
           "|---|---|---|---|---|---|" + "---|" * (2 * len(methods))]
  for r in rows:
    gain = claims.describe(r["gains"], r["gain"])
    slow = [f"{r['at'][m]['slowdown_levels']:.2f}" if m in r["at"] and r["at"][m]["slowdown_levels"]
            is not None else "" for m in methods]
    fin = []
    for m in methods:
      a, b = r["first"].get(m, {}).get("final"), r["at"].get(m, {}).get("final")
      fin.append(f"{a:.3f} / {b:.3f} ({b - a:+.3f})" if a is not None and b is not None else "")
    verdict = r["verdict"] + (f" ({r['why']})" if r["why"] else "")
    lines.append(f"| {r['T']} | {r['P']} | {r['T'] / r['tau_max']:.0f} | {r['seeds']} | {gain} | "
                 f"{verdict} | " + " | ".join(slow) + " | " + " | ".join(fin) + " |")
  lines += ["", "![rotation's staleness gain against the horizon](horizon.png)", ""]
  (out / "report.md").write_text("\n".join(lines))
  plots.gain_vs_horizon(rows, out / "horizon.png", PAPER_T_PER_DELAY)
  summary = {"command": command, "hosts": hosts, "gain_vs_horizon": [
      {"T": r["T"], "P": str(r["P"]), "method": "rotation", "seeds": r["seeds"],
       "verdict": r["verdict"], "per_seed": r["gains"],
       "gain": ({k: r["gain"][k] for k in ("mean", "min", "max", "ci95")} if r["gain"] else None)}
      for r in rows]}
  (out / "summary.json").write_text(json.dumps(summary, indent=1) + "\n")
  return summary


def main(argv=None):
  parser = argparse.ArgumentParser(prog="python -m experiments.studies.horizon", description=__doc__,
                                   formatter_class=argparse.RawDescriptionHelpFormatter)
  parser.add_argument("sources", nargs="+", help=f"study folders holding {curves.FILE}")
  parser.add_argument("--out", required=True, help="where to write report.md, horizon.png, summary.json")
  args = parser.parse_args(argv)
  rows, hosts = horizon_rows(args.sources)
  if not rows:
    raise ValueError(f"no main runs in {args.sources}")
  command = "python -m experiments.studies.horizon " + " ".join(sys.argv[1:] if argv is None else argv)
  summary = write(rows, hosts, pathlib.Path(args.out), command)
  print(f"wrote {args.out}/report.md: " + "; ".join(
      f"T = {g['T']}: gain {g['gain']['mean']:.2f} ({g['verdict']})" if g["gain"]
      else f"T = {g['T']}: no gain" for g in summary["gain_vs_horizon"]))
  return summary


if __name__ == "__main__":
  cli.exit_process(cli.run(main))

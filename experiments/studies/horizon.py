"""``python -m experiments.studies.horizon SOURCE [SOURCE ...] --out DIR``: the staleness study against the
training horizon T.

Each SOURCE is a study folder holding ``curves.json.xz`` (``experiments.report.curves``). Their main runs
are grouped by their length T; per T, every number is computed per seed as in the study's own
report (``metrics.study_table``) at the largest P of that T: each method's headline slowdown,
rotation's staleness gain over the best baseline, the primary endpoint, with its interval and
verdict under docs/protocol.md (``claims.protocol``: log scale, Holm over the horizons, the window
rule), and each method's
final smoothed loss at P = 1 and at P with their gap. Writes ``report.md``, ``horizon.png`` (the
gain against ``T / tau_max`` with its interval, the paper's regime marked) and ``summary.json``
with ``gain_vs_horizon: [{"T", "P", "method", "gain": {"mean", "min", "max", "ci95"}, "seeds",
"verdict", "per_seed"}]`` (``per_seed``: the gain of each seed, in seed order).
"""

from __future__ import annotations

import argparse
import pathlib
import sys

from experiments import cli
from experiments.harness.methods import BASELINES
from experiments.report import claims, curves, metrics, plots
from experiments.report.tables import curves_by, seed_tables
from experiments.studies import write_summary

NO_GAIN = "rotation or the best baseline diverged or shares no levels"
# Seeds trained and looked at before docs/protocol.md fixed the seeds (its "Seeds" and amendment 8).
SEEN_BEFORE_PROTOCOL = {2400: (0, 1, 2, 3, 4), 9600: (0, 1, 2), 38400: (0, 1, 2)}
# Horizons whose verdict amendment 8 relabelled exploratory, and why.
EXPLORATORY = {38400: "exploratory (protocol amendment 8): seeds 0-2 seen before the protocol, the "
                      "shared rate never tuned at this T, pairs across two CPUs"}
PAPER_T_PER_DELAY = 8000  # about 50 x the cpu preset's 2,400 / 15 (the paper's 95M runs at P = 32)


def by_horizon(runs) -> dict:
  """``{T: main runs of that length}``."""
  out = {}
  for r in runs:
    if r["group"] == "main":
      out.setdefault(r["config"]["steps"], []).append(r)
  return dict(sorted(out.items()))


def _gains(group, window: int, subject: str = "rotation") -> dict:
  """``{seed: subject's staleness gain over the best baseline}`` at the largest P of one horizon:
  every seed that holds the subject's and at least one baseline's runs counts (for rotation, Muon's
  runs are not needed)."""
  tables = claims.tables_by_seed(curves_by(group), window, (subject,) + BASELINES,
                                 claims.with_a_baseline(subject))
  top = max((r["stages"] for t in tables.values() for r in t), default=None)
  return {s: next((r["staleness_gain"] for r in t if r["method"] == subject and r["stages"] == top), None)
          for s, t in tables.items()}


def _control(group, window: int, rotation: dict) -> dict:
  """Muon's trend beside rotation's (protocol amendment 8's control, read here without a verdict):
  Muon's staleness gain over the best baseline per seed, and rotation's over Muon's where a seed
  has both."""
  muon = _gains(group, window, "muon")
  both = [s for s in muon if rotation.get(s) is not None and muon[s] is not None]
  return {"muon_gain": muon, "muon_interval": metrics.interval(list(muon.values()), log=True),
          "rotation_over_muon": {s: rotation[s] / muon[s] for s in both}}


def _readings(gains: dict, steps: int) -> dict:
  """What amendment 8 prints beside a verdict: the leave-one-seed-out readings, and the reading on
  the seeds trained after the protocol fixed them (a family of one; none at T = 2,400)."""
  seeds, values = list(gains), [NO_GAIN if v is None else v for v in gains.values()]
  fresh = [v for s, v in zip(seeds, values) if s not in SEEN_BEFORE_PROTOCOL.get(steps, ())]
  after = claims.check("", "", fresh, 1.0, log=True) if fresh else None
  return {"leave_one_out": claims.leave_one_out(seeds, values, 1.0, log=True),
          "after_protocol": None if after is None else {
              "seeds": [s for s in seeds if s not in SEEN_BEFORE_PROTOCOL.get(steps, ())],
              "mean": after.interval and after.interval["mean"],
              "ci95": after.interval and after.interval["ci95"], "p": after.p, "verdict": after.verdict}}


def horizon_rows(sources) -> tuple[list, list, list]:
  """Per T: the rows of the report and of ``gain_vs_horizon``, the hosts of every run and the
  report's line on mixed model revisions (``curves.revision_lines``). The
  primary endpoint's horizons are one family (docs/protocol.md): rotation's gain > 1 at each T,
  Holm-corrected over the horizons, on the log scale, and robust to half and double the window."""
  runs = []
  for source in sources:
    data = curves.read(source)
    runs += [{**r, "window": data["meta"]["window"]} for r in data["runs"]]  # one T per study
  groups = {steps: g for steps, g in by_horizon(runs).items() if _gains(g, g[0]["window"])}
  scale = {"reported": 1.0, "half": 0.5, "double": 2.0}

  def family(label):
    out = []
    for steps, g in groups.items():
      gains = list(_gains(g, max(1, int(g[0]["window"] * scale[label]))).values())
      out.append(claims.check(f"T = {steps}", "> 1", [NO_GAIN if v is None else v for v in gains], 1.0,
                              log=True))
    return out
  decided = claims.protocol(family)
  rows = []
  for (steps, group), claim in zip(groups.items(), decided):
    by_seed = _gains(group, group[0]["window"])
    gains = list(by_seed.values())
    tables = seed_tables(curves_by(group), group[0]["window"])  # the columns: seeds every method has
    top = max(r["stages"] for r in tables[0])
    aggregated = metrics.aggregate(tables)
    at = {r["method"]: r for r in aggregated if r["stages"] == top}
    first = {r["method"]: r for r in aggregated if r["stages"] == 1}
    slowdowns = {}  # each method's headline per seed, over every seed of its own runs
    for method in sorted({r["config"]["method"] for r in group}):
      own = seed_tables(curves_by([r for r in group if r["config"]["method"] == method]), group[0]["window"])
      slowdowns[method] = [next((x["slowdown_levels"] for x in t if x["stages"] == top), None) for t in own]
    rows.append({"T": steps, "P": top, "tau_max": top - 1, "seeds": len(gains), "common": len(tables),
                 "gains": gains, "seed_ids": list(by_seed), "slowdowns": slowdowns,
                 "exploratory": EXPLORATORY.get(steps, ""), **_readings(by_seed, steps),
                 **_control(group, group[0]["window"], by_seed),
                 "gain": claim.interval, "verdict": claim.verdict, "why": claim.why, "claim": claim,
                 "at": at, "first": first})
  return rows, curves.hosts_of(runs), curves.revision_lines(runs)


def _beside(rows) -> list:
  """The readings printed beside each verdict (amendment 8): leave-one-seed-out, the seeds trained
  after the protocol alone, and Muon's gain over the same baseline."""
  num = lambda x, spec="{:.2f}": "-" if x is None else spec.format(x)
  lines = ["## Beside each verdict", "",
           "Leave-one-seed-out: the gain's geometric mean, p and verdict (a family of one) with each seed "
           "left out in turn. After the protocol: the seeds trained after docs/protocol.md fixed them, "
           "alone. Muon's gain: Muon's staleness gain over the same best baseline, per seed (the "
           "control of amendment 8: a trend both share is not rotation's), and rotation's gain over "
           "Muon's where a seed has both. Readings, not verdicts.", "",
           "| T | leave one seed out (seed: mean, p, verdict) | after the protocol | Muon's gain per seed "
           "(geometric mean) | rotation's gain over Muon's per seed |", "|---|---|---|---|---|"]
  for r in rows:
    loo = "; ".join(f"{x['left_out']}: {num(x['mean'])}, p {num(x['p'], '{:.2g}')}, {x['verdict']}"
                    for x in r["leave_one_out"])
    a = r["after_protocol"]
    after = ("none (every seed seen before)" if a is None else
             f"seeds {a['seeds']}: {num(a['mean'])}" + (f" ({num(a['ci95'][0])} to {num(a['ci95'][1])}), "
                                                        f"p {num(a['p'], '{:.2g}')}" if a["ci95"] else "")
             + f", {a['verdict']}")
    muon = ", ".join(f"{s}: {num(v)}" for s, v in r["muon_gain"].items())
    mean = r["muon_interval"]["mean"] if r["muon_interval"] else None
    ratio = ", ".join(f"{s}: {num(v)}" for s, v in r["rotation_over_muon"].items())
    lines.append(f"| {r['T']} | {loo} | {after} | {muon} ({num(mean)}) | {ratio or '-'} |")
  return lines + [""]


def write(rows, hosts, out: pathlib.Path, command: str, revisions=()) -> dict:
  out.mkdir(parents=True, exist_ok=True)
  methods = sorted({m for r in rows for m in r["at"]})
  lines = ["# The staleness study against the training horizon", "",
           f"- made by `{command}`",
           "- runs from " + ("one CPU: " if len(hosts) == 1 else "**more than one CPU**: ")
           + curves.hosts_text(hosts), *revisions, "",
           "Per horizon T: rotation's staleness gain over the best baseline at the largest P (> 1: "
           "its lead grows with staleness), each method's headline slowdown from P = 1 and its final "
           "smoothed loss at P = 1 and at P. The gain is the primary endpoint of docs/protocol.md: "
           "per seed, tested on the log scale (geometric mean, Student's t interval of the mean log "
           "mapped back), the horizons one family under Holm's correction (each interval at its Holm "
           "level, the adjusted p beside it), a reproduced or refuted verdict kept only if it holds "
           "at half and double the smoothing window.", "",
           "The slowdown and final-loss columns are means over the seeds that every method of that T "
           "has (their count in the last column); the gain counts every seed with rotation's and the "
           "baselines' runs.", "",
           "| T | P | T / tau_max | seeds (gain) | rotation's staleness gain | verdict | "
           + " | ".join(f"{m} slowdown" for m in methods) + " | "
           + " | ".join(f"{m} final P=1 / P (gap)" for m in methods) + " | seeds (columns) |",
           "|---|---|---|---|---|---|" + "---|" * (2 * len(methods) + 1)]
  for r in rows:
    gain = r["claim"].evidence
    slow = [f"{r['at'][m]['slowdown_levels']:.2f}" if m in r["at"] and r["at"][m]["slowdown_levels"]
            is not None else "" for m in methods]
    fin = []
    for m in methods:
      a, b = r["first"].get(m, {}).get("final"), r["at"].get(m, {}).get("final")
      fin.append(f"{a:.3f} / {b:.3f} ({b - a:+.3f})" if a is not None and b is not None else "")
    verdict = r["verdict"] + (f" ({r['why']})" if r["why"] else "")
    verdict += f"; **{r['exploratory']}**" if r["exploratory"] else ""
    lines.append(f"| {r['T']} | {r['P']} | {r['T'] / r['tau_max']:.0f} | {r['seeds']} | {gain} | "
                 f"{verdict} | " + " | ".join(slow) + " | " + " | ".join(fin) + f" | {r['common']} |")
  lines += ["", "![rotation's staleness gain against the horizon](horizon.png)", ""] + _beside(rows)
  (out / "report.md").write_text("\n".join(lines))
  plots.gain_vs_horizon(rows, out / "horizon.png", PAPER_T_PER_DELAY)
  summary = {"command": command, "hosts": hosts, "gain_vs_horizon": [
      {"T": r["T"], "P": str(r["P"]), "method": "rotation", "seeds": r["seeds"],
       "verdict": r["verdict"], "why": r["why"], "per_seed": r["gains"],
       "p": r["claim"].p, "p_holm": r["claim"].p_holm, "scale": "log",
       "gain": ({k: r["gain"][k] for k in ("mean", "min", "max", "ci95")} | {
           "level": r["gain"].get("level", 0.95)} if r["gain"] else None),
       "slowdowns_per_seed": r["slowdowns"], "seed_ids": r["seed_ids"],
       "exploratory": r["exploratory"], "leave_one_out": r["leave_one_out"],
       "after_protocol": r["after_protocol"],
       "muon_gain": {"per_seed": {str(k): v for k, v in r["muon_gain"].items()},
                     "mean": r["muon_interval"] and r["muon_interval"]["mean"]},
       "rotation_over_muon": {str(k): v for k, v in r["rotation_over_muon"].items()}}
      for r in rows]}
  return write_summary(out, summary)


def main(argv=None):
  parser = argparse.ArgumentParser(prog="python -m experiments.studies.horizon", description=__doc__,
                                   formatter_class=argparse.RawDescriptionHelpFormatter)
  parser.add_argument("sources", nargs="+", help=f"study folders holding {curves.FILE}")
  parser.add_argument("--out", required=True, help="where to write report.md, horizon.png, summary.json")
  args = parser.parse_args(argv)
  rows, hosts, revisions = horizon_rows(args.sources)
  if not rows:
    raise ValueError(f"no main runs in {args.sources}")
  command = "python -m experiments.studies.horizon " + " ".join(sys.argv[1:] if argv is None else argv)
  summary = write(rows, hosts, pathlib.Path(args.out), command, revisions)
  print(f"wrote {args.out}/report.md: " + "; ".join(
      f"T = {g['T']}: gain {g['gain']['mean']:.2f} ({g['verdict']})" if g["gain"]
      else f"T = {g['T']}: no gain" for g in summary["gain_vs_horizon"]))
  return summary


if __name__ == "__main__":
  cli.exit_process(cli.run(main))

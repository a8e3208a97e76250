"""``python -m experiments.studies.pipedream_2bw SOURCE [SOURCE ...] --out DIR``: PipeDream 1F1B against
PipeDream-2BW, momentum under 2BW, and both papers' claims in one table.

Each SOURCE is a study folder holding the curves of sweeps (``experiments.report.curves``); their main runs
are merged by name (a run in several sources counts once). A run at P > 1 belongs to its schedule
and momentum ``b1``; a run at P = 1 (no pipeline: one run for both schedules) to every schedule at
its ``b1``. Per schedule and P > 1, at each method's own momentum, every number is computed per seed
from the runs at P = 1 and that P (``metrics.study_table``, as a study's own report):

- each method's final-loss gap (final smoothed training loss at P minus at P = 1, paired by seed)
  and headline slowdown, with Student's t 95% intervals;
- the rotation paper's claims at that P (``claims.main_claims``, decided under docs/protocol.md)
  and the follow-up's "Muon degrades less than AdamW" (Zmushko et al., arXiv 2606.30634, which
  measured it under PipeDream-2BW).

Momentum: under 2BW at the largest P, the gap of AdamW (PipeDream) and rotation per ``b1``, and the
follow-up's "higher momentum degrades less" (per seed: the gap at b1 = 0.9 minus the gap at the
largest b1, > 0). Its third claim, an error-feedback correction recovering 50-90% of the gap, is
listed as not tested: the rule (its section 3) is not in the text available to this project.

Writes ``report.md``, ``gaps.png``, ``summary.json`` (``{"command", "hosts", "gaps": [{"schedule",
"P", "method", "b1", "gap": {"mean", "min", "max", "ci95"}, "seeds"}], "claims": [...]}``) and
``curves.json.xz`` with every run but those of the ``--refer`` sources (published elsewhere): so
``python -m experiments.studies.pipedream_2bw OUT --refer ... --out OUT`` rebuilds the study from
committed curves (``docs/results/schedules`` reads its 1F1B runs at P = 1 and 16 from ``docs/results/cpu``).
"""

from __future__ import annotations

import argparse
import pathlib
import sys

from experiments import cli
from experiments.report import claims as claims_lib
from experiments.report import curves, metrics, plots
from experiments.report.tables import curves_by, seed_tables
from experiments.studies import write_summary

PAPER = "arXiv 2606.30634"
NAMES = {"1f1b": "1F1B", "2bw": "2BW"}
MOMENTUM_METHODS = ("pipedream", "rotation")
# The rows of the claims at a glance: (the start of the claim as ``claims.main_claims`` words it,
# the row's name, the format of its number).
GLANCE = (("rotation slows down least", "rotation slows down least from P = 1 (smallest baseline's "
           "slowdown over rotation's, > 1)", "{:.2f}"),
          ("rotation's lead over the best baseline grows", "rotation's lead grows with staleness "
           "(staleness gain, > 1)", "{:.2f}"),
          ("rotation needs fewer iterations", "rotation needs fewer iterations than the best baseline "
           "(percent, > 0)", "{:+.1f}%"),
          ("Muon degrades less than AdamW", "Muon degrades less than AdamW (AdamW's final-loss gap minus "
           "Muon's, > 0)", "{:+.3f}"),
          ("higher momentum degrades less under 2BW: pipedream", "more momentum shrinks AdamW's gap (gap "
           "at b1 0.9 minus at the largest b1, > 0)", "{:+.3f}"),
          ("higher momentum degrades less under 2BW: rotation", "more momentum shrinks rotation's gap "
           "(as above)", "{:+.3f}"))


def merged_runs(sources, methods=None) -> tuple[list, int, dict, list]:
  """The main runs of every source (of ``methods`` only, if given), once each (``curves.merge``:
  every source's window must agree); the study window; the run names each source holds; the sweeps
  that made them."""
  data = curves.merge(sources)
  held = {source: {r["name"] for r in curves.read(source)["runs"]} for source in sources}
  runs = [r for r in data["runs"]
          if r["group"] == "main" and (not methods or r["config"]["method"] in methods)]
  return runs, data["meta"]["window"], held, data["meta"]["sweeps"]


def setting_runs(runs, schedule: str, b1, stages: int) -> list:
  """The runs at P = 1 and at ``stages`` of one schedule and momentum (``None``: each method's own)."""
  return [r for r in runs if r["config"].get("b1") == b1 and (
      r["config"]["stages"] == 1 or (r["config"]["stages"] == stages
                                     and r["config"].get("schedule", "1f1b") == schedule))]


def gaps(tables, stages: int) -> dict:
  """``{method: per-seed final-loss gap at stages minus P = 1}`` (a string where a run diverged)."""
  out = {}
  for rows in tables:
    at = {(r["method"], r["stages"]): r["final"] for r in rows}
    for method in sorted(m for m, p in at if p == stages and (m, 1) in at):
      a, b = at[(method, 1)], at[(method, stages)]
      out.setdefault(method, []).append(b - a if a is not None and b is not None else "a run diverged")
  return out


def val_gaps(runs, method: str, stages: int, seeds) -> list:
  """Per seed: final validation loss at ``stages`` minus at P = 1 (a string where one is missing)."""
  final = {(r["config"]["stages"], r["config"]["seed"]): metrics.final_val(r) for r in runs
           if r["config"]["method"] == method}
  out = []
  for seed in seeds:
    a, b = final.get((1, seed)), final.get((stages, seed))
    out.append(b - a if a is not None and b is not None else "no final validation loss")
  return out


def study(runs, window: int) -> tuple[list, list, list, dict]:
  """``(rows, momentum rows, claims, glance)``: one row per schedule, P and method at each method's
  own momentum; one per b1 and method of the momentum study; the claims; the claims of ``GLANCE``
  by ``(row, schedule, P)``."""
  schedules = sorted({r["config"].get("schedule", "1f1b") for r in runs if r["config"]["stages"] > 1})
  rows, claims, glance = [], [], {}
  for schedule in schedules:
    depths = sorted({r["config"]["stages"] for r in runs if r["config"]["stages"] > 1
                     and r["config"].get("schedule", "1f1b") == schedule and r["config"].get("b1") is None})
    for p in depths:
      chosen = setting_runs(runs, schedule, None, p)
      curves_of = curves_by(chosen)
      tables = seed_tables(curves_of, window)
      if not tables:
        continue
      slow = {r["method"]: r for r in metrics.aggregate(tables) if r["stages"] == p}
      seeds = sorted(set.intersection(*(set(v) for v in curves_of.values())))  # seed_tables' seeds
      for method, values in gaps(tables, p).items():
        val = val_gaps(chosen, method, p, seeds)
        rows.append({"schedule": schedule, "P": p, "method": method, "b1": None, "gaps": values,
                     "gap": claims_lib.judge(values, 0.0)[1], "slowdown": slow.get(method),
                     "val_gaps": val, "val_gap": claims_lib.judge(val, 0.0)[1]})
      rotation_tables, muon_tables = claims_lib.claim_tables(curves_of, window)
      for c in claims_lib.main_claims(rotation_tables, f" ({NAMES[schedule]}, P = {p})", muon_tables):
        claims.append(c)
        row = next((i for i, (start, _, _) in enumerate(GLANCE) if c.claim.startswith(start)), None)
        if row is not None:
          glance[(row, schedule, p)] = c
  momentum, top = [], max((r["config"]["stages"] for r in runs if r["config"].get("b1") is not None),
                          default=None)
  if top is not None:
    values = sorted({r["config"]["b1"] for r in runs if r["config"].get("b1") is not None})
    per = {}
    for b1 in [None] + values:
      tables = seed_tables(curves_by(setting_runs(runs, "2bw", b1, top)), window)
      for method, v in gaps(tables, top).items():
        if method in MOMENTUM_METHODS:
          per[(method, b1)] = v
          momentum.append({"schedule": "2bw", "P": top, "method": method, "b1": 0.9 if b1 is None else b1,
                           "gaps": v, "gap": claims_lib.judge(v, 0.0)[1]})
    for method in MOMENTUM_METHODS:
      low, high = per.get((method, None)), per.get((method, values[-1]))
      if low is None or high is None:
        continue
      diffs = [a - b if not isinstance(a, str) and not isinstance(b, str) else "a run diverged"
               for a, b in zip(low, high)]
      claims.append(claims_lib.check(
          f"higher momentum degrades less under 2BW: {method}, b1 0.9 against {values[-1]:g} (final-loss "
          f"gap to P = 1 at P = {top})", f"the higher b1, the smaller the gap ({PAPER})", diffs, 0.0,
          spec="{:+.3f}", context=f"gap at b1 0.9 minus gap at b1 {values[-1]:g}: "))
      glance[(4 + MOMENTUM_METHODS.index(method), "2bw", top)] = claims[-1]
  claims.append(claims_lib.Claim(
      "an error-feedback correction recovers 50-90% of the remaining gap", f"50-90% ({PAPER})",
      "not tested: the rule (the paper's section 3) is not in the text available here", "inconclusive",
      "not measured"))
  return rows, momentum, claims, glance


def decided_study(runs, window: int) -> tuple[list, list, list, dict]:
  """``study`` with its claims decided under docs/protocol.md (one family: Holm, the window rule)."""
  rows, momentum, claims, glance = study(runs, window)
  other = {"half": max(1, window // 2), "double": 2 * window}
  decided = claims_lib.protocol(lambda label: claims if label == "reported" else study(runs, other[label])[2])
  by_text = {c.claim: c for c in decided}
  return rows, momentum, decided, {k: by_text[c.claim] for k, c in glance.items()}


def _cell(values, interval) -> str:
  return claims_lib.describe(values, interval, "{:+.3f}")


def glance_section(glance: dict) -> list:
  """Both papers' claims, one row per claim and one column per schedule and P: the verdict, the
  mean of the per-seed quantity (geometric for ratios) and its interval at the claim's Holm level."""
  settings = sorted({(s, p) for _, s, p in glance})
  lines = ["## Both papers' claims at a glance", "",
           "Verdict under docs/protocol.md, mean over seeds (geometric for ratios) and the interval at "
           "the claim's Holm level (the claims table below has the evidence and the p-values); "
           "the rotation paper's claims are its 1F1B claims, checked under both schedules. The "
           f"follow-up's ({PAPER}) correction is not tested: its rule is not in the text available here.",
           "", "| claim | " + " | ".join(f"{NAMES[s]}, P = {p}" for s, p in settings) + " |",
           "|---|" + "---|" * len(settings)]
  for row, (_, name, spec) in enumerate(GLANCE):
    cells = []
    for s, p in settings:
      c = glance.get((row, s, p))
      cells.append("" if c is None else claims_lib.glance(c, spec))
    if any(cells):
      lines.append(f"| {name} | " + " | ".join(cells) + " |")
  return lines + [""]


def write(rows, momentum, claims, glance, hosts, out: pathlib.Path, command: str, sweeps=()) -> dict:
  out.mkdir(parents=True, exist_ok=True)
  lines = ["# Two asynchronous schedules: PipeDream 1F1B and PipeDream-2BW", "",
           f"- made by `{command}`",
           "- runs from " + ("one CPU: " if len(hosts) == 1 else "**more than one CPU**: ")
           + curves.hosts_text(hosts),
           "- 1F1B: stage k lags P - 1 - k updates; 2BW: every stage one update behind whatever P "
           "(gradients at W(t - 1)); P = 1 is the same synchronous run for both",
           *[f"- runs of `{c}`" for c in sweeps], "",
           "## Final-loss gap to P = 1", "",
           "Final smoothed training loss at P minus at P = 1, paired by seed: mean [min, max] over "
           "seeds and Student's t 95% interval; each method at its own momentum. Beside it the same "
           "for the final validation loss (the follow-up's measure; after the last update, 4 held-out "
           "batches). The headline slowdown is the study's (the median over loss levels of "
           "t_P / t_1).", "",
           "| schedule | P | method | seeds | final-loss gap | validation-loss gap | headline slowdown |",
           "|---|---|---|---|---|---|---|"]
  for r in rows:
    s = r["slowdown"]
    slow = "" if s is None else claims_lib.describe(
        s["slowdown_levels_seeds"], metrics.interval(s["slowdown_levels_seeds"]))
    lines.append(f"| {NAMES[r['schedule']]} | {r['P']} | {r['method']} | {len(r['gaps'])} | "
                 f"{_cell(r['gaps'], r['gap'])} "
                 f"| {_cell(r['val_gaps'], r['val_gap'])} | {slow} |")
  if momentum:
    lines += ["", "## Momentum under 2BW", "",
              "AdamW (PipeDream) and rotation with first-moment decay b1 at P = 1 and P "
              f"= {momentum[0]['P']} (2BW); gap as above.", "",
              "| method | b1 | final-loss gap |", "|---|---|---|"]
    lines += [f"| {m['method']} | {m['b1']:g} | {_cell(m['gaps'], m['gap'])} |"
              for m in sorted(momentum, key=lambda m: (m["method"], m["b1"]))]
  lines += [""] + glance_section(glance)
  lines += claims_lib.section(claims, heading="Both papers' claims, checked")
  lines += ["![final-loss gap to P = 1 per schedule and method](gaps.png)", ""]
  (out / "report.md").write_text("\n".join(lines))
  plots.schedule_gaps(rows, out / "gaps.png")
  keep = lambda r: {"schedule": r["schedule"], "P": str(r["P"]), "method": r["method"], "b1": r["b1"],
                    "seeds": len(r["gaps"]), "gap": ({k: r["gap"][k] for k in ("mean", "min", "max", "ci95")}
                                                     if r["gap"] else None)}
  summary = {"command": command, "hosts": hosts, "gaps": [keep(r) for r in rows + momentum],
             "claims": [c.summary() for c in claims]}
  return write_summary(out, summary)


def main(argv=None):
  parser = argparse.ArgumentParser(prog="python -m experiments.studies.pipedream_2bw", description=__doc__,
                                   formatter_class=argparse.RawDescriptionHelpFormatter)
  parser.add_argument("sources", nargs="+", help=f"study folders holding {curves.FILE}, whose runs "
                      "--out keeps")
  parser.add_argument("--refer", nargs="+", default=[], help="study folders whose runs are read but "
                      "not copied into --out (published elsewhere)")
  parser.add_argument("--out", required=True, help="where to write report.md, gaps.png, summary.json")
  parser.add_argument("--methods", nargs="+", help="keep only these methods' runs (so that every "
                      "schedule compares the same methods)")
  args = parser.parse_args(argv)
  runs, window, held, sweeps = merged_runs(args.sources + args.refer, args.methods)
  rows, momentum, claims, glance = decided_study(runs, window)
  if not rows:
    raise ValueError(f"no runs at P > 1 with their P = 1 runs in {args.sources}")
  command = "python -m experiments.studies.pipedream_2bw " + " ".join(sys.argv[1:] if argv is None else argv)
  out = pathlib.Path(args.out)
  summary = write(rows, momentum, claims, glance, curves.hosts_of(runs), out, command, sweeps)
  # The runs of the --refer sources stay there; every other run goes into --out, so that
  # ``--out``'s folder as the source, with the same --refer, rebuilds the study from committed curves.
  elsewhere = set().union(*(held[source] for source in args.refer))
  curves.write(out / curves.FILE, {"window": window, "command": command, "sweeps": sweeps},
               [r for r in runs if r["name"] not in elsewhere])
  print(f"wrote {args.out}/report.md: " + "; ".join(
      f"{c['verdict']}: {c['claim']}" for c in summary["claims"]))
  return summary


if __name__ == "__main__":
  cli.exit_process(cli.run(main))

"""``python -m experiments.studies.lag SOURCE [SOURCE ...] --out DIR``: the estimation-lag study.

Rotation's ``L``, ``R`` statistics are exponential averages with decay ``shampoo_beta`` (default
``b2`` = 0.999, a memory of about 1,000 steps). Under a delay, a long memory may lag a moving
eigenbasis; this study measures rotation's slowdown from P = 1 to the largest P per decay, seeds
paired across decays (docs/protocol.md, "estimation lag").

Each SOURCE is a folder holding ``curves.json.xz`` (a sweep's ``--finished-only --publish`` folder,
one per decay, or this study's own ``--out``); their rotation runs are merged (``curves.merge``) and
grouped by decay. Per decay and seed: the headline slowdown at the method's own levels
(``metrics.study_table``), the final validation loss at P = 1 and at the largest P. The claims, one
family under the protocol (``claims.protocol``: log scale, Holm, the window rule): for each decay
below 0.999, "it slows rotation down less than 0.999" (per seed, 0.999's slowdown over its). The
decay the protocol carries to the long horizons: the lowest seed-mean slowdown among the decays
whose P = 1 final validation loss is not worse than 0.999's beyond the seeds' 95% interval (the
per-seed difference's interval reaches zero or below). A long horizon's report (``--fixed DECAY``)
tests the decay carried there and chooses nothing.

Writes ``report.md``, ``lag.png`` (slowdown per decay, each seed a point) and ``summary.json``
(``{"decays": [{"decay", "seeds", "slowdown", "per_seed", "val_p1", "val_top", ...}], "claims",
"chosen"}``), and the merged runs as this folder's ``curves.json.xz``, except those of the
``--refer`` folders (published elsewhere, e.g. the main study's 0.999 runs): ``--out`` as the only
SOURCE, with the same ``--refer``, rebuilds the study.
"""

from __future__ import annotations

import argparse
import pathlib

from experiments import cli
from experiments.harness.config import optimizer_of
from experiments.report import claims, curves, metrics, plots
from experiments.report.tables import curves_by, seed_tables
from experiments.studies import write_summary

REFERENCE = 0.999  # the paper's decay (b2)


def decay_of(config) -> float:
  """A rotation run's statistics decay, as its recorded optimizer applies it."""
  return float(optimizer_of(config).statistics_decay)


def rotation_runs(sources) -> tuple[dict, list]:
  """``(merged curves data, rotation's main runs)``."""
  data = curves.merge(sources)
  runs = [r for r in data["runs"] if r["group"] == "main" and r["config"]["method"] == "rotation"]
  if not runs:
    raise ValueError(f"no rotation runs in {[str(s) for s in sources]}")
  return data, runs


def decay_rows(runs, window: int) -> list:
  """One row per decay: its seeds, per-seed slowdown at the largest P, final validation losses."""
  rows = []
  for decay in sorted({decay_of(r["config"]) for r in runs}):
    mine = [r for r in runs if decay_of(r["config"]) == decay]
    tables = seed_tables(curves_by(mine), window)
    if not tables:
      continue
    top = max(r["stages"] for r in tables[0])
    seeds = sorted(set.intersection(*(set(v) for v in curves_by(mine).values())))
    slow = [next(r["slowdown_levels"] for r in t if r["stages"] == top) for t in tables]
    val = lambda p: [metrics.final_val(next(r for r in mine if r["config"]["seed"] == s
                                            and r["config"]["stages"] == p)) for s in seeds]
    rows.append({"decay": decay, "P": top, "seeds": seeds, "per_seed": slow,
                 "slowdown": metrics.interval(slow, log=True), "val_p1": val(1), "val_top": val(top)})
  return rows


def _paired(rows, decay, field):
  """Per seed shared with the reference: ``(reference's values, decay's values)``."""
  ref = next(r for r in rows if r["decay"] == REFERENCE)
  mine = next(r for r in rows if r["decay"] == decay)
  seeds = [s for s in mine["seeds"] if s in ref["seeds"]]
  at = lambda row: [row[field][row["seeds"].index(s)] for s in seeds]
  return at(ref), at(mine), seeds


def lag_claims(rows) -> list:
  """Per decay below the reference: "slows rotation down less than 0.999", per seed the reference's
  slowdown over the decay's (> 1), log scale, uncorrected (``claims.protocol`` decides them)."""
  if not any(r["decay"] == REFERENCE for r in rows):
    return []
  out = []
  for row in rows:
    if row["decay"] >= REFERENCE:
      continue
    ref, mine, seeds = _paired(rows, row["decay"], "per_seed")
    values = [a / b if a is not None and b is not None else "a run shares no levels"
              for a, b in zip(ref, mine)]
    out.append(claims.check(f"statistics decay {row['decay']:g} slows rotation down less than "
                            f"{REFERENCE:g} (P = {row['P']})", "beyond the paper (it uses b2 = 0.999)",
                            values, 1.0, log=True,
                            context=f"{REFERENCE:g}'s slowdown over {row['decay']:g}'s, seeds {seeds}: "))
  return out


def p1_differences(rows) -> dict:
  """Per decay other than the reference: the interval of its P = 1 final validation loss minus
  0.999's over the seeds they share (``metrics.interval``), ``None`` where there is none; nothing
  without the reference."""
  out = {}
  if not any(r["decay"] == REFERENCE for r in rows):
    return out
  for row in rows:
    if row["decay"] != REFERENCE:
      ref, mine, _ = _paired(rows, row["decay"], "val_p1")
      iv = metrics.interval([b - a if a is not None and b is not None else None for a, b in zip(ref, mine)])
      out[row["decay"]] = iv if iv is not None and iv["ci95"] is not None else None
  return out


def _ci(iv) -> str:
  return f"{iv['mean']:+.4f} (CI {iv['ci95'][0]:+.4f} to {iv['ci95'][1]:+.4f})"


def _difference(iv) -> str:
  if iv is None:
    return "no interval of its P = 1 validation loss against 0.999's"
  return f"P = 1 validation loss minus 0.999's {_ci(iv)}"


def chosen_decay(rows) -> tuple[float | None, dict]:
  """The protocol's rule (module docstring): ``(decay, {decay: why eligible or not})``."""
  if not any(r["decay"] == REFERENCE for r in rows):
    return None, {}
  why, excluded = {REFERENCE: "the reference"}, set()
  for decay, iv in p1_differences(rows).items():
    if iv is None:
      why[decay] = f"not eligible: {_difference(iv)}"
    elif iv["ci95"][0] > 0:
      why[decay] = f"not eligible: P = 1 validation loss worse than 0.999's, difference {_ci(iv)}"
    else:
      why[decay] = f"eligible: {_difference(iv)}"
      continue
    excluded.add(decay)
  eligible = [r for r in rows if r["decay"] not in excluded and r["slowdown"] is not None]
  best = min(eligible, key=lambda r: r["slowdown"]["mean"], default=None)
  return (best["decay"] if best else None), why


def study(runs, window: int, fixed: float | None = None) -> tuple[list, list, float | None, dict]:
  """``(rows, claims under the protocol, chosen decay, eligibility)``; with ``fixed`` (a long
  horizon's report, testing the decay the protocol carried from T = 2,400) nothing is chosen and each
  decay's entry is its P = 1 comparison with 0.999."""
  rows = decay_rows(runs, window)
  if fixed is not None and fixed not in {r["decay"] for r in rows}:
    raise ValueError(f"--fixed {fixed:g}: no rotation runs at that decay (decays: "
                     f"{sorted(r['decay'] for r in rows)})")
  other = {"reported": window, "half": max(1, window // 2), "double": 2 * window}
  decided = claims.protocol(lambda label: lag_claims(rows if label == "reported"
                                                     else decay_rows(runs, other[label])))
  if fixed is None:
    decay, why = chosen_decay(rows)
    return rows, decided, decay, why
  why = {d: _difference(iv) for d, iv in p1_differences(rows).items()} | {REFERENCE: "the reference"}
  return rows, decided, None, why


def _values(values, spec="{:.4f}") -> str:
  iv = metrics.interval(values)
  return claims.describe(values, iv, spec)


def write(rows, decided, decay, why, data, out: pathlib.Path, command: str,
          fixed: float | None = None) -> dict:
  out.mkdir(parents=True, exist_ok=True)
  hosts = curves.hosts_of(data["runs"])
  window = data["meta"]["window"]
  lines = ["# Estimation lag: rotation's slowdown per statistics decay", "",
           f"- made by `{command}`",
           "- the sweeps: " + "; ".join(f"`{c}`" for c in data["meta"]["sweeps"]),
           "- runs from " + ("one CPU: " if len(hosts) == 1 else "**more than one CPU**: ")
           + curves.hosts_text(hosts),
           f"- smoothing: centred window of {2 * metrics.half_window(window) + 1} steps", "",
           "Per decay of rotation's L, R statistics: the headline slowdown from P = 1 (per seed, the "
           "median over loss levels of the iteration ratio; geometric mean [min, max] and the t "
           "interval of the mean log), the final validation loss at P = 1 and at the largest P (mean "
           "[min, max] and 95% interval).", "",
           "| decay | memory (steps) | seeds | slowdown | final val P = 1 | final val at P | "
           + ("carried to the long horizons? |" if fixed is None else "P = 1 against 0.999 |"),
           "|---|---|---|---|---|---|---|"]
  for r in rows:
    lines.append(f"| {r['decay']:g} | {1 / (1 - r['decay']):.0f} | {len(r['seeds'])} | "
                 f"{claims.describe(r['per_seed'], r['slowdown'])} | {_values(r['val_p1'])} | "
                 f"{_values(r['val_top'])} | {'**chosen**; ' if r['decay'] == decay else ''}"
                 f"{why.get(r['decay'], '')} |")
  lines += ["", "The rule (docs/protocol.md): the lowest seed-mean slowdown among the decays whose P = 1 "
            "final validation loss is not worse than 0.999's beyond the seeds' 95% interval."
            if fixed is None else f"The decay {fixed:g} was fixed in advance (docs/protocol.md: the rule "
            "chose it at T = 2,400 and carried it to the long horizons); this report tests it.", ""]
  lines += claims.section(decided, heading="Claims, checked")
  lines += ["![slowdown per decay](lag.png)", ""]
  (out / "report.md").write_text("\n".join(lines))
  horizons = ", ".join(f"{t:,}" for t in sorted({r["config"]["steps"] for r in data["runs"]}))
  plots.series({f"seed {s}": [(1 / (1 - r["decay"]), r["per_seed"][r["seeds"].index(s)])
                              for r in rows if s in r["seeds"]]
                for s in sorted({s for r in rows for s in r["seeds"]})},
               out / "lag.png",
               f"rotation's slowdown from P = 1 to P = {rows[0]['P']} per statistics memory, T = {horizons}",
               "memory 1 / (1 - decay), steps", "slowdown")
  summary = {"command": command, "sweeps": data["meta"]["sweeps"], "hosts": hosts, "chosen": decay,
             **({} if fixed is None else {"fixed": fixed}),
             "decays": [{"decay": r["decay"], "P": r["P"], "seeds": r["seeds"], "per_seed": r["per_seed"],
                         "slowdown": r["slowdown"], "val_p1": r["val_p1"], "val_top": r["val_top"],
                         "eligibility": why.get(r["decay"])} for r in rows],
             "claims": [c.summary() for c in decided]}
  return write_summary(out, summary)


def main(argv=None):
  parser = argparse.ArgumentParser(prog="python -m experiments.studies.lag", description=__doc__,
                                   formatter_class=argparse.RawDescriptionHelpFormatter)
  parser.add_argument("sources", nargs="+", help=f"folders holding {curves.FILE}")
  parser.add_argument("--refer", nargs="+", default=[], help=f"folders holding {curves.FILE} whose "
                      "runs are read but not copied into --out (published elsewhere)")
  parser.add_argument("--fixed", type=float, help="the decay fixed in advance (a long horizon's report: "
                      "the protocol's rule chose it at T = 2,400); nothing is chosen")
  parser.add_argument("--out", required=True, help="where to write report.md, lag.png, summary.json "
                      f"and the merged {curves.FILE}")
  args = parser.parse_args(argv)
  data, runs = rotation_runs(args.sources + args.refer)
  rows, decided, decay, why = study(runs, data["meta"]["window"], args.fixed)
  if not rows:
    raise ValueError(f"no decay in {args.sources} has rotation at P = 1 and at P > 1 on a shared seed")
  out = pathlib.Path(args.out)
  refer = " --refer " + " ".join(args.refer) if args.refer else ""
  fixed = f" --fixed {args.fixed:g}" if args.fixed is not None else ""
  command = f"python -m experiments.studies.lag {args.out}{refer}{fixed} --out {args.out}"  # rebuilds it
  summary = write(rows, decided, decay, why, data, out, command, args.fixed)
  elsewhere = {r["name"] for source in args.refer for r in curves.read(source)["runs"]}
  curves.write(out / curves.FILE, data["meta"], [r for r in runs if r["name"] not in elsewhere])
  chosen = f"chosen decay {decay}; " if args.fixed is None else ""
  print(f"wrote {out / 'report.md'}: {chosen}" + "; ".join(
      f"{c['verdict']}: {c['claim']}" for c in summary["claims"]))
  return summary


if __name__ == "__main__":
  cli.exit_process(cli.run(main))

"""``python -m experiments.studies.long_horizon SOURCE... --rates SUMMARY --out DIR``: the long
horizon's confirmatory verdicts (docs/protocol.md amendment 8).

SOURCE folders hold ``curves.json.xz`` of the confirmatory runs (T = 38,400, seeds 6-11); SUMMARY is
the rate tuning's ``summary.json`` (``experiments.studies.tuned_rates``), whose ``chosen`` rate of each
(method, P) picks the run read for it. Per seed, from that seed's runs alone (``metrics.study_table``,
the baselines PipeDream and Nesterov): rotation's staleness gain over the best baseline at P = 16 (the
primary endpoint, a family of one), and the two secondary claims (one Holm family): rotation's gain
over Muon's gain over the same baseline (S1, "is the trend rotation's?") and Muon's gain (S2, the
control), all > 1 on the log scale, under the window rule. A seed complete on no single CPU is left
out (the amendment: it is trained again, whole, on one); with seeds on more than one CPU the CPU
is a fixed blocking factor of every test. Beside each verdict: the leave-one-seed-out readings.
Amendment 9: a seed counts on the one CPU type that holds all its runs (its runs on another type are
published and not read).

Writes ``report.md`` and ``summary.json`` (``claims``: each claim's verdict, interval, p and
``leave_one_out``, drawn only once all six seeds are counted; ``seeds``: the per-seed numbers so
far; ``left_out``: what each seed not counted holds) and, per CPU type, every confirmatory run of
the SOURCEs on that type as
``OUT/confirmatory-<cpu>/curves.json.xz`` (runs read or not: amendment 9 publishes them all; a run
at a rate the verdicts never read keeps its training loss as 100-step block means, as the tuning's
runs do), from which the printed command rebuilds ``OUT``. A queue passes the published folders
beside its own finished runs; a run name held in both is the same run.
"""

from __future__ import annotations

import argparse
import json
import math
import pathlib

from experiments import cli
from experiments.harness.methods import BASELINES
from experiments.report import claims, curves, metrics
from experiments.report.tables import curve_of
from experiments.studies import lr_grid, tuned_rates, write_summary

STEPS, TOP = 38400, 16
METHODS = ("pipedream", "nesterov", "rotation", "muon")
SEEDS = tuple(range(6, 12))
PRIMARY = "rotation's staleness gain over the best baseline (P = 16, T = 38,400)"
S1 = "rotation's gain over Muon's gain over the same baseline (is the trend rotation's?)"
S2 = "Muon's staleness gain over the best baseline (the control)"
SCALE = {"reported": 1.0, "half": 0.5, "double": 2.0}
DIFFERENCES = (("muon", "rotation"), ("rotation", "nesterov"), ("rotation", "pipedream"))


def chosen_rates(summary: dict) -> dict:
  """``{(method, P): rate}`` from the tuning summary; an error until every rate is chosen."""
  if not summary.get("chosen"):
    raise ValueError("the rate tuning has not chosen every rate yet (tuned_rates' summary.json: chosen)")
  return {(m, int(p)): r for m, by_p in summary["chosen"].items() for p, r in by_p.items()}


def read_at(run: dict, rates: dict) -> bool:
  """Whether ``run`` is one the verdicts read: a main run of T = 38,400 at its (method, P)'s chosen
  rate (a sweep at one method's P = 16 rate also trains its P = 1, unread where the P = 1 rate
  differs)."""
  c = run["config"]
  key = (c["method"], c["stages"])
  return (c["steps"] == STEPS and run["group"] == "main" and key in rates
          and math.isclose(c["lr"], rates[key], rel_tol=1e-9))


def by_seed(runs, rates: dict) -> tuple[dict, dict]:
  """``({seed: {(method, P): run}}`` of the runs at their chosen rate, ``{seed: why it is left out}``).
  Amendment 9: a seed counts on the one CPU type that holds all its runs; its runs on another type
  are not read, and a seed complete on no type, or on two, is left out."""
  picked = {}  # seed -> CPU -> {(method, P): run}
  for r in runs:
    c = r["config"]
    key = (c["method"], c["stages"])
    if read_at(r, rates):
      picked.setdefault(c["seed"], {}).setdefault(r["host"]["cpu"], {})[key] = r
  seeds, left = {}, {}
  for s in sorted(picked):
    complete = sorted(cpu for cpu, got in picked[s].items() if set(got) == set(rates))
    if len(complete) == 1:
      seeds[s] = picked[s][complete[0]]
    elif complete:
      left[s] = f"complete on {' and '.join(complete)} (amendment 9 counts one CPU type per seed)"
    else:
      left[s] = "; ".join(f"{len(got)} of {len(rates)} runs" + (f" on {cpu}" if len(picked[s]) > 1 else "")
                          for cpu, got in sorted(picked[s].items()))
  return seeds, left


def per_seed(runs_: dict, window: int) -> dict:
  """One seed's slowdowns and gains at P = 16 (``None`` where a run diverged or shares no levels)."""
  table = metrics.study_table({k: curve_of(r) for k, r in runs_.items()}, BASELINES, window)
  row = {r["method"]: r for r in table if r["stages"] == TOP}
  gain = lambda m: row[m]["staleness_gain"]
  ratio = gain("rotation") / gain("muon") if gain("rotation") and gain("muon") else None
  return {"cpu": next(iter(runs_.values()))["host"]["cpu"], "best_baseline": row["rotation"]["best_baseline"],
          "slowdown": {m: row[m]["slowdown_levels"] for m in METHODS}, "gain": gain("rotation"),
          "muon_gain": gain("muon"), "rotation_over_muon": ratio}


def verdicts(seeds: dict, window: int) -> list[claims.Claim]:
  """The primary claim (its own family), then S1 and S2 (one Holm family), under the window rule."""
  cpus = [next(iter(r.values()))["host"]["cpu"] for r in seeds.values()]
  blocks = cpus if len(set(cpus)) > 1 else None
  missing = "a run diverged or shares no levels"

  def values(label, field):
    w = max(1, int(window * SCALE[label]))
    return [missing if (v := per_seed(r, w)[field]) is None else v for r in seeds.values()]

  def primary(label):
    return [claims.check(PRIMARY, "> 1", values(label, "gain"), 1.0, log=True, blocks=blocks)]

  def secondary(label):
    return [claims.check(S1, "> 1", values(label, "rotation_over_muon"), 1.0, log=True, blocks=blocks),
            claims.check(S2, "> 1", values(label, "muon_gain"), 1.0, log=True, blocks=blocks)]
  return claims.protocol(primary) + claims.protocol(secondary)


def study(runs, rates: dict, window: int) -> dict:
  seeds, left = by_seed(runs, rates)
  rows = {s: per_seed(r, window) for s, r in seeds.items()}
  decided = verdicts(seeds, window) if set(seeds) == set(SEEDS) else []  # amendment 8: all six, or none
  cpus = [rows[s]["cpu"] for s in rows]
  blocks = cpus if len(set(cpus)) > 1 else None
  out = []
  for c in decided:
    loo = (claims.leave_one_out(list(rows), list(c.values), 1.0, log=True, blocks=blocks)
           if len(rows) > 2 else [])
    out.append({**c.summary(), "leave_one_out": loo,
                "rests_on_one_seed": [x["left_out"] for x in loo if x["verdict"] != c.verdict]})
  return {"seeds": rows, "left_out": left, "claims": out, "decided": decided, "used": seeds}


def final_validation(seeds: dict) -> dict:
  """Descriptive, not an endpoint of amendment 8 (docs/protocol.md says so): each run's last
  validation loss (step T), per seed, as ``{"loss": {"METHOD P=p": interval}, "degradation":
  {method: interval of P = 16 minus P = 1}, "difference": {"A minus B": interval at P = 16}}``, each
  ``metrics.interval`` (mean, range, Student's t 95% interval) over the seeds, paired within a seed."""
  last = lambda run: run["val_losses"][-1] if run["val_losses"] and run["status"] == "finished" else None
  val = {s: {k: last(r) for k, r in runs_.items()} for s, runs_ in seeds.items()}
  over = lambda f: metrics.interval([f(v) if all(x is not None for x in v.values()) else None
                                     for v in val.values()])
  return {"loss": {f"{m} P={p}": over(lambda v, k=(m, p): v[k]) for m in METHODS for p in (1, TOP)},
          "degradation": {m: over(lambda v, m=m: v[(m, TOP)] - v[(m, 1)]) for m in METHODS},
          "difference": {f"{a} minus {b}": over(lambda v, a=a, b=b: v[(a, TOP)] - v[(b, TOP)])
                         for a, b in DIFFERENCES}}


def one_rate(runs, rates: dict, window: int) -> dict | None:
  """A sensitivity reading, not a verdict of amendment 8: the primary and S1 with every method at
  its P = 16 rate at both P (the P = 1 runs a sweep at that rate trained beside P = 16), every curve
  at ``lr_grid.BLOCK``-step block means; ``None`` unless every seed holds those runs. Each claim is a
  family of one at 95%."""
  same = {(m, p): rates[(m, TOP)] for m, p in rates}
  seeds, _ = by_seed(runs, same)
  if set(seeds) != set(SEEDS):
    return None
  rows = [per_seed({k: curves.at_blocks(r, lr_grid.BLOCK) for k, r in s.items()}, window)
          for s in seeds.values()]
  out = {"rates": {m: same[(m, TOP)] for m in METHODS}, "block": lr_grid.BLOCK}
  for name, field in ((PRIMARY, "gain"), (S1, "rotation_over_muon")):
    out[field] = claims.check(name, "> 1", [r[field] for r in rows], 1.0, log=True).summary()
  return out


def _interval_text(iv: dict | None, spec="{:+.3f}") -> str:
  if iv is None:
    return "-"
  lo, hi = iv["ci95"]
  return (f"{spec.format(iv['mean'])} [{spec.format(iv['min'])}, {spec.format(iv['max'])}], "
          f"95% CI {spec.format(lo)} to {spec.format(hi)}")


def descriptive_lines(finals: dict, same: dict | None) -> list:
  """The report's descriptive sections: final validation losses and the one-rate reading."""
  lines = ["", "## Final validation loss at T = 38,400 (descriptive; not an endpoint of amendment 8)", "",
           "Each (method, P) at its tuned rate; mean [min, max] over the seeds and Student's t 95% interval; "
           "differences paired within a seed.", "",
           "| method | P = 1 | P = 16 | P = 16 minus P = 1 |", "|---|---|---|---|"]
  for m in METHODS:
    lines.append(f"| {m} | {_interval_text(finals['loss'][f'{m} P=1'], '{:.4f}')} | "
                 f"{_interval_text(finals['loss'][f'{m} P={TOP}'], '{:.4f}')} | "
                 f"{_interval_text(finals['degradation'][m])} |")
  gaps = finals["difference"].items()
  lines += ["", "At P = 16: " + "; ".join(f"{k}, {_interval_text(v)}" for k, v in gaps)
            + "."]
  if same:
    lines += ["", "## The rate pairing (a sensitivity reading; not a verdict of amendment 8)", "",
              "The staleness gain divides iteration counts of a method's P = 1 and P = 16 runs, each at its "
              "own rate, so it moves with the pairing of the two rates. With every method at its P = 16 rate "
              "at both P (" + ", ".join(f"{m} {r:g}" for m, r in same["rates"].items())
              + f"), every curve at {same['block']}-step block means, each claim a family of one at 95%:", ""]
    for field in ("gain", "rotation_over_muon"):
      c = same[field]
      lines.append(f"- {c['claim']}: {c['evidence']}; **{c['verdict']}**")
  return lines


def _num(x, spec="{:.2f}") -> str:
  return "-" if x is None else spec.format(x)


def compute(runs, rates: dict) -> dict:
  """Per CPU, what the published runs cost: ``{cpu: {"runs", "read", "seconds"}}`` (``seconds``: the
  training seconds the runs recorded, one core each; a resumed run carries its checkpoint's seconds
  on, and an interrupted process's steps after its last checkpoint are not counted, so the sum is a
  lower bound)."""
  out = {}
  for r in runs:
    row = out.setdefault((r.get("host") or {}).get("cpu"), {"runs": 0, "read": 0, "seconds": 0.0})
    row["runs"] += 1
    row["read"] += read_at(r, rates)
    row["seconds"] += r.get("seconds") or 0.0
  return out


def report(result: dict, rates: dict, command: str, hosts, cost: dict, finals=None, same=None,
           trained=None) -> str:
  lines = ["# The long horizon, confirmatory (protocol amendment 8)", "", f"- made by `{command}`",
           "- runs from " + ("one CPU: " if len(hosts) <= 1 else "**more than one CPU** (a blocking "
                             "factor of every test): ") + curves.hosts_text(hosts),
           *(f"- on {cpu}: {c['runs']} runs published ({c['read']} read by the claims), "
             f"{c['seconds']:,.0f} s of recorded training, {c['seconds'] / 3600:.1f} CPU-hours at one core "
             "a run (a lower bound: steps an interrupted process trained after its last checkpoint are not "
             "counted)" for cpu, c in cost.items()),
           *([f"- the model: {trained['parameters']:,} parameters, {trained['tokens_per_step']} tokens a "
              f"step, {trained['passes']} passes over the {trained['training_tokens']:,} training tokens"]
             if trained else []),
           f"- T = {STEPS}, P = 1 and {TOP}, 1F1B with weight stashing; the confirmatory seeds "
           f"{SEEDS[0]}-{SEEDS[-1]}; every (method, P) at its tuned rate: "
           + ", ".join(f"{m} {rates[(m, 1)]:g} / {rates[(m, TOP)]:g}" for m in METHODS) + " (P = 1 / 16)",
           "- seeds counted: " + (", ".join(map(str, result["seeds"])) or "none yet")
           + ("; left out: " + "; ".join(f"{s}: {w}" for s, w in result["left_out"].items())
              if result["left_out"] else ""), ""]
  if not result["decided"]:
    lines += [f"**Interim: {len(result['seeds'])} of {len(SEEDS)} seeds counted, no verdict.** Amendment 8's "
              "verdicts are drawn on all six seeds at once; until then this report shows each finished "
              "seed's numbers and claims nothing."]
  else:
    lines += ["| claim | threshold | evidence | verdict | leave one seed out (seed: mean, p, verdict) |",
              "|---|---|---|---|---|"]
  for c, s in zip(result["decided"], result["claims"]):
    loo = "; ".join(f"{x['left_out']}: {_num(x['mean'])}, p {_num(x['p'], '{:.2g}')}, {x['verdict']}"
                    for x in s["leave_one_out"]) or "-"
    rests = f" (rests on one seed: {s['rests_on_one_seed']})" if s["rests_on_one_seed"] else ""
    lines.append(f"{c.row()[:-2]}{rests} | {loo} |")
  lines += ["", "Per seed (slowdown from P = 1 to 16 at each run's own levels; gains over the best "
            "baseline):", "", "| seed | CPU | best baseline | slowdown: " + ", ".join(METHODS)
            + " | rotation's gain | Muon's gain | rotation's over Muon's |", "|---|---|---|---|---|---|---|"]
  for s, r in result["seeds"].items():
    lines.append(f"| {s} | {r['cpu']} | {r['best_baseline']} | "
                 + ", ".join(_num(r["slowdown"][m]) for m in METHODS)
                 + f" | {_num(r['gain'])} | {_num(r['muon_gain'])} | {_num(r['rotation_over_muon'])} |")
  if finals is not None:
    lines += descriptive_lines(finals, same)
  return "\n".join(lines + [""])


def main(argv=None) -> dict:
  parser = argparse.ArgumentParser(prog="python -m experiments.studies.long_horizon", description=__doc__,
                                   formatter_class=argparse.RawDescriptionHelpFormatter)
  parser.add_argument("sources", nargs="+", help=f"folders holding {curves.FILE} of the confirmatory runs")
  parser.add_argument("--rates", required=True, help="the rate tuning's summary.json")
  parser.add_argument("--out", required=True, help="where to write report.md, summary.json and the curves")
  args = parser.parse_args(argv)
  rates = chosen_rates(json.loads(pathlib.Path(args.rates).read_text()))
  cpus = curves.cpus_of(args.sources)
  unread = lambda r: not read_at(r, rates)  # stored as block means, as the tuning's runs are
  merged = {cpu: curves.merge(args.sources, block=lr_grid.BLOCK, cpu=cpu, only=unread)
            for cpu in cpus}  # one run name can hold two CPUs' runs
  if not merged:
    raise ValueError(f"no run in {args.sources}")
  out = pathlib.Path(args.out)
  folders = []
  for cpu, m in merged.items():
    folders.append(out / f"confirmatory-{tuned_rates.slug(cpu)}")
    folders[-1].mkdir(parents=True, exist_ok=True)
    curves.write(folders[-1] / curves.FILE, m["meta"], m["runs"])
  window = next(iter(merged.values()))["meta"]["window"]
  result = study([r for m in merged.values() for r in m["runs"]], rates, window)
  command = (f"python -m experiments.studies.long_horizon {' '.join(map(str, folders))} "
             f"--rates {args.rates} --out {out}")
  hosts = curves.hosts_of([r for m in merged.values() for r in m["runs"]])
  everything = [r for m in merged.values() for r in m["runs"]]
  cost = compute(everything, rates)
  finals = final_validation(result["used"]) if result["decided"] else None
  same = one_rate(everything, rates, window) if result["decided"] else None
  first = next(iter(result["used"].values()), {})
  meta = next(iter(merged.values()))["meta"]
  trained = curves.regime(meta, next(iter(first.values()))["config"]) if first else None
  (out / "report.md").write_text(report(result, rates, command, hosts, cost, finals, same, trained))
  summary = {"command": command, "hosts": hosts, "compute": cost,
             "rates": {f"{m} P={p}": r for (m, p), r in rates.items()},
             "seeds": {str(s): r for s, r in result["seeds"].items()},
             "left_out": {str(s): w for s, w in result["left_out"].items()}, "claims": result["claims"],
             **({"final_validation": finals} if finals else {}), **({"one_rate": same} if same else {}),
             **({"regime": trained} if trained else {})}
  summary = write_summary(out, summary)
  print(f"wrote {out}/report.md: " + ("; ".join(f"{c['claim']}: {c['verdict']}" for c in result["claims"])
                                      or f"interim, {len(result['seeds'])} of {len(SEEDS)} seeds counted; "
                                      "no verdict"))
  return summary


if __name__ == "__main__":
  cli.exit_process(cli.run(main))

"""``python -m experiments.studies.memory SOURCE [SOURCE ...] --out DIR``: a staleness-aware memory.

The study of docs/protocol.md's amendment 2: rotation with the paper's statistics decay
(``rotation``), the best uniform decay of the estimation-lag study (``rotation-fast``, 0.95), the
staleness-aware decay fixed in advance (``rotation-stage-decay``: each stage's memory shortened by
its delay, ``rotation.stage_aware_decay``), Nesterov and Muon, at P = 1, 4 and 16, under 1F1B and
2BW, at T = 2,400 and 9,600 steps (``rotation-stage-decay``'s P = 1 run is ``rotation``'s: an
undelayed stage keeps the base decay, ``methods.reference``). Each SOURCE holds ``curves.json.xz`` (a sweep's
``--finished-only --publish`` folder, or this study's ``--out``).

Per schedule and T, each P on the seeds that hold every method's runs at P = 1 and at that P (the
claims need no P = 4 run): each method's headline slowdown from P = 1 (``metrics.study_table``, the
median iteration ratio over its own loss levels) at every P > 1, and its final validation loss at
every P. The claims, at the largest P of each schedule and T (one family under ``claims.protocol``:
log scale for the ratio, Holm over the whole report, the window rule):

- "staleness-aware rotation slows down least of every method, Muon included": per seed, the smallest
  other method's slowdown over ``rotation-stage-decay``'s (> 1);
- "it ends lowest": per seed, the lowest other final validation loss minus its own (> 0).

Amendment 6 (a hypothesis the T = 2,400 results generated): the same two claims about the uniform
short memory (``rotation-fast``), a Holm family of their own judged at the horizons of
``FAST_JUDGED_AT`` (9,600) only, and printed as a description without a verdict at the others.

Writes ``report.md``, ``summary.json`` and the merged runs as ``curves.json.xz`` with each training
loss stored as ``BLOCKS`` means over consecutive blocks (10 steps at T = 2,400, 40 at 9,600: the same
fraction of a run, and of its smoothing window, at every T; ``--out`` as the only SOURCE rebuilds the
study from them).
"""

from __future__ import annotations

import pathlib

from experiments import cli
from experiments.report import claims, curves, metrics
from experiments.report.tables import curves_by, mean_range, seed_tables, spread, with_references
from experiments.studies import write_summary

BLOCKS = 240  # training-loss block means stored per run (the slowdowns are computed from them)
SUBJECT = "rotation-stage-decay"
FAST = "rotation-fast"
METHODS = ("rotation", FAST, SUBJECT, "nesterov", "muon")
FAST_JUDGED_AT = (9600,)  # amendment 6: FAST's claims are judged at these horizons only


def groups(runs) -> dict:
  """``{(schedule, T): runs}`` of the study's methods; a P = 1 run (no schedule: no delay) joins
  every schedule of its T."""
  mine = [r for r in runs if r["config"]["method"] in METHODS and r["group"] == "main"]
  delayed = sorted({(r["config"].get("schedule", "1f1b"), r["config"]["steps"]) for r in mine
                    if r["config"]["stages"] > 1})
  return {(schedule, steps): [r for r in mine if r["config"]["steps"] == steps and (
      r["config"]["stages"] == 1 or r["config"].get("schedule", "1f1b") == schedule)]
          for schedule, steps in delayed}


def _finals(group) -> dict:
  """``{(method, P): {seed: final validation loss or None}}`` (a missing P = 1 entry: its reference's)."""
  out = {}
  for r in group:
    c = r["config"]
    out.setdefault((c["method"], c["stages"]), {})[c["seed"]] = metrics.final_val(r)
  return with_references(out)


def rows_of(group, window: int) -> dict:
  """One schedule and T: per method the per-seed headline slowdown at each P > 1 and final
  validation loss at each P, each P on its own seeds (those holding every method's runs at P = 1
  and at that P: a slowdown needs nothing else), and the claims' per-seed values at the largest P
  (``least``, ``lowest``: the subject's; ``fast_least``, ``fast_lowest``: ``rotation-fast``'s) on
  that P's seeds (``seeds``)."""
  by = curves_by(group)
  stages = sorted({p for _, p in by})
  top = stages[-1] if stages else 1
  methods = [m for m in METHODS if any(k[0] == m for k in by)]
  shared = lambda keys: sorted(set.intersection(*(set(by.get(k, {})) for k in keys))) if keys else []
  seeds_at = {p: shared([(m, q) for m in methods for q in {1, p}]) for p in stages}
  # restricted to seeds_at[p] first: seed_tables intersects only the keys present, so a method with
  # no run at P would otherwise not hold back the others' seeds
  tables = {p: seed_tables({k: {s: v[s] for s in seeds_at[p]} for k, v in by.items() if k[1] in (1, p)},
                           window) for p in stages if p > 1}
  finals = _finals(group)
  at = lambda t, m, p: next((x for x in t if x["method"] == m and x["stages"] == p), None)
  slow = {m: {str(p): [(at(t, m, p) or {}).get("slowdown_levels") for t in tables[p]]
              for p in stages if p > 1} for m in methods}
  final = {m: {str(p): [finals.get((m, p), {}).get(s) for s in seeds_at[p]] for p in stages} for m in methods}
  seeds = seeds_at.get(top, [])

  def lowest(subject, s):
    own = finals.get((subject, top), {}).get(s)
    if own is None:
      return f"{subject} diverged or did not finish"
    vals = [finals.get((m, top), {}).get(s) for m in methods if m != subject]
    vals = [v for v in vals if v is not None]
    return min(vals) - own if vals else "every other method diverged"

  def beats(subject) -> tuple[list, list]:
    """Per seed the smallest other slowdown over ``subject``'s, and the lowest other final loss
    minus its own (empty without the subject's runs or a delayed P)."""
    if subject not in methods or top == 1:
      return [], []
    others = [m for m in methods if m != subject]
    return ([claims.least_ratio(t, "slowdown_levels", subject, others, top) for t in tables[top]],
            [lowest(subject, s) for s in seeds])

  (least, low), (fast_least, fast_low) = beats(SUBJECT), beats(FAST)
  return {"P": top, "seeds": seeds, "seeds_by_P": {str(p): v for p, v in seeds_at.items()},
          "methods": methods, "slowdown": slow, "final_val": final, "least": least, "lowest": low,
          "fast_least": fast_least, "fast_lowest": fast_low}


CLAIMS = {SUBJECT: ("staleness-aware rotation slows down least of every method, Muon included",
                    "staleness-aware rotation ends lowest", "least", "lowest"),
          FAST: ("the uniform short memory (rotation-fast) slows down least of every method, Muon included",
                 "the uniform short memory (rotation-fast) ends lowest", "fast_least", "fast_lowest")}


def study(runs, window: int) -> tuple[dict, list, list]:
  """``({(schedule, T): rows_of}, amendment 3's claims, amendment 6's claims)``, each family decided
  under the protocol."""
  found = groups(runs)
  scale = {"reported": 1.0, "half": 0.5, "double": 2.0}

  rows = {k: rows_of(g, window[k[1]]) for k, g in found.items()}
  rescaled = {}

  def rows_at(key, label):
    if label == "reported":
      return rows[key]
    if (key, label) not in rescaled:
      rescaled[(key, label)] = rows_of(found[key], max(1, int(window[key[1]] * scale[label])))
    return rescaled[(key, label)]

  def family(subject, judged):
    slow_claim, low_claim, least, lowest = CLAIMS[subject]

    def at(label):
      out = []
      for schedule, steps in found:
        r = rows_at((schedule, steps), label)
        if not r[least] or not judged(steps):
          continue
        where = f"({schedule}, T = {steps}, P = {r['P']})"
        out.append(claims.check(f"{slow_claim} {where}", "beyond both papers (> 1)", r[least], 1.0, log=True,
                                context="smallest other method's slowdown over its own: "))
        out.append(claims.check(f"{low_claim} {where}", "beyond both papers (> 0)", r[lowest], 0.0,
                                spec="{:+.4f}", context="lowest other final validation loss minus its own: "))
      return out
    return claims.protocol(at)

  return (rows, family(SUBJECT, lambda steps: True),
          family(FAST, lambda steps: steps in FAST_JUDGED_AT))


def _described(values, log: bool, spec: str) -> str:
  """Per-seed values as ``mean [min, max]`` (geometric for a ratio), or why a seed has none."""
  reason = next((v for v in values if isinstance(v, str)), None)
  iv = None if reason else metrics.interval(values, log=log)
  if iv is None:
    return reason or "no number"
  return mean_range(iv["mean"], iv["min"], iv["max"], iv["seeds"], spec)


def _fast_section(rows: dict, fast: list) -> list:
  """Amendment 6: ``rotation-fast``'s two quantities where they are not judged (a description),
  then its claims where they are."""
  described = [(k, r) for k, r in rows.items() if r["fast_least"] and k[1] not in FAST_JUDGED_AT]
  lines = []
  if described:
    lines += ["## The uniform short memory (rotation-fast), described", "",
              "Protocol amendment 6: the results at T = 2,400 suggested that the uniform short memory, "
              "not the staleness-aware one, beats every method; its claims are judged at T = "
              + ", ".join(f"{t:,}" for t in FAST_JUDGED_AT) + " only. Here, without a verdict:", "",
              "| schedule, T, P | smallest other slowdown over its own (> 1: it slows down least), "
              "geometric mean [min, max] | lowest other final validation loss minus its own (> 0: it "
              "ends lowest) |", "|---|---|---|"]
    lines += [f"| {sch}, {t}, {r['P']} | {_described(r['fast_least'], True, '{:.2f}')} | "
              f"{_described(r['fast_lowest'], False, '{:+.4f}')} |" for (sch, t), r in described]
    lines.append("")
  return lines + claims.section(fast, heading="The uniform short memory's claims (amendment 6), checked")


def _seeds_text(r: dict) -> str:
  """The seeds of one schedule and T: one list if every P has the same, else each P's."""
  by_p = r["seeds_by_P"]
  if len({tuple(v) for v in by_p.values()}) <= 1:
    return f"seeds {r['seeds']}"
  return "seeds " + ", ".join(f"P = {p}: {v}" for p, v in by_p.items()) + f"; the claims on P = {r['P']}'s"


def write(rows: dict, decided: list, fast: list, meta: dict, runs: list, out: pathlib.Path,
          command: str) -> dict:
  out.mkdir(parents=True, exist_ok=True)
  cpus = curves.hosts_text(curves.hosts_of(runs))
  lines = ["# A staleness-aware statistics memory", "", f"- made by `{command}`",
           "- the sweeps: " + "; ".join(f"`{c}`" for c in meta.get("sweeps", [])),
           f"- {len(runs)} runs on {cpus or 'unrecorded CPUs'}", *curves.revision_lines(runs),
           f"- `{SUBJECT}`: each stage's statistics memory shortened by its delay "
           "(`rotation.stage_aware_decay`); `rotation-fast`: decay 0.95 at every stage", ""]
  for (schedule, steps), r in rows.items():
    stages = sorted(int(p) for p in r["final_val"][r["methods"][0]]) if r["methods"] else []
    lines += [f"## {schedule.upper()}, T = {steps} ({_seeds_text(r)})", "",
              "| method | " + " | ".join(f"slowdown P = {p}" for p in stages if p > 1) + " | "
              + " | ".join(f"final val P = {p}" for p in stages) + " |",
              "|---|" + "---|" * (2 * len(stages) - 1)]
    ran = lambda p, text: text if r["seeds_by_P"][str(p)] else "no seed yet"  # not "never": nothing ran
    for m in r["methods"]:
      lines.append(f"| {m} | " + " | ".join(ran(p, spread(r["slowdown"][m][str(p)])) for p in stages if p > 1)
                   + " | " + " | ".join(ran(p, spread(r["final_val"][m][str(p)], "{:.4f}")) for p in stages)
                   + " |")
    lines.append("")
  lines += claims.section(decided, heading="Claims, checked") + _fast_section(rows, fast)
  (out / "report.md").write_text("\n".join(lines))
  summary = {"command": command, "hosts": curves.hosts_of(runs),
             "groups": [{"schedule": s, "T": t, **r} for (s, t), r in rows.items()],
             "claims": [c.summary() for c in decided], "claims_fast": [c.summary() for c in fast]}
  return write_summary(out, summary)


def main(argv=None):
  args = cli.study_parser("memory", __doc__, f"report.md, summary.json and {curves.FILE}").parse_args(argv)
  by_t = {}  # each T has its own smoothing window: the sources are merged per T
  for source in args.sources:
    for t in {r["config"]["steps"] for r in curves.read(source)["runs"]}:
      by_t.setdefault(t, []).append(source)
  windows, runs, sweeps = {}, [], []
  for t, sources in sorted(by_t.items()):
    data = curves.merge(sources, block=max(1, t // BLOCKS), steps=t)
    windows[str(t)] = data["meta"]["window"]
    runs += [r for r in data["runs"] if r["config"]["steps"] == t]
    sweeps += [c for c in data["meta"]["sweeps"] if c not in sweeps]
  if not runs:
    raise ValueError(f"no runs in {args.sources}")
  out = pathlib.Path(args.out)
  out.mkdir(parents=True, exist_ok=True)
  curves.write(out / curves.FILE, {"window": next(iter(windows.values())), "windows": windows,
                                   "sweeps": sweeps}, runs, link=args.link)
  runs = curves.read(out)["runs"]  # the study from the stored (block-mean) curves alone
  window = {int(t): w for t, w in windows.items()}
  rows, decided, fast = study(runs, window)
  command = f"python -m experiments.studies.memory {args.out}{cli.link_flag(args)} --out {args.out}"
  summary = write(rows, decided, fast, {"sweeps": sweeps}, runs, out, command)
  print(f"wrote {out / 'report.md'}: " + "; ".join(
      f"{c['verdict']}: {c['claim']}" for c in summary["claims"] + summary["claims_fast"]))
  return summary


if __name__ == "__main__":
  cli.exit_process(cli.run(main))

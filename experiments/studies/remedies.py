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

import collections
import pathlib

import numpy as np

from experiments import cli
from experiments.harness import methods
from experiments.harness.config import optimizer_of
from experiments.report import claims, curves, metrics
from experiments.studies import write_summary

BLOCK = 100  # training-loss block mean stored per run
DEFAULT = {"predict": methods.PREDICT_SCALE, "dc": methods.DC_LAMBDA}  # each remedy's own scale


def key(config: dict) -> tuple:
  """``(method, schedule, P, scale)`` of a run (the scale its recorded optimizer applies); P = 1 is
  one run under either schedule."""
  optimizer = optimizer_of(config)
  scale = optimizer.scale if optimizer.remedy else None
  schedule = "1f1b" if config["stages"] == 1 else config.get("schedule", "1f1b")
  return config["method"], schedule, config["stages"], scale


VARIES = ("method", "stages", "schedule", "seed", "predict_scale", "dc_lambda")  # within the study


def the_setting(runs) -> list:
  """The runs of the remedies' own setting (the sources may hold others: other rates, other b1):
  that of the remedy runs, which must be one; without them, the commonest."""
  ours = {curves.setting(r["config"], VARIES) for r in runs
          if methods.check_method(r["config"]["method"]).remedy}
  if len(ours) > 1:
    raise ValueError("the remedy runs differ in more than method, P, schedule, seed and scale: "
                     f"{sorted(ours)}")
  if not ours:
    counts = collections.Counter(curves.setting(r["config"], VARIES) for r in runs)
    ours = {counts.most_common(1)[0][0]} if counts else set()
  return [r for r in runs if curves.setting(r["config"], VARIES) in ours]


def final_vals(runs) -> dict:
  """``{key: {seed: final validation loss or None}}`` of the runs of the study's setting."""
  out = {}
  for r in the_setting(runs):
    out.setdefault(key(r["config"]), {})[r["config"]["seed"]] = metrics.final_val(r)
  return out


def _mean(by_seed: dict) -> float | None:
  vals = list(by_seed.values())
  return float(np.mean(vals)) if vals and all(v is not None for v in vals) else None


def scale_rows(vals: dict, top: int) -> tuple[list, dict]:
  """``(rows, {remedy: chosen scale})`` from the ``pipedream+<remedy>`` runs at P = ``top``, 1F1B, on
  the seeds every scale of the remedy has (the protocol's grid: seed 0), so that the study's later
  seeds at the chosen scale never move the choice."""
  rows, chosen = [], {}
  for remedy in methods.REMEDIES:
    cells = {k[3]: v for k, v in vals.items() if k[:3] == (f"pipedream+{remedy}", "1f1b", top)}
    if not cells:
      continue
    seeds = sorted(set.intersection(*(set(v) for v in cells.values())))
    mine = []
    for scale in sorted(cells):
      by_seed = {s: cells[scale][s] for s in seeds}
      mine.append({"remedy": remedy, "scale": scale, "seeds": seeds, "final_val": _mean(by_seed),
                   "per_seed": [by_seed[s] for s in seeds]})
    rows += mine
    done = [r for r in mine if r["final_val"] is not None]
    if done:
      chosen[remedy] = min(done, key=lambda r: r["final_val"])["scale"]
  return rows, chosen


OTHERS = ("nesterov", "pipedream-lr")  # the field's other remedies, on AdamW's (PipeDream's) gap as they are


def _fraction(one: dict, stale: dict, fixed: dict) -> tuple[list, list]:
  """``(seeds, per seed 1 - gap(fixed) / gap(stale))``, both gaps from the same P = 1 run."""
  seeds = sorted(set(one) & set(stale) & set(fixed))
  out = []
  for s in seeds:
    if None in (one[s], stale[s], fixed[s]) or stale[s] <= one[s]:
      out.append("no gap to close (a run diverged or P = 1 is not better)")
    else:
      out.append(1.0 - (fixed[s] - one[s]) / (stale[s] - one[s]))
  return seeds, out


def gap_rows(vals: dict, chosen: dict) -> list:
  """Per schedule, P > 1, optimizer and remedy: the per-seed fraction of the optimizer's gap it closes
  (Nesterov's look-ahead and PipeDream-LR's rate as remedies of AdamW, i.e. of ``pipedream``)."""
  rows = []
  depths = sorted({k[2] for k in vals if k[2] > 1})
  for schedule in ("1f1b", "2bw"):
    for P in depths:
      cells = [(base, remedy, f"{base}+{remedy}", chosen.get(remedy, DEFAULT[remedy]))
               for base in methods.REMEDY_BASES for remedy in methods.REMEDIES]
      cells += [("pipedream", other, other, None) for other in OTHERS]
      for base, remedy, method, scale in cells:
        seeds, per_seed = _fraction(vals.get((base, "1f1b", 1, None), {}),
                                    vals.get((base, schedule, P, None), {}),
                                    vals.get((method, schedule, P, scale), {}))
        if seeds:
          rows.append({"schedule": schedule, "optimizer": base, "remedy": remedy, "scale": scale, "P": P,
                       "seeds": seeds, "per_seed": per_seed})
  return rows


def final_rows(vals: dict, chosen: dict) -> list:
  """Per schedule and P > 1, every optimizer alone and with each remedy: the seed-mean final
  validation loss (which combination ends lowest: do a remedy and rotation add up?)."""
  rows = []
  for schedule in ("1f1b", "2bw"):
    for P in sorted({k[2] for k in vals if k[2] > 1}):
      for method in methods.REMEDY_BASES + OTHERS:
        row = {"schedule": schedule, "P": P, "method": method}
        for remedy in (None,) + (methods.REMEDIES if method in methods.REMEDY_BASES else ()):
          name = method if remedy is None else f"{method}+{remedy}"
          scale = None if remedy is None else chosen.get(remedy, DEFAULT[remedy])
          cell = vals.get((name, schedule, P, scale), {})
          row[remedy or "alone"] = {"seeds": sorted(cell), "final_val": _mean(cell)}
        if any(row[k]["seeds"] for k in row if isinstance(row[k], dict)):
          rows.append(row)
  return rows


def _label(r: dict) -> str:
  """A gap row's claim: "<remedy> closes part of <optimizer>'s staleness gap (schedule, P, scale)"."""
  who = r["remedy"] if r["remedy"] in OTHERS else f"{r['optimizer']}+{r['remedy']}"
  scale = "" if r["scale"] is None else f", scale {r['scale']:g}"
  return f"{who} closes part of {r['optimizer']}'s staleness gap ({r['schedule']}, P = {r['P']}{scale})"


def family(gaps, left_out=None) -> list[claims.Claim]:
  """The gap rows' claims, one Holm family; ``left_out``: a seed dropped from every claim."""
  out = []
  for r in gaps:
    kept = [(s, v) for s, v in zip(r["seeds"], r["per_seed"]) if s != left_out]
    out.append(claims.check(_label(r), "the remedy's own papers (> 0)", [v for _, v in kept], 0.0,
                            context=f"fraction of the gap closed, seeds {[s for s, _ in kept]}: "))
  return claims.holm(out)


def leave_one_out(gaps) -> list[list[dict]]:
  """Per claim, per seed it holds: the verdict with that seed left out of the whole family (every
  claim recomputed without it and Holm-corrected again), ``{"left_out", "mean", "p_holm", "verdict"}``."""
  seeds = sorted({s for r in gaps for s in r["seeds"]})
  without = {s: family(gaps, s) for s in seeds}
  return [[{"left_out": s, "mean": c.interval["mean"] if c.interval else None, "p_holm": c.p_holm,
            "verdict": c.verdict} for s in r["seeds"] for c in [without[s][i]]]
          for i, r in enumerate(gaps)]


def study(runs) -> tuple:
  vals = final_vals(runs)
  top = max((k[2] for k in vals), default=1)
  scales, chosen = scale_rows(vals, top)
  gaps = gap_rows(vals, chosen)
  return scales, chosen, gaps, final_rows(vals, chosen), family(gaps)


GLANCE = "The remedies at a glance"


def glance(gaps, decided) -> list:
  """The claims as one table for the README: a row per optimizer and remedy, a column per schedule
  and P; each cell the verdict, the mean fraction of the gap closed and its interval at the claim's
  Holm level."""
  columns = sorted({(g["schedule"], g["P"]) for g in gaps})
  if not columns:
    return []
  rows = {f"{b}+{r} closes part of {b}'s gap": {} for b in methods.REMEDY_BASES for r in methods.REMEDIES}
  rows.update({f"{o} closes part of pipedream's gap": {} for o in OTHERS})
  for g, c in zip(gaps, decided):
    who = g["remedy"] if g["remedy"] in OTHERS else f"{g['optimizer']}+{g['remedy']}"
    rows.setdefault(f"{who} closes part of {g['optimizer']}'s gap", {})[(g["schedule"], g["P"])] = (
        claims.glance(c))
  names = {"1f1b": "1F1B", "2bw": "2BW"}
  lines = [f"## {GLANCE}", "",
           "Fraction of the optimizer's staleness gap (final validation loss, P minus P = 1) the remedy "
           "closes, > 0: verdict under docs/protocol.md, seed mean and the interval at the claim's Holm "
           "level.", "", "| claim | " + " | ".join(f"{names[s]}, P = {p}" for s, p in columns) + " |",
           "|---|" + "---|" * len(columns)]
  lines += [f"| {name} | " + " | ".join(cells.get(c, "") for c in columns) + " |"
            for name, cells in rows.items() if cells]
  return lines + [""]


def write(scales, chosen, gaps, finals, decided, meta, runs, out: pathlib.Path, command: str) -> dict:
  out.mkdir(parents=True, exist_ok=True)
  commits = sorted({str((r.get("code") or {}).get("commit"))[:12] for r in runs})
  cpus = curves.hosts_text(curves.hosts_of(runs))
  lines = ["# The staleness remedies: weight prediction and delay compensation", "",
           f"- made by `{command}`", "- the sweeps: " + "; ".join(f"`{c}`" for c in meta["sweeps"]),
           f"- {len(runs)} runs, trained by commit(s) {', '.join(commits)} on {cpus or 'unrecorded CPUs'}",
           *curves.revision_lines(runs),
           "- a remedy has no delay to act on at P = 1: both gaps of a row share the optimizer's P = 1 run "
           "(`experiments.harness.methods.reference`); Nesterov's look-ahead and PipeDream-LR's rate are "
           "read as remedies of AdamW (`pipedream`)", "",
           "## Scales (pipedream, 1F1B, the largest P)", "",
           "| remedy | scale | seeds | final validation loss (seed mean) | chosen |", "|---|---|---|---|---|"]
  for r in scales:
    val = "-" if r["final_val"] is None else f"{r['final_val']:.4f}"
    lines.append(f"| {r['remedy']} | {r['scale']:g} | {len(r['seeds'])} | {val} | "
                 f"{'**yes**' if chosen.get(r['remedy']) == r['scale'] else ''} |")
  lines += ["", "## Fraction of the optimizer's staleness gap closed", "",
            "Per seed `1 - gap(optimizer with the remedy) / gap(optimizer)`, the gap being the final "
            "validation loss at P minus at P = 1: 1 closes it, 0 does nothing, below 0 widens it. "
            "Mean [min, max] over seeds and Student's t 95% interval.", ""]
  if gaps:
    lines += ["| schedule | P | optimizer | remedy | scale | seeds | fraction closed |",
              "|---|---|---|---|---|---|---|"]
    for r in gaps:
      nums = [v for v in r["per_seed"] if not isinstance(v, str)]
      iv = metrics.interval(nums) if len(nums) == len(r["per_seed"]) else None
      text = claims.describe(r["per_seed"], iv, "{:+.2f}")
      scale = "-" if r["scale"] is None else f"{r['scale']:g}"
      lines.append(f"| {r['schedule']} | {r['P']} | {r['optimizer']} | {r['remedy']} | {scale} | "
                   f"{len(r['seeds'])} | {text} |")
  else:
    lines += ["No optimizer holds its runs at P = 1 and at a larger P beside a remedy's yet."]
  lines += ["", "## Final validation loss: does a remedy add to the optimizer?", "",
            "Seed mean (seeds) at each P; a remedy that adds to rotation or Muon ends below it.", "",
            "| schedule | P | optimizer | alone | + predict | + dc |", "|---|---|---|---|---|---|"]
  for r in finals:
    def cell(key):
      c = r.get(key)
      return "" if not c or c["final_val"] is None else f"{c['final_val']:.4f} ({len(c['seeds'])})"
    lines.append(f"| {r['schedule']} | {r['P']} | {r['method']} | {cell('alone')} | {cell('predict')} | "
                 f"{cell('dc')} |")
  lines += [""] + glance(gaps, decided)
  lines += claims.section(decided, heading="Claims, checked") if decided else []
  loo = leave_one_out(gaps)
  moved = [[x["left_out"] for x in rows if x["verdict"] != c.verdict] for c, rows in zip(decided, loo)]
  decisive = [(c, rows, m) for c, rows, m in zip(decided, loo, moved) if c.verdict != "inconclusive"]
  if decisive:
    lines += ["", "## Leave one seed out", "",
              "Each claim that is not inconclusive, with one seed left out of the whole family (every "
              "claim recomputed without it, Holm-corrected again): the seed, the mean fraction closed, "
              "the Holm-adjusted p and the verdict. \"Rests on one seed\": a seed whose removal changes "
              "the verdict.", "", "| claim | verdict | leave one seed out | rests on one seed |",
              "|---|---|---|---|"]
    num = lambda x: ("" if x["mean"] is None or x["p_holm"] is None
                     else f"{x['mean']:+.2f}, p {x['p_holm']:.2g}, ")
    for c, rows, m in decisive:
      text = "; ".join(f"{x['left_out']}: {num(x)}{x['verdict']}" for x in rows)
      lines.append(f"| {c.claim} | {c.verdict} | {text} | {', '.join(map(str, m)) or 'no'} |")
  (out / "report.md").write_text("\n".join(lines))
  summary = {"command": command, "sweeps": meta["sweeps"], "commits": commits, "chosen": chosen,
             "scales": scales, "gaps": gaps, "finals": finals,
             "claims": [{**c.summary(), "rests_on_one_seed": m,  # the readings, where not inconclusive
                         **({"leave_one_out": rows} if c.verdict != "inconclusive" else {})}
                        for c, rows, m in zip(decided, loo, moved)]}
  return write_summary(out, summary)


def main(argv=None):
  args = cli.study_parser("remedies", __doc__, f"report.md, summary.json and {curves.FILE}").parse_args(argv)
  data = curves.merge(args.sources, block=BLOCK)
  scales, chosen, gaps, finals, decided = study(data["runs"])
  out = pathlib.Path(args.out)
  command = f"python -m experiments.studies.remedies {args.out}{cli.link_flag(args)} --out {args.out}"
  summary = write(scales, chosen, gaps, finals, decided, data["meta"], data["runs"], out, command)
  curves.write(out / curves.FILE, data["meta"], data["runs"], link=args.link)
  print(f"wrote {out / 'report.md'}: chosen scales {chosen}")
  return summary


if __name__ == "__main__":
  cli.exit_process(cli.run(main))

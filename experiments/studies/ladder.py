"""``python -m experiments.studies.ladder SOURCE... --out DIR``: the width ladder (docs/protocol.md
amendment 10): does rotation's standing under staleness hold, or grow, from width 32 to 128?

Every run is of the ``ladder`` preset (``experiments.sweep``): cpu-deep's 16 blocks at width 32, 64
or 128, the whole standard library seen once (``--data stdlib-all --sampling single-pass``), P = 1
and 16 under 1F1B with weight stashing, PipeDream (AdamW), Nesterov, rotation and Muon.

1. **Tuning** (seed 0, never confirmatory): per width, the peak rates ``tuned_rates.GRID`` at
   ``TUNE_T`` steps, each at P = 1 and 16; a (method, P)'s optimum is the rate with the lowest final
   validation loss, an optimum on the grid's edge widens it by a factor of 2 past the edge until it
   is interior (``tuned_rates.stage_one``). **The check** (width 32 only, the cheap width): each
   optimum and its two neighbours at the full ``T`` on seed 0; where the lowest final validation
   loss at ``T`` is not the short runs' optimum, the ``T`` reading replaces it at width 32
   (``tuned_rates.stage_two``), and the report states the shift; the other widths keep their
   ``TUNE_T`` optima.
2. **Confirmatory** (seeds ``SEEDS``, ``T`` steps, every (method, P, width) at its tuned rate): per
   seed and width, the final validation losses ``L[method, P]`` (each run's last evaluation, at
   ``T``) and the best baseline (PipeDream or Nesterov, the lower final smoothed training loss at
   P = 16: the protocol's one definition). The claims, one Holm family, each per seed on the linear
   scale, with the window rule and leave-one-seed-out readings: at each width, rotation ends below
   the best baseline at P = 16, ends below Muon at P = 16, and loses less to staleness than the best
   baseline (P = 16 minus P = 1); across widths, rotation's P = 16 lead over the best baseline grows
   from width 32 to 128, and the best baseline's P = 16 loss is higher at 128 than at 32 ("without
   rotation, wider models end worse"). Beside them, labelled secondary and in no family: the
   iteration-ratio staleness gain of rotation and Muon per width (``metrics.study_table``).

SOURCE folders hold ``curves.json.xz`` (sweeps' ``--finished-only --publish`` folders, or this
study's own ``OUT/tune``, ``OUT/check`` and ``OUT/confirmatory-<cpu>``, from which it rebuilds). A
confirmatory seed counts on the one CPU type that holds all its runs (amendment 9's rule). Writes
``report.md``, ``summary.json``, ``ladder.png`` and the merged curves; ``--next`` prints only the
sweeps still to run (the queue runs them).
"""

from __future__ import annotations

import pathlib

import numpy as np

from experiments import cli
from experiments.harness import provenance
from experiments.report import claims, curves, metrics
from experiments.report.tables import curve_of
from experiments.studies import lr_grid, out_folder, tuned_rates, write_summary

WIDTHS = (32, 64, 128)
METHODS = ("pipedream", "nesterov", "rotation", "muon")
BASELINES = ("pipedream", "nesterov")
STAGES, TOP = (1, 16), 16
TUNE_T, T = 1200, 4800
TUNING_SEED, CHECK_WIDTH = 0, 32
SEEDS = (12, 13, 14, 15)
BLOCK = 10  # the confirmatory runs' training loss is stored as 10-step block means
SWEEP = "python -m experiments.sweep --preset ladder"
SCALE = {"reported": 1.0, "half": 0.5, "double": 2.0}
WINDOW = max(1, int(T * 0.05))  # the ladder preset's smoothing window at T (its smooth_fraction)


def width_of(config: dict) -> int:
  return config.get("width") or 32  # cpu-deep's own width is stored as None


def _width_tuning(runs, w: int) -> tuple[dict, dict]:
  """One width's rate rule over ``runs`` (its tuning runs on one CPU type): ``({method: {"stage1",
  "stage2"}}, {method: {P: rate}} of the methods decided)``."""
  grid, check = tuned_rates.cells(runs, TUNE_T), tuned_rates.cells(runs, T)
  per, chosen = {}, {}
  for m in METHODS:
    first = tuned_rates.stage_one(grid, m, seeds=(TUNING_SEED,))
    second = (tuned_rates.stage_two(check, m, first, seed=TUNING_SEED, steps=T)
              if w == CHECK_WIDTH and first["chosen"] else None)
    per[m] = {"stage1": first, "stage2": second}
    decided = (second or {}).get("chosen") if w == CHECK_WIDTH else first["chosen"]
    if decided:
      chosen[m] = decided
  return per, chosen


def tuning(runs, here: str | None = None) -> dict:
  """The rate rule: ``{"widths": {w: {method: {"stage1", "stage2"}}}, "chosen": {w: {method: {P:
  rate}}} or None, "cpus": {w: the CPU type whose runs decide it}}`` (``stage2``: the full-``T``
  check, at ``CHECK_WIDTH`` only). A width's tuning counts on one CPU type (amendment 10's
  clarification, as amendment 9 for the long horizon's stage 2): the type that holds all of it;
  while none does, ``here`` (the type a queue trains on; default: the type with the most of the
  width's runs), whose missing runs are the ones asked for."""
  per, chosen, cpus = {}, {}, {}
  for w in WIDTHS:
    mine = [r for r in runs if width_of(r["config"]) == w and r["config"]["seed"] == TUNING_SEED]
    by_cpu = {}
    for r in mine:
      by_cpu.setdefault((r.get("host") or {}).get("cpu"), []).append(r)
    results = {cpu: _width_tuning(held, w) for cpu, held in by_cpu.items()}
    complete = [cpu for cpu, (_, got) in results.items() if len(got) == len(METHODS)]
    if len(complete) > 1:
      raise ValueError(f"width {w}'s tuning is complete on {complete}: it counts on one CPU type")
    busiest = max(by_cpu, key=lambda cpu: len(by_cpu[cpu]), default=None)
    cpus[w] = complete[0] if complete else here if here is not None else busiest
    per[w], got = results.get(cpus[w]) or _width_tuning([], w)
    if got:
      chosen[w] = got
  done = all(len(chosen.get(w, {})) == len(METHODS) for w in WIDTHS)
  return {"widths": per, "chosen": chosen if done else None, "cpus": cpus}


def seed_order(chosen: dict, runs, here: str) -> list:
  """Amendment 9's order for a queue on CPU ``here``: the seeds started and unfinished on its type,
  then those started nowhere; only when every unfinished seed was started elsewhere, the lowest."""
  need = {(w, m, p, chosen[w][m][p]) for w in WIDTHS for m in METHODS for p in STAGES}
  held = {}
  for r in runs:
    c = r["config"]
    if c["steps"] == T and c["seed"] in SEEDS and r.get("status") == "finished":
      held.setdefault(((r.get("host") or {}).get("cpu"), c["seed"]), set()).add(
          (width_of(c), c["method"], c["stages"], c["lr"]))
  return tuned_rates.order_of_seeds(held, need, SEEDS, here)


def ran_on(runs, here: str) -> set:
  """``{(seed, width, method, P, rate as %g)}`` of the confirmatory-length runs that ran to their end
  (finished or diverged) on CPU type ``here``: a sweep of those is not trained there again."""
  out = set()
  for r in runs:
    c = r["config"]
    if (c["steps"] == T and c["seed"] in SEEDS and r.get("status") in ("finished", "diverged")
            and (r.get("host") or {}).get("cpu") == here):
      out.add((c["seed"], width_of(c), c["method"], c["stages"], f"{c['lr']:g}"))
  return out


def sweeps(result: dict, results: str, order=SEEDS, ran=frozenset()) -> list:
  """The sweep commands still to run: the tuning (per width and rate), the check, then (once every
  rate is chosen) the confirmatory runs, seed by seed in ``order`` and width by width: two sweeps
  per (seed, width), P = 16 at its rates (``--no-reference``: no P = 1 run at them, which no claim
  reads) and P = 1 at its own, each left out once the runs it is for have run here (``ran_on``)."""
  out = []
  for w, per in result["widths"].items():
    for stage, steps, folder in (("stage1", TUNE_T, "tune"), ("stage2", T, "check")):
      by_rate = {}
      for m, v in per.items():
        for r in (v[stage] or {"todo": ()})["todo"]:
          by_rate.setdefault(r, []).append(m)
      out += [f"{SWEEP} --width {w} --steps {steps} --lr {r:g} --methods {' '.join(ms)} --seeds "
              f"{TUNING_SEED} --out {results}/{folder}" for r, ms in sorted(by_rate.items())]
  chosen = result["chosen"]
  for s in order if chosen else ():
    for w in WIDTHS:
      for p, extra in ((TOP, " --no-reference"), (1, "")):
        if any((s, w, m, p, f"{chosen[w][m][p]:g}") not in ran for m in METHODS):
          out.append(f"{SWEEP} --width {w} --stages {p}{extra} --lr "
                     + " ".join(f"{m}={chosen[w][m][p]:g}" for m in METHODS)
                     + f" --methods {' '.join(METHODS)} --seeds {s} --out {results}/confirmatory")
  return out


def by_seed(runs, chosen: dict) -> tuple[dict, dict]:
  """``({seed: {(width, method, P): run}}, {seed: why it is left out})``: the confirmatory runs at
  their chosen rates; a seed counts on the one CPU type that holds all of its runs."""
  picked = {}
  for r in runs:
    c = r["config"]
    w = width_of(c)
    key = (w, c["method"], c["stages"])
    if (c["steps"] == T and c["seed"] in SEEDS and r["group"] == "main" and w in chosen
            and np.isclose(c["lr"], chosen[w].get(c["method"], {}).get(c["stages"], -1.0), rtol=1e-9)):
      picked.setdefault(c["seed"], {}).setdefault((r.get("host") or {}).get("cpu"), {})[key] = r
  need = {(w, m, p) for w in WIDTHS for m in METHODS for p in STAGES}
  seeds, left = {}, {}
  for s in sorted(picked):
    complete = [cpu for cpu, got in picked[s].items() if set(got) == need]
    if len(complete) == 1:
      seeds[s] = picked[s][complete[0]]
    else:
      held = sorted(picked[s].items())
      left[s] = (f"complete on {len(complete)} CPU types" if complete else
                 "; ".join(f"{len(got)} of {len(need)} runs on {cpu}" for cpu, got in held))
  return seeds, left


def _final_val(run) -> float | None:
  return run["val_losses"][-1] if run["status"] == "finished" and run["val_losses"] else None


def per_seed(runs_: dict, window: int) -> dict:
  """One seed's numbers: final validation losses, each width's best baseline and the claims' values
  (``None`` where a run diverged)."""
  loss = {k: _final_val(r) for k, r in runs_.items()}
  smooth = {k: metrics.final_smoothed(curve_of(r), window) for k, r in runs_.items()}
  out = {"loss": {f"{w} {m} P={p}": loss[(w, m, p)] for w, m, p in sorted(runs_)}, "best": {},
         "lead": {}, "lead_muon": {}, "degradation_gap": {}, "best_top": {}}
  for w in WIDTHS:
    finite = [b for b in BASELINES if np.isfinite(smooth[(w, b, TOP)])]
    best = min(finite, key=lambda b: smooth[(w, b, TOP)]) if finite else None
    out["best"][w] = best
    get = lambda m, p: loss.get((w, m, p))
    ok = lambda *xs: all(x is not None for x in xs)
    rot16, rot1 = get("rotation", TOP), get("rotation", 1)
    b16, b1 = (get(best, TOP), get(best, 1)) if best else (None, None)
    out["best_top"][w] = b16
    out["lead"][w] = b16 - rot16 if ok(b16, rot16) else None
    out["lead_muon"][w] = get("muon", TOP) - rot16 if ok(get("muon", TOP), rot16) else None
    out["degradation_gap"][w] = (b16 - b1) - (rot16 - rot1) if ok(b16, b1, rot16, rot1) else None
  return out


def gains(runs_: dict, window: int) -> dict:
  """Secondary: ``{width: {"rotation": gain, "muon": gain}}``, the iteration-ratio staleness gain over
  the best baseline (``metrics.study_table``, each run at its own tuned rate)."""
  out = {}
  for w in WIDTHS:
    table = metrics.study_table({(m, p): curve_of(runs_[(w, m, p)]) for m in METHODS for p in STAGES},
                                BASELINES, window)
    row = {r["method"]: r for r in table if r["stages"] == TOP}
    out[w] = {m: row[m]["staleness_gain"] for m in ("rotation", "muon")}
  return out


# The claims made at each width: (``per_seed``'s field, the claim, what is measured), in the family's order.
AT_EACH_WIDTH = (
    ("lead", "rotation ends below the best baseline at P = 16", "its loss minus rotation's, > 0"),
    ("lead_muon", "rotation ends below Muon at P = 16", "Muon's loss minus rotation's, > 0"),
    ("degradation_gap", "rotation loses less to staleness than the best baseline",
     "the baseline's P = 16 minus P = 1 loss, minus rotation's, > 0"))


def claim_values(rows: list) -> list:
  """``[(claim, values)]`` of the family, from each seed's ``per_seed`` row: ``AT_EACH_WIDTH`` width by
  width, then the two across widths."""
  d = lambda a, b: None if a is None or b is None else a - b
  out = [(f"{claim} (width {w}; {what})", [r[field][w] for r in rows])
         for w in WIDTHS for field, claim, what in AT_EACH_WIDTH]
  out += [("rotation's P = 16 lead over the best baseline grows with width (at 128 minus at 32, > 0)",
           [d(r["lead"][WIDTHS[-1]], r["lead"][WIDTHS[0]]) for r in rows]),
          ("without rotation, wider models end worse at P = 16 (the best baseline's loss at 128 minus at "
           "32, > 0)", [d(r["best_top"][WIDTHS[-1]], r["best_top"][WIDTHS[0]]) for r in rows])]
  return out


def verdicts(seeds: dict, window: int) -> list:
  """The family under the protocol (Holm, the window rule), with the CPU a blocking factor when the
  seeds trained on more than one type."""
  cpus = [next(iter(r.values()))["host"]["cpu"] for r in seeds.values()]
  blocks = cpus if len(set(cpus)) > 1 else None

  def at(label):
    rows = [per_seed(r, max(1, int(window * SCALE[label]))) for r in seeds.values()]
    return [claims.check(name, "> 0", ["a run diverged" if v is None else v for v in values], 0.0,
                         spec="{:+.4f}", blocks=blocks) for name, values in claim_values(rows)]
  return claims.protocol(at)


def study(runs, chosen: dict, window: int) -> dict:
  seeds, left = by_seed(runs, chosen)
  rows = {s: per_seed(r, window) for s, r in seeds.items()}
  decided = verdicts(seeds, window) if set(seeds) == set(SEEDS) else []  # all four seeds, or none
  cpus = [next(iter(r.values()))["host"]["cpu"] for r in seeds.values()]
  blocks = cpus if len(set(cpus)) > 1 else None
  out = []
  for c in decided:
    loo = claims.leave_one_out(list(rows), list(c.values), 0.0, blocks=blocks)
    out.append({**c.summary(), "leave_one_out": loo,
                "rests_on_one_seed": [x["left_out"] for x in loo if x["verdict"] != c.verdict]})
  secondary = {s: gains(r, window) for s, r in seeds.items()}
  return {"seeds": rows, "left_out": left, "claims": out, "decided": decided, "gains": secondary}


GLANCE = "The ladder at a glance"


def glance(decided: list) -> list:
  """The family as one table for the README: a row per claim, a column per width and one for the
  claims across widths; each cell the verdict, the seed mean and its interval at the claim's Holm
  level (``decided`` in ``claim_values``' order)."""
  each, k = len(AT_EACH_WIDTH), len(AT_EACH_WIDTH) * len(WIDTHS)
  cell = lambda c: claims.glance(c, "{:+.3f}")
  lines = [f"## {GLANCE}", "",
           f"Final validation loss at T = {T:,} under 1F1B with weight stashing, each (method, P, width) at "
           "its own tuned rate: the verdict under docs/protocol.md (one Holm family of "
           f"{len(decided)}), the mean over seeds {SEEDS[0]}-{SEEDS[-1]} and its interval at the claim's "
           "Holm level. The best baseline: PipeDream or Nesterov, whichever has the lower final smoothed "
           "training loss at P = 16 (the protocol's definition).",
           "", "| claim | " + " | ".join(f"width {w}" for w in WIDTHS)
           + f" | {WIDTHS[-1]} minus {WIDTHS[0]} |",
           "|---|" + "---|" * (len(WIDTHS) + 1)]
  lines += [f"| {claim} ({what}) | " + " | ".join(cell(c) for c in decided[i:k:each]) + " |  |"
            for i, (_, claim, what) in enumerate(AT_EACH_WIDTH)]
  lines += [f"| {c.claim} | " + " | " * len(WIDTHS) + f"{cell(c)} |" for c in decided[k:]]
  return lines + [""]


def descriptive(rows: dict) -> dict:
  """Per (width, method, P) the final validation loss over the seeds (``metrics.interval``), and per
  (width, method) its degradation, P = 16 minus P = 1, paired within a seed."""
  keys = sorted({k for r in rows.values() for k in r["loss"]})
  loss = {k: metrics.interval([r["loss"][k] for r in rows.values()]) for k in keys}
  degradation = {}
  for w in WIDTHS:
    for m in METHODS:
      one, top = f"{w} {m} P=1", f"{w} {m} P={TOP}"
      vals = [None if r["loss"].get(one) is None or r["loss"].get(top) is None
              else r["loss"][top] - r["loss"][one] for r in rows.values()]
      degradation[f"{w} {m}"] = metrics.interval(vals) if rows else None
  return {"loss": loss, "degradation": degradation}


def figure(desc: dict, path: pathlib.Path) -> None:
  import matplotlib
  matplotlib.use("Agg")
  import matplotlib.pyplot as plt

  fig, ax = plt.subplots(figsize=(7.4, 4.4), dpi=100)
  for i, m in enumerate(METHODS):  # P = 1 dashed with open circles, P = 16 solid with filled squares
    for p, style, face in ((1, "--o", "white"), (TOP, "-s", f"C{i}")):
      ivs = [(w, desc["loss"].get(f"{w} {m} P={p}")) for w in WIDTHS]
      ivs = [(w, iv) for w, iv in ivs if iv]
      if ivs:
        w, mean = [w for w, _ in ivs], np.array([iv["mean"] for _, iv in ivs])
        span = np.array([[iv["mean"] - iv["min"], iv["max"] - iv["mean"]] for _, iv in ivs]).T
        ax.errorbar(w, mean, yerr=span, fmt=style, color=f"C{i}", markerfacecolor=face, capsize=3,
                    label=f"{m}, P = {p}")
  ax.set_xscale("log", base=2)
  ax.set_xticks(WIDTHS, [str(w) for w in WIDTHS])
  ax.set_xlabel("width (16 blocks)")
  ax.set_ylabel(f"final validation loss at T = {T:,}\n(seed mean; bars: the seeds' range)")
  ax.legend(fontsize=8, handlelength=3.5, loc="upper left", bbox_to_anchor=(1.01, 1.0))
  fig.tight_layout()
  fig.savefig(path)
  plt.close(fig)


def _iv(iv, spec="{:.4f}") -> str:
  if not iv:
    return "-"
  text = f"{spec.format(iv['mean'])} [{spec.format(iv['min'])}, {spec.format(iv['max'])}]"
  lo, hi = iv["ci95"] or (None, None)
  return text + (f", 95% CI {spec.format(lo)} to {spec.format(hi)}" if iv["ci95"] else "")


def _models_line(trained: dict) -> list:
  if not trained:
    return []
  one = next(iter(trained.values()))  # tokens a step and the corpus are every width's
  sizes = "; ".join(f"width {w}: {r['parameters']:,} parameters" for w, r in trained.items())
  return [f"- the models: {sizes}; {one['tokens_per_step']} tokens a step; T = {T:,} steps read "
          f"{one['passes']} of one pass over the {one['training_tokens']:,} training tokens (none twice)"]


def report(result: dict, tune: dict, commands: list, command: str, hosts, desc: dict, trained: dict) -> str:
  lines = ["# The width ladder (protocol amendment 10)", "", f"- made by `{command}`",
           "- runs from " + ("one CPU: " if len(hosts) <= 1 else "**more than one CPU**: ")
           + curves.hosts_text(hosts),
           f"- widths {', '.join(map(str, WIDTHS))} at 16 blocks, P = 1 and {TOP} (1F1B, weight stashing), "
           f"T = {T:,}, the whole standard library seen once; tuning on seed {TUNING_SEED} at {TUNE_T:,} "
           f"steps (width {CHECK_WIDTH} checked at {T:,}); confirmatory seeds {SEEDS[0]}-{SEEDS[-1]}",
           *_models_line(trained),
           "- each width's tuning counted on: " + ", ".join(f"{w}: {cpu or 'no run yet'}"
                                                            for w, cpu in tune["cpus"].items()),
           "- seeds counted: " + (", ".join(map(str, result["seeds"])) or "none yet")
           + ("; left out: " + "; ".join(f"{s}: {w}" for s, w in result["left_out"].items())
              if result["left_out"] else ""), "", "## The rates", ""]
  if tune["chosen"]:
    lines += ["| width | " + " | ".join(f"{m} P = 1 / 16" for m in METHODS) + " |",
              "|---|" + "---|" * len(METHODS)]
    lines += [f"| {w} | " + " | ".join(f"{tune['chosen'][w][m][1]:g} / {tune['chosen'][w][m][TOP]:g}"
                                       for m in METHODS) + " |" for w in WIDTHS]
    moved = {m: v["stage2"]["moved"] for m, v in tune["widths"][CHECK_WIDTH].items() if v["stage2"]}
    lines += ["", f"The check at width {CHECK_WIDTH} ({T:,} steps): "
              + "; ".join(f"{m} P = {p} {'moved' if mv else 'stands'}" for m, by_p in moved.items()
                          for p, mv in by_p.items()) + "."]
  else:
    lines += ["Not all chosen yet (the tuning's sweeps are listed below)."]
  lines += ["", f"Tuning (seed {TUNING_SEED}, {TUNE_T:,} steps): final validation loss per rate, the optimum "
            "in bold; '-': not trained yet or diverged.", "", "| width | method | P | losses |",
            "|---|---|---|---|"]
  for w, per in tune["widths"].items():
    for m, v in per.items():
      for p in STAGES:
        row = v["stage1"]["rows"][p]
        cells = [f"{r:g}: " + ("-" if x is None else f"**{x:.4f}**" if r == row["best"] else f"{x:.4f}")
                 for r, x in zip(row["rates"], row["mean"])]
        lines.append(f"| {w} | {m} | {p} | {', '.join(cells)} |")
  lines += [""]
  if not result["decided"]:
    lines += [f"**Interim: {len(result['seeds'])} of {len(SEEDS)} seeds counted, no verdict.** The "
              "verdicts are drawn on all four seeds at once.", ""]
  else:
    lines += glance(result["decided"]) + ["## The claims (one Holm family)", "",
              "| claim | threshold | evidence | verdict | leave one seed out (seed: mean, p, verdict) |",
              "|---|---|---|---|---|"]
    for c, s in zip(result["decided"], result["claims"]):
      loo = "; ".join(f"{x['left_out']}: " + ("-" if x["mean"] is None else f"{x['mean']:+.4f}")
                      + f", p {x['p'] if x['p'] is None else format(x['p'], '.2g')}, {x['verdict']}"
                      for x in s["leave_one_out"])
      rests = f" (rests on one seed: {s['rests_on_one_seed']})" if s["rests_on_one_seed"] else ""
      lines.append(f"{c.row()[:-2]}{rests} | {loo} |")
    lines += [""]
  if desc["loss"]:
    lines += [f"## Final validation loss at T = {T:,}", "",
              "Each (method, P, width) at its tuned rate; mean [min, max] over the seeds counted and "
              "Student's t 95% interval.", "", "| width | method | P = 1 | P = 16 | P = 16 minus P = 1 |",
              "|---|---|---|---|---|"]
    for w in WIDTHS:
      for m in METHODS:
        lines.append(f"| {w} | {m} | {_iv(desc['loss'].get(f'{w} {m} P=1'))} | "
                     f"{_iv(desc['loss'].get(f'{w} {m} P={TOP}'))} | "
                     f"{_iv(desc['degradation'].get(f'{w} {m}'), '{:+.4f}')} |")
    lines += ["", "![final validation loss against width](ladder.png)", "",
              "## Secondary: the iteration-ratio staleness gain (no verdict; for comparison with the "
              "earlier studies)", "", "| width | rotation's gain | Muon's gain |", "|---|---|---|"]
    for w in WIDTHS:
      cell = lambda m: _iv(metrics.interval([g[w][m] for g in result["gains"].values()], log=True), "{:.2f}")
      lines.append(f"| {w} | {cell('rotation')} | {cell('muon')} |")
    lines += [""]
  lines += ["## Sweeps still to run", ""] + ([f"- `{c}`" for c in commands] or ["none"]) + [""]
  return "\n".join(lines)


def main(argv=None) -> dict:
  parser = cli.Parser(prog="python -m experiments.studies.ladder", description=__doc__)
  parser.add_argument("sources", nargs="*", help=f"folders holding {curves.FILE} of the ladder's runs")
  parser.add_argument("--out", help="where to write report.md, summary.json, the figure and the curves")
  parser.add_argument("--results", default="results/ladder", help="the sweeps' --out prefix in the "
                      "printed commands (default results/ladder)")
  parser.add_argument("--next", action="store_true", help="print only the sweeps still to run")
  parser.add_argument("--cpu", help="the CPU type a queue trains on (default: this machine's)")
  parser.add_argument("--register-cpu", metavar="FILE", help="record this machine's CPU type in FILE "
                      "(a queue's check: one name, one family and model) and print its folder suffix")
  args = parser.parse_args(argv)
  if args.register_cpu:
    print(tuned_rates.slug(provenance.register_cpu_type(args.register_cpu)["cpu"]))
    return {}
  sources = [s for s in args.sources if (pathlib.Path(s) / curves.FILE).exists() or s.endswith(curves.FILE)]
  held = [curves.read(s) for s in sources]
  # the confirmatory runs as the report publishes them (BLOCK-step means): a rebuild reads the same
  everything = [r if r["config"]["seed"] == TUNING_SEED else curves.at_blocks(r, BLOCK)
                for data in held for r in data["runs"]]
  here = args.cpu or provenance.host()["cpu"]
  tune = tuning([r for r in everything if r["config"]["seed"] == TUNING_SEED], here)
  order = seed_order(tune["chosen"], everything, here) if tune["chosen"] else SEEDS
  result = (study(everything, tune["chosen"], WINDOW) if tune["chosen"] else
            {"seeds": {}, "left_out": {}, "claims": [], "decided": [], "gains": {}})
  commands = sweeps(tune, args.results, order, ran_on(everything, here))
  out = out_folder(args, commands)
  if out is None:
    return result
  folders = _write_curves(out, sources, tune["chosen"])
  command = f"python -m experiments.studies.ladder {' '.join(folders)} --cpu '{here}' --out {out}"
  desc = descriptive(result["seeds"])
  hosts = curves.hosts_of(everything)
  trained = models(held[0]["meta"] if held else {}, everything)
  if desc["loss"]:
    figure(desc, out / "ladder.png")
  (out / "report.md").write_text(report(result, tune, commands, command, hosts, desc, trained))
  summary = {"command": command, "hosts": hosts, "chosen": tune["chosen"], "tuning": tune["widths"],
             "tuning_cpus": {str(w): cpu for w, cpu in tune["cpus"].items()},
             "sweeps_to_run": commands,
             "seeds": {str(s): r for s, r in result["seeds"].items()},
             "left_out": {str(s): w for s, w in result["left_out"].items()}, "claims": result["claims"],
             "final_validation": desc, "secondary_gains": {str(s): g for s, g in result["gains"].items()},
             "models": {str(w): r for w, r in trained.items()}}
  write_summary(out, summary)
  print(f"wrote {out}/report.md: " + ("; ".join(f"{c['claim']}: {c['verdict']}" for c in result["claims"])
                                      or f"{len(result['seeds'])} of {len(SEEDS)} seeds counted; "
                                      f"{len(commands)} sweeps still to run"))
  return result


def models(meta: dict, runs) -> dict:
  """``{width: curves.regime}`` of the ladder's models at the horizon ``T`` (from the first run held
  at each width and the corpus ``meta``, a source's, records)."""
  first = {}
  for r in runs:
    first.setdefault(width_of(r["config"]), r["config"])
  found = {w: curves.regime(meta, {**first[w], "steps": T}) for w in WIDTHS if w in first}
  return {w: r for w, r in found.items() if r}


def _gather(sources: list, keep, block: int, cpu=None) -> tuple[dict, list]:
  """``(meta, runs)``: the runs of ``sources`` that ``keep`` holds for (and, with ``cpu``, trained on
  it), each as ``block``-step block means and once (a run held twice, published as block means and
  in a queue's full copy, is the same run: compacting it twice gives the same means). The sources
  may smooth with other windows (1,200- and 4,800-step runs): the analysis reads each run's own
  losses, and the meta records every sweep."""
  meta, runs, sweeps = None, {}, []
  for source in sources:
    data = curves.read(source)
    meta = meta or dict(data["meta"])
    sweeps += [c for c in data["meta"].get("sweeps", [data["meta"].get("command")]) if c not in sweeps]
    for r in data["runs"]:
      if keep(r) and (cpu is None or (r.get("host") or {}).get("cpu") == cpu):
        runs.setdefault((r.get("group"), r["name"]), curves.compact(r, block))
  return {**(meta or {}), "sweeps": sweeps}, list(runs.values())


def _write_curves(out: pathlib.Path, sources: list, chosen) -> list:
  """Writes the runs of ``sources`` into ``OUT/tune`` (the tuning seed's, its 1,200-step grid and
  the 4,800-step check, 100-step block means) and per CPU type ``OUT/confirmatory-<cpu>`` (the
  others, 10-step block means); returns the folders written."""
  if not sources:
    return []
  tuning_run = lambda r: r["config"]["seed"] == TUNING_SEED
  written = []
  meta, runs = _gather(sources, tuning_run, lr_grid.BLOCK)
  if runs:
    (out / "tune").mkdir(exist_ok=True)
    curves.write(out / "tune" / curves.FILE, meta, runs)
    written.append(str(out / "tune"))
  for cpu in curves.cpus_of(sources):
    meta, runs = _gather(sources, lambda r: not tuning_run(r), BLOCK, cpu)
    if runs:
      folder = out / f"confirmatory-{tuned_rates.slug(cpu)}"
      folder.mkdir(exist_ok=True)
      curves.write(folder / curves.FILE, meta, runs)
      written.append(str(folder))
  return written


if __name__ == "__main__":
  cli.exit_process(cli.run(main))

"""``python -m experiments.studies.wallclock SOURCE --out DIR``: wall-clock to the target.

The paper's cost claim is in GPU hours: rotation reaches the best baseline's final loss in 54.3%
fewer of them. A study's iteration counts are in its committed curves; its runs' own seconds per
step are not usable when they trained several at a time (``--jobs``: each run's time includes the
others' load). This study measures the time per step alone and multiplies (docs/protocol.md,
amendment 4):

- per (method, P) of SOURCE's main study (``MAIN``), the sweep's own training program for seed 0's
  config (``runs.build``: one call trains a chunk of ``config.chunk`` steps, pipeline, model and
  optimizer; evaluation, data and checkpoints are not timed) is compiled and run once, then timed
  for ``--rounds`` rounds, the configurations taking turns within each round so that machine drift
  hits them alike; its seconds per step are the median of the rounds (their range reported);
- per seed, a method's wall-clock to the target at P is its iterations to the best baseline's final
  smoothed loss at P (``metrics.study_table``, as in the main report) times that median.

The claims, one Holm family under the window rule (``claims.protocol``): "rotation reaches the best
baseline's final loss in less wall-clock time" at the largest P (per seed, the ratio of rotation's
wall-clock to the best baseline's, < 1, log scale; the paper: 54.3% fewer GPU hours) and at P = 1 (the
control). The time per step is one measured constant per configuration, so a claim's interval
carries the seeds' iteration counts only.

``--measured FILE`` (a ``summary.json`` this study wrote) takes the times from it instead of timing:
the report is then rebuilt from SOURCE's curves and the recorded measurement alone. Writes
``report.md`` and ``summary.json`` (no curves: SOURCE's are committed).
"""

from __future__ import annotations

import argparse
import json
import pathlib
import statistics
import time

from experiments import cli
from experiments.report import claims, curves
from experiments.report.tables import curves_by, seed_tables, spread
from experiments.studies import write_summary

MAIN = ("pipedream", "pipedream-lr", "nesterov", "rotation", "muon")
SUBJECT = "rotation"
ROUNDS = 7


def configs_of(runs) -> dict:
  """``{(method, P): RunConfig}``: seed 0's (else the lowest seed's) config of each main-study run."""
  from experiments.harness.config import recorded

  out = {}
  for r in sorted(runs, key=lambda r: r["config"]["seed"]):
    c = r["config"]
    if r["group"] == "main" and c["method"] in MAIN:
      out.setdefault((c["method"], c["stages"]), recorded(c))
  return dict(sorted(out.items()))


def measure(configs: dict, rounds: int = ROUNDS, clock=time.perf_counter) -> dict:
  """``{key: [seconds per step, one per round]}`` of each config's training chunk (compiled and run
  once first), the configs taking turns within each round."""
  import jax

  from experiments.harness import data as data_lib
  from experiments.harness import runs as runs_lib

  programs, corpora = {}, {}
  for key, config in configs.items():
    context = config.model_config(256).context
    if context not in corpora:
      corpora[context] = data_lib.default_corpus(context)
    ds = corpora[context]
    pipe, state, _, _ = runs_lib.build(config, ds)
    batches = ds.batches(config.seed, 0, config.chunk, config.batch_size,
                         config.model_config(ds.vocab_size).context)
    state, out = pipe.run(state, batches)  # compiles; the first chunk also holds the cold refresh
    jax.block_until_ready(out)
    programs[key] = [pipe, state, batches, config.chunk]
  times = {key: [] for key in programs}
  for _ in range(rounds):
    for key, program in programs.items():
      pipe, state, batches, chunk = program
      start = clock()
      state, out = pipe.run(state, batches)
      jax.block_until_ready((state, out))
      times[key].append((clock() - start) / chunk)
      program[1] = state  # the chunk consumes its state
  return times


def per_seed(runs, window: int, seconds: dict) -> dict:
  """``{P: {"seeds", "best", "ratio": [per seed], "rows": {method: {"iters", "seconds"}}}}``: per
  seed, each method's iterations and wall-clock to the best baseline's final loss at P, and the
  ratio of rotation's wall-clock to that baseline's (a string where a seed has none)."""
  by = curves_by([r for r in runs if r["group"] == "main" and r["config"]["method"] in MAIN])
  seeds = sorted(set.intersection(*(set(v) for v in by.values()))) if by else []
  step = {k: {s: seconds[k] for s in seeds} for k in by if k in seconds}
  tables = seed_tables(by, window, seconds=step)
  out = {}
  for p in sorted({p for _, p in by}):
    rows, ratio, best = {}, [], []
    for table in tables:
      at = {r["method"]: r for r in table if r["stages"] == p}
      for m, r in at.items():
        rows.setdefault(m, {"iters": [], "seconds": []})
        rows[m]["iters"].append(r["iters"])
        rows[m]["seconds"].append(r["seconds"])
      mine = at.get(SUBJECT)
      b = mine and mine["best_baseline"]
      best.append(b)
      if not mine or not b:
        ratio.append(f"{SUBJECT} or every baseline missing")
      elif mine["seconds"] is None or at[b]["seconds"] is None:
        ratio.append("never reached the target")
      else:
        ratio.append(mine["seconds"] / at[b]["seconds"])
    out[p] = {"seeds": seeds, "best": best, "ratio": ratio, "rows": rows}
  return out


def study(runs, window: int, seconds: dict) -> tuple[dict, list]:
  """``(per_seed at the reported window, the claims decided under the protocol)``."""
  windows = {"reported": window, "half": max(1, window // 2), "double": 2 * window}
  readings = {label: per_seed(runs, w, seconds) for label, w in windows.items()}

  def family(label):
    got = readings[label]
    top = max(got) if got else 1
    out = []
    for p in sorted({1, top}):
      if p in got:
        out.append(claims.check(
            f"rotation reaches the best baseline's final loss in less wall-clock time (P = {p})",
            "54.3% fewer GPU hours (< 1)" if p == top else "control (< 1: faster without staleness)",
            got[p]["ratio"], 1.0, side=-1, log=True,
            context="rotation's wall-clock to the target over the best baseline's: "))
    return out
  return readings["reported"], claims.protocol(family)


def write(source: str, rows: dict, decided: list, seconds: dict, measured: dict, runs, out: pathlib.Path,
          command: str) -> dict:
  out.mkdir(parents=True, exist_ok=True)
  cpus = curves.hosts_text(curves.hosts_of(runs))
  lines = ["# Wall-clock to the target", "", f"- made by `{command}`",
           f"- iteration counts: the committed curves of {source} ({len(runs)} runs, trained on "
           f"{cpus or 'unrecorded CPUs'}; iterations do not depend on a CPU's speed)",
           f"- time per step: {measured['how']}", ""]
  stages = sorted(rows)
  lines += ["## Seconds per training step, measured alone", "",
            "Median of the rounds [their range], each a chunk of the sweep's training program.", "",
            "| method | " + " | ".join(f"P = {p}" for p in stages) + " |", "|---|" + "---|" * len(stages)]
  for m in MAIN:
    cells = []
    for p in stages:
      got = measured["rounds"].get(m, {}).get(str(p))
      cells.append(f"{statistics.median(got) * 1e3:.2f} ms [{min(got) * 1e3:.2f}, {max(got) * 1e3:.2f}]"
                   if got else "-")
    if any(c != "-" for c in cells):
      lines.append(f"| {m} | " + " | ".join(cells) + " |")
  for p in stages:
    r = rows[p]
    lines += ["", f"## P = {p}: to the best baseline's final loss at P (seeds {r['seeds']})", "",
              "Best baseline per seed: " + ", ".join(str(b) for b in r["best"]) + ".", "",
              "| method | iterations | wall-clock (s) |", "|---|---|---|"]
    for m in MAIN:
      if m in r["rows"]:
        lines.append(f"| {m} | {spread(r['rows'][m]['iters'], '{:.0f}')} | "
                     f"{spread(r['rows'][m]['seconds'], '{:.1f}')} |")
  lines += [""] + claims.section(decided, heading="Claims, checked")
  (out / "report.md").write_text("\n".join(lines))
  summary = {"command": command, "source": source, "hosts": curves.hosts_of(runs), "measured": measured,
             "seconds_per_step": {m: {str(p): seconds[(m, p)] for p in stages if (m, p) in seconds}
                                  for m in MAIN},
             "rows": {str(p): {**r, "ratio": [x if isinstance(x, str) else float(x) for x in r["ratio"]]}
                      for p, r in rows.items()},
             "claims": [c.summary() for c in decided]}
  return write_summary(out, summary)


def main(argv=None):
  parser = argparse.ArgumentParser(prog="python -m experiments.studies.wallclock", description=__doc__,
                                   formatter_class=argparse.RawDescriptionHelpFormatter)
  parser.add_argument("source", help=f"the study whose iterations to use: a folder holding {curves.FILE}")
  parser.add_argument("--out", required=True, help="where to write report.md and summary.json")
  parser.add_argument("--rounds", type=int, default=ROUNDS, help=f"timed rounds (default {ROUNDS})")
  parser.add_argument("--measured", help="a summary.json of this study: its times, not a new measurement")
  args = parser.parse_args(argv)
  if args.rounds < 1:
    raise ValueError(f"--rounds must be >= 1, got {args.rounds}")
  data = curves.read(args.source)
  runs, window = data["runs"], data["meta"]["window"]
  if args.measured:
    measured = json.loads(pathlib.Path(args.measured).read_text())["measured"]
  else:
    configs = configs_of(runs)
    if not configs:
      raise ValueError(f"{args.source!r} holds no main-study run of {', '.join(MAIN)}")
    times = measure(configs, args.rounds)
    from experiments.harness import provenance

    measured = {"how": f"{args.rounds} rounds, the configurations taking turns, seed 0's configs, on "
                       f"{curves.hosts_text([provenance.host()])}", "host": provenance.host(), "rounds": {}}
    for (m, p), got in times.items():
      measured["rounds"].setdefault(m, {})[str(p)] = got
  seconds = {(m, int(p)): statistics.median(got) for m, by_p in measured["rounds"].items()
             for p, got in by_p.items()}
  rows, decided = study(runs, window, seconds)
  out = pathlib.Path(args.out)
  command = f"python -m experiments.studies.wallclock {args.source} --out {args.out}"
  if args.measured:
    command += f" --measured {args.measured}"
  summary = write(args.source, rows, decided, seconds, measured, runs, out, command)
  print(f"wrote {out / 'report.md'}: " + "; ".join(
      f"{c['verdict']}: {c['claim']}" for c in summary["claims"]))
  return summary


if __name__ == "__main__":
  cli.exit_process(cli.run(main))

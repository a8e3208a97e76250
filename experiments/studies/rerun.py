"""``python -m experiments.studies.rerun NEW --against OLD --out DIR``: does a rerun reproduce a study?

NEW and OLD are folders holding ``curves.json.xz`` (a sweep's ``--out``, a ``--finished-only
--publish`` folder or a published study such as docs/results/cpu). Runs are paired by their whole
config (``curves.setting`` with nothing free: method, P, seed, rate and every option); per pair the
report gives the final validation loss of each and their difference, the final smoothed training
loss of each (OLD's window), whether the two training curves are identical at the stored precision
(both rounded to ``curves.LOSS_DECIMALS``) and the first step where they differ. Runs of NEW that
OLD does not hold are counted, not compared.

Writes ``report.md`` and ``summary.json`` (no curves: NEW's are wherever it was written).
"""

from __future__ import annotations

import argparse
import pathlib

import numpy as np

from experiments import cli
from experiments.report import curves, metrics
from experiments.studies import write_summary


def pair(new: dict, old: dict, window: int) -> dict:
  """One rerun against its committed run."""
  a, b = np.asarray(new["losses"], np.float64), np.asarray(old["losses"], np.float64)
  n = min(len(a), len(b))
  differ = np.flatnonzero(~np.isclose(a[:n], b[:n], rtol=0, atol=0, equal_nan=True))
  c = new["config"]
  vals = [metrics.final_val(new), metrics.final_val(old)]
  return {"method": c["method"], "P": c["stages"], "seed": c["seed"], "lr": c["lr"],
          "final_val": {"rerun": vals[0], "committed": vals[1]},
          "final_val_difference": None if None in vals else vals[0] - vals[1],
          "final_smoothed": {"rerun": metrics.final_smoothed(a, window),
                             "committed": metrics.final_smoothed(b, window)},
          "identical": len(a) == len(b) and differ.size == 0,
          "first_difference_step": None if differ.size == 0 else int(differ[0]) + 1,
          "rerun_seconds": new.get("seconds"), "rerun_commit": (new.get("code") or {}).get("commit"),
          "committed_commit": (old.get("code") or {}).get("commit")}


def study(new_runs, old_runs, window: int) -> tuple[list, int, dict]:
  """``(pairs, rerun runs without a twin, {"rerun", "committed": {"hosts", "commits"}})`` of the
  paired runs: on which CPUs and by which code each side trained."""
  held = {curves.setting(r["config"], ()): r for r in old_runs}
  pairs, unmatched, sides = [], 0, {"rerun": [], "committed": []}
  for r in new_runs:
    old = held.get(curves.setting(r["config"], ()))
    if old is None:
      unmatched += 1
    else:
      pairs.append(pair(r, old, window))
      sides["rerun"].append(r)
      sides["committed"].append(old)
  pairs.sort(key=lambda p: (p["method"], p["P"], p["lr"], p["seed"]))
  provenance = {k: {"hosts": curves.hosts_of(v),
                    "commits": sorted({str((r.get("code") or {}).get("commit"))[:12] for r in v})}
                for k, v in sides.items()}
  return pairs, unmatched, provenance


def _spread(pairs) -> dict | None:
  diffs = [abs(p["final_val_difference"]) for p in pairs if p["final_val_difference"] is not None]
  return None if not diffs else {"median": float(np.median(diffs)), "max": float(max(diffs))}


def write(pairs, unmatched, sources, out: pathlib.Path, command: str, provenance=None) -> dict:
  out.mkdir(parents=True, exist_ok=True)
  spread = _spread(pairs)
  by_p = {str(p): _spread([x for x in pairs if x["P"] == p]) for p in sorted({x["P"] for x in pairs})}
  aggregate = {"pairs": len(pairs), "identical": sum(p["identical"] for p in pairs),
               "unmatched": unmatched, "abs_final_val_difference": spread,
               "abs_final_val_difference_by_P": by_p}
  fmt = lambda v: "-" if v is None else f"{v:.5f}"
  cpus = lambda side: curves.hosts_text(side["hosts"]) or "-"
  lines = ["# A rerun against the committed study", "", f"- made by `{command}`",
           f"- rerun: `{sources[0]}`; committed: `{sources[1]}`"]
  if provenance:
    lines += [f"- CPUs: rerun {cpus(provenance['rerun'])}; committed {cpus(provenance['committed'])}",
              f"- code commits: rerun {', '.join(provenance['rerun']['commits'])}; committed "
              f"{', '.join(provenance['committed']['commits'])}"]
  lines += [f"- {len(pairs)} runs paired by their whole config, {aggregate['identical']} with identical "
            f"training curves (as stored, {curves.LOSS_DECIMALS} decimals); {unmatched} rerun runs without a "
            "committed twin",
            ""]
  if spread:
    lines += [f"|final validation loss, rerun minus committed|: median {spread['median']:.4f}, "
              f"max {spread['max']:.4f}; " + "; ".join(
                  f"at P = {p}: median {v['median']:.4f}, max {v['max']:.4f}" for p, v in by_p.items() if v),
              ""]
  lines += ["| method | P | lr | seed | final val (committed) | final val (rerun) | difference | "
            "final smoothed (committed) | final smoothed (rerun) | identical curve | first differing step |",
            "|---|---|---|---|---|---|---|---|---|---|---|"]
  for p in pairs:
    d = p["final_val_difference"]
    lines.append(f"| {p['method']} | {p['P']} | {p['lr']:g} | {p['seed']} | "
                 f"{fmt(p['final_val']['committed'])} | {fmt(p['final_val']['rerun'])} | "
                 f"{'-' if d is None else f'{d:+.5f}'} | "
                 f"{fmt(p['final_smoothed']['committed'])} | {fmt(p['final_smoothed']['rerun'])} | "
                 f"{'yes' if p['identical'] else 'no'} | {p['first_difference_step'] or '-'} |")
  (out / "report.md").write_text("\n".join(lines) + "\n")
  summary = {"command": command, "sources": list(sources), "provenance": provenance,
             "aggregate": aggregate, "pairs": pairs}
  return write_summary(out, summary)


def main(argv=None):
  parser = argparse.ArgumentParser(prog="python -m experiments.studies.rerun", description=__doc__,
                                   formatter_class=argparse.RawDescriptionHelpFormatter)
  parser.add_argument("new", help=f"the rerun: a folder holding {curves.FILE}")
  parser.add_argument("--against", required=True, help=f"the committed study: a folder holding {curves.FILE}")
  parser.add_argument("--out", required=True, help="where to write report.md and summary.json")
  args = parser.parse_args(argv)
  new, old = curves.merge([args.new]), curves.merge([args.against])  # both at the stored precision
  pairs, unmatched, provenance = study(new["runs"], old["runs"], old["meta"]["window"])
  if not pairs:
    raise ValueError(f"no run of {args.new!r} has a twin in {args.against!r} (same config)")
  command = f"python -m experiments.studies.rerun {args.new} --against {args.against} --out {args.out}"
  summary = write(pairs, unmatched, (args.new, args.against), pathlib.Path(args.out), command, provenance)
  print(f"wrote {args.out}/report.md: {len(pairs)} pairs, {summary['aggregate']['identical']} identical")
  return summary


if __name__ == "__main__":
  cli.exit_process(cli.run(main))

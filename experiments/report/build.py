"""``python -m experiments.report SOURCE``: a study's report rebuilt from its committed curves.

SOURCE is a folder holding ``curves.json.xz`` (a sweep's ``--out``, or a published
``docs/results/<study>``). The report is computed from those curves alone, in seconds, with nothing
trained: ``report.md`` (tables, claims and verdicts), ``results.csv``, ``summary.json`` and the
figures, into ``--out`` (default SOURCE). ``--methods`` keeps only those methods' runs; the headline
of a method depends on its own runs only, so it does not change. ``--block N --out DIR`` first writes
SOURCE's runs into DIR's curves file with each training loss stored as means over blocks of N steps
(``curves.compact``: a tenth of the bytes at N = 10), then builds the report from those, so that
``python -m experiments.report DIR`` rebuilds every number from what DIR holds. ``--no-figures``
writes everything but the figures (a study of many runs kept small). ``--readme`` rewrites the
README's generated tables from the published reports they name.

``summary.json``: ``{"command", "commit", "hosts", "headline": {method: {P: {"mean", "min", "max",
"ci95", "seeds"}}}, "claims": [{"claim", "verdict", "evidence", "paper"}], "readings": ...}``.
"""

from __future__ import annotations

import argparse
import csv
import pathlib
import re
import tempfile

import numpy as np

from experiments.report import ablations as ablations_lib
from experiments.report import claims as claims_lib
from experiments.report import curves as curves_lib
from experiments.report import metrics, sections
from experiments.report import published as published_lib
from experiments.report import summary as summary_lib
from experiments.report.tables import curves_by, final_loss

TUNED = "tuned-lr"  # the group of runs at a method's own tuned rate (the second reading)


def write_csv(path: pathlib.Path, runs, window: int) -> None:
  with open(path, "w", newline="") as f:
    w = csv.writer(f)
    w.writerow(["name", "group", "method", "stages", "mode", "model", "num_blocks", "seed", "lr",
                "steps", "status", "final_smoothed_loss", "final_val_loss", "seconds", "steps_per_second"])
    for r in runs:
      c = r["config"]
      # A run that diverged or did not finish has no final validation loss (not an earlier one).
      val = [v for v in (r["val_losses"][-1:] if r["status"] == "finished" else []) if np.isfinite(v)]
      sps = r.get("steps_per_second")
      w.writerow([r["name"], r["group"], c["method"], c["stages"], c["mode"], c["model"],
                  c["num_blocks"] or "", c["seed"], c["lr"], c["steps"], r["status"],
                  f"{final_loss(r, window):.5f}", f"{val[-1]:.5f}" if val else "",
                  f"{r['seconds']:.2f}", f"{sps:.1f}" if sps else ""])


def choose_rates(main: list, tuned: list, intervals: bool = True) -> tuple[list, list, dict]:
  """The main reading and the second one, and the evidence for the choice.

  The main reading runs every method at the shared rate, unless a method's own tuned rate beats it
  by more than the seed noise: the per-seed difference of final validation loss at P = 1 (shared
  minus tuned) has a 95% interval above zero. Returns ``(main reading, tuned reading, {method:
  {"shared", "tuned", "difference": interval or per-seed values, "verdict", "main"}})``. Without
  ``intervals`` (fewer seeds than a verdict needs) the shared rate stays the main reading and the
  difference is given per seed."""
  choice = {}
  by_method = {}
  for r in tuned:
    by_method.setdefault(r["config"]["method"], []).append(r)
  for method, runs in sorted(by_method.items()):
    at1 = lambda rs: {r["config"]["seed"]: metrics.final_val(r) for r in rs
                      if r["config"]["method"] == method and r["config"]["stages"] == 1}
    shared, own = at1(main), at1(runs)
    seeds = sorted(set(shared) & set(own))
    diffs = [None if shared[s] is None or own[s] is None else shared[s] - own[s] for s in seeds]
    verdict, iv, why = claims_lib.judge(diffs, 0.0)
    if not intervals:
      verdict, iv, why = "inconclusive", None, "too few seeds for a verdict"
    choice[method] = {"shared": sorted({r["config"]["lr"] for r in main if r["config"]["method"] == method}),
                      "tuned": sorted({r["config"]["lr"] for r in runs}), "seeds": seeds,
                      "difference": claims_lib.describe(diffs, iv, "{:+.4f}"),
                      "main": "tuned" if verdict == "reproduced" else "shared", "why": why}
  swap = {m for m, c in choice.items() if c["main"] == "tuned"}
  of = lambda rs, m: [r for r in rs if r["config"]["method"] == m]
  names = sorted({r["config"]["method"] for r in main} | set(by_method))
  main_reading = [r for m in names for r in of(tuned if m in swap else main, m)]
  second = [r for m in names for r in of(main if m in swap or m not in by_method else tuned, m)]
  return main_reading, second, choice


def rates_section(choice: dict) -> list:
  if not choice:
    return []
  lines = ["## Learning rates: the main reading and the second", "",
           "The main reading runs every method at one shared rate unless a method's own tuned rate "
           "beats it by more than the seed noise: the per-seed difference of final validation loss "
           "at P = 1 (shared minus tuned, paired by seed) has a 95% t interval above zero. The "
           "other rate is the second reading, whose claims are listed too.", "",
           "| method | shared rate | tuned rate | val. loss, shared minus tuned (P = 1) | main reading |",
           "|---|---|---|---|---|"]
  for m, c in choice.items():
    why = f" ({c['why']})" if c["why"] else ""
    lines.append(f"| {m} | {', '.join(f'{x:g}' for x in c['shared'])} | "
                 f"{', '.join(f'{x:g}' for x in c['tuned'])} | {c['difference']} | {c['main']}{why} |")
  return lines + [""]


def header(meta: dict, runs: list, command: str) -> list:
  """The report's first lines: how it was made, on which CPUs, and the study's setting."""
  commits = sorted({str((r.get("code") or {}).get("commit"))[:12] for r in runs})
  distinct = {r["name"]: r for r in runs}  # an ablation may list a main run again
  trained = sum(r.get("seconds") or 0.0 for r in distinct.values())
  sweeps = meta.get("sweeps") or [meta["command"]]
  made = (f"made by `{command}`" if command == meta["command"] else
          f"rebuilt by `{command}` from `{curves_lib.FILE}` (the sweep" + ("s" if len(sweeps) > 1 else "")
          + ": " + "; ".join(f"`{c}`" for c in sweeps) + ")")
  lines = [f"# Staleness study: preset `{meta['preset']}`", "",
           f"- {made}; runs trained by commit(s) {', '.join(commits)}, {trained:.0f} s of training "
           f"over {len(distinct)} distinct runs (compilation included)"]
  cpus = curves_lib.hosts_of(runs)
  if len(cpus) > 1:
    lines.append("- **the runs come from more than one CPU**: " + curves_lib.hosts_text(cpus)
                 + " (a run's numbers depend on both)")
  elif cpus:
    lines.append(f"- every run trained on one CPU: {curves_lib.hosts_text(cpus)}")
  lines += curves_lib.revision_lines(distinct.values())
  schedules = sorted({r["config"].get("schedule", "1f1b") for r in runs if r["config"]["stages"] > 1})
  names = {"1f1b": "PipeDream 1F1B (stage k lags P - 1 - k updates)",
           "2bw": "PipeDream-2BW (every stage one update behind, whatever P)"}
  if schedules:
    lines.append("- pipeline schedule at P > 1: " + "; ".join(names.get(x, x) for x in schedules))
  lines += [f"- {line}" for line in meta["setting"]] + [""]
  if meta.get("deviations"):
    lines += ["## Deviations from the paper", ""] + [f"- {d}" for d in meta["deviations"]] + [""]
  return lines


def headline(tables) -> dict:
  """``{method: {P: interval}}`` of the headline (``metrics.interval``; ``None`` values where a
  seed has no number)."""
  out = {}
  for row in metrics.aggregate(tables):
    f = "slowdown_levels"
    out.setdefault(row["method"], {})[str(row["stages"])] = {
        "mean": row[f], "min": row[f + "_lo"], "max": row[f + "_hi"], "ci95": row[f + "_ci"],
        "seeds": row["seeds"]}
  return out


def report_claims(main, second, choice, groups, window: int) -> list:
  """One report's claims, uncorrected, at smoothing ``window`` (``claims.protocol`` decides them)."""
  tables, muon = claims_lib.claim_tables(curves_by(main), window) if main else ([], [])
  out = claims_lib.main_claims(tables, " (main reading)" if choice else "", muon)
  if choice:
    tables2, muon2 = claims_lib.claim_tables(curves_by(second), window)
    out += claims_lib.main_claims(tables2, " (second reading)", muon2)
  return out + ablations_lib.ablation_claims(groups, window, curves_by(main) if main else {})


def checked_claims(runs: list, window: int, intervals: bool = True) -> tuple[list, tuple]:
  """The claims of a study's runs under the protocol (Holm, the window rule), and ``(main reading,
  second reading, rate choice, ablation groups)`` they were drawn from."""
  main, second, choice = choose_rates([r for r in runs if r["group"] == "main"],
                                      [r for r in runs if r["group"] == TUNED], intervals)
  groups = {}
  for r in runs:
    if r["group"] not in ("main", TUNED):
      groups.setdefault(r["group"], []).append(r)
  windows = {"reported": window, "half": max(1, window // 2), "double": 2 * window}
  claims = claims_lib.protocol(lambda label: report_claims(main, second, choice, groups, windows[label]))
  return claims, (main, second, choice, groups)


def build(source, out=None, methods=None, command: str | None = None, figures: bool = True,
          published=None) -> dict:
  """Writes report.md, results.csv, summary.json and (unless ``figures`` is false) the figures of
  the study in ``source`` (a folder holding ``curves.json.xz``, or the file) into ``out`` (default:
  its folder); returns the summary. ``published``: the folder of the published study of the same
  preset, whose runs of the same names the report compares with; with fewer seeds than it holds,
  the report draws no verdict and prints no t interval (``experiments.report.published``)."""
  data = curves_lib.read(source)
  source = pathlib.Path(source)
  out = pathlib.Path(out) if out is not None else (source if source.is_dir() else source.parent)
  out.mkdir(parents=True, exist_ok=True)
  meta, runs = data["meta"], data["runs"]
  if methods:
    known = sorted({r["config"]["method"] for r in runs})
    unknown = sorted(set(methods) - set(known))
    if unknown:
      raise ValueError(f"--methods {unknown}: not in this study (it has {known})")
    runs = [r for r in runs if r["config"]["method"] in methods]
  command = command or f"python -m experiments.report {source}"
  window = meta["window"]
  write_csv(out / "results.csv", runs, window)
  theirs = curves_lib.read(published) if published is not None else None
  needed = len(published_lib.seeds_of(theirs["runs"])) if theirs else None
  seeds = published_lib.seeds_of(runs)
  decided = needed is None or len(seeds) >= needed
  claims, (main, second, choice, groups) = checked_claims(runs, window, decided)
  scratch = None if figures else tempfile.TemporaryDirectory()  # where the figures go unpublished
  ctx = sections.Context(out if figures else pathlib.Path(scratch.name), window, main, [], decided)
  lines = header(meta, runs, command) + rates_section(choice)
  tables = []
  if main:
    section, tables = sections.main_section(ctx, main)
    lines += section
  lines += sections.diagnostics_section(ctx, runs)
  for name, results in groups.items():
    ablation = ablations_lib.check_group(name)
    lines += [f"## Ablation: {name}", "", ablation.description, ""]
    lines += ablation.section(ctx, name, results)
  plumbing = bool(meta.get("plumbing"))
  if decided:
    lines += claims_lib.section(claims, plumbing)
  compared = {}
  if theirs is not None:
    compared["runs"] = published_lib.compare_runs(runs, window, theirs["runs"], theirs["meta"]["window"])
    lines += published_lib.runs_section(compared["runs"], published_lib.shown(published),
                                        theirs["meta"]["command"], published_lib.seeds_of(theirs["runs"]))
    if not plumbing:
      their_claims, _ = checked_claims(theirs["runs"], theirs["meta"]["window"])
      compared["claims"] = published_lib.compare_claims(claims, their_claims)
      lines += published_lib.claims_section(compared["claims"], seeds, None if decided else needed)
  if figures:
    lines += ["## Figures", ""] + [f"![{f}]({f})" for f in ctx.figures] + [""]
  else:
    scratch.cleanup()
    lines += ["No figures are published with this study (docs/results' size); `python -m "
              f"experiments.report {source} --out DIR` draws them from the same curves.", ""]
  (out / "report.md").write_text(curves_lib.current_commands("\n".join(lines)))
  summary = {"command": meta["command"], "rebuilt_by": command,
             "commit": (meta.get("code") or {}).get("commit"),
             "hosts": curves_lib.hosts_of(runs), "headline": headline(tables),
             "claims": [] if plumbing or not decided else [c.summary() for c in claims],
             "readings": choice, "plumbing": plumbing,
             **({"published": {"folder": str(published), "seeds_needed": needed, **compared}}
                if theirs is not None else {})}
  return summary_lib.write(out / "summary.json", summary)


# ---- the README's generated tables ---------------------------------------------------------------

GENERATED = re.compile(r"(<!-- generated from (\S+) section \"([^\"]+)\" -->\n)(.*?)"
                       r"(<!-- end generated -->)", re.S)


def section_table(report_md: str, heading: str) -> str:
  """The first Markdown table under ``## heading`` of a report."""
  lines = report_md.splitlines()
  try:
    start = lines.index(f"## {heading}")
  except ValueError:
    raise ValueError(f"no section '## {heading}' in the report") from None
  table = []
  for line in lines[start + 1:]:
    if line.startswith("## "):
      break
    if line.startswith("|"):
      table.append(line)
    elif table:
      break
  if not table:
    raise ValueError(f"section '## {heading}' has no table")
  return "\n".join(table) + "\n"


def sync_readme(readme: pathlib.Path) -> list:
  """Rewrites each generated block of ``readme`` (between ``<!-- generated from PATH section
  "HEADING" -->`` and ``<!-- end generated -->``) with that table of the report at PATH (relative to
  the README's folder). Returns the blocks that changed (as ``(path, heading)``)."""
  text, changed = readme.read_text(), []

  def fill(m):
    table = section_table((readme.parent / m.group(2)).read_text(), m.group(3))
    if table != m.group(4):
      changed.append((m.group(2), m.group(3)))
    return m.group(1) + table + m.group(5)

  new = GENERATED.sub(fill, text)
  if new != text:
    readme.write_text(new)
  return changed


def main(argv=None):
  parser = argparse.ArgumentParser(prog="python -m experiments.report", description=__doc__,
                                   formatter_class=argparse.RawDescriptionHelpFormatter)
  parser.add_argument("source", nargs="?", help=f"a folder holding {curves_lib.FILE}")
  parser.add_argument("--methods", nargs="+", help="keep only these methods' runs")
  parser.add_argument("--out", help="where to write (default: SOURCE)")
  parser.add_argument("--add", nargs="+", default=[], metavar="FOLDER", help=f"first merge the runs "
                      f"of these folders' {curves_lib.FILE} into SOURCE's (its rerun seeds, say), "
                      "rewriting SOURCE's curves file")
  parser.add_argument("--no-figures", action="store_true", help="write no figures (the report says "
                      "how to draw them)")
  parser.add_argument("--block", type=int, help="store the runs in --out's curves file as training-loss "
                      "means over blocks of this many steps, and build the report from them")
  parser.add_argument("--readme", help="rewrite this README's generated tables (after rebuilding "
                      "SOURCE, if given)")
  args = parser.parse_args(argv)
  if args.source is None and args.readme is None:
    parser.error("give SOURCE, --readme, or both")
  summary = None
  if args.source is not None:
    if args.add:
      merged = curves_lib.merge([args.source] + args.add)
      target = pathlib.Path(args.source)
      target = target / curves_lib.FILE if target.is_dir() else target
      curves_lib.write(target, merged["meta"], merged["runs"])
      print(f"merged {len(merged['runs'])} runs into {target}")
    source = args.source
    if args.block is not None:
      if args.block < 1 or not args.out or pathlib.Path(args.out).resolve() == pathlib.Path(source).resolve():
        raise ValueError(f"--block needs an int >= 1 and an --out other than SOURCE, got --block "
                         f"{args.block}, --out {args.out}")
      compacted = curves_lib.merge([source], block=args.block)
      pathlib.Path(args.out).mkdir(parents=True, exist_ok=True)
      curves_lib.write(pathlib.Path(args.out) / curves_lib.FILE, compacted["meta"], compacted["runs"])
      source, args.out = args.out, None  # the report comes from the compacted curves alone
    command = f"python -m experiments.report {source}" + (f" --out {args.out}" if args.out else "") + (
        f" --methods {' '.join(args.methods)}" if args.methods else "") + (
        " --no-figures" if args.no_figures else "")
    summary = build(source, args.out, args.methods, command, figures=not args.no_figures)
    print(f"wrote {pathlib.Path(args.out or source) / 'report.md'}")
  if args.readme is not None:
    readme = pathlib.Path(args.readme)
    if not readme.is_file():
      raise ValueError(f"--readme {str(readme)!r} is not a file")
    changed = sync_readme(readme)
    print("\n".join(f"updated: {p}, section {h!r}" for p, h in changed) or "up to date")
    return changed
  return summary


if __name__ == "__main__":
  from experiments import cli

  cli.exit_process(cli.run(main))

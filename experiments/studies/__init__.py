"""The studies beyond the sweep, one module each, each its own command
(``python -m experiments.studies.<name>``): ``horizon`` (the training horizon), ``lag`` and
``basis_lag`` (estimation lag), ``lr_grid``, ``memory`` (the staleness-aware statistics memory),
``remedies``, ``wallclock`` (wall-clock to target), ``rerun``, ``pipedream_2bw`` (PipeDream-2BW
against 1F1B), ``protocol``, ``regime``, ``misalignment``, the long horizon's ``tuned_rates`` and
``long_horizon``, the width ``ladder``, and the diagnostics ``hessian`` and ``toy_quadratic``."""

from __future__ import annotations

import pathlib

from experiments.report import summary as summary_lib


def write_summary(out: pathlib.Path, summary: dict) -> dict:
  """Writes ``out/summary.json`` (``experiments.report.summary.write``) and returns the summary as a
  reader of that file gets it."""
  return summary_lib.write(pathlib.Path(out) / "summary.json", summary)


def out_folder(args, commands: list) -> pathlib.Path | None:
  """A queued study's ``--next`` / ``--out``: with ``--next`` prints the sweeps still to run (one a
  line, for the queue) and returns ``None``; else the ``--out`` folder, created."""
  if args.next:
    print("\n".join(commands))
    return None
  if not args.out:
    raise ValueError("give --out (or --next)")
  out = pathlib.Path(args.out)
  out.mkdir(parents=True, exist_ok=True)
  return out

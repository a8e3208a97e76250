"""The studies beyond the sweep, one module each, each its own command
(``python -m experiments.studies.<name>``): ``horizon`` (the training horizon), ``lag`` and
``basis_lag`` (estimation lag), ``lr_grid``, ``memory`` (the staleness-aware statistics memory),
``remedies``, ``wallclock`` (wall-clock to target), ``rerun``, ``pipedream_2bw`` (PipeDream-2BW
against 1F1B), ``protocol``, ``regime``, ``misalignment``, and the diagnostics ``hessian`` and
``toy_quadratic``."""

from __future__ import annotations

import pathlib

from experiments.report import summary as summary_lib


def write_summary(out: pathlib.Path, summary: dict) -> dict:
  """Writes ``out/summary.json`` (``experiments.report.summary.write``) and returns the summary as a
  reader of that file gets it."""
  return summary_lib.write(pathlib.Path(out) / "summary.json", summary)

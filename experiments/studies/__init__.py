"""The studies beyond the sweep, one module each, each its own command
(``python -m experiments.studies.<name>``): ``horizon`` (the training horizon), ``lag`` and
``basis_lag`` (estimation lag), ``lr_grid``, ``memory`` (the staleness-aware statistics memory),
``remedies``, ``wallclock`` (wall-clock to target), ``rerun``, ``pipedream_2bw`` (PipeDream-2BW
against 1F1B), ``protocol``, ``regime``, ``misalignment``, and the diagnostics ``hessian`` and
``toy_quadratic``."""

from __future__ import annotations

import json
import pathlib

import numpy as np


def write_summary(out: pathlib.Path, summary: dict) -> dict:
  """Writes ``out/summary.json`` (NumPy floats as floats, anything else not JSON as its text) and
  returns the summary as a reader of that file gets it."""

  def plain(x):
    return float(x) if isinstance(x, np.floating) else str(x)

  text = json.dumps(summary, indent=1, default=plain)
  (pathlib.Path(out) / "summary.json").write_text(text + "\n")
  return json.loads(text)

"""How every study writes its JSON results (``summary.json`` and the like): compact, one line, each
float to ``DIGITS`` significant digits, so that docs/results stays under its 2 MB budget (indented,
the committed summaries took a quarter more; every digit, 25 KB more), and read back as a reader of
the file gets them."""

from __future__ import annotations

import json
import pathlib

import numpy as np


def plain(x):
  """JSON's fallback: NumPy and JAX scalars as numbers, anything else not JSON as its text."""
  if isinstance(x, np.integer):
    return int(x)
  if isinstance(x, np.floating):
    return float(x)
  if hasattr(x, "item") and np.ndim(x) == 0:  # a 0-d array
    return x.item()
  return str(x)


DIGITS = 10  # significant digits of a float: past any study's precision (reports quote 2 to 5)


def _rounded(x):
  """``x`` with every float (NumPy's too) to ``DIGITS`` significant digits."""
  if isinstance(x, (float, np.floating)):
    return float(f"{x:.{DIGITS}g}")
  if isinstance(x, dict):
    return {k: _rounded(v) for k, v in x.items()}
  if isinstance(x, (list, tuple)):
    return [_rounded(v) for v in x]
  return x


def dumps(obj) -> str:
  """``obj`` as compact JSON text (no spaces; floats rounded, ``_rounded``), with ``plain`` for what
  JSON cannot hold."""
  return json.dumps(_rounded(obj), separators=(",", ":"), default=plain)


def write(path, obj) -> dict:
  """Writes ``obj`` to ``path`` (``dumps``, then a newline) and returns it as read back."""
  text = dumps(obj)
  pathlib.Path(path).write_text(text + "\n")
  return json.loads(text)

"""The study around the library: model, data, runs, the sweep, diagnostics and benchmarks.

Thread policy of the command-line tools (``python -m experiments.<tool>``): XLA's CPU QR, eigh and
SVD (basis rotation's refreshes) call LAPACK in OpenBLAS, whose own worker threads compete with
XLA's threads, and with any other process, for the cores; on a busy 2-core machine one refresh can
take hundreds of times longer (``python -m experiments.bench_threads``). So when a tool of this
package is the program being run, OpenBLAS is made single-threaded before anything loads it,
unless the user already chose (``OPENBLAS_NUM_THREADS`` or ``OMP_NUM_THREADS`` set). Importing
this package from your own program changes nothing: set ``OPENBLAS_NUM_THREADS=1`` yourself before
Python starts.
"""

import os
import sys

BLAS_THREAD_VARIABLES = ("OPENBLAS_NUM_THREADS", "OMP_NUM_THREADS")


def _running_tool() -> str | None:
  """``experiments.X`` when this process is ``python -m experiments.X`` (else ``None``)."""
  argv = list(getattr(sys, "orig_argv", []))
  if "-m" in argv[:-1]:
    module = argv[argv.index("-m") + 1]
    if module.startswith("experiments."):
      return module
  return None


if _running_tool() is not None and not any(v in os.environ for v in BLAS_THREAD_VARIABLES):
  os.environ["OPENBLAS_NUM_THREADS"] = "1"

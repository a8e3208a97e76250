"""The study around the library: model, data, runs, the sweep, diagnostics and benchmarks.

Thread policy of the command-line tools (``python -m experiments.<tool>``): XLA's CPU QR, eigh and
SVD (basis rotation's refreshes) call LAPACK in OpenBLAS, whose own worker threads compete with
XLA's threads, and with any other process, for the cores; on a busy 2-core machine one refresh can
take hundreds of times longer (``python -m experiments.bench.threads``). So when a tool of this
package is the program being run, OpenBLAS is made single-threaded before anything loads it,
unless the user already chose (``OPENBLAS_NUM_THREADS`` or ``OMP_NUM_THREADS`` set). Importing
this package from your own program changes no environment variable, and the library changes no
thread count (a program of one's own calls ``rotation.limit_lapack_threads()``).

Compilation cache of the command-line tools: JAX's persistent compilation cache is turned on, in
``$XDG_CACHE_HOME/staleness-rotation/jax`` (default ``~/.cache/...``), unless the user set
``JAX_COMPILATION_CACHE_DIR`` (an empty value turns it off). A run's compiled programs depend on
its shapes and settings, not on its seed, so the second seed of a configuration, a resumed run
and a rerun skip compilation; the cached program is the same program, so the numbers do not
change.
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

if _running_tool() is not None and "JAX_COMPILATION_CACHE_DIR" not in os.environ:
  _cache_home = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
  os.environ["JAX_COMPILATION_CACHE_DIR"] = os.path.join(_cache_home, "staleness-rotation", "jax")

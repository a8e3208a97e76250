"""One LAPACK thread for basis rotation's refreshes on CPU, when the caller asks for it.

On the CPU backend JAX's QR, eigh and SVD (basis rotation's refreshes) call LAPACK through SciPy's
``cython_lapack``, i.e. the OpenBLAS that SciPy ships, whose own worker threads compete with XLA's
threads for the same cores (docs/benchmarks.md, "Threads", measures what that costs). The library
never changes this by itself: a program opts in with ``OPENBLAS_NUM_THREADS=1`` in its environment
(before anything loads OpenBLAS) or by calling ``limit_lapack_threads()`` once, which sets *that*
OpenBLAS (the libraries shipped inside the ``scipy`` distribution, found with threadpoolctl) to
one thread. What it changes: SciPy's own LAPACK/BLAS calls in the same process (``scipy.linalg``)
also run single-threaded; NumPy's matmuls (NumPy ships its own OpenBLAS) and XLA's own kernels do
not change. With ``OPENBLAS_NUM_THREADS`` or ``OMP_NUM_THREADS`` set it changes nothing (the
setting is the user's); where SciPy uses a system BLAS (a conda install), nothing is changed either.
The study's command-line tools set ``OPENBLAS_NUM_THREADS=1`` (``experiments/__init__.py``).
"""

from __future__ import annotations

import functools
import os
import pathlib
from importlib import metadata

BLAS_THREAD_VARIABLES = ("OPENBLAS_NUM_THREADS", "OMP_NUM_THREADS")


def _scipy_libraries() -> set[str]:
  """Real paths of the shared libraries inside the installed ``scipy`` distribution."""
  try:
    files = metadata.files("scipy") or []
  except metadata.PackageNotFoundError:
    return set()
  return {os.path.realpath(f.locate()) for f in files if ".so" in f.name or f.name.endswith(".dll")}


@functools.cache
def limit_lapack_threads() -> list[str]:
  """Sets the OpenBLAS that JAX's CPU LAPACK calls use to one thread (once per process), unless the
  user set ``OPENBLAS_NUM_THREADS`` or ``OMP_NUM_THREADS``. Returns the paths of the libraries
  limited (empty when nothing was changed)."""
  if any(v in os.environ for v in BLAS_THREAD_VARIABLES):
    return []
  try:
    import scipy.linalg.cython_lapack  # noqa: F401  (loads the LAPACK that jaxlib's CPU kernels call)
    from threadpoolctl import ThreadpoolController
  except ImportError:
    return []
  ours = _scipy_libraries()
  controller = ThreadpoolController()
  paths = [lib.filepath for lib in controller.lib_controllers
           if lib.internal_api == "openblas" and os.path.realpath(lib.filepath) in ours]
  if paths:
    controller.select(filepath=paths).limit(limits=1)
  return [str(pathlib.Path(p)) for p in paths]

"""rotation.threads: using the library changes no thread count; a program that calls
``rotation.limit_lapack_threads()`` gets single-threaded LAPACK for the refreshes on CPU (SciPy's
OpenBLAS), NumPy's OpenBLAS untouched, a user's own setting kept."""

import json
import os
import subprocess
import sys

import pytest

PROBE = """
import json, os
import jax, jax.numpy as jnp
import scipy.linalg.cython_lapack
from threadpoolctl import threadpool_info
import rotation
from rotation.threads import _scipy_libraries
ours = _scipy_libraries()
count = lambda: {("scipy" if os.path.realpath(i["filepath"]) in ours else "other"): i["num_threads"]
                 for i in threadpool_info() if i["internal_api"] == "openblas"}
before = count()
tx = rotation.basis_rotation(1e-3, refresh_every=1)
state = tx.init({"w": jnp.zeros((4, 3))})
tx.update({"w": jnp.ones((4, 3))}, state, {"w": jnp.zeros((4, 3))})  # a refresh: QR and eigh
used = count()
limited = rotation.limit_lapack_threads()
print(json.dumps({"cores": len(os.sched_getaffinity(0)), "before": before, "used": used, "after": count(),
                  "limited": limited}))
"""


def _probe(**env):
  base = {k: v for k, v in os.environ.items() if k not in ("OPENBLAS_NUM_THREADS", "OMP_NUM_THREADS")}
  out = subprocess.run([sys.executable, "-c", PROBE], env={**base, "JAX_PLATFORMS": "cpu", **env},
                       capture_output=True, text=True, timeout=300)
  assert out.returncode == 0, out.stderr[-2000:]
  return json.loads(out.stdout.strip().splitlines()[-1])


def test_using_the_library_changes_no_thread_count_and_the_one_line_limits_scipys_openblas():
  got = _probe()
  assert "scipy" in got["before"], got  # the wheel's OpenBLAS that jaxlib's LAPACK calls
  if got["cores"] > 1:  # (on one core OpenBLAS starts single-threaded: nothing to tell apart)
    assert got["before"]["scipy"] > 1, got
  assert got["used"] == got["before"], got  # init and a refresh leave the process as it was
  assert got["after"]["scipy"] == 1 and got["limited"], got
  assert got["after"].get("other") == got["before"].get("other"), got  # NumPy's own untouched


@pytest.mark.parametrize("variable", ["OPENBLAS_NUM_THREADS", "OMP_NUM_THREADS"])
def test_a_users_own_thread_setting_is_kept(variable):
  got = _probe(**{variable: "2"})
  assert got["after"] == got["before"] and got["limited"] == [], got


def test_the_benchmarks_median_of_repeated_runs():
  from experiments.bench import threads

  got = threads.medians({"a": [1.3, 1.1, 1.7, 1.2, 1.25], "b": [2.0], "none": []})
  assert got == {"a": (1.25, 1.1, 1.7), "b": (2.0, 2.0, 2.0)}
  with pytest.raises(ValueError, match="--repeat must be >= 1"):
    threads.main(["--repeat", "0"])

"""What ``python -m experiments.<tool>`` sets before JAX loads (experiments/__init__.py)."""

import json
import os
import subprocess
import sys

import pytest

PROBE = ("import json, os, sys; sys.orig_argv = {argv!r}; import experiments; "
         "print(json.dumps({{k: os.environ.get(k) for k in ('OPENBLAS_NUM_THREADS', "
         "'JAX_COMPILATION_CACHE_DIR')}}))")


def _env_after_import(argv, **env):
  base = {k: v for k, v in os.environ.items()
          if k not in ("OPENBLAS_NUM_THREADS", "OMP_NUM_THREADS", "JAX_COMPILATION_CACHE_DIR")}
  out = subprocess.run([sys.executable, "-c", PROBE.format(argv=argv)], env={**base, **env},
                       capture_output=True, text=True, check=True)
  return json.loads(out.stdout)


@pytest.mark.parametrize("tool", [True, False])
def test_tools_get_single_threaded_blas_and_a_compilation_cache(tool, tmp_path):
  argv = ["python", "-m", "experiments.sweep"] if tool else ["python", "my_script.py"]
  got = _env_after_import(argv, XDG_CACHE_HOME=str(tmp_path))
  if tool:
    assert got == {"OPENBLAS_NUM_THREADS": "1",
                   "JAX_COMPILATION_CACHE_DIR": str(tmp_path / "staleness-rotation" / "jax")}
  else:  # importing the package from one's own program changes nothing
    assert got == {"OPENBLAS_NUM_THREADS": None, "JAX_COMPILATION_CACHE_DIR": None}


def test_the_users_own_settings_are_kept():
  argv = ["python", "-m", "experiments.sweep"]
  got = _env_after_import(argv, OMP_NUM_THREADS="2", JAX_COMPILATION_CACHE_DIR="")
  assert got == {"OPENBLAS_NUM_THREADS": None, "JAX_COMPILATION_CACHE_DIR": ""}

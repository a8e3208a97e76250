import os

# The suite's programs run a few steps each, so compiling them dominates: XLA's CPU backend with
# LLVM at -O0 and without its expensive passes compiles a rotation run's step about 2x faster. Every
# comparison in the suite is between programs compiled alike, or against a reference with a
# tolerance.
FAST_COMPILE = "--xla_backend_optimization_level=0 --xla_llvm_disable_expensive_passes=true"


def xla_flags(devices: int) -> str:
  """XLA_FLAGS for a test process with ``devices`` forced CPU devices."""
  return f"--xla_force_host_platform_device_count={devices} {FAST_COMPILE}"


os.environ.setdefault("XLA_FLAGS", xla_flags(1))
# The harness's thread policy (experiments/__init__.py sets it for its command-line tools): one
# OpenBLAS thread for the refreshes' LAPACK; the library itself changes no thread count.
os.environ.setdefault("OPENBLAS_NUM_THREADS", "1")
os.environ.setdefault("JAX_PLATFORMS", "cpu")
# One persistent compilation cache per test session, shared by the xdist workers and by the
# subprocesses the tests start (they inherit the environment): many tests compile the same
# programs (a run, then its resumption; the same model in several processes). Same executables,
# so the same numbers; removed when the session ends.
if "JAX_COMPILATION_CACHE_DIR" not in os.environ:
  import atexit  # noqa: E402
  import shutil  # noqa: E402
  import tempfile  # noqa: E402

  os.environ["JAX_COMPILATION_CACHE_DIR"] = tempfile.mkdtemp(prefix="jax-test-cache-")
  atexit.register(shutil.rmtree, os.environ["JAX_COMPILATION_CACHE_DIR"], ignore_errors=True)
  os.environ["JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS"] = "0"
  os.environ["JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES"] = "0"

import json  # noqa: E402
import pathlib  # noqa: E402
import subprocess  # noqa: E402
import sys  # noqa: E402

import pytest  # noqa: E402
from quiet_shutdown import pytest_sessionfinish  # noqa: E402, F401 - a hook, by its name

ROOT = pathlib.Path(__file__).resolve().parents[1]


@pytest.fixture
def sigint_from_a_terminal():
  """The subprocesses a test starts get SIGINT at its default, as from a terminal. A suite run as a
  shell's background job (``pytest &``, as CI runs it) ignores SIGINT, and an ignored signal stays
  ignored across exec; a Python handler is reset to the default there."""
  import signal

  previous = signal.signal(signal.SIGINT, signal.default_int_handler)
  yield
  signal.signal(signal.SIGINT, previous)


@pytest.fixture(scope="session")
def forced_devices():
  """``run(script, n)``: runs a Python script in a subprocess with n forced CPU devices (the device
  count is fixed when JAX starts) and returns the JSON object it prints last."""

  def run(script: str, n: int = 4, timeout: int = 900):
    env = {**os.environ, "XLA_FLAGS": xla_flags(n), "JAX_PLATFORMS": "cpu"}
    proc = subprocess.run([sys.executable, "-c", script], cwd=ROOT, env=env, capture_output=True,
                          text=True, timeout=timeout)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])

  return run

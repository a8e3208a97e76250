"""tests/quiet_shutdown.py: an xdist worker whose end of session is slow (here up to 12 s of garbage
collection through a slow callback, as jax's is under load) is sent SIGINT by execnet after 5 s;
without the hook the KeyboardInterrupt surfaces as a traceback after the results, with it none."""

import pathlib
import subprocess
import sys

import pytest

CONFTEST = """
import gc
import time
{hook}

interrupted = []


def _slow_callback(*args):
  try:
    time.sleep(0.5)  # nearly all of the worker's time is spent here, as in jax's callback under load
  except KeyboardInterrupt:
    interrupted.append(True)
    raise


def pytest_unconfigure(config):
  if hasattr(config, "workerinput"):
    gc.callbacks.append(_slow_callback)
    end = time.time() + 12  # past execnet's 5 s, before its os._exit 10 s later
    while time.time() < end and not interrupted:
      gc.collect()
"""


@pytest.mark.parametrize("hooked", [True, False])
def test_a_slow_worker_shutdown_prints_no_interrupt(tmp_path, hooked):
  hook = "from quiet_shutdown import pytest_sessionfinish  # noqa: F401" if hooked else ""
  (tmp_path / "conftest.py").write_text(CONFTEST.format(hook=hook))
  (tmp_path / "test_one.py").write_text("def test_one():\n  assert 1 + 1 == 2\n")
  (tmp_path / "pytest.ini").write_text("[pytest]\n")  # not the project's settings
  here = pathlib.Path(__file__).parent
  proc = subprocess.run([sys.executable, "-m", "pytest", "-n", "1", "-q", "-p", "no:cacheprovider",
                         "-c", str(tmp_path / "pytest.ini"), str(tmp_path)], cwd=tmp_path,
                        env={"PYTHONPATH": str(here), "PATH": "/usr/bin:/bin"}, capture_output=True,
                        text=True, timeout=120)
  out = proc.stdout + proc.stderr
  assert proc.returncode == 0 and "1 passed" in out, out[-2000:]
  assert ("KeyboardInterrupt" in out) is not hooked, out[-2000:]

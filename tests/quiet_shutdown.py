"""A pytest hook that keeps signals away from an xdist worker whose tests are done.

execnet asks a worker to finish when the session ends and, if the worker's remaining work takes
more than 5 s (a loaded machine: teardown, garbage collection of compiled programs), sends it a
SIGINT. The KeyboardInterrupt lands wherever the worker is, for instance inside jax's garbage
collection callback, and prints a traceback after the suite's results. By then the worker's
results are sent, so it ignores SIGINT from its session's end on (execnet's own exit follows)."""

import signal
import threading

import pytest


@pytest.hookimpl(tryfirst=True)
def pytest_sessionfinish(session):
  if hasattr(session.config, "workerinput") and threading.current_thread() is threading.main_thread():
    signal.signal(signal.SIGINT, signal.SIG_IGN)

"""What every ``python -m experiments.<tool>`` shares: one-line errors, exit statuses, Ctrl-C."""

from __future__ import annotations

import argparse
import os
import signal
import sys
import threading


class RunFailed(RuntimeError):
  """Some runs of a sweep failed (each named); the others finished and the same command resumes."""


def _terminate(signum, frame):
  raise KeyboardInterrupt  # unwinds like Ctrl-C: a sweep stops its workers on the way out


def run(entry, argv=None) -> int:
  """``entry(argv)`` with one-line errors (status 2 for bad input, 1 for failed runs), a one-line
  message on Ctrl-C or SIGTERM (status 130), which unwind the same way (so a sweep's workers are
  stopped, not left training), and nothing when the output's reader stops reading (status 0)."""
  main_thread = threading.current_thread() is threading.main_thread()
  previous = signal.signal(signal.SIGTERM, _terminate) if main_thread else None
  try:
    entry(argv)
  except KeyboardInterrupt:
    print("\ninterrupted; run the same command again to resume", file=sys.stderr)
    return 130
  except (ValueError, FileNotFoundError) as e:
    print(f"error: {e}", file=sys.stderr)
    return 2
  except RunFailed as e:
    print(f"error: {e}", file=sys.stderr)
    return 1
  except BrokenPipeError:  # the reader took what it wanted (``--next | head -1``): stop quietly
    os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())  # nothing left to flush at exit
    return 0
  finally:
    if main_thread:
      signal.signal(signal.SIGTERM, previous)
  return 0


def exit_process(code: int) -> None:
  """Ends the process with ``code``. After a Ctrl-C (130) it skips the interpreter's teardown: XLA's
  compiler threads may still be running (a Ctrl-C during a compilation), and tearing down under
  them can end in a segmentation fault. Finished work is on disk already (results and checkpoints
  are written atomically)."""
  if code == 130:
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(130)
  sys.exit(code)


class Parser(argparse.ArgumentParser):
  """An ``argparse`` parser whose bad command line (an unknown flag, a missing value) is one line,
  the error first and a pointer to ``--help`` (a ``ValueError``, which ``run`` prints with status
  2), not the usage text before it."""

  def __init__(self, **kwargs):
    super().__init__(formatter_class=argparse.RawDescriptionHelpFormatter, **kwargs)

  def error(self, message):
    raise ValueError(f"{message} (`{self.prog} --help` lists the flags)")


def study_parser(name: str, doc: str | None, writes: str):
  """The parser of ``python -m experiments.studies.<name> SOURCE [SOURCE ...] --out DIR``: folders
  holding ``curves.json.xz`` in, ``writes`` (what goes into ``--out``) out."""
  parser = Parser(prog=f"python -m experiments.studies.{name}", description=doc)
  parser.add_argument("sources", nargs="+", help="folders holding curves.json.xz")
  parser.add_argument("--link", nargs="+", default=[], help="published study folders: a run one of "
                      "them holds is stored in --out's curves.json.xz as a link to it, not copied "
                      "(``experiments.report.curves.write``)")
  parser.add_argument("--out", required=True, help=f"where to write {writes}")
  return parser


def link_flag(args) -> str:
  """``--link``'s part of a study's rebuild command: ``" --link A B"``, or nothing."""
  return " --link " + " ".join(args.link) if args.link else ""

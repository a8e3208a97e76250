"""The sweep's folders: checks of the folders it will write (perhaps hours later), the results folder
and its lock, publishing a report with its figures, and restoring published runs into a new one."""

from __future__ import annotations

import contextlib
import fcntl
import pathlib
import re
import shutil

from experiments.harness import processes, runs
from experiments.harness.config import run_dir
from experiments.report import curves


def check_folder(path: pathlib.Path, flag: str) -> pathlib.Path:
  """A folder the tool writes into (perhaps hours later): a file in its place is an error now."""
  if path.exists() and not path.is_dir():
    raise ValueError(f"{flag} {str(path)!r} is a file, not a folder")
  return path


def check_file(path: pathlib.Path, flag: str) -> pathlib.Path:
  """A file the tool writes (perhaps hours later): a folder in its place is an error now."""
  if path.is_dir():
    raise ValueError(f"{flag} {str(path)!r} is a folder, not a file")
  return path


def prepare_out(path: pathlib.Path) -> pathlib.Path:
  """Creates the results folder; a clear error when that is impossible."""
  check_folder(path, "--out")
  error = None
  if processes.is_primary():  # several processes share the folder: process 0 writes, the others wait
    try:
      path.mkdir(parents=True, exist_ok=True)
      probe = path / ".write-test"
      probe.write_text("")
      probe.unlink()
    except OSError as e:
      error = e.strerror or str(e)
  if processes.agree(error is not None):  # every process learns process 0's failure (none waits for ever)
    raise ValueError(f"--out {str(path)!r} cannot be written" + (f": {error}" if error else
                                                                 " (process 0 could not write it)"))
  processes.barrier(f"results folder {path}")
  return path


@contextlib.contextmanager
def exclusive(out: pathlib.Path):
  """Holds ``out/.lock`` so that two sweeps never write into one results folder at once."""
  with open(out / ".lock", "w") as f:
    try:
      fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
      raise ValueError(f"another sweep is writing into {str(out)!r}; wait for it or use another "
                       "--out") from None
    yield


def clear_figures(target: pathlib.Path) -> None:
  """Creates ``target`` and removes its figures (another report's would be left beside this one's)."""
  target.mkdir(parents=True, exist_ok=True)
  for old in target.glob("*.png"):
    old.unlink()


def publish(out: pathlib.Path, target: pathlib.Path, files=None) -> None:
  """Copies a sweep's report, summary, curves and the figures its report shows (not its runs, nor
  figures left in ``out`` by other sweeps, nor its per-run table ``results.csv``, which
  ``python -m experiments.report TARGET`` rebuilds from the curves), or ``files`` (a report first,
  then figures), into ``target``, replacing older figures there, so that a reader sees them without
  running anything."""
  if not files:
    shown = re.findall(r"!\[[^\]]*\]\(([^)/]+\.png)\)", (out / "report.md").read_text())
    files = [out / "report.md", out / "summary.json", out / curves.FILE,
             *(out / f for f in dict.fromkeys(shown))]
  clear_figures(target)
  for f in files:
    shutil.copyfile(f, target / f.name)
  figures = sum(f.suffix == ".png" for f in files)
  print(f"published {files[0]} and {figures} figures to {target}")


def restore_finished(plan, ds, out: pathlib.Path, sources) -> int:
  """Restores into ``out`` (``runs.restore``) every run of ``plan`` that has no result there and is
  published in one of ``sources``' curves files; returns how many."""
  configs = list(plan.main) + [c for _, c in plan.ablations]
  folders = {f.name: f for f in (run_dir(c, ds, out) for c in configs)}
  restored = 0
  for source in sources:
    for record in curves.read(source)["runs"]:
      folder = folders.get(record["name"])
      if folder is not None and runs.load_result(folder) is None:
        runs.restore(record, folder, ds, str(source))
        restored += 1
  return restored

"""The sweep's runs: one in this process (``run_one``), or several at once, each in a fresh worker
process (``run_all``), with progress, one-line failures by run, and Ctrl-C / SIGTERM that stop
every worker (finished runs are on disk, the others resume from their last checkpoint).

Progress goes to a terminal as tqdm bars; anywhere else (a log file, ``nohup``, a queue) as plain
lines: each run's start or resumption, each tenth of it, and its end."""

from __future__ import annotations

import io
import multiprocessing
import pathlib
import signal
import sys
import time

import numpy as np
from tqdm import tqdm

from experiments.cli import RunFailed
from experiments.harness import provenance, runs
from experiments.harness.config import run_dir


def on_terminal() -> bool:
  """Whether progress goes to a terminal (bars) or elsewhere (plain lines)."""
  return sys.stderr.isatty()


def overall_bar(total: int, desc: str = "sweep"):
  """The sweep's count of runs: a bar on a terminal, elsewhere a silent counter (the plain lines
  are each run's own). Its rate and time left count only the runs trained here (``count_cached``)."""
  quiet = {} if on_terminal() else {"file": io.StringIO(), "mininterval": 1e9}
  return tqdm(total=total, desc=desc, unit="run", dynamic_ncols=True, smoothing=0, **quiet)


def count_cached(overall) -> None:
  """One run found finished: counted, but not in the rate (so the time left is the trained runs')."""
  overall.initial = getattr(overall, "initial", 0) + 1  # a disabled bar has none
  overall.update(1)


class RunBar:
  """One run's progress (the ``progress`` ``runs.train`` advances): a tqdm bar on a terminal, plain
  lines elsewhere (one per tenth of the run); on both, one line when the run resumes from a
  checkpoint, naming the step."""

  def __init__(self, name: str, total: int, position: int | None = None):
    self.name, self.total, self.n, self.tenth, self.loss = name, total, 0, 0, None
    self.started = self.told = False
    self.position = position or 0
    self.bar = tqdm(total=total, desc=name, leave=False, unit="step", dynamic_ncols=True,
                    position=position) if on_terminal() else None

  def reset(self, total):
    self.total, self.n, self.tenth, self.started = total, 0, 0, False
    if self.bar is not None:
      self.bar.reset(total=total)

  def update(self, n):
    first, self.started = not self.started, True
    self.n += n
    tenth = self.n * 10 // max(self.total, 1)
    if self.bar is not None:
      self.bar.update(n)
    elif first:  # a fresh run starts at 0; a resumed one at its checkpoint (its note says so)
      if self.n == 0:
        tqdm.write(f"  {self.name}: starts ({self.total} steps)")
    elif tenth > self.tenth and self.n < self.total:
      tqdm.write(f"  {self.name}: step {self.n}/{self.total}" + (f", loss {self.loss}" if self.loss else ""))
    self.tenth = max(self.tenth, tenth)

  def set_postfix(self, postfix, refresh=False):
    if "resumed at" in postfix and not self.told:
      self.told = True
      tqdm.write(f"  {self.name}: resumes from step {postfix['resumed at']} of {self.total} (its last "
                 "checkpoint)")
    self.loss = postfix.get("loss", self.loss)
    if self.bar is not None:
      self.bar.set_postfix(postfix, refresh=refresh)

  def close(self):
    if self.bar is not None:
      self.bar.close()

  def __enter__(self):
    return self

  def __exit__(self, *exc):
    self.close()
    return False


class _QueueProgress:
  """The ``progress`` a worker's ``runs.train`` advances: forwards steps and notes to the sweep."""

  def __init__(self, queue, index):
    self.queue, self.index = queue, index

  def reset(self, total):
    self.queue.put(("reset", self.index, total))

  def update(self, n):
    parent = multiprocessing.parent_process()
    if parent is not None and not parent.is_alive():  # the sweep was killed: stop at this chunk
      raise SystemExit("the sweep that started this worker is gone")
    self.queue.put(("update", self.index, n))

  def set_postfix(self, postfix, refresh=False):
    self.queue.put(("postfix", self.index, dict(postfix)))


# Signals held while a worker starts, so that the sweep registers every worker it starts before an
# interruption unwinds it (and terminates them all); a worker inherits the mask and releases it.
HELD = (signal.SIGINT, signal.SIGTERM)


def _worker(queue, index, config, ds, folder, jobs, source, keep=False) -> None:
  """One run in a fresh process: refuses to train if the source files changed since the sweep
  began (the worker would import other code than the sweep's), reports progress, then the result
  or the error, by run. Ctrl-C is the sweep's to handle (it terminates its workers): a worker
  ignores SIGINT, so one delivered while it starts (held until here) is dropped, not raised where
  nothing catches it; SIGTERM ends it silently (its default)."""
  signal.signal(signal.SIGINT, signal.SIG_IGN)
  signal.signal(signal.SIGTERM, signal.SIG_DFL)
  signal.pthread_sigmask(signal.SIG_UNBLOCK, HELD)
  try:
    changed = provenance.changed_files(source)
    if changed:
      raise RuntimeError(f"the source changed since the sweep began ({', '.join(changed)}); this "
                         "worker would run other code: restart the sweep")
    t0 = time.time()
    result = runs.train(config, ds, folder, progress=_QueueProgress(queue, index), jobs=jobs,
                        keep_checkpoints=keep)
    queue.put(("done", index, (result, time.time() - t0)))
  except BaseException as e:  # noqa: BLE001 - reported by run name in the sweep
    queue.put(("error", index, f"{type(e).__name__}: {e}".strip()))


def _summary(result, seconds) -> str:
  finite = [x for x in result["losses"] if np.isfinite(x)]
  return (f"{result['status']}, last loss {finite[-1] if finite else float('nan'):.4f} ({seconds})")


def run_all(configs, ds, out: pathlib.Path, overall, jobs: int = 1, keep_checkpoints: bool = False) -> list:
  """Every run of ``configs`` (finished ones loaded, unfinished ones resumed), in order; configs that
  name the same run folder are trained once.

  ``jobs > 1`` trains that many runs at once, each in a fresh process (``spawn``: JAX is not
  fork-safe); the numbers are the same as in one process (each run is a pure function of its config
  and data). Workers are not pinned to cores: XLA's CPU kernels split their work by the number of
  cores the process may use, so a run pinned to one core computes other round-off (its losses part
  from step 4-12 on) than the same run on two; unpinned, every run keeps the machine's thread count
  and its numbers. A worker must find the source files the sweep started with (``provenance.source_files``)
  or it refuses to train. A run that fails (an exception, or a worker killed) is reported by name at
  once and the others go on; at the end ``RunFailed`` lists them (the next start resumes them).
  Ctrl-C or SIGTERM (``cli.run``) stops every worker; runs that finished are on disk, and the others
  resume from their last checkpoint. A worker whose sweep was killed outright (SIGKILL) stops at its
  next chunk. A finished run's checkpoints are deleted unless ``keep_checkpoints``."""
  if jobs < 1:
    raise ValueError(f"--jobs must be >= 1, got {jobs}")
  folders = [run_dir(c, ds, out) for c in configs]
  first = {}
  for i, folder in enumerate(folders):
    first.setdefault(folder, i)
  unique = sorted(set(first.values()))
  done = {}
  if jobs == 1 or len(unique) < 2:
    for i in unique:
      done[i] = run_one(configs[i], ds, out, overall, keep_checkpoints)
  else:
    done = _run_parallel([(i, configs[i], folders[i]) for i in unique], ds, overall, jobs, keep_checkpoints)
  for _ in range(len(configs) - len(unique)):  # the same folders again
    count_cached(overall)
  return [done[first[folder]] for folder in folders]


def _run_parallel(todo, ds, overall, jobs, keep=False) -> dict:
  """``{index: result}`` of ``todo`` (index, config, folder), ``jobs`` fresh processes at a time."""
  results = {}
  pending = []
  for i, c, folder in todo:
    cached = runs.load_result(folder)
    if cached is None:
      pending.append((i, c, folder))
    else:
      results[i] = cached
      count_cached(overall)
      tqdm.write(f"[{overall.n}/{overall.total}] {c.name}: {cached['status']} (cached)")
  if not pending:
    return results
  spawn = multiprocessing.get_context("spawn")
  queue = spawn.Queue()
  workers = min(jobs, len(pending))
  source = provenance.started_files()  # what this process began with: every worker must find the same
  active, failed = {}, []
  names = {i: c.name for i, c, _ in pending}

  def finish(i, message):
    proc, bar = active.pop(i)
    proc.join()
    bar.close()
    overall.update(1)
    tqdm.write(f"[{overall.n}/{overall.total}] {names[i]}: {message}")

  try:
    while pending or active:
      while pending and len(active) < workers:
        i, c, folder = pending.pop(0)
        proc = spawn.Process(target=_worker, args=(queue, i, c, ds, folder, workers, source, keep),
                             daemon=True)
        slot = min(set(range(1, workers + 1)) - {bar.position for _, bar in active.values()})
        held = signal.pthread_sigmask(signal.SIG_BLOCK, HELD)
        try:  # an interruption inside start() would leave a worker the sweep cannot stop
          proc.start()
          active[i] = (proc, RunBar(c.name, c.steps, position=slot))
        finally:
          signal.pthread_sigmask(signal.SIG_SETMASK, held)
      try:
        kind, i, payload = queue.get(timeout=1.0)
      except Exception:  # noqa: BLE001 - queue.Empty: look for workers that died
        for i, (proc, _) in list(active.items()):
          if not proc.is_alive() and proc.exitcode is not None:
            failed.append(names[i])
            finish(i, f"FAILED: the worker died (exit code {proc.exitcode}"
                      f"{', killed by signal ' + str(-proc.exitcode) if proc.exitcode < 0 else ''})")
        continue
      if i not in active:
        continue
      bar = active[i][1]
      if kind == "reset":
        bar.reset(total=payload)
      elif kind == "update":
        bar.update(payload)
      elif kind == "postfix":
        bar.set_postfix(payload, refresh=False)
      elif kind == "done":
        results[i] = payload[0]
        finish(i, _summary(payload[0], f"{payload[1]:.0f}s"))
      elif kind == "error":
        failed.append(names[i])
        finish(i, f"FAILED: {payload}")
  finally:
    for proc, bar in active.values():
      proc.terminate()
      proc.join()
      bar.close()
  if failed:
    raise RunFailed(f"{len(failed)} run(s) failed: {', '.join(failed)}; the others finished. Run the same "
                    "command again to resume them")
  return results


def run_one(config, ds, out, overall, keep_checkpoints: bool = False):
  """One run in this process (finished: loaded; unfinished: resumed), with its progress."""
  folder = run_dir(config, ds, out)
  with RunBar(config.name, config.steps) as bar:
    t0 = time.time()
    already = runs.load_result(folder) is not None
    result = runs.train(config, ds, folder, progress=bar, keep_checkpoints=keep_checkpoints)
  if already:
    count_cached(overall)
  else:
    overall.update(1)
  tqdm.write(f"[{overall.n}/{overall.total}] {config.name}: "
             f"{_summary(result, 'cached' if already else f'{time.time() - t0:.0f}s')}")
  return result

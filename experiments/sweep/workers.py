"""The sweep's runs: one in this process (``run_one``), or several at once, each in a fresh worker
process (``run_all``), with progress, one-line failures by run, and Ctrl-C / SIGTERM that stop
every worker (finished runs are on disk, the others resume from their last checkpoint)."""

from __future__ import annotations

import multiprocessing
import pathlib
import signal
import time

import numpy as np
from tqdm import tqdm

from experiments.cli import RunFailed
from experiments.harness import provenance, runs
from experiments.harness.config import run_dir


class _QueueProgress:
  """The ``progress`` a worker's ``runs.train`` advances: forwards steps and loss to the sweep."""

  def __init__(self, queue, index):
    self.queue, self.index, self.postfix = queue, index, {}

  def reset(self, total):
    self.queue.put(("reset", self.index, total))

  def update(self, n):
    parent = multiprocessing.parent_process()
    if parent is not None and not parent.is_alive():  # the sweep was killed: stop at this chunk
      raise SystemExit("the sweep that started this worker is gone")
    self.queue.put(("update", self.index, (n, self.postfix.get("loss"))))

  def set_postfix(self, postfix, refresh=False):
    self.postfix = dict(postfix)


# Signals held while a worker starts, so that the sweep registers every worker it starts before an
# interruption unwinds it (and terminates them all); a worker inherits the mask and releases it.
HELD = (signal.SIGINT, signal.SIGTERM)


def _worker(queue, index, config, ds, folder, jobs, source) -> None:
  """One run in a fresh process: refuses to train if the source files changed since the sweep
  began (the worker would import other code than the sweep's), reports progress, then the result
  or the error, by run."""
  signal.pthread_sigmask(signal.SIG_UNBLOCK, HELD)
  try:
    changed = provenance.changed_files(source)
    if changed:
      raise RuntimeError(f"the source changed since the sweep began ({', '.join(changed)}); this "
                         "worker would run other code: restart the sweep")
    t0 = time.time()
    result = runs.train(config, ds, folder, progress=_QueueProgress(queue, index), jobs=jobs)
    queue.put(("done", index, (result, time.time() - t0)))
  except BaseException as e:  # noqa: BLE001 - reported by run name in the sweep
    queue.put(("error", index, f"{type(e).__name__}: {e}".strip()))


def _summary(result, seconds) -> str:
  finite = [x for x in result["losses"] if np.isfinite(x)]
  return (f"{result['status']}, last loss {finite[-1] if finite else float('nan'):.4f} ({seconds})")


def run_all(configs, ds, out: pathlib.Path, overall, jobs: int = 1) -> list:
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
  next chunk."""
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
      done[i] = run_one(configs[i], ds, out, overall)
  else:
    done = _run_parallel([(i, configs[i], folders[i]) for i in unique], ds, overall, jobs)
  overall.update(len(configs) - len(unique))  # the same folders again
  return [done[first[folder]] for folder in folders]


def _run_parallel(todo, ds, overall, jobs) -> dict:
  """``{index: result}`` of ``todo`` (index, config, folder), ``jobs`` fresh processes at a time."""
  results = {}
  pending = []
  for i, c, folder in todo:
    cached = runs.load_result(folder)
    if cached is None:
      pending.append((i, c, folder))
    else:
      results[i] = cached
      overall.update(1)
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
        proc = spawn.Process(target=_worker, args=(queue, i, c, ds, folder, workers, source), daemon=True)
        slot = min(set(range(1, workers + 1)) - {abs(bar.pos) for _, bar in active.values()})
        held = signal.pthread_sigmask(signal.SIG_BLOCK, HELD)
        try:  # an interruption inside start() would leave a worker the sweep cannot stop
          proc.start()
          active[i] = (proc, tqdm(total=c.steps, desc=c.name, leave=False, unit="step",
                                  dynamic_ncols=True, position=slot))
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
        bar.update(payload[0])
        if payload[1] is not None:
          bar.set_postfix(loss=payload[1], refresh=False)
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


def run_one(config, ds, out, overall):
  """One run in this process (finished: loaded; unfinished: resumed), with a progress bar."""
  folder = run_dir(config, ds, out)
  with tqdm(total=config.steps, desc=config.name, leave=False, unit="step", dynamic_ncols=True) as bar:
    t0 = time.time()
    already = runs.load_result(folder) is not None
    result = runs.train(config, ds, folder, progress=bar)
  overall.update(1)
  tqdm.write(f"[{overall.n}/{overall.total}] {config.name}: "
             f"{_summary(result, 'cached' if already else f'{time.time() - t0:.0f}s')}")
  return result

"""``python -m experiments.bench.allocator``: what the process's ``malloc`` costs a training step on CPU.

On the CPU backend XLA takes each call's temporary buffer (every intermediate of the program) from
``malloc``. The C library's maps a large buffer afresh for every call and unmaps it afterwards, so
every page the call touches is a page fault and a zeroed page; jemalloc told to keep the pages it
frees reuses them. Each setting runs in a fresh process, the settings taking turns ``--repeat``
times, on one paper-95m Transformer block (``experiments.bench.optimizer.block_config``): the update
alone (AdamW and the default rotation, median of ``--rounds`` interleaved means over one refresh
period), the rotation update's minor page faults a call, and the whole training step (micro-batch
``--batch`` x 512). Printed: each run, then per setting the median of its runs and its ratio to the C
library's. Run it on a quiet machine. jemalloc: ``apt install libjemalloc2`` (Debian, Ubuntu) or
``--jemalloc PATH``; without it only the C library's setting runs.
"""

from __future__ import annotations

import argparse
import ctypes.util
import json
import os
import pathlib
import statistics
import subprocess
import sys

KEEP_PAGES = "dirty_decay_ms:-1,muzzy_decay_ms:-1"  # jemalloc never hands freed pages back

CHILD = r"""
import json, sys
import numpy as np
from experiments.bench import optimizer as bo
width, batch, rounds = (int(x) for x in sys.argv[1:4])
params = bo.block_params(width)
update = bo.bench_update(params, 10, 10, rounds, bo.pair(10), np.median)
step = bo.block_step_report(width, 10, batch_size=batch, rounds=rounds)
print(json.dumps({"allocator": bo.allocator(), "faults": update["rotation"]["faults_per_call"],
                  "step": step["seconds"],
                  "update": {name: v["seconds"] for name, v in update.items()}}))
"""


def find_jemalloc() -> str | None:
  """The path of the system's jemalloc shared library, or ``None``."""
  for path in ("/usr/lib/x86_64-linux-gnu/libjemalloc.so.2", "/usr/lib/aarch64-linux-gnu/libjemalloc.so.2",
               "/usr/lib64/libjemalloc.so.2", "/usr/lib/libjemalloc.so.2"):
    if pathlib.Path(path).exists():
      return path
  name = ctypes.util.find_library("jemalloc")
  return name if name and pathlib.Path(name).is_absolute() else None


def settings(jemalloc: str | None) -> dict:
  """``{label: environment changes}``: the C library's ``malloc`` (nothing preloaded; a preload or
  ``MALLOC_CONF`` of the caller's removed) and, given jemalloc's path, jemalloc keeping its pages."""
  out = {"libc": {"LD_PRELOAD": None, "MALLOC_CONF": None}}
  if jemalloc:
    out["jemalloc, pages kept"] = {"LD_PRELOAD": jemalloc, "MALLOC_CONF": KEEP_PAGES}
  return out


def environment(changes: dict, base: dict | None = None) -> dict:
  """``base`` (default this process's environment) with ``changes`` applied (``None``: removed)."""
  env = dict(os.environ if base is None else base)
  for key, value in changes.items():
    if value is None:
      env.pop(key, None)
    else:
      env[key] = value
  return env


def measure(changes: dict, width: int, batch: int, rounds: int) -> dict:
  """One fresh process's numbers (``CHILD``) under the environment ``changes``."""
  root = pathlib.Path(__file__).resolve().parents[2]
  env = environment(changes)
  env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(root), env.get("PYTHONPATH")]))
  out = subprocess.run([sys.executable, "-c", CHILD, str(width), str(batch), str(rounds)], env=env,
                       capture_output=True, text=True, check=True, timeout=3600, cwd=root)
  return json.loads(out.stdout.strip().splitlines()[-1])


def summarize(runs: dict) -> dict:
  """``{label: {quantity: (median, ratio to libc's median)}}`` over each setting's runs (``runs[label]``
  a list of ``measure`` results), for the update alone and the whole step of each optimizer and the
  faults a call."""
  def quantities(r):
    return {"update adamw": r["update"]["adamw"], "update rotation": r["update"]["rotation"],
            "step adamw": r["step"]["adamw"], "step rotation": r["step"]["rotation"], "faults": r["faults"]}
  medians = {label: {q: float(statistics.median(quantities(r)[q] for r in rs)) for q in quantities(rs[0])}
             for label, rs in runs.items() if rs}
  base = medians["libc"]
  return {label: {q: (v, v / base[q] if base[q] else float("nan")) for q, v in m.items()}
          for label, m in medians.items()}


def main(argv=None):
  parser = argparse.ArgumentParser(prog="python -m experiments.bench.allocator", description=__doc__)
  parser.add_argument("--repeat", type=int, default=2, help="runs of each setting, taking turns (default 2)")
  parser.add_argument("--width", type=int, default=384, help="the block's width (384: the paper's)")
  parser.add_argument("--batch", type=int, default=32, help="micro-batch of the whole step (x 512 tokens)")
  parser.add_argument("--rounds", type=int, default=3, help="interleaved means per median (default 3)")
  parser.add_argument("--jemalloc", help="path of libjemalloc.so.2 (default: the system's, if installed)")
  args = parser.parse_args(argv)
  if min(args.repeat, args.width, args.batch, args.rounds) < 1:
    raise ValueError(f"--repeat, --width, --batch and --rounds must be >= 1, got {args.repeat}, "
                     f"{args.width}, {args.batch} and {args.rounds}")
  if args.jemalloc and not pathlib.Path(args.jemalloc).exists():
    raise ValueError(f"--jemalloc {args.jemalloc!r} does not exist")
  jemalloc = args.jemalloc or find_jemalloc()
  if jemalloc is None:
    print("jemalloc not found (apt install libjemalloc2, or --jemalloc PATH): the C library's malloc only")
  chosen = settings(jemalloc)
  runs = {label: [] for label in chosen}
  for i in range(args.repeat):
    for label, changes in chosen.items():
      r = measure(changes, args.width, args.batch, args.rounds)
      runs[label].append(r)
      print(f"run {i + 1}, {label} (allocator seen: {r['allocator']}): update adamw "
            f"{r['update']['adamw'] * 1e3:.1f} ms, rotation {r['update']['rotation'] * 1e3:.1f} ms, "
            f"{r['faults']:,.0f} page faults a call; whole step adamw {r['step']['adamw'] * 1e3:.0f} ms, "
            f"rotation {r['step']['rotation'] * 1e3:.0f} ms", flush=True)
  got = summarize(runs)
  for label, m in got.items():
    print(f"median of {args.repeat}, {label}: " + ", ".join(
        f"{q} {v * 1e3:.1f} ms ({ratio:.2f}x libc's)" if q != "faults" else f"faults {v:,.0f} a call"
        for q, (v, ratio) in m.items()))
  return got


if __name__ == "__main__":
  from experiments import cli

  cli.exit_process(cli.run(main))

"""``python -m experiments.bench.threads``: what OpenBLAS's own threads cost basis rotation.

XLA's CPU QR, eigh and SVD call LAPACK in OpenBLAS. Each setting runs in a fresh process (the
program imports ``rotation`` as a user's own would): OpenBLAS's default thread count (set
explicitly, ``OPENBLAS_NUM_THREADS`` = the cores) against the one line a user adds,
``rotation.limit_lapack_threads()``, which makes the OpenBLAS of JAX's LAPACK calls single-threaded,
on a quiet machine and with a second process busy on every core (a NumPy matmul loop). Printed: the
time of 16 Householder QRs of 128 x 128 (one warm refresh of 16 such matrices), and the whole
cpu-deep training step of rotation over AdamW's (batch 16, refresh period 10), each as ratios
measured in this run. ``--repeat N`` (N > 1) instead runs the quiet whole step N times per setting
(OPENBLAS_NUM_THREADS=1 set by hand added), the settings taking turns, and prints each run's ratio
and their median (the number to quote on a noisy machine).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys

CHILD = r"""
import json, time
import jax, jax.numpy as jnp, optax
import rotation
from experiments.bench import optimizer as bo
from experiments.harness import data as data_lib
from experiments.harness import model as model_lib

import os
if os.environ.get("LIMIT_LAPACK"):
  rotation.limit_lapack_threads()  # the one line a user adds
qr = jax.jit(lambda a: jax.lax.map(lambda x: jnp.linalg.qr(x)[0], a))
a = jax.random.normal(jax.random.PRNGKey(0), (16, 128, 128))
jax.block_until_ready(qr(a))
times = []
for _ in range(5):
  t0 = time.perf_counter()
  jax.block_until_ready(qr(a))
  times.append(time.perf_counter() - t0)
cfg = model_lib.CONFIGS["cpu-deep"]
graphdef, params = model_lib.init(cfg)
loss_fn = model_lib.make_loss(graphdef)
batch = tuple(jnp.asarray(x) for x in data_lib.default_corpus(cfg.context).batch(0, 0, 16, cfg.context))
fns = {}
for name, tx in (("adamw", optax.adamw(1e-3, weight_decay=0.01)),
                 ("rotation", rotation.basis_rotation(
                     1e-3, refresh_every=10, weight_dimension_numbers=model_lib.rotation_dims))):
  def step(p, s, tx=tx):
    u, s = tx.update(jax.grad(loss_fn)(p, batch), s, p)
    return optax.apply_updates(p, u), s
  fns[name] = (jax.jit(step, donate_argnums=(0, 1)), (jax.tree.map(jnp.copy, params), tx.init(params)))
t = bo.time_interleaved(fns, 20)
print(json.dumps({"qr": min(times), "rotation": t["rotation"], "adamw": t["adamw"]}))
"""

BUSY = "import numpy as np\na = np.random.rand(1024, 1024)\nwhile True:\n  a = a @ a / 1024.0\n"


def measure(threads: str | None, busy: bool) -> dict:
  """One fresh process: ``threads`` as ``OPENBLAS_NUM_THREADS``, or ``None``: the program calls
  ``rotation.limit_lapack_threads()``."""
  env = {k: v for k, v in os.environ.items() if k not in ("OPENBLAS_NUM_THREADS", "OMP_NUM_THREADS")}
  if threads is not None:
    env["OPENBLAS_NUM_THREADS"] = threads
  else:
    env["LIMIT_LAPACK"] = "1"
  load = subprocess.Popen([sys.executable, "-c", BUSY], env=env) if busy else None
  try:
    out = subprocess.run([sys.executable, "-c", CHILD], env=env, capture_output=True, text=True,
                         check=True, timeout=3600)
  finally:
    if load is not None:
      load.kill()
      load.wait()
  return json.loads(out.stdout.strip().splitlines()[-1])


def medians(ratios: dict) -> dict:
  """``{setting: (median, min, max)}`` of each setting's per-run ratios."""
  return {k: (float(statistics.median(v)), min(v), max(v)) for k, v in ratios.items() if v}


def main(argv=None):
  parser = argparse.ArgumentParser(prog="python -m experiments.bench.threads", description=__doc__)
  parser.add_argument("--repeat", type=int, default=1, help="quiet runs of each setting, taking turns, "
                      "and their median (default 1: one quiet and one busy run of each)")
  args = parser.parse_args(argv)
  if args.repeat < 1:
    raise ValueError(f"--repeat must be >= 1, got {args.repeat}")
  cores = str(len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count())
  print(f"{cores} cores; each line: a fresh process, a user's own program importing rotation")
  settings = {cores: f"OPENBLAS_NUM_THREADS={cores} (OpenBLAS's default, the opt-out)",
              None: "rotation.limit_lapack_threads() (SciPy's OpenBLAS single-threaded)"}
  if args.repeat > 1:
    settings["1"] = "OPENBLAS_NUM_THREADS=1 (set by hand)"
    ratios = {label: [] for label in settings.values()}
    for i in range(args.repeat):
      for threads, label in settings.items():
        r = measure(threads, False)
        ratios[label].append(r["rotation"] / r["adamw"])
        print(f"run {i + 1}, quiet, {label}: whole step rotation / adamw {ratios[label][-1]:.3f}x "
              f"(adamw {r['adamw'] * 1e3:.2f} ms)", flush=True)
    for label, (mid, low, high) in medians(ratios).items():
      print(f"median of {args.repeat}, quiet, {label}: {mid:.3f}x ({low:.3f}-{high:.3f})")
    return medians(ratios)
  got = {}
  for busy in (False, True):
    for threads, label in settings.items():
      r = got[(busy, threads)] = measure(threads, busy)
      print(f"{'busy ' if busy else 'quiet'} {label}: 16 QRs 128x128 {r['qr'] * 1e3:.1f} ms; whole step "
            f"rotation / adamw {r['rotation'] / r['adamw']:.2f}x", flush=True)
  for busy in (False, True):
    d, lib = got[(busy, cores)], got[(busy, None)]
    print(f"{'busy' if busy else 'quiet'}: OpenBLAS default / one thread = {d['qr'] / lib['qr']:.2f}x "
          f"on the QRs, {d['rotation'] / lib['rotation']:.2f}x on rotation's whole step")


if __name__ == "__main__":
  from experiments import cli

  cli.exit_process(cli.run(main))

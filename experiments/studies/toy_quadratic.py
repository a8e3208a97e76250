"""``python -m experiments.studies.toy_quadratic``: Adam vs basis rotation on ``0.5 w^T H w`` in 2-D.

Four panels: a diagonal and a 45-degree rotated Hessian, each without delay and with a gradient
delay of ``tau`` steps (the stale-gradient model of a pipeline's first stage). Gradients carry
noise with covariance ``sigma^2 H`` so that their second moment sees the curvature. Printed per
case: final loss, and the share of steps whose applied (delayed) update points *against* the
current gradient-descent direction (``<update, -grad(w_t)> < 0``).
"""

from __future__ import annotations

import argparse
import pathlib

import jax
import jax.numpy as jnp
import numpy as np
import optax

import rotation
from experiments import cli
from experiments.report import plots
from experiments.sweep import folders

EIGS = (1.0, 25.0)


def hessian(angle_deg: float):
  c, s = np.cos(np.radians(angle_deg)), np.sin(np.radians(angle_deg))
  r = np.array([[c, -s], [s, c]])
  return r @ np.diag(EIGS) @ r.T


def trajectory(tx, h, delay: int, steps: int = 200, sigma: float = 0.3, seed: int = 0):
  """Positions, losses and the against-descent indicator of a run with a stale-gradient FIFO."""
  if steps < 1:
    raise ValueError(f"steps must be >= 1, got {steps}")
  if delay < 0:
    raise ValueError(f"delay must be >= 0, got {delay}")
  h = jnp.asarray(h, jnp.float32)
  chol = jnp.linalg.cholesky(h)
  w = jnp.array([[1.5], [1.0]])  # a (2, 1) matrix: the left side carries the 2-D rotation
  state = tx.init(w)
  fifo = [jnp.zeros_like(w)] * delay
  key = jax.random.PRNGKey(seed)
  update = jax.jit(tx.update)
  path, losses, against = [np.asarray(w[:, 0])], [], []
  for _ in range(steps):
    key, sub = jax.random.split(key)
    grad = h @ w + sigma * chol @ jax.random.normal(sub, w.shape)
    fifo.append(grad)
    applied = fifo.pop(0)
    u, state = update(applied, state, w)
    against.append(float(jnp.vdot(u, -(h @ w))) < 0)
    w = optax.apply_updates(w, u)
    path.append(np.asarray(w[:, 0]))
    losses.append(float(0.5 * (w.T @ h @ w)[0, 0]))
  return np.array(path), np.array(losses), float(np.mean(against))


def run(out: pathlib.Path, delay: int = 8, lr: float = 0.05, steps: int = 200):
  import matplotlib
  matplotlib.use("Agg")
  import matplotlib.pyplot as plt

  methods = {"Adam": optax.adam(lr),
             "basis rotation": rotation.basis_rotation(lr, weight_decay=0.0, refresh_every=5)}
  fig, axes = plt.subplots(2, 2, figsize=(10, 9))
  rows = []
  for i, angle in enumerate((0.0, 45.0)):
    h = hessian(angle)
    for j, tau in enumerate((0, delay)):
      ax = axes[i, j]
      grid = np.linspace(-1.8, 1.8, 120)
      xx, yy = np.meshgrid(grid, grid)
      zz = 0.5 * (h[0, 0] * xx**2 + 2 * h[0, 1] * xx * yy + h[1, 1] * yy**2)
      ax.contour(xx, yy, zz, levels=15, colors="0.8", linewidths=0.6)
      for name, tx in methods.items():
        path, losses, against = trajectory(tx, h, tau, steps)
        ax.plot(path[:, 0], path[:, 1], lw=1, marker=".", ms=2, label=f"{name}: final loss {losses[-1]:.3g}")
        rows.append((angle, tau, name, losses[-1], against))
      ax.set_title(f"{'rotated' if angle else 'diagonal'} H, delay {tau}")
      ax.set_aspect("equal")
      ax.legend(fontsize=8, loc="lower left")
  out.parent.mkdir(parents=True, exist_ok=True)
  plots.save(fig, out)
  return rows


def main(argv=None):
  parser = argparse.ArgumentParser(prog="python -m experiments.studies.toy_quadratic", description=__doc__,
                                   formatter_class=argparse.RawDescriptionHelpFormatter)
  parser.add_argument("--out", default="results/toy_quadratic.png")
  parser.add_argument("--delay", type=int, default=8)
  parser.add_argument("--steps", type=int, default=200)
  args = parser.parse_args(argv)
  rows = run(folders.check_file(pathlib.Path(args.out), "--out"), args.delay, steps=args.steps)
  print("| Hessian | delay | method | final loss | updates against descent |")
  print("|---|---|---|---|---|")
  for angle, tau, name, final, against in rows:
    print(f"| {'rotated 45deg' if angle else 'diagonal'} | {tau} | {name} | {final:.4g} | {against:.0%} |")
  print(f"written {args.out}")


if __name__ == "__main__":
  cli.exit_process(cli.run(main))

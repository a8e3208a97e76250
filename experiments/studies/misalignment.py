"""``python -m experiments.studies.misalignment``: the paper's mechanism on a controlled problem.

The paper's argument: a Hessian misaligned with the coordinate axes amplifies the delay penalty of
Adam, multiplicatively (its bound couples the misalignment and the delay), and running Adam in the
Hessian's eigenbasis removes that amplification. Here the misalignment and the delay are set by
hand and everything else is fixed:

- the parameter is one matrix ``W`` (``dim x dim``) with the quadratic loss
  ``f(W) = 0.5 tr((W - W*)^T A (W - W*) B)``, whose Hessian is ``A (x) B``; ``A`` and ``B`` have
  eigenvalues spread over ``sqrt(condition)`` each (condition number of ``A (x) B``: ``condition``)
  and eigenbases ``Q(theta) = expm(theta K)``, ``K`` a fixed random skew-symmetric matrix scaled so
  that its largest rotation angle is 1 radian: ``theta = 0`` is the coordinate basis, a larger
  ``theta`` turns every eigenvector further away from the axes;
- each step's gradient carries noise with covariance proportional to the Hessian
  (``sigma A^{1/2} Z B^{1/2}``, ``Z`` standard normal);
- the delay ``tau`` is applied by the library itself: ``pipeline_sim.Pipeline`` in weight-stashing
  mode with ``tau + 1`` stages, ``W`` in the first stage (delay ``tau``) and one empty scalar per
  other stage;
- the optimizers: Adam (``rotation.scale_by_adam``, the inner Adam of the rotation), basis
  rotation with its estimated bases (the library's transformation, refresh period 10), and Adam in
  the exact eigenbasis ``(Q_A, Q_B)`` (an oracle: fixed bases,
  ``rotation.scale_by_basis_rotation(ablation=rotation.Ablation(bases=...))``);
- the measure: updates until ``f(W) <= target * f(W_0)`` with ``W_0 = 0``, per seed, for each
  learning rate of a grid; per cell the rate with the smallest median over the seeds. A cell whose
  best rate is an edge of the grid gets the grid extended by x2 steps past that edge until its best
  rate is interior (at most ``max_extensions`` times; a cell still at an edge is flagged). A cell
  that never reaches the target within ``steps`` updates is *censored*: shown as a lower bound
  (``> steps``), and a slope through it, taken with the cap as its value, is a bound (marked).

Reported: the steps per (theta, tau) and optimizer, the slope of ``log(steps)`` against ``tau`` for
each theta, and the normalised (1,1)-norm ``||H||_11 / (N ||H||_F)`` of ``A (x) B`` in the
coordinate basis, measured by ``experiments.studies.hessian``. The paper predicts that Adam's slope grows
with theta while the rotation's (and the oracle's) stays flat. The harness is checked first: at
``theta = 0`` Adam and Adam in the identity basis give the same trajectory.
"""

from __future__ import annotations

import argparse
import dataclasses
import pathlib
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np
import optax
import scipy.linalg

import pipeline_sim as ps
import rotation
from experiments import cli
from experiments.harness import provenance
from experiments.report import plots
from experiments.report import summary as summary_lib
from experiments.studies import hessian
from experiments.sweep import folders

OPTIMIZERS = ("adam", "rotation", "oracle")


@dataclasses.dataclass(frozen=True)
class Study:
  """The grid and the problem (defaults: the issue's protocol, minutes on a 2-core CPU)."""

  dim: int = 16
  condition: float = 100.0
  thetas: tuple = (0.0, 5.0, 15.0, 30.0, 45.0)  # degrees
  taus: tuple = (0, 1, 3, 7, 15)
  seeds: tuple = (0, 1, 2)
  lrs: tuple = tuple(float(x) for x in np.geomspace(2e-3, 0.128, 7))  # x2 grid
  steps: int = 2400
  max_extensions: int = 4
  target: float = 1e-2  # of the initial loss
  sigma: float = 0.05  # gradient-noise scale (relative to the Hessian's square root)
  refresh_every: int = 10
  optimizers: tuple = OPTIMIZERS
  lag: tuple = ()  # (shampoo_beta, refresh_every) of extra rotations: the estimation-lag study

  def names(self) -> tuple:
    """Every optimizer of the study: ``optimizers`` and one ``rotation:BETA:T`` per ``lag`` pair."""
    return tuple(self.optimizers) + tuple(f"rotation:{b:g}:{t}" for b, t in self.lag)


def rotation_matrix(dim: int, theta_deg: float, seed: int) -> np.ndarray:
  """``expm(theta K)`` with ``K`` random skew-symmetric, largest rotation angle ``theta``."""
  s = np.random.default_rng(seed).normal(size=(dim, dim))
  k = s - s.T
  k /= np.max(np.abs(np.linalg.eigvals(k)))
  return scipy.linalg.expm(np.radians(theta_deg) * k)


def problem(study: Study, theta: float):
  """``(A, B, Q_A, Q_B, W*)`` of the quadratic at angle ``theta`` (float64 NumPy)."""
  d = study.dim
  spread = np.geomspace(np.sqrt(study.condition), 1.0, d)
  qa, qb = rotation_matrix(d, theta, 1), rotation_matrix(d, theta, 2)
  a, b = qa @ np.diag(spread) @ qa.T, qb @ np.diag(spread) @ qb.T
  w_star = np.random.default_rng(3).normal(size=(d, d))
  return a, b, qa, qb, w_star


def optimizer(name: str, lr: float, qa=None, qb=None, study: Study = Study()):
  """The optimizer ``name`` at learning rate ``lr``; the rate lives in the state
  (``optax.inject_hyperparams``), so that one compiled program serves every rate."""
  if name == "adam":
    core = rotation.scale_by_adam()
  elif name == "rotation":
    core = rotation.scale_by_basis_rotation(refresh_every=study.refresh_every)
  elif name.startswith("rotation:"):  # rotation:BETA:T, statistics decay BETA, refresh every T
    _, beta, period = name.split(":")
    core = rotation.scale_by_basis_rotation(refresh_every=int(period), shampoo_beta=float(beta))
  else:
    bases = {"w": (jnp.asarray(qa, jnp.float32), jnp.asarray(qb, jnp.float32)), "pad": None}
    core = rotation.scale_by_basis_rotation(ablation=rotation.Ablation(bases=bases))
  return optax.chain(core, optax.inject_hyperparams(optax.scale)(step_size=-lr))


def _loss(a, b, a_half, b_half, w_star, sigma):
  """Value ``f(W)``; gradient ``A E B + sigma A^{1/2} Z B^{1/2}`` (the noise term has no value)."""

  def loss(params, z):
    e = params["w"] - w_star
    f = 0.5 * jnp.sum(e * (a @ e @ b))
    noise = sigma * jnp.sum(z * (a_half @ e @ b_half))
    return f + noise - jax.lax.stop_gradient(noise)

  return loss


def trajectories(study: Study, name: str, theta: float, tau: int) -> np.ndarray:
  """``f(W_n) / f(W_0)`` for ``n = 0 .. steps - tau - 1`` updates, per (lr, seed):
  (len(lrs), len(seeds), steps - tau). One jit-compiled program per call."""
  a, b, qa, qb, w_star = problem(study, theta)
  f32 = lambda x: jnp.asarray(x, jnp.float32)
  half = lambda m: scipy.linalg.sqrtm(m).real
  loss = _loss(f32(a), f32(b), f32(half(a)), f32(half(b)), f32(w_star), study.sigma)
  params = {"w": jnp.zeros((study.dim, study.dim)), "pad": [jnp.zeros(()) for _ in range(tau)]}
  labels = {"w": 0, "pad": list(range(1, tau + 1))}
  pipes = [ps.Pipeline(loss, optimizer(name, lr, qa, qb, study), labels) for lr in study.lrs]
  n_lr, n_seed = len(study.lrs), len(study.seeds)
  # one state per (lr, seed): the same optimizer structure, the rate in the state
  states = jax.tree.map(lambda *x: jnp.repeat(jnp.stack(x), n_seed, axis=0), *[p.init(params) for p in pipes])
  noise = jnp.stack([jax.random.normal(jax.random.PRNGKey(s), (study.steps, study.dim, study.dim))
                     for s in study.seeds])
  noise = jnp.tile(noise, (n_lr, 1, 1, 1))
  run = jax.jit(lambda st, z: jax.lax.map(lambda a: pipes[0]._run(*a)[1], (st, z)))
  out = np.asarray(run(states, noise), np.float64).reshape(n_lr, n_seed, study.steps)
  f0 = 0.5 * np.sum(w_star * (a @ w_star @ b))
  # the loss of micro-batch i is observed at W(i - tau): drop the first tau (W_0 repeated)
  return out[:, :, tau:] / f0


def steps_to_target(curves: np.ndarray, target: float) -> np.ndarray:
  """First update count ``n`` with ``f(W_n) <= target`` along the last axis (``inf``: never)."""
  hit = curves <= target
  first = np.argmax(hit, axis=-1).astype(np.float64)
  return np.where(hit.any(axis=-1), first, np.inf)


def cell(study: Study, steps: np.ndarray) -> dict:
  """Best learning rate of one (theta, tau, optimizer) cell from steps (lrs, seeds)."""
  med = np.median(steps, axis=1)
  best = int(np.argmin(med))
  return {"lr": study.lrs[best], "steps": steps[best].tolist(), "median": float(med[best]),
          "interior": bool(0 < best < len(study.lrs) - 1 and np.isfinite(med[best]))}


def best_cell(study: Study, name: str, theta: float, tau: int) -> dict:
  """``cell`` of (theta, tau, optimizer) on the study's grid, extended by x2 steps past an edge that
  wins until the best rate is interior (``study.max_extensions`` at most); ``grid``: the rates
  tried."""
  lrs = list(study.lrs)
  steps = steps_to_target(trajectories(study, name, theta, tau), study.target)
  for _ in range(study.max_extensions):
    c = cell(dataclasses.replace(study, lrs=tuple(lrs)), steps)
    if c["interior"] or not np.isfinite(c["median"]):
      break
    low = lrs.index(c["lr"]) == 0
    new = lrs[0] / 2 if low else lrs[-1] * 2
    extra = steps_to_target(trajectories(dataclasses.replace(study, lrs=(new,)), name, theta, tau),
                            study.target)
    lrs = [new] + lrs if low else lrs + [new]
    steps = np.concatenate([extra, steps] if low else [steps, extra])
  return {**cell(dataclasses.replace(study, lrs=tuple(lrs)), steps), "grid": lrs}


def slope(taus, medians, caps=None) -> tuple[float | None, bool]:
  """``(slope, censored)``: the least-squares slope of ``log(steps)`` against ``tau``; a censored
  median (never reached: ``inf``) counts as its cap (``caps``, per tau), which makes the slope a
  bound (``censored`` true); ``None`` if a censored cell has no cap."""
  y = np.asarray(medians, np.float64)
  censored = ~np.isfinite(y)
  if censored.any():
    if caps is None:
      return None, True
    y = np.where(censored, np.asarray(caps, np.float64), y)
  if np.any(y <= 0):
    return None, bool(censored.any())
  return float(np.polyfit(np.asarray(taus, np.float64), np.log(y), 1)[0]), bool(censored.any())


def misalignment_of(study: Study, theta: float) -> float:
  """Normalised (1,1)-norm of ``A (x) B`` in the coordinate basis (``experiments.studies.hessian``)."""
  a, b, *_ = problem(study, theta)
  a32, b32 = jnp.asarray(a, jnp.float32), jnp.asarray(b, jnp.float32)
  hvp = lambda v: a32 @ v @ b32  # the Hessian-vector product of f
  return hessian.block_misalignment(hvp, (study.dim, study.dim), exact_limit=study.dim**4)[2]


def identity_check(study: Study) -> float:
  """Max difference of Adam and Adam in the identity basis at theta = 0, tau = 3 (must be 0)."""
  eye = np.eye(study.dim)
  small = dataclasses.replace(study, lrs=study.lrs[:2], seeds=study.seeds[:1], steps=100)
  adam = trajectories(small, "adam", 0.0, 3)
  oracle = trajectories(small, "oracle", 0.0, 3)  # Q(0) = I: the oracle's bases are the identity
  assert np.allclose(problem(small, 0.0)[2], eye)
  return float(np.max(np.abs(adam - oracle)))


def run(study: Study, out: pathlib.Path, argv=None) -> dict:
  t0 = time.time()
  got = {"study": dataclasses.asdict(study), "identity_check": identity_check(study), "cells": {},
         "misalignment": {str(t): misalignment_of(study, t) for t in study.thetas}}
  for name in study.names():
    for theta in study.thetas:
      for tau in study.taus:
        got["cells"][f"{name}/{theta:g}/{tau}"] = best_cell(study, name, theta, tau)
      print(f"{name} theta={theta:g}: " + ", ".join(
          f"tau={tau}: {got['cells'][f'{name}/{theta:g}/{tau}']['median']:.0f}" for tau in study.taus),
            flush=True)
  caps = [study.steps - tau for tau in study.taus]  # the most updates a cell observes
  got["slopes"] = {f"{name}/{theta:g}": slope(study.taus, [got["cells"][f"{name}/{theta:g}/{tau}"]["median"]
                                                           for tau in study.taus], caps)
                   for name in study.names() for theta in study.thetas}
  got["seconds"] = time.time() - t0
  out.mkdir(parents=True, exist_ok=True)
  summary_lib.write(out / "misalignment.json", got)
  code = provenance.code_version()
  command = " ".join(["python -m experiments.studies.misalignment", *(argv or [])])
  header = ["# Misalignment x delay on a controlled problem", "",
            f"- made by `{command}` (code {code['version']}, commit {str(code['commit'])[:12]}), "
            f"{got['seconds']:.0f} s on this machine",
            f"- {study.dim} x {study.dim} matrix, Hessian A (x) B with condition number {study.condition:g}, "
            f"gradient noise {study.sigma:g} A^(1/2) Z B^(1/2); updates until f(W) <= {study.target:g} x "
            f"f(W_0) within {study.steps} steps; learning rates {', '.join(f'{x:g}' for x in study.lrs)}, "
            f"extended by x2 past an edge that wins (up to {study.max_extensions} times), per cell the "
            f"one with the fewest median updates over seeds {list(study.seeds)} (* = still at an edge); "
            "> N: never within the cap (censored, a lower bound); a slope through a censored cell "
            "takes the cap as its value and is a bound (marked); "
            f"identity check (Adam vs Adam in the identity basis): max |diff| {got['identity_check']:.1e}",
            ""]
  (out / "report.md").write_text("\n".join(header + table(study, got) + ["", "![](misalignment.png)", ""]))
  figure(study, got, out / "misalignment.png")
  return got


def table(study: Study, got: dict) -> list:
  def fmt(c, tau):
    text = f"{c['median']:.0f}" if np.isfinite(c["median"]) else f"> {study.steps - tau}"
    return text + ("" if c["interior"] or not np.isfinite(c["median"]) else "*")

  def fmt_slope(s):
    value, censored = s
    if value is None:
      return "n/a"
    return f"{value:.4f}" + (" (bound: a censored cell)" if censored else "")

  lines = ["| optimizer | theta | normalised (1,1)-norm | " + " | ".join(f"tau={t}" for t in study.taus)
           + " | slope of log(steps) vs tau |", "|---|---|---|" + "---|" * len(study.taus) + "---|"]
  for name in study.names():
    for theta in study.thetas:
      lines.append(f"| {name} | {theta:g} | {got['misalignment'][str(theta)]:.3f} | " + " | ".join(
          fmt(got["cells"][f"{name}/{theta:g}/{tau}"], tau) for tau in study.taus)
          + f" | {fmt_slope(got['slopes'][f'{name}/{theta:g}'])} |")
  return lines


def figure(study: Study, got: dict, path: pathlib.Path) -> None:
  import matplotlib
  matplotlib.use("Agg")
  import matplotlib.pyplot as plt

  names = study.names()
  fig, axes = plt.subplots(1, len(names), figsize=(4 * len(names), 3.4), sharey=True, squeeze=False)
  axes = axes[0]
  for ax, name in zip(axes, names):
    for theta in study.thetas:
      ys = [got["cells"][f"{name}/{theta:g}/{tau}"]["median"] for tau in study.taus]
      ax.plot(study.taus, ys, marker="o", label=f"theta={theta:g}")
    ax.set_yscale("log")
    ax.set_title(name)
    ax.set_xlabel("delay tau")
  axes[0].set_ylabel(f"updates to {study.target:g} x initial loss")
  axes[-1].legend(fontsize=7)
  plots.save(fig, path)


def main(argv=None):
  parser = argparse.ArgumentParser(prog="python -m experiments.studies.misalignment", description=__doc__,
                                   formatter_class=argparse.RawDescriptionHelpFormatter)
  parser.add_argument("--out", default="results/misalignment", help="output folder")
  parser.add_argument("--steps", type=int, default=Study.steps)
  parser.add_argument("--seeds", type=int, nargs="+", default=list(Study.seeds))
  parser.add_argument("--thetas", type=float, nargs="+", default=list(Study.thetas),
                      help="misalignment angles in degrees (default: %(default)s)")
  parser.add_argument("--optimizers", nargs="*", default=list(OPTIMIZERS), choices=OPTIMIZERS,
                      help="optimizers of the study (default: all three)")
  parser.add_argument("--lag", action="store_true", help="the estimation-lag study: add rotation with "
                      "statistics decay (shampoo_beta) 0.9, 0.99 and 0.999, each refreshed every 1 and "
                      "10 steps")
  args = parser.parse_args(argv)
  if args.steps < max(Study.taus) + 2:
    raise ValueError(f"--steps must exceed the largest delay {max(Study.taus)} + 1, got {args.steps}")
  if not args.optimizers and not args.lag:
    raise ValueError("nothing to run: give --optimizers or --lag")
  lag = tuple((b, t) for b in (0.9, 0.99, 0.999) for t in (1, 10)) if args.lag else ()
  study = Study(steps=args.steps, seeds=tuple(args.seeds), thetas=tuple(args.thetas),
                optimizers=tuple(args.optimizers), lag=lag)
  out = folders.prepare_out(pathlib.Path(args.out))
  got = run(study, out, argv=list(sys.argv[1:] if argv is None else argv))
  print("\n".join(table(study, got)))
  print(f"identity check (Adam vs Adam in the identity basis, theta = 0): max |diff| "
        f"{got['identity_check']:.2e}; {got['seconds']:.0f} s; written {args.out}/report.md")


if __name__ == "__main__":
  cli.exit_process(cli.run(main))

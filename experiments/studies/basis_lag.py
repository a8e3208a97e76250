"""``python -m experiments.studies.basis_lag --out DIR``: estimation lag, measured.

The estimation-lag reading (docs/study.md): rotation's bases come from statistics with a memory of
``1 / (1 - decay)`` steps; if the eigenbasis of the *current* gradient statistics moves faster than
that memory follows, the basis in use lags it, and a stale stage (whose gradients are already
``tau_k`` steps old) pays twice. This study measures both quantities in the Transformer, per decay
and per stage, on one rotation run per decay (the cpu preset's model, data, rate and length).

Every ``--every`` steps, per stage, over its rotated matrices, with ``S`` the fresh statistics of
the stage's gradients at the current weights over the next ``--window`` micro-batches
(``mean G G^T`` and ``mean G^T G``, each side) and ``off(Q, S) = ||offdiag(Q^T S Q)||_F / ||S||_F``
(0: ``Q`` diagonalises ``S``, what Adam in the basis ``Q`` needs; about 1 for a basis unrelated to
``S``):

- **lag**: ``off(U_used, S)``, the basis rotation applies now against the current statistics;
- **motion**: ``off(E_prev, S)``, with ``E_prev`` the exact eigenbasis of the fresh statistics
  ``--every`` steps earlier: how far the current eigenbasis moved in that time;
- **noise**: ``off(E_other, S)``, with ``E_other`` the exact eigenbasis of another ``--window``
  micro-batches' statistics at the same weights: the floor that sampling alone sets;
- **coordinates**: ``off(I, S)``, Adam's own basis, the reference.

A lag above the motion means the basis in use is further from the current statistics than the
eigenbasis of ``--every`` steps ago: it lags by more than ``--every`` steps. Reported per decay and
stage as the mean over the checkpoints past the first 20% of training. Writes ``report.md``,
``basis_lag.png`` and ``summary.json`` (every checkpoint's values); one process, one run at a time.
"""

from __future__ import annotations

import argparse
import json
import pathlib
import sys
import time

import jax
import numpy as np

import pipeline_sim as ps
from experiments import cli
from experiments.harness import data as data_lib
from experiments.harness import model as model_lib
from experiments.harness import runs
from experiments.harness.config import record
from experiments.report import plots
from experiments.studies import write_summary
from experiments.studies.hessian import run_bases
from experiments.sweep import presets


def off_diagonal(q, s) -> float:
  """``||offdiag(Q^T S Q)||_F / ||S||_F`` for an orthogonal ``Q`` (float64 on the host)."""
  q, s = np.asarray(q, np.float64), np.asarray(s, np.float64)
  m = q.T @ s @ q
  total = np.sum(m * m)
  return float(np.sqrt(max(total - np.sum(np.diag(m) ** 2), 0.0) / total)) if total > 0 else 0.0


def _rotated(bases, params, labels):
  """``[(stage, leaf index, (U, V))]`` of every rotated matrix leaf (both sides or one)."""
  is_pair = lambda x: x is None or (isinstance(x, tuple) and len(x) == 2
                                    and not isinstance(x[0], tuple))
  pairs = jax.tree.leaves(bases, is_leaf=is_pair)
  stages = jax.tree.leaves(labels)
  if len(pairs) != len(stages):
    raise ValueError(f"{len(pairs)} bases for {len(stages)} parameter leaves: only single-matrix "
                     "leaves (no batch axes, no blocks) are measured")
  return [(k, i, p) for i, (k, p) in enumerate(zip(stages, pairs)) if p is not None]


QUANTITIES = ("lag", "motion", "noise", "coordinates")


def _statistics(grads, i) -> tuple:
  """``(mean G G^T, mean G^T G)`` of leaf ``i`` over ``grads`` (per micro-batch leaf lists), float64."""
  g = np.stack([np.asarray(x[i], np.float64) for x in grads])
  return np.einsum("tij,tkj->ik", g, g) / len(g), np.einsum("tji,tjk->ik", g, g) / len(g)


def checkpoint(grad_fn, params, bases, labels, window, other, previous) -> tuple[dict, dict]:
  """``({stage: {quantity: mean over its matrices}}, {leaf: (E_left, E_right)})`` at one step;
  ``window`` and ``other`` are two independent lists of micro-batches."""
  grads, others = ([jax.tree.leaves(grad_fn(params, b)) for b in w] for w in (window, other))
  values, eig = {}, {}
  for k, i, (u, v) in _rotated(bases, params, labels):
    stats = _statistics(grads, i)
    floor = [np.linalg.eigh(s)[1] for s in _statistics(others, i)]
    eig[i] = tuple(np.linalg.eigh(s)[1] for s in stats)
    for side, (q, s) in enumerate(zip((u, v), stats)):
      if q is None:
        continue
      row = values.setdefault(k, {name: [] for name in QUANTITIES})
      row["lag"].append(off_diagonal(q, s))
      row["noise"].append(off_diagonal(floor[side], s))
      row["coordinates"].append(off_diagonal(np.eye(len(s)), s))
      if i in previous:
        row["motion"].append(off_diagonal(previous[i][side], s))
  out = {k: {name: float(np.mean(v)) if v else None for name, v in row.items()} for k, row in values.items()}
  return out, eig


def measure(decay: float | None, args, ds, progress=print) -> dict:
  """One rotation run at ``decay`` (``None``: the paper's, following b2) with checkpoints."""
  preset = presets.PRESETS[args.preset]
  config = preset.config("rotation", args.stages, args.seed, lr=args.lr, steps=args.steps,
                         shampoo_beta=decay, chunk=args.every)
  config.validate()
  pipe, state, _, loss_fn = runs.build(config, ds)
  labels = model_lib.stage_labels(state.params, config.stages)
  context = config.model_config(ds.vocab_size).context
  grad_fn = jax.jit(jax.grad(loss_fn))
  window = lambda seed, step: [jax.tree.map(lambda x: x[j], ds.batches(seed, step, args.window,
                                                                       config.batch_size, context))
                               for j in range(args.window)]
  points, previous, start = [], {}, time.time()
  for step in range(0, config.steps + 1, args.every):
    if step:
      batches = ds.batches(config.seed, step - args.every, args.every, config.batch_size, context)
      state, _ = pipe.run(state, batches)
    if step == 0:
      continue  # no statistics yet: the first basis comes from the first gradients
    bases = run_bases(state, labels, config.stages)
    values, previous = checkpoint(grad_fn, state.params, bases, labels, window(config.seed, step),
                                  window(config.seed + 10_000, step), previous)
    points.append({"step": step, "stages": {str(k): v for k, v in sorted(values.items())}})
    progress(f"decay {config.optimizer.statistics_decay:g} step {step}: stage 0 lag "
             f"{values[0]['lag']:.3f}, last stage lag {values[config.stages - 1]['lag']:.3f} "
             f"({time.time() - start:.0f} s)")
  return {"decay": config.optimizer.statistics_decay, "config": record(config), "points": points,
          "seconds": time.time() - start}


def summarise(run: dict, burn_in: float = 0.2) -> dict:
  """Per stage: the mean of each quantity over the checkpoints past ``burn_in`` of training."""
  steps = run["config"]["steps"]
  late = [p for p in run["points"] if p["step"] > burn_in * steps]
  stages = sorted({int(k) for p in late for k in p["stages"]})
  mean = lambda k, name: (float(np.mean(v)) if (v := [p["stages"][str(k)][name] for p in late
                                                     if p["stages"].get(str(k), {}).get(name) is not None])
                          else None)
  return {str(k): {name: mean(k, name) for name in QUANTITIES} for k in stages}


def write(measured: list, out: pathlib.Path, command: str) -> dict:
  out.mkdir(parents=True, exist_ok=True)
  num_stages = measured[0]["config"]["stages"]
  delays = ps.stage_delays(num_stages)
  lines = ["# Estimation lag, measured: how far rotation's basis lags the current statistics", "",
           f"- made by `{command}`", "- one rotation run per decay, the cpu preset's model, data and "
           f"rate, seed {measured[0]['config']['seed']}, P = {num_stages} (1F1B), "
           f"{measured[0]['config']['steps']} steps", "",
           "Per stage (its delay tau), the mean over checkpoints past 20% of training of "
           "`off(Q, S)`, the fraction of the fresh gradient statistics `S` off the diagonal in the "
           "basis `Q` (module docstring): lag (the basis in use), motion (the exact eigenbasis of "
           "the previous checkpoint), noise (the exact eigenbasis of other micro-batches at the same "
           "weights) and coordinates (Adam's basis).", "",
           "| decay | memory (steps) | stage (tau) | lag | motion | noise | coordinates | lag / motion |",
           "|---|---|---|---|---|---|---|---|"]
  config = {k: measured[0]["config"][k] for k in ("stages", "seed", "steps")}
  summary = {"command": command, "config": config, "runs": []}
  for run in measured:
    rows = summarise(run)
    summary["runs"].append({"decay": run["decay"], "per_stage": rows, "points": _packed(run["points"]),
                            "seconds": round(run["seconds"])})
    for k in sorted(rows, key=int):
      r = rows[k]
      ratio = (f"{r['lag'] / r['motion']:.2f}" if r["lag"] is not None and r["motion"] else "-")
      fmt = lambda v: "-" if v is None else f"{v:.3f}"
      lines.append(f"| {run['decay']:g} | {1 / (1 - run['decay']):.0f} | {k} ({delays[int(k)]}) | "
                   f"{fmt(r['lag'])} | {fmt(r['motion'])} | {fmt(r['noise'])} | {fmt(r['coordinates'])} | "
                   f"{ratio} |")
  lines += ["", "![lag per stage and decay](basis_lag.png)", ""]
  (out / "report.md").write_text("\n".join(lines))
  plots.series({f"decay {run['decay']:g}": [(delays[int(k)] + 1, v["lag"]) for k, v in
                                            summarise(run).items() if v["lag"] is not None]
                for run in measured}, out / "basis_lag.png",
               "basis lag off(U_used, S_fresh) per stage", "stage delay tau + 1", "off-diagonal fraction")
  return write_summary(out, summary)


def _packed(points, digits: int = 4) -> list:
  """Checkpoints as ``[step, {stage: [lag, motion, noise, coordinates]}]`` (``QUANTITIES``' order,
  ``digits`` decimals): a summary a tenth the size of the dicts."""
  r = lambda v: None if v is None else round(v, digits)
  return [[p["step"], {k: [r(v[q]) for q in QUANTITIES] for k, v in p["stages"].items()}] for p in points]


def _unpacked(points) -> list:
  return [{"step": step, "stages": {k: dict(zip(QUANTITIES, v)) for k, v in stages.items()}}
          for step, stages in points]


def rebuild(out: pathlib.Path) -> dict:
  """The report, figure and summary again from ``out/summary.json`` (no training)."""
  old = json.loads((out / "summary.json").read_text())
  config = old.get("config") or {"stages": 16, "seed": 0, "steps": 2400}  # (the first summary's run)
  unpack = lambda pts: pts if pts and isinstance(pts[0], dict) else _unpacked(pts)
  measured = [{"decay": r["decay"], "config": config, "points": unpack(r["points"]), "seconds": r["seconds"]}
              for r in old["runs"]]
  return write(measured, out, old["command"])


def main(argv=None):
  parser = argparse.ArgumentParser(prog="python -m experiments.studies.basis_lag", description=__doc__,
                                   formatter_class=argparse.RawDescriptionHelpFormatter)
  parser.add_argument("--decays", nargs="+", type=float, default=[0.999, 0.99, 0.95, 0.9],
                      help="statistics decays (0.999: the paper's, following b2)")
  parser.add_argument("--preset", default="cpu")
  parser.add_argument("--stages", type=int, default=16)
  parser.add_argument("--seed", type=int, default=0)
  parser.add_argument("--steps", type=int, default=2400)
  parser.add_argument("--lr", type=float, default=3e-3)
  parser.add_argument("--every", type=int, default=100, help="steps between checkpoints")
  parser.add_argument("--window", type=int, default=16, help="micro-batches of the fresh statistics")
  parser.add_argument("--out", required=True)
  parser.add_argument("--rebuild", action="store_true", help="rewrite --out's report, figure and "
                      "summary from its summary.json, training nothing")
  args = parser.parse_args(argv)
  if args.rebuild:
    summary = rebuild(pathlib.Path(args.out))
    print(f"rebuilt {args.out}/report.md")
    return summary
  if args.every < 1 or args.window < 2 or args.steps % args.every:
    raise ValueError(f"need every >= 1 dividing steps and window >= 2, got every={args.every}, "
                     f"window={args.window}, steps={args.steps}")
  if args.preset not in presets.PRESETS:
    raise ValueError(f"unknown preset {args.preset!r}; choose from {sorted(presets.PRESETS)}")
  template = presets.PRESETS[args.preset].config("rotation", 1, 0)
  ds = data_lib.load(None, context=template.model_config(256).context)
  measured = [measure(None if d == 0.999 else d, args, ds) for d in args.decays]
  command = "python -m experiments.studies.basis_lag " + " ".join(sys.argv[1:] if argv is None else argv)
  summary = write(measured, pathlib.Path(args.out), command.strip())
  print(f"wrote {args.out}/report.md")
  return summary


if __name__ == "__main__":
  cli.exit_process(cli.run(main))

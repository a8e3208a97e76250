"""``python -m experiments.bench.refresh_spike``: the step after rotation's first warm refresh.

Trains a model of the harness (default ``cpu-tiny``) synchronously from the same initialisation on
the same batches with AdamW and with ``rotation.basis_rotation`` at the library's defaults (every
2-D leaf rotated), no warm-up, under both rules for the second moments on a refresh (``permute``:
the paper's; ``rotate``), and prints per step the loss, the largest update element and the update's
RMS, both over the learning rate (docs/algorithms.md, "the refresh spike").
"""

from __future__ import annotations

import argparse
import dataclasses
import json

import jax
import jax.numpy as jnp
import optax

import rotation
from experiments import cli
from experiments.harness import data as data_lib
from experiments.harness import model as model_lib


def trace(tx, loss_fn, params, batches, lr: float) -> list[dict]:
  """Per step: ``{"loss", "max_over_lr", "rms_over_lr"}`` of the update ``tx`` applies."""
  state = tx.init(params)

  @jax.jit
  def step(params, state, batch):
    loss, grads = jax.value_and_grad(loss_fn)(params, batch)
    updates, state = tx.update(grads, state, params)
    leaves = jax.tree.leaves(updates)
    peak = jnp.max(jnp.stack([jnp.max(jnp.abs(u)) for u in leaves]))
    rms = jnp.sqrt(sum(jnp.sum(u * u) for u in leaves) / sum(u.size for u in leaves))
    return optax.apply_updates(params, updates), state, loss, peak, rms

  out = []
  for batch in batches:
    params, state, loss, peak, rms = step(params, state, batch)
    out.append({"loss": float(loss), "max_over_lr": float(peak) / lr, "rms_over_lr": float(rms) / lr})
  return out


def main(argv=None):
  parser = argparse.ArgumentParser(prog="python -m experiments.bench.refresh_spike", description=__doc__,
                                   formatter_class=argparse.RawDescriptionHelpFormatter)
  parser.add_argument("--model", default="cpu-tiny", choices=sorted(model_lib.CONFIGS))
  parser.add_argument("--lr", type=float, default=3e-3)
  parser.add_argument("--refresh-every", type=int, default=2)
  parser.add_argument("--steps", type=int, default=6)
  parser.add_argument("--batch-size", type=int, default=16)
  args = parser.parse_args(argv)
  if args.steps < 1 or args.refresh_every < 1 or not args.lr > 0:
    raise ValueError(f"need steps >= 1, refresh_every >= 1 and lr > 0, got {args.steps}, "
                     f"{args.refresh_every}, {args.lr}")
  cfg = model_lib.CONFIGS[args.model]
  ds = data_lib.load(None, context=cfg.context)
  cfg = dataclasses.replace(cfg, vocab_size=ds.vocab_size)
  graphdef, params = model_lib.init(cfg, seed=0)
  loss_fn = model_lib.make_loss(graphdef, 0.01, "float32")
  batches = [tuple(jnp.asarray(x) for x in ds.batch(0, i, args.batch_size, cfg.context))
             for i in range(args.steps)]
  txs = {"adamw": optax.adamw(args.lr)}
  for rule in rotation.SECOND_MOMENT_RULES:
    txs[f"rotation, {rule}"] = rotation.basis_rotation(args.lr, refresh_every=args.refresh_every,
                                                       second_moments=rule)
  got = {name: trace(tx, loss_fn, params, batches, args.lr) for name, tx in txs.items()}
  print(f"{args.model}, lr {args.lr:g}, no warm-up, refresh every {args.refresh_every}; per step: loss, "
        "largest update element / lr, update RMS / lr")
  for name, rows in got.items():
    print(f"{name:>20}: " + "  ".join(f"{r['loss']:.3f} ({r['max_over_lr']:.1f}, {r['rms_over_lr']:.2f})"
                                      for r in rows))
  print(json.dumps(got))
  return got


if __name__ == "__main__":
  cli.exit_process(cli.run(main))

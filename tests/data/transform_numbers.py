"""The update numbers of ``rotation.basis_rotation`` frozen before a rewrite of its code: 20 steps
(a cold refresh at step 1, warm ones every 3 steps) of eight configurations over leaves that exercise
the plain, 2-D, stacked and blocked paths. ``python tests/data/transform_numbers.py`` rewrites
``transform_numbers.json`` (only when the numbers are meant to change: say why in the commit);
tests/test_transform_numbers.py checks the current code against it, bit for bit on the CPU that
wrote it and to 1e-5 elsewhere (the same seed gives other rounding on another CPU)."""

import hashlib
import json
import os
import pathlib
import platform

if __name__ == "__main__":  # the test suite's XLA flags (tests/conftest.py): they change the rounding
  import sys

  sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1]))
  from conftest import xla_flags

  os.environ["XLA_FLAGS"] = xla_flags(1)
  os.environ["JAX_PLATFORMS"] = "cpu"

import jax
import jax.numpy as jnp
import numpy as np

import rotation

STEPS = 20
CONFIGS = {
    "default": {},
    "unilateral": {"geometry": "unilateral"},
    "first": {"source": "first"},
    "first-unilateral-power": {"source": "first", "geometry": "unilateral", "first_order_step": "power"},
    "rotate-second-moments": {"second_moments": "rotate"},
    "stagger-decay": {"stagger": True, "shampoo_beta": 0.95},
    "bf16-state": {"precond_dtype": "bfloat16", "mu_dtype": "bfloat16"},
    "cholesky-qr": {"orthonormalization": "cholesky_qr"},
}


def params():
  rng = np.random.default_rng(0)
  return {"w": jnp.asarray(rng.normal(size=(8, 12)), jnp.float32),
          "stack": jnp.asarray(rng.normal(size=(2, 6, 6)), jnp.float32),
          "long": jnp.asarray(rng.normal(size=(40, 8)), jnp.float32),
          "b": jnp.zeros((12,), jnp.float32)}


def dims(p):
  return {"w": rotation.LINEAR, "stack": rotation.stacked(rotation.LINEAR), "long": rotation.LINEAR,
          "b": None}


def updates(config: dict) -> list[np.ndarray]:
  """Every step's updates, each leaf flattened, in leaf order."""
  p = params()
  tx = rotation.basis_rotation(1e-2, weight_decay=0.01, refresh_every=3, block_size=16,
                               weight_dimension_numbers=dims, **config)
  state = tx.init(p)
  step = jax.jit(tx.update)
  rng = np.random.default_rng(1)
  out = []
  for _ in range(STEPS):
    g = jax.tree.map(lambda x: jnp.asarray(rng.normal(size=x.shape), x.dtype), p)
    u, state = step(g, state, p)
    out.append(np.concatenate([np.asarray(x, np.float32).ravel() for x in jax.tree.leaves(u)]))
  return out


def numbers(config: dict) -> dict:
  steps = updates(config)
  digest = hashlib.sha256(b"".join(s.tobytes() for s in steps)).hexdigest()
  return {"sha256": digest, "norms": [float(np.linalg.norm(s.astype(np.float64))) for s in steps]}


def cpu() -> str:
  try:
    with open("/proc/cpuinfo") as f:
      return next(line.split(":", 1)[1].strip() for line in f if line.startswith("model name"))
  except (OSError, StopIteration):
    return platform.processor() or platform.machine()


if __name__ == "__main__":
  out = {"cpu": cpu(), "xla_flags": os.environ["XLA_FLAGS"], "jax": jax.__version__,
         "configs": {k: numbers(v) for k, v in CONFIGS.items()}}
  path = pathlib.Path(__file__).with_suffix(".json")
  path.write_text(json.dumps(out, indent=1) + "\n")
  print(f"wrote {path}")

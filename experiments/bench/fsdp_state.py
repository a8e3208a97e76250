"""``python -m experiments.bench.fsdp_state``: basis rotation's state under FSDP, from shapes.

The paper's 95M model (``--config paper-95m``, vocabulary 50,257) with every parameter split over an
``fsdp`` mesh axis of ``--devices`` forced CPU devices (its longest axis that the device count
divides; a leaf with none is replicated). For AdamW and three rotation settings (the study's: the
paper's kernels, no blocks, ``max_precond_dim=10_000``; the library default's 1,024 blocks on the
same kernels; the same with bf16 parameters, ``mu_dtype`` and ``precond_dtype``), XLA's memory
analysis of the jitted ``tx.update`` compiled from shapes (nothing allocated, nothing run): the
state's bytes in all and on the fullest device, and the update's temporaries per device. The CPU's
compiler stands in for an accelerator's: their buffer assignments differ.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys

from experiments.harness import model as model_lib

CHILD = r"""
import json, sys
import jax, jax.numpy as jnp, numpy as np, optax
from jax.sharding import NamedSharding, PartitionSpec as P
import rotation
from experiments.harness import model as model_lib

n = jax.device_count()
mesh = jax.make_mesh((n,), ("fsdp",))
cfg = model_lib.CONFIGS[sys.argv[1]]
shapes = model_lib.abstract_params(cfg)

def fsdp(x):
  axes = [a for a in np.argsort(x.shape)[::-1] if x.shape[a] % n == 0]
  spec = [None] * x.ndim
  if axes:
    spec[axes[0]] = "fsdp"
  return NamedSharding(mesh, P(*spec))

shardings = jax.tree.map(fsdp, shapes)
dims = model_lib.rotation_dims(shapes)
settings = {
  "adamw": (jnp.float32, optax.adamw(1e-3, weight_decay=0.01)),
  "rotation, study (no blocks)": (jnp.float32, rotation.basis_rotation(
      1e-3, weight_dimension_numbers=dims, block_size=None, max_precond_dim=10_000)),
  "rotation, 1,024 blocks": (jnp.float32, rotation.basis_rotation(1e-3, weight_dimension_numbers=dims)),
  "rotation, 1,024 blocks, bf16": (jnp.bfloat16, rotation.basis_rotation(
      1e-3, weight_dimension_numbers=dims, mu_dtype=jnp.bfloat16, precond_dtype=jnp.bfloat16)),
}
nbytes = lambda x: int(np.prod(x.shape)) * jnp.dtype(x.dtype).itemsize
# a NamedSharding splits evenly: every device holds one shard's shape of each leaf
shard_bytes = lambda x: (int(np.prod(x.sharding.shard_shape(x.shape))) * jnp.dtype(x.dtype).itemsize
                         if x.sharding is not None else nbytes(x))
rows = {}
for name, (dtype, tx) in settings.items():
  params = jax.tree.map(lambda x, s: jax.ShapeDtypeStruct(x.shape, dtype, sharding=s), shapes, shardings)
  if name == "adamw":
    state = jax.eval_shape(tx.init, params)
  else:
    state = jax.eval_shape(jax.jit(tx.init, out_shardings=rotation.state_sharding(
        jax.eval_shape(tx.init, params), shardings)), params)
  leaves = jax.tree.leaves(state)
  temp = -1
  if sys.argv[2] == "1":
    compiled = jax.jit(tx.update).lower(params, state, params).compile()
    temp = int(compiled.memory_analysis().temp_size_in_bytes)
  rows[name] = {"params": sum(nbytes(x) for x in jax.tree.leaves(params)),
                "state": sum(nbytes(x) for x in leaves),
                "state_per_device": sum(shard_bytes(x) for x in leaves),
                "temp_per_device": temp}
  print(json.dumps({name: rows[name]}), file=sys.stderr, flush=True)
print(json.dumps({"devices": n, "rows": rows}))
"""


def measure(devices: int, config: str = "paper-95m", temporaries: bool = True) -> dict:
  """The rows (bytes) in a fresh process with ``devices`` forced CPU devices; ``temporaries=False``
  skips compiling the updates (their temporaries are then -1)."""
  env = dict(os.environ, XLA_FLAGS=f"--xla_force_host_platform_device_count={devices}")
  out = subprocess.run([sys.executable, "-c", CHILD, config, str(int(temporaries))], env=env,
                       capture_output=True, text=True, timeout=3600)
  if out.returncode:
    raise RuntimeError(out.stderr[-4000:])
  return dict(json.loads(out.stdout.strip().splitlines()[-1]), config=config)


def table(got: dict) -> str:
  n, rows = got["devices"], got["rows"]
  lines = [f"| {got['config']} under FSDP, {n} devices | state / params (bytes) | state, all devices (MB) | "
           "state, fullest device (MB) | fullest device / all | update temporaries per device (MB) |",
           "|---|---|---|---|---|---|"]
  for name, r in rows.items():
    lines.append(f"| {name} | {r['state'] / r['params']:.2f} | {r['state'] / 1e6:.1f} | "
                 f"{r['state_per_device'] / 1e6:.1f} | {r['state_per_device'] / r['state']:.3f} | "
                 f"{r['temp_per_device'] / 1e6:.1f} |")
  return "\n".join(lines)


def main(argv=None) -> dict:
  parser = argparse.ArgumentParser(prog="python -m experiments.bench.fsdp_state", description=__doc__,
                                   formatter_class=argparse.RawDescriptionHelpFormatter)
  parser.add_argument("--devices", type=int, default=8, help="forced CPU devices (default 8)")
  parser.add_argument("--config", default="paper-95m", help="model config (default paper-95m)")
  args = parser.parse_args(argv)
  if args.devices < 1:
    parser.error(f"--devices must be >= 1, got {args.devices}")
  if args.config not in model_lib.CONFIGS:
    parser.error(f"unknown --config {args.config!r}; choose from {sorted(model_lib.CONFIGS)}")
  got = measure(args.devices, args.config)
  print(table(got))
  return got


if __name__ == "__main__":
  from experiments import cli

  cli.exit_process(cli.run(main))

"""``python -m experiments.bench.compile_time``: how long the optimizer update takes to compile.

Rotation against AdamW on ``L`` layers of a Transformer block's six kernels (q, k, v, o: ``width x
width``; the MLP's up and down: ``width x 4 width``), laid out two ways: *unrolled*, one leaf per
kernel per layer (as the study's model), and *scanned*, one leaf per kernel with a leading layer
axis (``nnx.scan`` / ``lax.scan`` stacks; ``rotation.stacked(rotation.LINEAR)``, so every layer keeps
bases of its own). Each cell is the median of ``--repeat`` compilations of ``jit(tx.update)``, each a
new ``jax.jit`` with JAX's persistent compilation cache turned off (which the command-line tools
otherwise turn on), so that no cache answers, with rotation's ratio to AdamW's measured in this
run. Quote it from a quiet machine.
"""

from __future__ import annotations

import argparse
import statistics
import time

import jax
import jax.numpy as jnp
import optax

import rotation

KERNELS = {"q": (1, 1), "k": (1, 1), "v": (1, 1), "o": (1, 1), "up": (1, 4), "down": (4, 1)}
LAYOUTS = ("unrolled", "scanned")


def layout(name: str, layers: int, width: int):
  """``(params, weight_dimension_numbers)`` as shape structs: ``layers`` layers of the six kernels,
  unrolled or scanned."""
  shape = lambda m: (m[0] * width, m[1] * width)
  if name == "unrolled":
    params = {f"layer{i}": {k: jax.ShapeDtypeStruct(shape(m), jnp.float32) for k, m in KERNELS.items()}
              for i in range(layers)}
    return params, jax.tree.map(lambda _: rotation.LINEAR, params)
  if name == "scanned":
    params = {k: jax.ShapeDtypeStruct((layers,) + shape(m), jnp.float32) for k, m in KERNELS.items()}
    return params, jax.tree.map(lambda _: rotation.stacked(rotation.LINEAR), params)
  raise ValueError(f"layout {name!r} is not one of {LAYOUTS}")


def compile_seconds(tx: optax.GradientTransformation, params) -> float:
  """Seconds to lower and compile ``tx.update`` for ``params`` (shape structs), in a new ``jit``."""
  state = jax.eval_shape(tx.init, params)
  fn = jax.jit(tx.update)  # a new transformation, so a new jit
  cached = jax.config.jax_enable_compilation_cache
  jax.config.update("jax_enable_compilation_cache", False)  # every compilation a real one
  try:
    start = time.perf_counter()
    fn.lower(params, state, params).compile()
    return time.perf_counter() - start
  finally:
    jax.config.update("jax_enable_compilation_cache", cached)


def main(argv=None) -> dict:
  parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  parser.add_argument("--layers", type=int, nargs="+", default=[16, 64])
  parser.add_argument("--width", type=int, default=32)
  parser.add_argument("--repeat", type=int, default=3, help="compilations per cell (the median is printed)")
  args = parser.parse_args(argv)
  bad = [v for v in args.layers + [args.width, args.repeat] if v < 1]
  if bad:
    parser.error(f"--layers, --width and --repeat must be >= 1, got {bad[0]}")
  optimizers = {"adamw": lambda dims: optax.adamw(3e-3),
                "rotation": lambda dims: rotation.basis_rotation(3e-3, weight_dimension_numbers=dims)}
  rows = {}
  print("| layers | layout | AdamW s | rotation s | rotation / AdamW |")
  print("|---|---|---|---|---|")
  for layers in args.layers:
    for name in LAYOUTS:
      params, dims = layout(name, layers, args.width)
      times = {opt: [] for opt in optimizers}
      for _ in range(args.repeat):  # the optimizers take turns
        for opt, make in optimizers.items():
          times[opt].append(compile_seconds(make(dims), params))
      row = {opt: statistics.median(t) for opt, t in times.items()}
      row["ratio"] = row["rotation"] / row["adamw"]
      rows[(layers, name)] = row
      print(f"| {layers} | {name} | {row['adamw']:.2f} | {row['rotation']:.2f} | {row['ratio']:.1f}x |",
            flush=True)
  return rows


if __name__ == "__main__":
  main()

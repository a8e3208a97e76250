"""What XLA says a function costs: FLOPs, temporary memory, wall time; and growth exponents."""

from __future__ import annotations

import dataclasses
import time

import jax
import numpy as np


@dataclasses.dataclass(frozen=True)
class Cost:
  flops: float  # XLA's cost_analysis() FLOP count
  temp_bytes: int  # memory_analysis().temp_size_in_bytes
  seconds: float  # median wall time of the compiled function


def measure(fn, *args, repeats: int = 5, time_it: bool = True) -> Cost:
  """Compiles ``fn`` for ``args`` and reports XLA's FLOPs, temporary memory and wall time."""
  compiled = jax.jit(fn).lower(*args).compile()
  analysis = compiled.cost_analysis()
  if isinstance(analysis, (list, tuple)):  # older JAX returns one dict per computation
    analysis = analysis[0]
  flops = float(analysis.get("flops", 0.0))
  memory = compiled.memory_analysis()
  temp = int(getattr(memory, "temp_size_in_bytes", 0)) if memory is not None else 0
  seconds = float("nan")
  if time_it:
    jax.block_until_ready(compiled(*args))
    times = []
    for _ in range(repeats):
      t0 = time.perf_counter()
      jax.block_until_ready(compiled(*args))
      times.append(time.perf_counter() - t0)
    seconds = float(np.median(times))
  return Cost(flops, temp, seconds)


def growth_exponent(xs, ys) -> float:
  """Least-squares slope of log(y) against log(x): y ~ x ** exponent."""
  xs, ys = np.log(np.asarray(xs, np.float64)), np.log(np.maximum(np.asarray(ys, np.float64), 1e-30))
  return float(np.polyfit(xs, ys, 1)[0])

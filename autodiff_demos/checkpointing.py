"""Gradient checkpointing with sqrt(L) segments: O(sqrt(L)) memory for about 4/3 the compute.

Memory is measured on ``lax.scan`` formulations (the backward of a scan walks the segments one at
a time, so XLA's buffers show the saving); FLOPs on the unrolled network, since XLA counts a
loop body once.
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp

from autodiff_demos import costs
from autodiff_demos.report import check

DEPTHS = (16, 36, 64, 100, 144)


def tutorial_counts(layers: int = 100):
  """The tutorial's figure: sqrt(L) stored boundaries plus sqrt(L) recomputed activations."""
  seg = math.isqrt(layers)
  return 2 * seg, layers


def _layer(x, w):
  return jnp.tanh(x @ w), None


def scan_loss(depth, segment):
  """Loss of a depth-``depth`` tanh network; ``segment`` > 0: checkpointed segments of that size."""

  def loss(ws, x):
    if segment:
      body = jax.checkpoint(lambda x, wseg: (jax.lax.scan(_layer, x, wseg)[0], None))
      x = jax.lax.scan(body, x, ws.reshape(depth // segment, segment, *ws.shape[1:]))[0]
    else:
      x = jax.lax.scan(_layer, x, ws)[0]
    return jnp.sum(x**2)

  return loss


def unrolled_loss(depth, segment):
  def run(ws, x):
    for i in range(ws.shape[0]):
      x = _layer(x, ws[i])[0]
    return x

  def loss(ws, x):
    if segment:
      for i in range(0, depth, segment):
        x = jax.checkpoint(run)(ws[i:i + segment], x)
    else:
      x = run(ws, x)
    return jnp.sum(x**2)

  return loss


def measure(depths=DEPTHS, width=64, batch=256):
  rows = []
  for depth in depths:
    ws = jax.random.normal(jax.random.PRNGKey(0), (depth, width, width)) / jnp.sqrt(width)
    x = jax.random.normal(jax.random.PRNGKey(1), (batch, width))
    seg = math.isqrt(depth)
    mem = lambda s: costs.measure(jax.grad(scan_loss(depth, s)), ws, x, time_it=False).temp_bytes
    flops = lambda s: costs.measure(jax.grad(unrolled_loss(depth, s)), ws, x, time_it=False).flops
    rows.append({"depth": depth, "plain_bytes": mem(0), "ckpt_bytes": mem(seg),
                 "plain_flops": flops(0), "ckpt_flops": flops(seg)})
  return rows


def claims(rows=None):
  rows = measure() if rows is None else rows
  depths = [r["depth"] for r in rows]
  plain_exp = costs.growth_exponent(depths, [r["plain_bytes"] for r in rows])
  ckpt_exp = costs.growth_exponent(depths, [r["ckpt_bytes"] for r in rows])
  ratio = rows[-1]["ckpt_flops"] / rows[-1]["plain_flops"]
  stored, total = tutorial_counts()
  return [
      check("checkpointing", "L = 100 with sqrt(L) segments", "20 stored instead of 100",
            f"{stored} stored instead of {total}", (stored, total) == (20, 100)),
      check("checkpointing", "temporary memory growth with L (memory_analysis)", "O(sqrt L): exponent 0.5",
            f"exponent {ckpt_exp:.2f} with checkpointing, {plain_exp:.2f} without "
            f"({rows[-1]['ckpt_bytes']} vs {rows[-1]['plain_bytes']} bytes at L={depths[-1]})",
            0.3 < ckpt_exp < 0.7 and plain_exp > 0.85),
      check("checkpointing", "compute with recomputation / without", "about 4/3 = 1.33",
            f"{ratio:.3f} (XLA FLOPs at L={depths[-1]}; the last segment needs no recomputation)",
            abs(ratio - 4 / 3) < 0.12),
  ]

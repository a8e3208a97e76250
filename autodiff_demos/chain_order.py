"""Chain order: multiplying layer Jacobians right-to-left (matrix x matrix) or left-to-right
starting from the loss's row vector (vector x matrix). Same answer, cost differs by the width."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from autodiff_demos import costs
from autodiff_demos.report import check


def analytic(width: int = 4096, layers: int = 100):
  """The tutorial's counts: (layers - 1) products of n^3 or of n^2 multiplies."""
  return (layers - 1) * width**3, (layers - 1) * width**2


def _right_to_left(first, mats):
  return functools.reduce(lambda acc, j: j @ acc, mats, first)  # full Jacobian: n x n each step


def _left_to_right(row, mats):
  return functools.reduce(lambda acc, j: acc @ j, mats[::-1], row)  # a 1 x n row each step


def measured(width: int = 512, layers: int = 20):
  """XLA FLOPs of the same ``layers - 1`` products in both orders."""
  key = jax.random.PRNGKey(0)
  mats = list(jax.random.normal(key, (layers - 1, width, width)) / jnp.sqrt(width))
  first = jnp.eye(width)
  row = jnp.ones((1, width))
  right = costs.measure(_right_to_left, first, mats, repeats=2)
  left = costs.measure(_left_to_right, row, mats, repeats=2)
  return right, left


def claims():
  right, left = analytic()
  out = [check("chain order", "right-to-left, 100 layers of width 4096", "6.8e12 multiplies",
               f"{right:.3g}", abs(right - 6.8e12) / 6.8e12 < 0.01),
         check("chain order", "left-to-right from the loss row", "1.66e9 (1.7e9) multiplies",
               f"{left:.3g}", abs(left - 1.66e9) / 1.66e9 < 0.01),
         check("chain order", "ratio of the two orders", "exactly 4096", f"{right / left:g}",
               right / left == 4096)]
  r, l = measured()
  ratio = r.flops / l.flops
  out.append(check("chain order", "XLA FLOPs, 19 products at width 512: ratio = width", "512",
                   f"{ratio:.1f} ({r.flops:.3g} vs {l.flops:.3g} FLOPs; time x{r.seconds / l.seconds:.0f})",
                   abs(ratio - 512) / 512 < 0.02))
  return out

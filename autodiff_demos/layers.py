"""Per-layer VJPs, fan-out sums, broadcasting, gradient accumulation, and the backward/forward
FLOP ratio of an MLP with the tutorial's variants."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from autodiff_demos import costs
from autodiff_demos.report import check


def elementwise_vjp_cost(width: int = 4096):
  """XLA FLOPs of relu's VJP against multiplying by its explicit diagonal Jacobian."""
  x = jax.random.normal(jax.random.PRNGKey(0), (width,))
  u = jnp.ones(width)
  vjp = costs.measure(lambda x, u: jax.vjp(jax.nn.relu, x)[1](u)[0], x, u, time_it=False)
  dense = costs.measure(lambda x, u: u @ jnp.diag((x > 0).astype(x.dtype)), x, u, time_it=False)
  return vjp.flops, dense.flops


def mlp_ratios(width: int = 256, layers: int = 8, batch: int = 64):
  """Backward FLOPs / forward FLOPs for a linear MLP and the tutorial's variants."""
  key = jax.random.PRNGKey(0)
  ws = list(jax.random.normal(key, (layers, width, width)) / jnp.sqrt(width))
  x = jax.random.normal(key, (batch, width))

  def net(ws, x, act=lambda z: z):
    for w in ws:
      x = act(x @ w)
    return 0.5 * jnp.sum(x * x)  # a data-dependent cotangent (a sum would let XLA skip a matmul)

  forward = costs.measure(net, ws, x, time_it=False).flops
  total = lambda fn: costs.measure(fn, ws, x, time_it=False).flops
  ratio = lambda fn: (total(fn) - forward) / forward
  half = layers // 2
  relu_net = lambda ws, x: net(ws, x, jax.nn.relu)
  # (measured ratio, the product count's prediction)
  return {
      "weights only (first layer needs no input gradient)":
          (ratio(jax.grad(net)), (2 * layers - 1) / layers),
      "last half frozen (input gradients only there)":
          (ratio(lambda ws, x: jax.grad(lambda low: net(low + ws[half:], x))(ws[:half])),
           (half + 2 * half - 1) / layers),
      "with relu activations": (ratio(jax.grad(relu_net)), (2 * layers - 1) / layers),
      # value_and_grad keeps the first forward alive; the backward then recomputes it.
      "with recomputation (jax.checkpoint of the whole net)":
          (ratio(jax.value_and_grad(jax.checkpoint(relu_net))), (3 * layers - 1) / layers),
  }, ratio(jax.grad(net, argnums=(0, 1))), total(jax.grad(net)) / forward


def worked():
  fan = jax.grad(lambda x: (2 * x) * (x**2))(3.0)
  U = jnp.array([[1.0, 2.0], [3.0, 4.0], [5.0, 6.0]])
  bias = jnp.zeros(2)
  x = jnp.zeros((3, 2))
  dsum = jax.vjp(lambda b: x + b, bias)[1](U)[0]  # dL/dy = U, y = x + b broadcast over the batch
  dmean = jax.grad(lambda b: jnp.sum(U * (x + b)) / 3)(bias)
  # Gradient accumulation: 4 micro-batches of a summed loss give the big-batch gradient.
  key = jax.random.PRNGKey(1)
  w = jax.random.normal(key, (5, 3))
  data = jax.random.normal(jax.random.PRNGKey(2), (16, 5))
  loss = lambda w, d: jnp.sum(jnp.tanh(d @ w) ** 2)
  big = jax.grad(loss)(w, data)
  acc = sum(jax.grad(loss)(w, data[i * 4:(i + 1) * 4]) for i in range(4))
  # Bias: pass-through; residual: u + u^T J_F.
  u = jnp.array([1.0, -2.0, 0.5])
  v = jnp.array([0.3, 0.1, -0.7])
  F = lambda z: jnp.tanh(jnp.outer(v, v) @ z)
  res = jax.vjp(lambda z: z + F(z), v)[1](u)[0]
  res_ref = u + jax.vjp(F, v)[1](u)[0]
  passthrough = jax.vjp(lambda b: v + b, jnp.zeros(3))[1](u)[0]
  return {"fan": float(fan), "bias_sum": np.asarray(dsum), "bias_mean": np.asarray(dmean),
          "accumulation_error": float(jnp.max(jnp.abs(big - acc))),
          "residual_error": float(jnp.max(jnp.abs(res - res_ref))),
          "passthrough_error": float(jnp.max(jnp.abs(passthrough - u)))}


def claims():
  w = worked()
  vjp_flops, dense_flops = elementwise_vjp_cost()
  ratios, both, step = mlp_ratios()
  out = [
      check("per-layer VJP", "element-wise VJP at width 4096: O(n), not an n x n matrix",
            "4096 multiplies vs a 16.7M-entry matrix",
            f"{vjp_flops:.0f} FLOPs vs {dense_flops:.3g} for the dense diagonal",
            vjp_flops <= 3 * 4096 and dense_flops >= 2 * 4096**2 * 0.99),
      check("per-layer VJP", "bias: pass-through; residual: u + u^T J_F", "exact",
            f"max errors {w['passthrough_error']:.1e}, {w['residual_error']:.1e}",
            w["passthrough_error"] == 0 and w["residual_error"] < 1e-6),
      check("fan-out", "a = 2x, b = x^2, L = ab at x = 3: branches add", "18 + 36 = 54 = 6x^2",
            f"{w['fan']:g}", w["fan"] == 54.0),
      check("accumulation", "4 micro-batch gradients summed = big-batch gradient", "equal",
            f"max diff {w['accumulation_error']:.1e}", w["accumulation_error"] < 1e-5),
      check("broadcasting", "bias gradient = sum over the broadcast axis", "(9, 12)",
            str(tuple(float(x) for x in w["bias_sum"])), np.allclose(w["bias_sum"], [9, 12])),
      check("broadcasting", "mean instead of sum loss divides it by the batch size", "(3, 4) for batch 3",
            str(tuple(round(float(x), 6) for x in w["bias_mean"])), np.allclose(w["bias_mean"], [3, 4])),
      check("backward cost", "linear layers: backward / forward FLOPs", "about 2",
            f"{both:.3f} (weight and input gradients)", abs(both - 2) < 0.1),
      check("backward cost", "training step (forward + backward) / forward", "about 3",
            f"{step:.3f} (weights only)", 2.7 < step < 3.1),
  ]
  for name, (r, predicted) in ratios.items():
    out.append(check("backward cost", f"variant: {name}", f"between 1x and 3x (count: {predicted:.3f})",
                     f"{r:.3f}", 0.9 <= r <= 3.1 and abs(r - predicted) < 0.1))
  return out

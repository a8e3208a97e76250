"""Hessian-vector products by forward-over-reverse, against the full Hessian, and the design's core
comparison (jvp, vjp, jacfwd(grad), jacrev, HVP) on an MLP loss as the input size n grows."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from autodiff_demos import costs
from autodiff_demos.report import check

SIZES = (16, 32, 64, 128, 256)


def hvp(f, x, v):
  """``H v`` as the JVP of the gradient (forward-over-reverse): a few gradients' cost."""
  return jax.jvp(jax.grad(f), (x,), (v,))[1]


def worked():
  f = lambda x: x[0] ** 2 * x[1]
  x, v = jnp.array([2.0, 3.0]), jnp.array([1.0, 2.0])
  return np.asarray(jax.jacfwd(jax.grad(f))(x)), np.asarray(hvp(f, x, v))


def mlp_loss(n, hidden=64, seed=0):
  k1, k2 = jax.random.split(jax.random.PRNGKey(seed))
  w1 = jax.random.normal(k1, (n, hidden)) / jnp.sqrt(n)
  w2 = jax.random.normal(k2, (hidden,)) / jnp.sqrt(hidden)
  return lambda x: jnp.sum(jnp.tanh(x @ w1) @ w2) ** 2


def core_comparison(sizes=SIZES):
  """Per n: XLA FLOPs, temporary bytes and wall time of each method on the MLP loss."""
  table = []
  for n in sizes:
    f = mlp_loss(n)
    x = jax.random.normal(jax.random.PRNGKey(1), (n,))
    v = jnp.ones(n)
    methods = {
        "forward": (f, (x,)),
        "jax.jvp": (lambda x, v: jax.jvp(f, (x,), (v,))[1], (x, v)),
        "jax.vjp (gradient)": (lambda x: jax.vjp(f, x)[1](jnp.ones(()))[0], (x,)),
        "HVP (jvp of grad)": (lambda x, v: hvp(f, x, v), (x, v)),
        "jax.jacfwd(jax.grad)": (jax.jacfwd(jax.grad(f)), (x,)),
        "jax.jacrev(jax.grad)": (jax.jacrev(jax.grad(f)), (x,)),
    }
    for name, (fn, args) in methods.items():
      c = costs.measure(fn, *args, repeats=3)
      table.append({"n": n, "method": name, "flops": c.flops, "temp_bytes": c.temp_bytes,
                    "seconds": c.seconds})
  return table


def exponents(table):
  out = {}
  for name in sorted({r["method"] for r in table}):
    rows = [r for r in table if r["method"] == name]
    out[name] = costs.growth_exponent([r["n"] for r in rows], [r["flops"] for r in rows])
  return out


def claims(table=None):
  table = core_comparison() if table is None else table
  H, Hv = worked()
  exp = exponents(table)
  at = lambda name, n: next(r for r in table if r["method"] == name and r["n"] == n)
  n_max = max(r["n"] for r in table)
  grad_ratio = at("jax.vjp (gradient)", n_max)["flops"] / at("forward", n_max)["flops"]
  hvp_ratio = at("HVP (jvp of grad)", n_max)["flops"] / at("jax.vjp (gradient)", n_max)["flops"]
  hess_ratio = [at("jax.jacfwd(jax.grad)", n)["flops"] / at("jax.vjp (gradient)", n)["flops"]
                for n in sorted({r["n"] for r in table})]
  hess_vs_grad_exp = costs.growth_exponent(sorted({r["n"] for r in table}), hess_ratio)
  return [
      check("HVP", "L = x1^2 x2 at (2, 3): Hessian", "[[6, 4], [4, 0]]", str(H.tolist()),
            np.allclose(H, [[6, 4], [4, 0]])),
      check("HVP", "H v for v = (1, 2) (forward-over-reverse)", "(14, 4)", str(Hv.tolist()),
            np.allclose(Hv, [14, 4])),
      check("HVP", f"gradient / forward FLOPs on the MLP loss (n={n_max})", "a small constant (about 2-3)",
            f"{grad_ratio:.2f}", 1.5 < grad_ratio < 4),
      check("HVP", "HVP / gradient FLOPs", "a few gradients", f"{hvp_ratio:.2f}", 1 < hvp_ratio < 5),
      check("HVP", "full Hessian / gradient FLOPs grows about linearly in n",
            "exponent about 1", f"ratios {[round(r) for r in hess_ratio]}, exponent {hess_vs_grad_exp:.2f}",
            0.8 < hess_vs_grad_exp < 1.2),
      check("HVP", "FLOP growth exponents in n (gradient vs full Hessian)", "about 1 vs about 2",
            f"grad {exp['jax.vjp (gradient)']:.2f}, HVP {exp['HVP (jvp of grad)']:.2f}, "
            f"jacfwd(grad) {exp['jax.jacfwd(jax.grad)']:.2f}, jacrev(grad) {exp['jax.jacrev(jax.grad)']:.2f}",
            exp["jax.jacfwd(jax.grad)"] - exp["jax.vjp (gradient)"] > 0.8),
  ]

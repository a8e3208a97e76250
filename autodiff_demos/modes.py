"""Forward vs reverse mode: Jacobian passes, the scalar-loss argument, multi-objective losses and
memory on square Jacobians."""

from __future__ import annotations

import jax
import jax.numpy as jnp

from autodiff_demos import costs
from autodiff_demos.report import check

SECONDS_PER_YEAR = 365.25 * 24 * 3600


def _mlp(n_in, n_out, hidden=64, seed=0):
  k1, k2 = jax.random.split(jax.random.PRNGKey(seed))
  w1 = jax.random.normal(k1, (n_in, hidden)) / jnp.sqrt(n_in)
  w2 = jax.random.normal(k2, (hidden, n_out)) / jnp.sqrt(hidden)
  return lambda x: jnp.tanh(jnp.tanh(x @ w1) @ w2)


def jacobian_costs(sizes=(8, 32, 128, 512), fixed=8):
  """XLA FLOPs of jacfwd and jacrev for R^n -> R^m as one side grows and the other stays small."""
  rows = []
  for n in sizes:
    for n_in, n_out in ((n, fixed), (fixed, n)):
      fn = _mlp(n_in, n_out)
      x = jnp.ones(n_in)
      rows.append({"n": n_in, "m": n_out, "fwd": costs.measure(jax.jacfwd(fn), x, time_it=False).flops,
                   "rev": costs.measure(jax.jacrev(fn), x, time_it=False).flops})
  return rows


def multi_objective(num_losses=16, n=256):
  """One VJP of sum_i lambda_i L_i against m VJPs for the per-loss gradients."""
  fn = _mlp(n, num_losses)
  x = jax.random.normal(jax.random.PRNGKey(3), (n,))
  lam = jnp.linspace(0.1, 1.0, num_losses)
  weighted = jax.grad(lambda x: lam @ fn(x))
  per_loss = jax.jacrev(fn)
  err = float(jnp.max(jnp.abs(weighted(x) - lam @ per_loss(x))))
  one = costs.measure(weighted, x, time_it=False).flops
  many = costs.measure(per_loss, x, time_it=False).flops
  many_loop = costs.measure(lambda x: jnp.stack([jax.grad(lambda x, i=i: fn(x)[i])(x)
                                                 for i in range(num_losses)]), x, time_it=False).flops
  return err, one, many, many_loop


def square_memory(depths=(8, 16, 32, 64), width=128, batch=64):
  """Temporary memory of a JVP and a VJP through a deep square network as depth grows."""
  out = []
  for depth in depths:
    ws = jax.random.normal(jax.random.PRNGKey(0), (depth, width, width)) / jnp.sqrt(width)
    x = jax.random.normal(jax.random.PRNGKey(1), (batch, width))

    def net(x, ws=ws):
      for w in ws:
        x = jnp.tanh(x @ w)
      return x

    fwd = costs.measure(lambda x, t: jax.jvp(net, (x,), (t,))[1], x, x, time_it=False).temp_bytes
    rev = costs.measure(lambda x, u: jax.vjp(net, x)[1](u)[0], x, x, time_it=False).temp_bytes
    out.append({"depth": depth, "jvp": fwd, "vjp": rev})
  return out


def claims():
  rows = jacobian_costs()
  wide_in = [r for r in rows if r["m"] == 8 and r["n"] > 8]
  wide_out = [r for r in rows if r["n"] == 8 and r["m"] > 8]
  fwd_exp = costs.growth_exponent([r["n"] for r in wide_in], [r["fwd"] for r in wide_in])
  rev_exp = costs.growth_exponent([r["n"] for r in wide_in], [r["rev"] for r in wide_in])
  big_in, big_out = wide_in[-1], wide_out[-1]
  years = 7e9 * 0.1 / SECONDS_PER_YEAR
  err, one, many, many_loop = multi_objective()
  mem = square_memory()
  jvp_exp = costs.growth_exponent([r["depth"] for r in mem], [max(r["jvp"], 1) for r in mem])
  vjp_exp = costs.growth_exponent([r["depth"] for r in mem], [max(r["vjp"], 1) for r in mem])
  return [
      check("fwd vs rev", "n inputs -> 8 outputs: jacfwd needs n passes, jacrev 8",
            "forward cost grows with n; sweep the narrow side",
            f"FLOPs at n=512: jacfwd {big_in['fwd']:.3g}, jacrev {big_in['rev']:.3g}; "
            f"exponents in n: {fwd_exp:.2f} vs {rev_exp:.2f}",
            big_in["fwd"] > 4 * big_in["rev"] and fwd_exp > rev_exp + 0.4),
      check("fwd vs rev", "8 inputs -> m outputs: the other way round", "reverse cost grows with m",
            f"FLOPs at m=512: jacfwd {big_out['fwd']:.3g}, jacrev {big_out['rev']:.3g}",
            big_out["rev"] > 4 * big_out["fwd"]),
      check("scalar loss", "n = 7e9 parameters, 0.1 s per forward pass",
            "7e8 s, about 22 years; reverse about 0.2 s",
            f"{7e9 * 0.1:.3g} s = {years:.1f} years; reverse = one VJP = 2 x 0.1 s", abs(years - 22.2) < 0.5),
      check("multi-objective", "sum_i lambda_i grad L_i = one VJP of sum_i lambda_i L_i", "equal, 1 VJP",
            f"max diff {err:.1e}", err < 1e-5),
      check("multi-objective", "per-loss gradients for m = 16 losses cost m VJPs",
            "m VJPs; sharing one forward (backward = forward for input gradients): (1 + m) / 2 = 8.5x",
            f"{many_loop / one:.2f}x (16 grads), jacrev {many / one:.2f}x",
            abs(many_loop / one - 8.5) < 0.85),
      check("square Jacobians", "memory as depth grows: forward mode flat, reverse linear",
            "JVP O(1), VJP O(L)",
            f"temp bytes at L=8..64: JVP {[r['jvp'] for r in mem]}, VJP {[r['vjp'] for r in mem]}; "
            f"exponents {jvp_exp:.2f} vs {vjp_exp:.2f}", vjp_exp > 0.8 and jvp_exp < 0.3),
  ]

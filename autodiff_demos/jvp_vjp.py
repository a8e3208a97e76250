"""JVP and VJP on the tutorial's worked example, and dual numbers (forward mode by hand)."""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np

from autodiff_demos.report import check

X0 = jnp.array([2.0, 3.0])


def f(x):
  return jnp.stack([x[0] ** 2 * x[1], x[0] + 3 * x[1]])


def g(u):
  return jnp.stack([u[0] + u[1], u[0] * u[1]])


def h(x):
  return g(f(x))


@dataclasses.dataclass(frozen=True)
class Dual:
  """``a + b eps`` with ``eps^2 = 0``; ``b`` may be a vector (several tangent slots at once)."""

  a: float
  b: object

  def __add__(self, o):
    o = o if isinstance(o, Dual) else Dual(o, 0 * self.b)
    return Dual(self.a + o.a, self.b + o.b)

  __radd__ = __add__

  def __mul__(self, o):
    o = o if isinstance(o, Dual) else Dual(o, 0 * self.b)
    return Dual(self.a * o.a, self.a * o.b + self.b * o.a)

  __rmul__ = __mul__


def f_dual(x1, x2):
  return x1 * x1 * x2, x1 + 3 * x2


def g_dual(u1, u2):
  return u1 + u2, u1 * u2


def values():
  """Every number of the worked example, computed by JAX and by the dual-number class."""
  v, u = jnp.array([1.0, 2.0]), jnp.array([1.0, 2.0])
  jvp_out = jax.jvp(h, (X0,), (v,))[1]
  vjp_out = jax.vjp(h, X0)[1](u)[0]
  mid = f(X0)
  duals_f = f_dual(Dual(2.0, 1.0), Dual(3.0, 2.0))
  duals_g = g_dual(*duals_f)
  slots = g_dual(*f_dual(Dual(2.0, np.array([1.0, 0.0])), Dual(3.0, np.array([0.0, 1.0]))))
  return {
      "J": np.asarray(jax.jacfwd(h)(X0)), "J_rev": np.asarray(jax.jacrev(h)(X0)),
      "J_f": np.asarray(jax.jacfwd(f)(X0)), "J_g": np.asarray(jax.jacfwd(g)(mid)),
      "Jv": np.asarray(jvp_out), "uJ": np.asarray(vjp_out),
      "uJ_g": np.asarray(jax.vjp(g, mid)[1](u)[0]), "J_f v": np.asarray(jax.jvp(f, (X0,), (v,))[1]),
      "dual_f": [(d.a, d.b) for d in duals_f], "dual_g": [(d.a, d.b) for d in duals_g],
      "dual_columns": np.stack([d.b for d in slots]),  # rows: outputs, columns: tangent slots
      "vmap_columns": np.asarray(jax.vmap(lambda t: jax.jvp(h, (X0,), (t,))[1])(jnp.eye(2))).T,
  }


def claims():
  v = values()
  eq = lambda a, b: np.allclose(np.asarray(a, float), np.asarray(b, float))
  fmt = lambda a: np.array2string(np.asarray(a, float), separator=", ").replace("\n", "")
  return [
      check("JVP/VJP", "Jacobian of g(f(x)) at (2, 3)", "[[13, 7], [144, 80]]", fmt(v["J"]),
            eq(v["J"], [[13, 7], [144, 80]]) and eq(v["J_rev"], v["J"])),
      check("JVP/VJP", "J_f and J_g", "[[12, 4], [1, 3]], [[1, 1], [11, 12]]",
            f"{fmt(v['J_f'])}, {fmt(v['J_g'])}",
            eq(v["J_f"], [[12, 4], [1, 3]]) and eq(v["J_g"], [[1, 1], [11, 12]])),
      check("JVP/VJP", "J v for v = (1, 2) (jax.jvp)", "(27, 304)", fmt(v["Jv"]), eq(v["Jv"], [27, 304])),
      check("JVP/VJP", "u^T J for u = (1, 2) (jax.vjp)", "(301, 167)", fmt(v["uJ"]), eq(v["uJ"], [301, 167])),
      check("JVP/VJP", "layer by layer: u^T J_g, J_f v", "(23, 25), (20, 7)",
            f"{fmt(v['uJ_g'])}, {fmt(v['J_f v'])}", eq(v["uJ_g"], [23, 25]) and eq(v["J_f v"], [20, 7])),
      check("dual numbers", "f(2 + eps, 3 + 2 eps)", "(12 + 20 eps, 11 + 7 eps)",
            " , ".join(f"{a:g} + {b:g} eps" for a, b in v["dual_f"]),
            [(a, float(b)) for a, b in v["dual_f"]] == [(12, 20), (11, 7)]),
      check("dual numbers", "g(f(...))", "(23 + 27 eps, 132 + 304 eps)",
            " , ".join(f"{a:g} + {b:g} eps" for a, b in v["dual_g"]),
            [(a, float(b)) for a, b in v["dual_g"]] == [(23, 27), (132, 304)]),
      check("dual numbers", "two tangent slots = Jacobian columns (also vmap of jax.jvp)",
            "(13, 144), (7, 80)", fmt(v["dual_columns"].T),
            eq(v["dual_columns"], [[13, 7], [144, 80]]) and eq(v["vmap_columns"], v["dual_columns"])),
  ]

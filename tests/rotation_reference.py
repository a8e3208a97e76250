"""The float64 NumPy transcription of docs/algorithms.md section 2 that the rotation tests compare
against, and the small drivers they share."""

import jax
import jax.numpy as jnp
import numpy as np
import optax

B1, B2, EPS, LR, WD = 0.9, 0.999, 1e-8, 1e-2, 0.01


def reference(w0, grads, *, source, geometry, period, b1=B1, b2=B2, eps=EPS, lr=LR, wd=WD,
              first_order_step="paper", second_moments="permute"):
  """The paper's algorithm (docs/algorithms.md) in float64 NumPy, first moment kept in original
  coordinates; unilateral geometry rotates the input (left) side of a square Flax kernel.
  ``second_moments="rotate"``: at a warm refresh ``nu <- (U_new^T U_old)^2 nu (V_old^T V_new)^2``
  instead of the permutations."""
  w = np.array(w0, np.float64)
  m_dim, n_dim = w.shape
  rot_l, rot_r = (True, True) if geometry == "bilateral" else (m_dim <= n_dim, m_dim > n_dim)
  ql, qr = np.eye(m_dim), np.eye(n_dim)
  stat_l, stat_r = np.zeros((m_dim, m_dim)), np.zeros((n_dim, n_dim))
  mom, nu = np.zeros_like(w), np.zeros_like(w)
  history = []

  def desc_eigh(s):
    return np.linalg.eigh(s + 1e-30 * np.eye(len(s)))[1][:, ::-1]

  for t, g in enumerate(grads, start=1):
    g = np.asarray(g, np.float64)
    if source == "second":
      stat_l = b2 * stat_l + (1 - b2) * g @ g.T
      stat_r = b2 * stat_r + (1 - b2) * g.T @ g
    if t == 1 or t % period == 0:
      ql_old, qr_old, nu_old = ql, qr, nu
      look = b1 * mom + (1 - b1) * g
      if t == 1 and source == "second":
        ql = desc_eigh(stat_l) if rot_l else ql
        qr = desc_eigh(stat_r) if rot_r else qr
      elif t == 1:
        u, _, vt = np.linalg.svd(look)
        ql, qr = (u if rot_l else ql), (vt.T if rot_r else qr)
      elif source == "second":
        for side, s in ((0, stat_l), (1, stat_r)):
          if not (rot_l, rot_r)[side]:
            continue
          q = (ql, qr)[side]
          order = np.argsort(-np.diag(q.T @ s @ q), kind="stable")
          nu = np.take(nu, order, axis=side)
          q = np.linalg.qr(s @ q[:, order], mode="complete")[0]
          ql, qr = (q, qr) if side == 0 else (ql, q)
      else:
        if rot_l:
          order = np.argsort(-np.sum((look.T @ ql) ** 2, 0), kind="stable")
          ql, nu = ql[:, order], nu[order, :]
        if rot_r:
          order = np.argsort(-np.sum((look @ qr) ** 2, 0), kind="stable")
          qr, nu = qr[:, order], nu[:, order]
        if rot_l and rot_r:
          ql, qr = np.linalg.qr(look @ qr, mode="complete")[0], np.linalg.qr(look.T @ ql, mode="complete")[0]
        elif first_order_step == "paper" and rot_l:  # qr of M's columns sorted by norm
          ql = np.linalg.qr(look[:, np.argsort(-np.sum(look**2, 0), kind="stable")], mode="complete")[0]
        elif first_order_step == "paper":  # qr of M's rows sorted by norm
          qr = np.linalg.qr(look[np.argsort(-np.sum(look**2, 1), kind="stable")].T, mode="complete")[0]
        elif rot_l:
          ql = np.linalg.qr(look @ look.T @ ql, mode="complete")[0]
        else:
          qr = np.linalg.qr(look.T @ look @ qr, mode="complete")[0]
      if second_moments == "rotate" and t > 1:
        nu = (ql.T @ ql_old) ** 2 @ nu_old @ (qr_old.T @ qr) ** 2
    mom = b1 * mom + (1 - b1) * g
    uq = ql if rot_l else np.eye(m_dim)
    vq = qr if rot_r else np.eye(n_dim)
    g_rot, m_rot = uq.T @ g @ vq, uq.T @ mom @ vq
    nu = b2 * nu + (1 - b2) * g_rot**2
    step = np.sqrt(1 - b2**t) / (1 - b1**t) * uq @ (m_rot / (np.sqrt(nu) + eps)) @ vq.T
    w = w - lr * wd * w - lr * step
    history.append(w.copy())
  return np.stack(history)


def run(tx, w0, grads):
  params = {"w": jnp.asarray(w0, jnp.float32)}
  state = tx.init(params)

  @jax.jit
  def step(params, state, g):
    updates, state = tx.update({"w": g}, state, params)
    return optax.apply_updates(params, updates), state

  out = []
  for g in grads:
    params, state = step(params, state, jnp.asarray(g, jnp.float32))
    out.append(np.asarray(params["w"]))
  return np.stack(out), state


def gradient_sequence(shape, steps, seed, zero_first=True):
  rng = np.random.default_rng(seed)
  mix = rng.normal(size=(shape[0], shape[0]))
  grads = [mix @ rng.normal(size=shape) * np.linspace(2.0, 0.5, shape[1]) for _ in range(steps)]
  if zero_first:
    grads[0] = np.zeros(shape)  # a zero first gradient must work
  return grads


def run_tree(tx, params, grads):
  """Updates of ``tx`` over a list of gradient trees (jitted once), as float64 NumPy trees."""
  state, out = tx.init(params), []
  update = jax.jit(tx.update)
  for g in grads:
    u, state = update(g, state, params)
    out.append(jax.tree.map(lambda x: np.asarray(x, np.float64), u))
  return out, state

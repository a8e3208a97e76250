"""Update diagnostics (pipeline_sim/diagnostics.py) against hand replays of the pipeline's weight
history: the cosines of stale and fresh updates and the flip rate along the sharpest direction."""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from test_driver import tanh_layers

import pipeline_sim as ps


def test_update_diagnostics_against_a_replay_of_the_weight_history():
  # Three tanh layers with 4 x 4 matrices, SGD (update = -lr * gradient): the cosine of a stage's
  # stale and fresh updates is that of its gradient at the stashed weights W_k(i - tau_k) and at the
  # current ones, recomputed here from the recorded weight history; the flip rate from the applied
  # updates and fresh gradients with NumPy's eigh.
  num_stages, warm, window = 3, 5, 6
  n = warm + window
  params, labels, loss_fn, xs, ys = tanh_layers(num_stages, n, seed=3)
  pipe = ps.Pipeline(loss_fn, optax.sgd(0.3), labels)
  state = pipe.init(params)
  history = [jax.tree.map(np.asarray, params)]
  for i in range(warm):
    state, _ = pipe.run(state, (xs[i:i + 1], ys[i:i + 1]))
    history.append(jax.tree.map(np.asarray, state.params))
  got = ps.diagnose(pipe, state, (xs[warm:], ys[warm:]))
  for i in range(warm, n):  # the trial steps, replayed
    state, _ = pipe.run(state, (xs[i:i + 1], ys[i:i + 1]))
    history.append(jax.tree.map(np.asarray, state.params))
  tau = ps.stage_delays(num_stages)
  grad = jax.grad(loss_fn)
  cos, deltas, fresh = [], [], []
  for i in range(warm, n):
    stale_w = {"w": [history[max(0, i - tau[k])]["w"][k] for k in range(num_stages)]}
    g_stale, g_fresh = grad(stale_w, (xs[i], ys[i])), grad(history[i], (xs[i], ys[i]))
    cos.append([float(np.dot(np.ravel(g_stale["w"][k]), np.ravel(g_fresh["w"][k]))
                      / np.linalg.norm(g_stale["w"][k]) / np.linalg.norm(g_fresh["w"][k]))
                for k in range(num_stages)])
    deltas.append([history[i + 1]["w"][k] - history[i]["w"][k] for k in range(num_stages)])
    fresh.append([np.asarray(g_fresh["w"][k], np.float64) for k in range(num_stages)])
  np.testing.assert_allclose(got["cosine"], np.array(cos), atol=1e-5)
  np.testing.assert_allclose(got["gradient_cosine"], got["cosine"], atol=1e-5)  # SGD: no momentum
  assert np.min(got["cosine"]) < 0.99  # staleness turns the updates (the last stage's too: its
  # input comes from the earlier stages' stashed weights)
  for k in range(num_stages):
    g = np.stack([f[k] for f in fresh])
    d = np.stack([x[k] for x in deltas])
    u = np.linalg.eigh(np.einsum("tij,tkj->ik", g, g))[1][:, -1]
    v = np.linalg.eigh(np.einsum("tji,tjk->ik", g, g))[1][:, -1]
    c = np.einsum("i,tij,j->t", u, d, v)
    assert got["flip_rate"][k] == pytest.approx(np.mean(np.sign(c[1:]) != np.sign(c[:-1]))), k
  synchronous = ps.Pipeline(lambda p, b: loss_fn(p, b), optax.adam(0.1), {"w": [0] * num_stages})
  one = ps.diagnose(synchronous, synchronous.init(params), (xs[:3], ys[:3]))
  np.testing.assert_allclose(one["cosine"], 1.0, atol=1e-6)  # no delay: stale = fresh
  with pytest.raises(ValueError, match="diagnose supports modes"):
    ps.diagnose(ps.Pipeline(loss_fn, optax.sgd(0.1), labels, "stale_gradients"), state, (xs[:2], ys[:2]))


def test_the_flip_rate_counts_a_stacked_leaf_as_its_matrices():
  """A scanned stack (one (L, m, n) leaf) gives the flip rate of the same L matrices held as L
  2-D leaves: the mean of their per-matrix rates (not NaN: it is not left out)."""
  rng = np.random.default_rng(5)
  mats = [jnp.asarray(rng.normal(size=(4, 4)) * 0.8, jnp.float32) for _ in range(3)]
  xs = jnp.asarray(rng.normal(size=(8, 8, 4)), jnp.float32)
  ys = jnp.asarray(rng.normal(size=(8, 8, 4)), jnp.float32)

  def loss_of(stack, last, batch):
    h = batch[0]
    for w in stack:
      h = jnp.tanh(h @ w)
    return jnp.mean((h @ last - batch[1]) ** 2)

  flips = {}
  for layout, params in (("stacked", {"s": jnp.stack(mats[:2]), "w": mats[2]}),
                         ("separate", {"s": mats[:2], "w": mats[2]})):
    labels = {"s": 0 if layout == "stacked" else [0, 0], "w": 1}
    pipe = ps.Pipeline(lambda p, b: loss_of(p["s"], p["w"], b), optax.sgd(0.3), labels)
    state, _ = pipe.run(pipe.init(params), (xs[:2], ys[:2]))
    flips[layout] = ps.diagnose(pipe, state, (xs[2:], ys[2:]))["flip_rate"]
  assert np.all(np.isfinite(flips["stacked"]))
  np.testing.assert_allclose(flips["stacked"], flips["separate"], atol=1e-6)


def test_the_gradient_cosine_leaves_the_shared_momentum_out():
  """Momentum SGD: the whole updates share ``0.9 m``, so their cosine is near 1 whatever the
  delay; the gradient's own part ``u(g) - u(0) = -lr g`` has the cosine of the stale and fresh
  gradients themselves, recomputed here from the recorded weights."""
  num_stages, warm, window = 3, 6, 4
  n = warm + window
  params, labels, loss_fn, xs, ys = tanh_layers(num_stages, n, seed=4)
  pipe = ps.Pipeline(loss_fn, optax.sgd(0.3, momentum=0.9), labels)
  state = pipe.init(params)
  history = [jax.tree.map(np.asarray, params)]
  for i in range(n):
    if i == warm:
      got = ps.diagnose(pipe, state, (xs[warm:], ys[warm:]))
    state, _ = pipe.run(state, (xs[i:i + 1], ys[i:i + 1]))
    history.append(jax.tree.map(np.asarray, state.params))
  tau, grad = ps.stage_delays(num_stages), jax.grad(loss_fn)
  want = []
  for i in range(warm, n):
    stale = {"w": [history[max(0, i - tau[k])]["w"][k] for k in range(num_stages)]}
    a, b = grad(stale, (xs[i], ys[i])), grad(history[i], (xs[i], ys[i]))
    want.append([float(np.vdot(a["w"][k], b["w"][k]) / np.linalg.norm(a["w"][k]) / np.linalg.norm(b["w"][k]))
                 for k in range(num_stages)])
  np.testing.assert_allclose(got["gradient_cosine"], np.array(want), atol=1e-4)
  # the stale stages' whole updates share the momentum: their cosine is closer to 1
  assert np.mean(got["cosine"][:, :-1]) > np.mean(got["gradient_cosine"][:, :-1])



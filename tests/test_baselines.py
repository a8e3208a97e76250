import jax.numpy as jnp
import numpy as np
import optax
import pytest

import pipeline_sim as ps


def torch_nadam_reference(p0, grads, lr, b1, b2, eps, wd, psi=0.004):
  """NumPy transcription of torch.optim.NAdam(decoupled_weight_decay=True)'s step."""
  p = np.array(p0, np.float64)
  m, v, mu_product = np.zeros_like(p), np.zeros_like(p), 1.0
  out = []
  for step, g in enumerate(grads, start=1):
    p = p * (1 - lr * wd)
    bias_correction2 = 1 - b2**step
    mu = b1 * (1.0 - 0.5 * 0.96 ** (step * psi))
    mu_next = b1 * (1.0 - 0.5 * 0.96 ** ((step + 1) * psi))
    mu_product *= mu
    m = m + (g - m) * (1 - b1)  # exp_avg.lerp_(grad, 1 - beta1)
    v = v * b2 + (1 - b2) * g * g
    denom = np.sqrt(v / bias_correction2) + eps
    p = p - lr * (1.0 - mu) / (1.0 - mu_product) * g / denom
    p = p - lr * mu_next / (1.0 - mu_product * mu_next) * m / denom
    out.append(p.copy())
  return np.stack(out)


def test_nadam_matches_torch_formula_over_20_steps():
  rng = np.random.default_rng(0)
  p0 = rng.normal(size=(3, 4))
  grads = [rng.normal(size=(3, 4)) for _ in range(20)]
  tx = ps.nesterov(1e-2, b1=0.99, b2=0.999, eps=1e-8, weight_decay=0.1)
  params, state, ours = jnp.asarray(p0, jnp.float32), None, []
  state = tx.init(params)
  for g in grads:
    u, state = tx.update(jnp.asarray(g, jnp.float32), state, params)
    params = optax.apply_updates(params, u)
    ours.append(np.asarray(params))
  ref = torch_nadam_reference(p0, grads, 1e-2, 0.99, 0.999, 1e-8, 0.1)
  np.testing.assert_allclose(np.stack(ours), ref, rtol=2e-5, atol=2e-6)
  # optax's nadamw is a different formula.
  other = optax.nadamw(1e-2, b1=0.99, b2=0.999, eps=1e-8, weight_decay=0.1)
  params, st = jnp.asarray(p0, jnp.float32), None
  st = other.init(params)
  for g in grads:
    u, st = other.update(jnp.asarray(g, jnp.float32), st, params)
    params = optax.apply_updates(params, u)
  assert np.abs(np.asarray(params) - ref[-1]).max() > 1e-4


@pytest.mark.parametrize("delay,t,expected", [(0, 0, 1e-3), (4, 0, 1e-3 / 4), (4, 50, 1e-3 / 2),
                                              (4, 100, 1e-3), (4, 500, 1e-3), (9, 50, 1e-3 / 3)])
def test_pipemare_lr_factors(delay, t, expected):
  sched = ps.pipemare_lr_schedule(1e-3, delay, transition_steps=100)
  np.testing.assert_allclose(float(sched(t)), expected, rtol=1e-6)


def test_pipedream_lr_scales_the_first_adamw_step():
  g = jnp.ones(3)
  step = lambda tx: tx.update(g, tx.init(jnp.zeros(3)), jnp.zeros(3))[0]
  np.testing.assert_allclose(step(ps.pipedream_lr(1e-2, 4, 100)), np.asarray(step(ps.pipedream(1e-2))) / 4,
                             rtol=1e-6)


def test_per_stage_optimizers_and_clipping():
  np.testing.assert_allclose(ps.nesterov_stage_b1(0.9, 3, 4), 0.9 + 3 * 0.09 / 4)
  opts = ps.per_stage(lambda k: optax.sgd(0.1 * (k + 1)), 3, clip_norm=1.0)
  assert len(opts) == 3
  big = jnp.asarray([30.0, 40.0])  # norm 50: clipped to norm 1
  for k, opt in enumerate(opts):
    u, _ = opt.update(big, opt.init(big))
    np.testing.assert_allclose(u, -0.1 * (k + 1) * np.array([0.6, 0.8]), rtol=1e-6)
  small = jnp.asarray([0.3, 0.4])  # norm 0.5: untouched
  u, _ = opts[0].update(small, opts[0].init(small))
  np.testing.assert_allclose(u, -0.1 * np.array([0.3, 0.4]), rtol=1e-6)

"""The staleness remedies (weight prediction in pipeline_sim.Pipeline, pipeline_sim.dc_asgd) against
plain float64 loops written out by hand, under 1F1B and 2BW."""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from test_driver import product_model  # stage k multiplies by its scalar weight

import pipeline_sim as ps

LR, STEPS = 0.05, 14


def data(dtype, n=STEPS):
  rng = np.random.default_rng(1)
  return jnp.asarray(rng.uniform(0.5, 1.5, n), dtype), jnp.asarray(rng.normal(size=n), dtype)


def hand_loop(w0, xs, ys, delays, scales, lam=0.0, decay=None, eps=1e-7):
  """Weight stashing with prediction and DC-corrected SGD, one step at a time in float64.

  ``hist[k][j]`` is stage k's weight after j updates (``j < 0`` reads as 0). Step i: stage k computes
  at ``W(i - tau) + s * tau * (W(i - tau) - W(i - tau - 1))``; the gradient is corrected by
  ``lam * g^2 * (w - w_at)`` (divided by ``sqrt(v) + eps`` with ``v`` a mean square of decay
  ``decay``) and applied by SGD to the current weight."""
  hist = [[float(w)] for w in w0]
  v = [0.0] * len(w0)
  at_ = lambda k, j: hist[k][max(j, 0)]
  losses = []
  for i, (x, y) in enumerate(zip(xs, ys)):
    at = [at_(k, i - t) + s * t * (at_(k, i - t) - at_(k, i - t - 1))
          for k, (t, s) in enumerate(zip(delays, scales))]
    out = float(x) * np.prod(at)
    losses.append(0.5 * (out - float(y)) ** 2)
    for k in range(len(w0)):
      g = (out - float(y)) * float(x) * np.prod([a for j, a in enumerate(at) if j != k])
      w = hist[k][-1]
      c = lam
      if decay is not None:
        v[k] = decay * v[k] + (1 - decay) * g * g
        c = lam / (np.sqrt(v[k]) + eps)
      hist[k].append(w - LR * (g + c * g * g * (w - at[k])))
  return np.asarray(losses), np.asarray([h[-1] for h in hist])


def pipeline_run(num_stages, schedule, optimizer, predict=None, dtype=jnp.float64):
  params, labels, loss_fn = product_model(num_stages, dtype=dtype)
  pipe = ps.Pipeline(loss_fn, optimizer, labels, schedule=schedule, predict=predict)
  state, losses = pipe.run(pipe.init(params), data(dtype))
  return np.asarray(losses), np.asarray([float(w) for w in state.params["w"]])


CASES = [("1f1b", 3, 0.7), ("1f1b", 4, [0.5, 1.0, 0.25, 2.0]), ("2bw", 3, 1.0)]


@pytest.mark.parametrize("schedule,num_stages,scale", CASES)
def test_weight_prediction_equals_a_float64_hand_loop(schedule, num_stages, scale):
  with jax.enable_x64(True):
    losses, w = pipeline_run(num_stages, schedule, optax.sgd(LR), predict=scale)
    params, _, _ = product_model(num_stages, dtype=jnp.float64)
    xs, ys = data(jnp.float64)
    scales = scale if isinstance(scale, list) else [scale] * num_stages
    want_losses, want_w = hand_loop(params["w"], xs, ys, ps.stage_delays(num_stages, schedule), scales)
    np.testing.assert_allclose(losses, want_losses, rtol=1e-12, atol=1e-14)
    np.testing.assert_allclose(w, want_w, rtol=1e-12)
    # and prediction changes the run: stashing alone is another trajectory
    plain, _ = hand_loop(params["w"], xs, ys, ps.stage_delays(num_stages, schedule), [0.0] * num_stages)
    assert np.max(np.abs(plain - want_losses)) > 1e-4


@pytest.mark.parametrize("schedule", ["1f1b", "2bw"])
@pytest.mark.parametrize("decay", [None, 0.9])
def test_dc_asgd_equals_a_float64_hand_loop(schedule, decay):
  with jax.enable_x64(True):
    lam = 2.0
    tx = ps.dc_asgd(optax.sgd(LR), lam, mean_square_decay=decay)
    for predict in (None, 0.5):  # alone, and with the predicted weights as the stale ones
      losses, w = pipeline_run(3, schedule, tx, predict=predict)
      params, _, _ = product_model(3, dtype=jnp.float64)
      xs, ys = data(jnp.float64)
      want_losses, want_w = hand_loop(params["w"], xs, ys, ps.stage_delays(3, schedule),
                                      [predict or 0.0] * 3, lam=lam, decay=decay)
      np.testing.assert_allclose(losses, want_losses, rtol=1e-12, atol=1e-14)
      np.testing.assert_allclose(w, want_w, rtol=1e-12)
      plain, _ = hand_loop(params["w"], xs, ys, ps.stage_delays(3, schedule), [predict or 0.0] * 3)
      assert np.max(np.abs(plain - want_losses)) > 1e-6  # the correction did something


@pytest.mark.parametrize("schedule", ["1f1b", "2bw"])
def test_zero_scale_and_zero_lambda_are_todays_pipeline_exactly(schedule):
  adam = optax.adamw(3e-2, weight_decay=1e-3)
  base_losses, base_w = pipeline_run(4, schedule, adam, dtype=jnp.float32)
  for kwargs in ({"predict": 0.0}, {"predict": [0.0] * 4}):
    losses, w = pipeline_run(4, schedule, adam, dtype=jnp.float32, **kwargs)
    np.testing.assert_array_equal(losses, base_losses)
    np.testing.assert_array_equal(w, base_w)
  for decay in (None, 0.99):
    losses, w = pipeline_run(4, schedule, ps.dc_asgd(adam, 0.0, decay), dtype=jnp.float32)
    np.testing.assert_array_equal(losses, base_losses)
    np.testing.assert_array_equal(w, base_w)


def test_prediction_keeps_one_more_version_per_stage():
  params, labels, loss_fn = product_model(4, dtype=jnp.float32)
  sizes = []
  for predict in (None, 1.0):
    pipe = ps.Pipeline(loss_fn, optax.sgd(LR), labels, predict=predict)
    sizes.append([int(b["w"][k].shape[0]) for k, b in enumerate(pipe.init(params).buffers)])
  assert sizes == [[4, 3, 2, 1], [5, 4, 3, 2]]


def test_bad_arguments_are_refused_by_name():
  params, labels, loss_fn = product_model(3, dtype=jnp.float32)
  for bad, match in ((-0.5, r"predict scales must be finite numbers >= 0, got -0.5"),
                     (float("nan"), "got nan"), ([1.0, 2.0], "predict has 2 scales for 3 stages"),
                     ("1", "got '1'")):
    with pytest.raises(ValueError, match=match):
      ps.Pipeline(loss_fn, optax.sgd(LR), labels, predict=bad)
  with pytest.raises(ValueError, match=r"predict=1.0.*needs mode 'weight_stashing', got mode 'stale_grad"):
    ps.Pipeline(loss_fn, optax.sgd(LR), labels, mode="stale_gradients", predict=1.0)
  with pytest.raises(ValueError, match=r"dc_asgd: lam must be a finite number >= 0, got -1"):
    ps.dc_asgd(optax.sgd(LR), -1)
  with pytest.raises(ValueError, match=r"mean_square_decay must be None or in \[0, 1\), got 1.0"):
    ps.dc_asgd(optax.sgd(LR), 1.0, mean_square_decay=1.0)
  tx = ps.dc_asgd(optax.sgd(LR), 1.0)
  state = tx.init(params)
  with pytest.raises(ValueError, match=r"dc_asgd needs .*stale_params"):
    tx.update(params, state, params)
  # stale_gradients keeps gradients, not weights: DC is refused when the step is traced
  pipe = ps.Pipeline(loss_fn, tx, labels, mode="stale_gradients")
  with pytest.raises(ValueError, match=r"dc_asgd needs .*stale_params"):
    pipe.run(pipe.init(params), data(jnp.float32))

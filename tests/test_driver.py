"""pipeline_sim.driver against independent simulations of the 1F1B schedule."""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import pipeline_sim as ps

LR = 0.05


def product_model(num_stages, seed=0, dtype=jnp.float32):
  """Stage k multiplies by its scalar weight: loss 0.5 * (x * prod_k w_k - y)^2."""
  rng = np.random.default_rng(seed)
  params = {"w": [jnp.asarray(1.0 + 0.1 * rng.normal(), dtype) for _ in range(num_stages)]}
  labels = {"w": list(range(num_stages))}

  def loss_fn(params, batch):
    x, y = batch
    out = x
    for w in params["w"]:
      out = w * out
    return 0.5 * (out - y) ** 2

  return params, labels, loss_fn


def batches(n, seed=1):
  rng = np.random.default_rng(seed)
  return (jnp.asarray(rng.uniform(0.5, 1.5, n), jnp.float32), jnp.asarray(rng.normal(size=n), jnp.float32))


def one_f_one_b_orders(num_stages, n):
  """Each stage's op order in 1F1B: ``P - k`` warm-up forwards, then one backward and one forward
  in turn, then the remaining backwards."""
  orders = []
  for k in range(num_stages):
    warm = min(num_stages - k, n)
    ops, nxt = [("F", i) for i in range(warm)], warm
    for i in range(n):
      ops.append(("B", i))
      if nxt < n:
        ops.append(("F", nxt))
        nxt += 1
    orders.append(ops)
  return orders


def ready_ops(orders, pos, done):
  """The ops that run in this tick: each stage's next op whose dependencies finished earlier (a
  forward needs the previous stage's forward of the micro-batch, a backward the next stage's)."""
  num_stages, ready = len(orders), []
  for k in range(num_stages):
    if pos[k] == len(orders[k]):
      continue
    kind, i = orders[k][pos[k]]
    if kind == "F" and (k == 0 or ("F", k - 1, i) in done):
      ready.append((k, kind, i))
    if kind == "B" and ("F", k, i) in done and (k == num_stages - 1 or ("B", k + 1, i) in done):
      ready.append((k, kind, i))
  assert ready, "schedule deadlocked"
  return ready


def event_simulation_1f1b(w0, xs, ys, lr):
  """Event-by-event PipeDream 1F1B with weight stashing.

  Stage k runs ``P - k`` warm-up forwards, then alternates one backward and one forward, then
  drains its backwards. A forward needs the previous stage's forward of the same micro-batch, a
  backward the next stage's backward; every op whose dependencies finished in an earlier tick runs
  in this tick. The forward stashes the stage's current weight version; the backward uses the
  stashed version and then updates the stage (plain SGD).

  Returns:
    (versions[k][i]: the number of updates stage k had done when micro-batch i's forward ran,
     history[k]: stage k's weights after each of its updates).
  """
  num_stages, n = len(w0), len(xs)
  orders = one_f_one_b_orders(num_stages, n)
  weights = [[float(w)] for w in w0]
  versions = [[None] * n for _ in range(num_stages)]
  acts = [[None] * n for _ in range(num_stages + 1)]  # acts[k][i]: stage k's input
  cots = [[None] * n for _ in range(num_stages + 1)]  # cots[k][i]: dL/d(stage k's output)
  stash = [[None] * n for _ in range(num_stages)]
  done, pos = set(), [0] * num_stages
  while any(p < len(o) for p, o in zip(pos, orders)):
    for k, kind, i in ready_ops(orders, pos, done):
      if kind == "F":
        x = xs[i] if k == 0 else acts[k][i]
        acts[k][i] = x
        versions[k][i] = len(weights[k]) - 1
        stash[k][i] = weights[k][-1]
        acts[k + 1][i] = stash[k][i] * x
      else:
        ct = acts[num_stages][i] - ys[i] if k == num_stages - 1 else cots[k + 1][i]
        grad_w = ct * acts[k][i]
        cots[k][i] = ct * stash[k][i]
        weights[k].append(weights[k][-1] - lr * grad_w)
      done.add((kind, k, i))
      pos[k] += 1
  return versions, weights


@pytest.mark.parametrize("num_stages", [2, 4])
def test_weight_stashing_matches_event_simulation_of_1f1b(num_stages):
  params, labels, loss_fn = product_model(num_stages)
  n = 12
  xs, ys = batches(n)
  versions, history = event_simulation_1f1b([float(w) for w in params["w"]], np.asarray(xs, np.float64),
                                            np.asarray(ys, np.float64), LR)
  tau = ps.stage_delays(num_stages)
  for k in range(num_stages):  # the schedule's versions are exactly i - tau_k
    assert versions[k] == [max(0, i - tau[k]) for i in range(n)]
  pipe = ps.Pipeline(loss_fn, optax.sgd(LR), labels, "weight_stashing")
  state = pipe.init(params)
  ours = []
  for i in range(n):  # one-step chunks so that every intermediate version is visible
    state, _ = pipe.run(state, (xs[i:i + 1], ys[i:i + 1]))
    ours.append([float(w) for w in state.params["w"]])
  ours = np.array(ours)
  for k in range(num_stages):
    np.testing.assert_allclose(ours[:, k], history[k][1:], rtol=1e-5)
  assert pipe.run._cache_size() == 1


def event_simulation_2bw(w0, xs, ys, lr):
  """Event-by-event PipeDream-2BW: 1F1B over a stream of micro-batches, ``m = xs.shape[1]`` per
  batch; a stage accumulates its gradients over a batch and updates once at the backward of the
  batch's last micro-batch; every micro-batch of batch t runs forward and backward on the stage's
  version ``W(t - 1)`` (``W(0)`` for t = 0), which the simulation checks the stage already has.

  Returns ``history[k]``: stage k's weights after each of its updates (float64)."""
  num_stages, (num_batches, m) = len(w0), xs.shape
  n = num_batches * m
  xs, ys = xs.reshape(-1), ys.reshape(-1)
  orders = one_f_one_b_orders(num_stages, n)
  weights = [[float(w)] for w in w0]
  acc = [[0.0] * num_batches for _ in range(num_stages)]
  acts = [[None] * n for _ in range(num_stages + 1)]
  cots = [[None] * n for _ in range(num_stages + 1)]
  done, pos = set(), [0] * num_stages
  while any(p < len(o) for p, o in zip(pos, orders)):
    for k, kind, i in ready_ops(orders, pos, done):
      t = i // m
      version = max(0, t - 1)
      assert len(weights[k]) > version, "2BW's version W(t - 1) is not there yet"
      w = weights[k][version]
      if kind == "F":
        acts[k][i] = xs[i] if k == 0 else acts[k][i]
        acts[k + 1][i] = w * acts[k][i]
      else:
        ct = (acts[num_stages][i] - ys[i]) / m if k == num_stages - 1 else cots[k + 1][i]
        acc[k][t] += ct * acts[k][i]
        cots[k][i] = ct * w
        if i % m == m - 1:  # the batch's last micro-batch: one update with the batch's gradient
          weights[k].append(weights[k][-1] - lr * acc[k][t])
      done.add((kind, k, i))
      pos[k] += 1
  return weights


def _mean_loss(loss_fn):
  return lambda params, batch: jnp.mean(loss_fn(params, batch))


@pytest.mark.parametrize("num_stages", [2, 4])
def test_2bw_matches_event_simulation_and_a_one_step_delayed_gradient(num_stages):
  params, labels, loss_fn = product_model(num_stages)
  steps, m = 8, num_stages  # at least P micro-batches per batch, as 2BW needs
  rng = np.random.default_rng(3)
  xs, ys = rng.uniform(0.5, 1.5, (steps, m)), rng.normal(size=(steps, m))
  history = event_simulation_2bw([float(w) for w in params["w"]], xs, ys, LR)
  pipe = ps.Pipeline(_mean_loss(loss_fn), optax.sgd(LR), labels, "weight_stashing", schedule="2bw")
  assert pipe.delays == (1,) * num_stages
  state = pipe.init(params)
  batches = (jnp.asarray(xs, jnp.float32), jnp.asarray(ys, jnp.float32))
  ours = []
  for i in range(steps):
    state, _ = pipe.run(state, jax.tree.map(lambda b: b[i:i + 1], batches))
    ours.append([float(w) for w in state.params["w"]])
  for k in range(num_stages):
    np.testing.assert_allclose(np.array(ours)[:, k], history[k][1:], rtol=1e-5)
  # Adam (per-stage copies) against a plain loop: update t applies the gradient at W(t - 1).
  opt = optax.adam(0.05)
  pipe = ps.Pipeline(_mean_loss(loss_fn), opt, labels, "weight_stashing", schedule="2bw")
  state, _ = pipe.run(pipe.init(params), batches)
  w, prev, opt_state = params, params, opt.init(params)
  for i in range(steps):
    g = jax.grad(_mean_loss(loss_fn))(prev, jax.tree.map(lambda b: b[i], batches))
    updates, opt_state = opt.update(g, opt_state, w)
    prev, w = w, optax.apply_updates(w, updates)
  np.testing.assert_allclose(state.params["w"], w["w"], rtol=1e-6)


def test_2bw_is_synchronous_at_p1_and_refuses_modes_it_cannot_mean():
  params, labels, loss_fn = product_model(1)
  assert ps.stage_delays(1, "2bw") == (0,) and ps.stage_delays(3, "2bw") == (1, 1, 1)
  xs, ys = batches(6)
  a = ps.Pipeline(loss_fn, optax.adam(0.05), labels, schedule="2bw")
  b = ps.Pipeline(loss_fn, optax.adam(0.05), labels)
  np.testing.assert_array_equal(a.run(a.init(params), (xs, ys))[0].params["w"],
                                b.run(b.init(params), (xs, ys))[0].params["w"])
  params, labels, loss_fn = product_model(2)
  for mode in ("stale_gradients", "no_stashing"):
    with pytest.raises(ValueError, match=f"schedule '2bw' needs mode 'weight_stashing'.*got mode '{mode}'"):
      ps.Pipeline(loss_fn, optax.sgd(1.0), labels, mode, staged=ps.Staged([lambda p, a: a] * 2, None),
                  schedule="2bw")
  with pytest.raises(ValueError, match="unknown pipeline schedule 'gpipe'"):
    ps.Pipeline(loss_fn, optax.sgd(1.0), labels, schedule="gpipe")


@pytest.mark.parametrize("num_stages,delay", [(1, 2), (3, 2), (2, 3)])
def test_a_uniform_delay_is_a_hand_written_delayed_loop(num_stages, delay):
  # The third schedule, a value (pipeline_sim.schedules.UniformDelay): update t applies the gradient
  # at W(t - D) (W(0) before the first) at every stage, P = 1 included, in a loop written here.
  params, labels, loss_fn = product_model(num_stages)
  xs, ys = batches(9)
  opt = optax.adam(0.05)
  pipe = ps.Pipeline(loss_fn, opt, labels, "weight_stashing", schedule=ps.UniformDelay(delay))
  assert pipe.delays == (delay,) * num_stages and pipe.schedule.name == f"uniform-{delay}"
  state, losses = pipe.run(pipe.init(params), (xs, ys))
  history, opt_state, expected = [params], opt.init(params), []
  for t in range(len(xs)):
    at = history[max(0, t - delay)]
    loss, g = jax.value_and_grad(loss_fn)(at, (xs[t], ys[t]))
    updates, opt_state = opt.update(g, opt_state, history[-1])
    history.append(optax.apply_updates(history[-1], updates))
    expected.append(float(loss))
  np.testing.assert_allclose(state.params["w"], history[-1]["w"], rtol=1e-6)
  np.testing.assert_allclose(losses, expected, rtol=1e-6)
  sync = ps.Pipeline(loss_fn, opt, labels)  # the control: the delay changes the run
  assert np.max(np.abs(np.asarray(sync.run(sync.init(params), (xs, ys))[0].params["w"])
                       - np.asarray(state.params["w"]))) > 1e-4


def test_optimizers_built_for_other_delays_are_refused_by_name():
  params, labels, loss_fn = product_model(3)
  built = ps.per_stage(lambda k: optax.sgd(0.1), 3, delays=ps.stage_delays(3, "1f1b"))
  assert built.delays == (2, 1, 0)
  ps.Pipeline(loss_fn, built, labels)  # the schedule it was built for
  with pytest.raises(ValueError, match=r"built for stage delays \(2, 1, 0\), but the pipeline's "
                                       r"schedule '2bw' has delays \(1, 1, 1\) at P = 3"):
    ps.Pipeline(loss_fn, built, labels, schedule="2bw")
  with pytest.raises(ValueError, match=r"got 2 stage delays \(1, 0\) for 3 stages"):
    ps.per_stage(lambda k: optax.sgd(0.1), 3, delays=(1, 0))


def test_stale_gradients_fifo_and_warm_up():
  num_stages, n = 4, 10
  rng = np.random.default_rng(0)
  coeffs = jnp.asarray(rng.normal(size=(n, num_stages)), jnp.float32)
  params = {"w": [jnp.zeros(()) for _ in range(num_stages)]}
  labels = {"w": list(range(num_stages))}
  loss_fn = lambda p, c: sum(w * c[k] for k, w in enumerate(p["w"]))  # gradient of w_k is c[k]
  pipe = ps.Pipeline(loss_fn, optax.sgd(1.0), labels, "stale_gradients")
  state, _ = pipe.run(pipe.init(params), coeffs)
  tau = ps.stage_delays(num_stages)
  for k in range(num_stages):  # stage k applied g(0) .. g(n - 1 - tau_k): each exactly once
    np.testing.assert_allclose(state.params["w"][k], -np.sum(coeffs[:n - tau[k], k]), rtol=1e-6)
  # With Adam, a stage in warm-up leaves its optimizer state untouched.
  pipe = ps.Pipeline(loss_fn, optax.adam(0.1), labels, "stale_gradients")
  state = pipe.init(params)
  for steps_done in range(1, 6):
    state, _ = pipe.run(state, coeffs[steps_done - 1:steps_done])
    counts = [int(s[0].count) for s in state.opt_states]
    assert counts == [max(0, steps_done - t) for t in tau]


def test_stashing_and_stale_gradients_see_the_same_gradients():
  """With tau_k = P-1-k, the gradient stage k applies as its n-th update is, in both modes, taken
  at (W_0(n - tau_0), ..., W_{P-1}(n)): the observed losses agree step by step."""
  params, labels, loss_fn = product_model(4, seed=3)
  xs, ys = batches(16, seed=4)
  runs = {}
  for mode in ("weight_stashing", "stale_gradients"):
    pipe = ps.Pipeline(loss_fn, optax.adam(0.05), labels, mode)
    runs[mode] = pipe.run(pipe.init(params), (xs, ys))[1]
  np.testing.assert_allclose(runs["weight_stashing"], runs["stale_gradients"], rtol=1e-6)


def test_no_stashing_two_stage_hand_computation():
  """Stage 0 is h = a * b * x, stage 1 is out = c * h; P = 2 so stage 0 lags one update."""
  params = {"a": jnp.asarray(1.2), "b": jnp.asarray(0.7), "c": jnp.asarray(0.9)}
  labels = {"a": 0, "b": 0, "c": 1}
  staged = ps.Staged([lambda p, x: p["a"] * p["b"] * x, lambda p, h: p["c"] * h],
                     loss_of=lambda out, batch: 0.5 * (out - batch[1]) ** 2)
  xs, ys = batches(8, seed=2)

  def hand(stash):
    a, b, c = 1.2, 0.7, 0.9
    prev = (a, b)  # stage 0's version from one update ago (W(-1) = W(0))
    losses = []
    for x, y in zip(np.asarray(xs, np.float64), np.asarray(ys, np.float64)):
      a_s, b_s = prev
      h = a_s * b_s * x
      r = c * h - y
      losses.append(0.5 * r * r)
      ct_h = r * c
      ga, gb = (ct_h * b_s * x, ct_h * a_s * x) if stash else (ct_h * b * x, ct_h * a * x)
      prev = (a, b)
      a, b, c = a - LR * ga, b - LR * gb, c - LR * r * h
    return np.array([a, b, c]), np.array(losses)

  out = {}
  for mode, stash in (("no_stashing", False), ("weight_stashing", True)):
    pipe = ps.Pipeline(None, optax.sgd(LR), labels, mode, staged)
    state, losses = pipe.run(pipe.init(params), (xs, ys))
    expected, expected_losses = hand(stash)
    got = np.array([float(state.params[k]) for k in "abc"])
    np.testing.assert_allclose(got, expected, rtol=1e-5)
    np.testing.assert_allclose(losses, expected_losses, rtol=1e-5)
    out[mode] = got
  assert np.abs(out["no_stashing"] - out["weight_stashing"]).max() > 1e-4


def test_p1_every_mode_equals_plain_training():
  params, _, loss_fn = product_model(3, seed=5)
  labels = {"w": [0, 0, 0]}
  xs, ys = batches(10, seed=6)
  staged = ps.Staged([lambda p, x: p["w"][0] * p["w"][1] * p["w"][2] * x],
                     loss_of=lambda out, b: 0.5 * (out - b[1]) ** 2)
  opt = optax.adam(0.05)

  @jax.jit
  def plain(params):
    def body(carry, batch):
      p, s = carry
      l, g = jax.value_and_grad(loss_fn)(p, batch)
      u, s = opt.update(g, s, p)
      return (optax.apply_updates(p, u), s), l
    return jax.lax.scan(body, (params, opt.init(params)), (xs, ys))

  (ref_params, _), ref_losses = plain(params)
  for mode in ps.MODES:
    pipe = ps.Pipeline(loss_fn, opt, labels, mode, staged)
    state, losses = pipe.run(pipe.init(params), (xs, ys))
    np.testing.assert_allclose(losses, ref_losses, rtol=1e-5, atol=1e-7)
    for w, r in zip(state.params["w"], ref_params["w"]):
      np.testing.assert_allclose(w, r, rtol=1e-5)


def test_one_optimizer_is_per_stage_copies_and_merged_is_one_update():
  """One optimizer means P per-stage copies (a real pipeline's, and DevicePipeline's, meaning): the
  same numbers as a list of P. ``merged=True`` is one update over every stage's leaves: equal for
  leaf-wise transformations (Adam, basis rotation), and not for a global-norm clip (the control:
  a merged clip sees every stage's gradient)."""
  import rotation
  num_stages = 3
  rng = np.random.default_rng(7)
  params = {"w": [jnp.asarray(rng.normal(size=(4, 4)) / 2 + np.eye(4), jnp.float32)
                  for _ in range(num_stages)]}
  labels = {"w": list(range(num_stages))}
  staged = ps.Staged([lambda p, x, k=k: jnp.tanh(x @ p["w"][k]) for k in range(num_stages)],
                     loss_of=lambda out, b: jnp.mean((out - b[1]) ** 2))
  xs = jnp.asarray(rng.normal(size=(12, 2, 4)), jnp.float32)
  ys = jnp.asarray(rng.normal(size=(12, 2, 4)), jnp.float32)

  def run(opt, mode, merged=False):
    pipe = ps.Pipeline(None, opt, labels, mode, staged, merged=merged)
    state, losses = pipe.run(pipe.init(params), (xs, ys))
    return pipe, state, losses

  close = lambda a, b: all(np.allclose(x, y, rtol=1e-5, atol=1e-6)
                           for x, y in zip(a.params["w"], b.params["w"]))
  for opt in (optax.adam(0.05), rotation.basis_rotation(0.05, refresh_every=3)):
    for mode in ("weight_stashing", "no_stashing"):
      pipe, merged, losses = run(opt, mode, merged=True)
      assert pipe.merged and len(merged.opt_states) == 1
      pipe, apart, ref = run([opt] * num_stages, mode)
      assert not pipe.merged and len(apart.opt_states) == num_stages
      np.testing.assert_allclose(losses, ref, rtol=1e-5, atol=1e-6)
      assert close(merged, apart)
  clip = optax.chain(optax.clip_by_global_norm(1e-3), optax.sgd(1.0))
  _, one, _ = run(clip, "weight_stashing")
  _, apart, _ = run([clip] * num_stages, "weight_stashing")
  _, merged, _ = run(clip, "weight_stashing", merged=True)
  assert len(one.opt_states) == num_stages and close(one, apart)  # one optimizer = P copies
  assert np.abs(np.asarray(merged.params["w"][0]) - np.asarray(apart.params["w"][0])).max() > 1e-5
  for bad in (dict(optimizer=[clip] * num_stages, mode="weight_stashing"),
              dict(optimizer=clip, mode="stale_gradients")):
    with pytest.raises(ValueError, match="merged=True runs one optimizer"):
      ps.Pipeline(None, staged=staged, labels=labels, merged=True, **bad)


def test_buffer_memory_and_no_recompilation_across_chunks():
  num_stages = 4
  params = {"s": [jnp.ones((3, 5)) * k for k in range(num_stages)]}
  labels = {"s": list(range(num_stages))}
  loss_fn = lambda p, b: sum(jnp.sum(w * w) for w in p["s"]) * b
  pipe = ps.Pipeline(loss_fn, optax.adam(1e-2), labels, "weight_stashing")
  state = pipe.init(params)
  expected = sum((tau + 1) * 15 * 4 for tau in ps.stage_delays(num_stages))
  assert pipe.buffer_bytes(state) == expected
  for _ in range(3):
    state, losses = pipe.run(state, jnp.ones(5))
  assert pipe.run._cache_size() == 1 and int(state.step) == 15
  assert pipe.buffer_bytes(state) == expected


def test_running_a_state_never_deletes_the_callers_parameters():
  params, labels, loss_fn = product_model(3)
  kept = [float(w) for w in params["w"]]
  pipe = ps.Pipeline(loss_fn, optax.sgd(LR), labels, "weight_stashing")
  state, _ = pipe.run(pipe.init(params), batches(4))  # the state is donated
  assert not any(w.is_deleted() for w in params["w"])
  assert [float(w) for w in params["w"]] == kept
  assert [float(w) for w in state.params["w"]] != kept
  # What guards it on every platform (on CPU jit never forwards an input buffer, so the lines
  # above pass either way; an accelerator may forward it, and donating would then delete it):
  # no output of init is one of its inputs passed through.
  jaxpr = jax.make_jaxpr(pipe._init_impl)(params).jaxpr
  assert not set(map(id, jaxpr.invars)) & {id(v) for v in jaxpr.outvars if hasattr(v, "aval")}


def test_bad_input():
  params, labels, loss_fn = product_model(2)
  with pytest.raises(ValueError, match="unknown pipeline mode 'async'"):
    ps.Pipeline(loss_fn, optax.sgd(1.0), labels, "async")
  with pytest.raises(ValueError, match="ints >= 0, got -1"):
    ps.Pipeline(loss_fn, optax.sgd(1.0), {"w": [0, -1]})
  with pytest.raises(ValueError, match="needs the model as stage functions"):
    ps.Pipeline(loss_fn, optax.sgd(1.0), labels, "no_stashing")
  with pytest.raises(ValueError, match="got 3 optimizers for 2 stages"):
    ps.Pipeline(loss_fn, [optax.sgd(1.0)] * 3, labels)
  for bad in ("adam", [optax.sgd(1.0), "adam"]):  # a string was taken for a list of 4 optimizers
    with pytest.raises(TypeError, match="optimizer must be an optax.GradientTransformation"):
      ps.Pipeline(loss_fn, bad, labels)
  pipe = ps.Pipeline(loss_fn, optax.sgd(1.0), {"w": [1]})
  with pytest.raises(ValueError, match="do not cover the parameters"):
    pipe.init(params)
  pipe = ps.Pipeline(loss_fn, optax.sgd(1.0), {"w": [1, 1]})
  with pytest.raises(ValueError, match=r"stage\(s\) \[0\] of 2 have no parameters"):
    pipe.init(params)
  assert ps.Pipeline(loss_fn, optax.sgd(1.0), {"w": [0, 5]}).num_stages == 6


def tanh_layers(num_stages, n, seed, width=4):
  """Stage k: one ``tanh(h @ W_k)`` layer of 4 x 4; squared error; ``n`` steps of 8 samples."""
  rng = np.random.default_rng(seed)
  params = {"w": [jnp.asarray(rng.normal(size=(width, width)) * 0.8, jnp.float32) for _ in range(num_stages)]}

  def loss_fn(p, batch):
    h = batch[0]
    for w in p["w"]:
      h = jnp.tanh(h @ w)
    return jnp.mean((h - batch[1]) ** 2)

  xs = jnp.asarray(rng.normal(size=(n, 8, width)), jnp.float32)
  ys = jnp.asarray(rng.normal(size=(n, 8, width)), jnp.float32)
  return params, {"w": list(range(num_stages))}, loss_fn, xs, ys


def test_a_stage_reading_another_stages_leaf_is_named_with_the_leaf():
  """Stage 0 reads stage 1's leaf: one ``OtherStageError`` naming stage and leaf (for a Flax NNX
  module built from that leaf too), where the ``None`` would fail deep in the model's code; a
  correct model is unaffected, and another failure keeps its own error."""
  from flax import nnx

  class Lin(nnx.Module):
    def __init__(self, rngs):
      self.w = nnx.Param(jax.random.normal(rngs.params(), (3, 3)))

    def __call__(self, x):
      return x @ self.w[...]

  graphdef, state = nnx.split(Lin(nnx.Rngs(0)))
  params = {"a": {"w": jnp.eye(3)}, "b": nnx.to_pure_dict(state)}
  labels = {"a": {"w": 0}, "b": {"w": 1}}

  def module(d):
    st = nnx.state(nnx.eval_shape(lambda: Lin(nnx.Rngs(0))))
    nnx.replace_by_pure_dict(st, d)
    return nnx.merge(graphdef, st)

  batches = (jnp.ones((2, 4, 3)), jnp.ones((2, 4, 3)))
  loss_of = lambda out, b: jnp.mean((out - b[1]) ** 2)
  wrong = [[lambda p, h: h @ p["a"]["w"] @ p["b"]["w"], lambda p, h: h @ p["b"]["w"]],
           [lambda p, h: module(p["b"])(h), lambda p, h: module(p["b"])(h)]]
  for fns in wrong:
    for mode in ("weight_stashing", "no_stashing"):
      pipe = ps.Pipeline(None, optax.sgd(0.1), labels, mode=mode, staged=ps.Staged(fns, loss_of))
      with pytest.raises(ps.OtherStageError, match=r"stage 0's function reads parameter leaf \['b'\]\['w'\]"):
        pipe.run(pipe.init(params), batches)
  right = ps.Staged([lambda p, h: h @ p["a"]["w"], lambda p, h: module(p["b"])(h)], loss_of)
  pipe = ps.Pipeline(None, optax.sgd(0.1), labels, mode="no_stashing", staged=right)
  _, losses = pipe.run(pipe.init(params), batches)
  whole = lambda p, b: loss_of(module(p["b"])(b[0] @ p["a"]["w"]), b)
  assert float(losses[0]) == pytest.approx(float(whole(params, (batches[0][0], batches[1][0]))), rel=1e-6)
  other = ps.Staged([lambda p, h: h @ p["a"]["w"][:, :2], lambda p, h: module(p["b"])(h)], loss_of)
  pipe = ps.Pipeline(None, optax.sgd(0.1), labels, staged=other)
  with pytest.raises(TypeError, match="dot_general requires contracting dimensions"):
    pipe.run(pipe.init(params), batches)


def test_a_consumed_state_is_refused_by_name():
  params, labels, loss_fn, xs, ys = tanh_layers(2, 4, seed=0)
  pipe = ps.Pipeline(loss_fn, optax.adam(1e-2), labels)
  state = pipe.init(params)
  new, _ = pipe.run(state, (xs[:2], ys[:2]))
  with pytest.raises(ValueError, match="Pipeline.run: this state was consumed by an earlier call"):
    pipe.run(state, (xs[2:], ys[2:]))
  _, losses = pipe.run(new, (xs[2:], ys[2:]))  # the returned state is live
  assert np.all(np.isfinite(np.asarray(losses)))
  assert pipe.run._cache_size() == 1

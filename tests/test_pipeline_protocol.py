"""pipeline_sim.protocol: both pipelines implement it, its methods return what their own ``run`` and
``finish`` compute, the constructors share one set of checks, and the harness drives either
without asking which it has."""

import pathlib

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import pipeline_sim as ps

C, B, W, P = 3, 4, 5, 2
rng = np.random.default_rng(0)
xs, ys = (jnp.asarray(rng.normal(size=(2 * C, B, W)), jnp.float32) for _ in range(2))
params = {f"w{k}": jnp.asarray(rng.normal(size=(W, W)) * 0.5, jnp.float32) for k in range(P)}
labels = {f"w{k}": k for k in range(P)}
staged = ps.Staged([lambda p, h, k=k: jnp.tanh(h @ p[f"w{k}"]) for k in range(P)],
                   loss_of=lambda out, b: jnp.mean((out - b[1]) ** 2))


def chunk(c):
  return xs[c * C:(c + 1) * C], ys[c * C:(c + 1) * C]


def test_both_pipelines_implement_the_protocol():
  emulated = ps.Pipeline(None, optax.sgd(0.1), labels, staged=staged)
  on_devices = ps.DevicePipeline(ps.Staged(staged.stage_fns[:1], staged.loss_of), optax.sgd(0.1),
                                 {"w0": 0}, mesh=ps.pipeline_mesh(1))
  for pipe in (emulated, on_devices):
    assert isinstance(pipe, ps.PipelineProtocol)
  assert (emulated.in_flight, emulated.flushes) == (0, False) and on_devices.flushes


@pytest.mark.parametrize("grad_norms", [True, False])
def test_the_emulators_advance_is_its_step_loop(grad_norms):
  """``advance`` over two chunks against a hand loop of ``step``: the same steps (0-2, then 3-5),
  losses and weights; grad norms where asked for, NaN where not; ``finish`` completes nothing."""
  pipe = ps.Pipeline(None, optax.sgd(0.1), labels, staged=staged, grad_norms=grad_norms)
  mesh = ps.data_mesh(jax.devices()[:1])
  state = pipe.place(pipe.init(params, chunk(0)), mesh)
  got_steps, got_losses, got_norms = [], [], []
  for c in range(2):
    state, (steps, losses, norms) = pipe.advance(state, pipe.place_batches(chunk(c), mesh))
    got_steps += list(steps)
    got_losses += list(losses)
    got_norms += list(norms)
  state, (steps, losses, norms) = pipe.finish(state)
  assert steps.size == losses.size == norms.size == 0
  hand = ps.Pipeline(None, optax.sgd(0.1), labels, staged=staged, grad_norms=True)
  hs, want_losses, want_norms = hand.init(params), [], []
  for t in range(2 * C):
    hs, (loss, norm) = hand.step(hs, (xs[t], ys[t]))
    want_losses.append(float(loss))
    want_norms.append(float(norm))
  assert got_steps == list(range(2 * C))
  np.testing.assert_allclose(got_losses, want_losses, rtol=1e-6)
  if grad_norms:
    np.testing.assert_allclose(got_norms, want_norms, rtol=1e-6)
  else:
    assert np.all(np.isnan(got_norms))
  jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-6), pipe.params(state), hs.params)


def test_the_device_pipelines_advance_keeps_the_completed_batches():
  """P = 1 on one device: nothing in flight, so ``advance`` completes each chunk's own batches, with
  the emulator's losses and weights."""
  one = ps.Staged(staged.stage_fns[:1], staged.loss_of)
  pipe = ps.DevicePipeline(one, optax.sgd(0.1), {"w0": 0}, mesh=ps.pipeline_mesh(1))
  emulated = ps.Pipeline(None, optax.sgd(0.1), {"w0": 0}, staged=one)
  p1 = {"w0": params["w0"]}
  state, es = pipe.init(p1, (xs[0], ys[0])), emulated.init(p1)
  for c in range(2):
    state, (steps, losses, _) = pipe.advance(state, pipe.place_batches(chunk(c), None))
    es, (esteps, elosses, _) = emulated.advance(es, chunk(c))
    np.testing.assert_array_equal(steps, esteps)
    np.testing.assert_allclose(losses, elosses, rtol=1e-6)
  state, (steps, _, _) = pipe.finish(state)
  assert steps.size == 0
  np.testing.assert_allclose(pipe.params(state)["w0"], es.params["w0"], rtol=1e-6)
  with pytest.raises(ValueError, match="DevicePipeline.init needs example_batch"):
    pipe.init(p1)


@pytest.mark.parametrize("make", [
    lambda **kw: ps.Pipeline(None, optax.sgd(0.1), labels, staged=staged, **kw),
    lambda **kw: ps.DevicePipeline(staged, optax.sgd(0.1), labels, mesh=ps.pipeline_mesh(1), **kw),
])
def test_the_shared_checks_refuse_alike(make):
  with pytest.raises(ValueError, match="schedule '2bw' needs mode 'weight_stashing'.*got mode 'no_stashing'"):
    make(schedule="2bw", mode="no_stashing")
  with pytest.raises(ValueError, match="unknown (device )?pipeline mode 'async'"):
    make(mode="async")


def test_the_harness_asks_no_pipeline_which_it_is():
  source = (pathlib.Path(__file__).parents[1] / "experiments" / "harness" / "runs.py").read_text()
  assert "isinstance(pipe" not in source and "DevicePipeline)" not in source

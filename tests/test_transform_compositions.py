"""rotation.basis_rotation inside the field's tools: optax's compositions (chain, inject_hyperparams,
MultiSteps, tree_map_params, schedules, extra args), Flax NNX's optimizer, Orbax checkpoints, and the
dtypes it keeps through the state."""

import os
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx
from rotation_reference import LR, run_tree

import rotation


def test_compositions_with_optax_and_no_recompilation():
  params = {"w": jnp.ones((4, 6)), "b": jnp.ones(6)}
  grads = {"w": jnp.full((4, 6), 0.5), "b": jnp.full(6, 0.5)}
  txs = [
      optax.chain(optax.clip_by_global_norm(1.0), rotation.basis_rotation(1e-3)),
      optax.inject_hyperparams(rotation.basis_rotation,
                               static_args=("refresh_every", "max_precond_dim"))(
          learning_rate=1e-3, b1=0.9, refresh_every=3),
      optax.MultiSteps(rotation.basis_rotation(1e-3), every_k_schedule=2),
      optax.apply_if_finite(rotation.basis_rotation(1e-3), 3),
  ]
  for tx in txs:
    state = tx.init(params)
    update = jax.jit(tx.update)
    for _ in range(3):
      u, state = update(grads, state, params)
    assert update._cache_size() == 1
    assert all(bool(jnp.all(jnp.isfinite(x))) for x in jax.tree.leaves(u))
  # inject_hyperparams traces the learning rate: changing it does not recompile.
  tx = txs[1]
  state = tx.init(params)
  update = jax.jit(tx.update)
  u1, state = update(grads, state, params)
  state.hyperparams["learning_rate"] = jnp.asarray(2e-3, jnp.float32)
  u2, _ = update(grads, state, params)
  assert update._cache_size() == 1 and not np.allclose(u1["w"], u2["w"])


def test_flax_nnx_optimizer_on_transformer():
  from experiments.harness import model as model_lib
  cfg = model_lib.CONFIGS["cpu-tiny"]
  net = model_lib.Transformer(cfg, nnx.Rngs(0))
  opt = nnx.Optimizer(net, rotation.basis_rotation(1e-2, refresh_every=2), wrt=nnx.Param)
  tokens = (jnp.arange(cfg.context + 1)[None, :] * 7 + jnp.arange(4)[:, None] * 3) % 13  # learnable

  @nnx.jit
  def train_step(net, opt):
    def loss_fn(net):
      logits, _ = net(tokens[:, :-1])
      return model_lib.cross_entropy(logits, tokens[:, 1:])
    loss, grads = nnx.value_and_grad(loss_fn)(net)
    opt.update(net, grads)
    return loss

  losses = [float(train_step(net, opt)) for _ in range(8)]
  assert losses[-1] < losses[0] - 0.5, losses


@pytest.mark.parametrize("source", rotation.SOURCES)
@pytest.mark.parametrize("geometry", rotation.GEOMETRIES)
def test_state_round_trips_through_orbax(tmp_path, source, geometry):
  """Every configuration's state (unrotated sides, no statistics, sides over max_precond_dim) is
  saved and restored exactly by orbax's StandardCheckpointer."""
  import orbax.checkpoint as ocp
  params = {"a": jnp.ones((3, 8)), "b": jnp.ones((8, 3)), "bias": jnp.ones(4), "big": jnp.ones((2, 40))}
  tx = rotation.basis_rotation(1e-2, source=source, geometry=geometry, max_precond_dim=16)
  state = tx.init(params)
  rng = np.random.default_rng(0)
  grads = {k: jnp.asarray(rng.normal(size=v.shape), jnp.float32) for k, v in params.items()}
  _, state = tx.update(grads, state, params)
  ckpt = ocp.StandardCheckpointer()
  ckpt.save(tmp_path / "state", state)
  ckpt.wait_until_finished()
  got = ckpt.restore(tmp_path / "state", jax.tree.map(ocp.utils.to_shape_dtype_struct, state))
  assert jax.tree.structure(got) == jax.tree.structure(state)
  jax.tree.map(np.testing.assert_array_equal, got, state)


def test_extra_args_reach_only_inner_transformations_that_take_them():
  """In a chain with reduce_on_plateau, update(..., value=loss) works (the default inner Adam
  takes no extra arguments) and an inner transformation that takes them receives them."""
  params = {"w": jnp.ones((4, 6))}
  grads = {"w": jnp.full((4, 6), 0.1)}
  tx = optax.chain(rotation.basis_rotation(1e-2), optax.contrib.reduce_on_plateau())
  state = tx.init(params)
  updates, state = jax.jit(tx.update)(grads, state, params, value=jnp.asarray(1.0))
  assert np.all(np.isfinite(np.asarray(updates["w"])))
  seen = []

  def inner_update(updates, state, params=None, *, value):
    seen.append(value)
    return updates, state

  inner = optax.GradientTransformationExtraArgs(lambda p: optax.EmptyState(), inner_update)
  rot = rotation.scale_by_basis_rotation(inner)
  rot.update(grads, rot.init(params), value=3.0)
  assert seen == [3.0]


def test_inject_hyperparams_needs_no_static_args_and_trains():
  """optax's contract: every numeric argument may be injected, the rest are static by construction."""
  a = jnp.asarray(np.random.default_rng(0).normal(size=(6, 6)), jnp.float32)
  loss = lambda p: jnp.sum((a @ p["w"] - jnp.eye(6)) ** 2) + jnp.sum(p["b"] ** 2)
  params = {"w": jnp.zeros((6, 6)), "b": jnp.ones(3)}
  tx = optax.inject_hyperparams(rotation.basis_rotation)(learning_rate=0.02, refresh_every=3)
  plain = rotation.basis_rotation(0.02, refresh_every=3)
  state, plain_state = tx.init(params), plain.init(params)

  @jax.jit
  def step(params, state):
    u, state = tx.update(jax.grad(loss)(params), state, params)
    return optax.apply_updates(params, u), state

  losses, seen = [], []
  for t in range(1, 61):
    before = np.asarray(state.inner_state[0].bases["w"][0].left)
    if t <= 2:  # the same updates as the un-injected optimizer's (before a warm refresh, whose QR
      # amplifies their round-off by the statistics' condition number)
      g = jax.grad(loss)(params)
      ours, _ = tx.update(g, state, params)
      ref, plain_state = plain.update(g, plain_state, params)
      np.testing.assert_allclose(ours["w"], ref["w"], atol=1e-6)
    params, state = step(params, state)
    losses.append(float(loss(params)))
    if not np.array_equal(before, np.asarray(state.inner_state[0].bases["w"][0].left)):
      seen.append(t)
  assert losses[-1] < 0.2 * losses[0], losses
  assert seen[:4] == [1, 3, 6, 9]  # the injected period is honoured
  assert step._cache_size() == 1
  # a new rate takes effect, without a recompile
  state.hyperparams["learning_rate"] = jnp.zeros_like(state.hyperparams["learning_rate"])
  frozen, _ = step(params, state)
  jax.tree.map(np.testing.assert_array_equal, frozen, params)
  assert step._cache_size() == 1


def test_tree_map_params_reaches_the_moments_and_not_the_bases():
  params = {"w": jnp.ones((4, 5)), "b": jnp.ones(5)}
  tx = rotation.basis_rotation(1e-3)
  state = tx.init(params)
  grads = jax.tree.map(lambda x: jnp.full_like(x, 0.5), params)
  _, state = tx.update(grads, state, params)
  same = optax.tree_map_params(tx, lambda p: p, state)
  jax.tree.map(np.testing.assert_array_equal, same, state)
  doubled = optax.tree_map_params(tx, lambda p: 2 * p, state)
  inner, new_inner = state[0].inner_state, doubled[0].inner_state
  np.testing.assert_array_equal(new_inner.mu["w"], 2 * inner.mu["w"])
  np.testing.assert_array_equal(new_inner.nu["b"], 2 * inner.nu["b"])
  jax.tree.map(np.testing.assert_array_equal, doubled[0].bases, state[0].bases)


def test_parameters_with_no_leaves_keep_no_bases():
  """No private optax name decides the bases of a leafless tree (tree_map_params' stand-in is one):
  an empty marker array stands for them, and a real empty tree trains under jit like Adam."""
  tx = rotation.basis_rotation(1e-3)
  for params in ({}, {"w": None}):
    state = tx.init(params)
    assert state[0].bases.shape == (0,)
    updates, state = jax.jit(tx.update)(params, state, params)
    assert updates == params and int(state[0].count) == 1 and state[0].bases.shape == (0,)
  with_leaves = tx.init({"w": jnp.ones((3, 2))})
  assert isinstance(with_leaves[0].bases, dict) and with_leaves[0].bases["w"][0].left.shape == (1, 3, 3)


def test_schedules_and_multisteps():
  params = {"w": jnp.ones((4, 3))}
  rng = np.random.default_rng(0)
  grads = [{"w": jnp.asarray(rng.normal(size=(4, 3)), jnp.float32)} for _ in range(4)]
  sched = optax.linear_schedule(1e-2, 0.0, 4)
  scheduled, _ = run_tree(rotation.basis_rotation(sched, weight_decay=0.0), params, grads)
  unit, _ = run_tree(rotation.basis_rotation(1.0, weight_decay=0.0), params, grads)
  for t in range(4):
    np.testing.assert_allclose(scheduled[t]["w"], unit[t]["w"] * float(sched(t)), rtol=1e-6, atol=1e-9)
  multi = optax.MultiSteps(rotation.basis_rotation(1e-2, weight_decay=0.0), every_k_schedule=2)
  stepped, _ = run_tree(multi, params, grads)
  mean = [{"w": (grads[0]["w"] + grads[1]["w"]) / 2}, {"w": (grads[2]["w"] + grads[3]["w"]) / 2}]
  direct, _ = run_tree(rotation.basis_rotation(1e-2, weight_decay=0.0), params, mean)
  np.testing.assert_array_equal(stepped[0]["w"], 0.0)
  np.testing.assert_allclose(stepped[1]["w"], direct[0]["w"], rtol=1e-5, atol=1e-8)
  np.testing.assert_allclose(stepped[3]["w"], direct[1]["w"], rtol=1e-5, atol=1e-8)


def test_none_leaves_in_the_tree_do_not_shift_the_bases():
  """A per-stage tree keeps other stages' leaves as ``None`` (pipeline_sim.split_stages): each
  rotated leaf still meets its own bases, and the numbers equal the tree without the ``None``s."""
  rng = np.random.default_rng(3)
  w = {k: jnp.asarray(rng.normal(size=s), jnp.float32) for k, s in (("a", (5, 3)), ("b", (4, 6)))}
  holey = {"x": None, "a": w["a"], "y": [None, w["b"]]}
  tx = rotation.basis_rotation(LR, refresh_every=2)
  s_full, s_holey = tx.init(w), tx.init(holey)
  for _ in range(4):
    g = {k: jnp.asarray(rng.normal(size=v.shape), jnp.float32) for k, v in w.items()}
    u_full, s_full = jax.jit(tx.update)(g, s_full, w)
    u_holey, s_holey = jax.jit(tx.update)({"x": None, "a": g["a"], "y": [None, g["b"]]}, s_holey, holey)
    np.testing.assert_allclose(u_holey["a"], u_full["a"], rtol=1e-6, atol=1e-7)
    np.testing.assert_allclose(u_holey["y"][1], u_full["b"], rtol=1e-6, atol=1e-7)
  assert rotation.leaf_bases(s_holey, holey)["y"][1][0].shape == (4, 4)


@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float32])
def test_dtypes_are_preserved_and_the_state_is_stable_through_refreshes(dtype):
  params = {"w": jnp.zeros((6, 4), dtype), "stack": jnp.zeros((2, 3, 5), dtype), "b": jnp.zeros(4, dtype)}
  dims = {"w": rotation.LINEAR, "stack": rotation.stacked(rotation.LINEAR), "b": None}
  tx = rotation.basis_rotation(1e-2, weight_dimension_numbers=dims, refresh_every=2, block_size=4)
  state = tx.init(params)
  types = jax.tree.map(jax.typeof, state)
  update = jax.jit(tx.update)
  rng = np.random.default_rng(0)
  for _ in range(5):  # cold start, keep, warm, keep, warm
    g = jax.tree.map(lambda x: jnp.asarray(rng.normal(size=x.shape), dtype), params)
    u, state = update(g, state, params)
    assert jax.tree.map(lambda x: x.dtype, u) == jax.tree.map(lambda x: x.dtype, params)
    assert jax.tree.map(jax.typeof, state) == types
    assert all(bool(jnp.all(jnp.isfinite(x.astype(jnp.float32)))) for x in jax.tree.leaves(u))
  assert update._cache_size() == 1


def test_float64_leaves_keep_float64_through_the_state(tmp_path):
  script = """
import jax, jax.numpy as jnp, numpy as np, rotation
jax.config.update("jax_enable_x64", True)
params = {"w": jnp.zeros((5, 4), jnp.float64), "b": jnp.zeros(4, jnp.float64)}
tx = rotation.basis_rotation(1e-2)
state = tx.init(params)
g = {"w": jnp.asarray(np.random.default_rng(0).normal(size=(5, 4))), "b": jnp.ones(4, jnp.float64)}
u, state = jax.jit(tx.update)(g, state, params)
assert {x.dtype for x in jax.tree.leaves(u)} == {jnp.dtype("float64")}
floats = [x.dtype for x in jax.tree.leaves(state) if jnp.issubdtype(x.dtype, jnp.floating)]
assert set(floats) == {jnp.dtype("float64")}, floats
print("ok")
"""
  out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=300,
                       env={**os.environ, "JAX_PLATFORMS": "cpu"})
  assert out.returncode == 0 and out.stdout.strip() == "ok", out.stderr[-2000:]


def test_bf16_moments_and_statistics():
  params = {"w": jnp.zeros((8, 6))}
  rng = np.random.default_rng(0)
  grads = [{"w": jnp.asarray(rng.normal(size=(8, 6)), jnp.float32)} for _ in range(6)]
  full, _ = run_tree(rotation.basis_rotation(1e-2, refresh_every=2), params, grads)
  for tx in (rotation.basis_rotation(1e-2, refresh_every=2, mu_dtype=jnp.bfloat16,
                                     precond_dtype=jnp.bfloat16, precision="default"),
             optax.chain(rotation.scale_by_basis_rotation(optax.scale_by_adam(mu_dtype=jnp.bfloat16),
                                                          refresh_every=2), optax.scale(-1e-2))):
    low, state = run_tree(tx, params, grads)
    for a, b in zip(low, full):
      assert np.abs(a["w"] - b["w"]).max() < 0.1 * np.abs(b["w"]).max()  # bf16 state, same steps
  assert state[0].inner_state.mu["w"].dtype == jnp.bfloat16  # optax's Adam with a bf16 moment
  state = rotation.basis_rotation(1e-2, mu_dtype=jnp.bfloat16, precond_dtype=jnp.bfloat16).init(params)
  (p,) = state[0].bases["w"]
  assert {p.left.dtype, p.right.dtype, p.stat_left.dtype, p.stat_right.dtype} == {jnp.dtype("bfloat16")}
  assert state[0].inner_state.mu["w"].dtype == jnp.bfloat16
  with pytest.raises(ValueError, match="precision must be a jax.lax.Precision or its name, got 'fast'"):
    rotation.scale_by_basis_rotation(precision="fast")

"""optax's shared contract for contributed optimizers (optax/contrib/_common_test.py, which every
optimizer of ``optax.contrib``, Muon included, passes), restated for ``rotation.basis_rotation``: its
targets, thresholds and assertions are optax's, written in this project's words. Each case (the
paper's alias and every option that changes what it computes or keeps: ``CASES``) runs the
optimizer as optax's does and asks the same of it:

- extra keyword arguments it does not expect are accepted, and the second ``update`` does not
  recompile;
- it converges on optax's four targets (a parabola, Rosenbrock, a matrix parabola, a 1-D plus 2-D
  target) within 3e-2 after 30,000 scanned steps, ``tree_map_params`` being a no-op on its state;
- ``inject_hyperparams`` gives the same updates and state (1e-5), with init and update jitted; as
  optax lists its own optimizers' shape-fixing integers as static there (GaLore's ``rank``, Muon's
  ``ns_steps``), rotation's two (``block_size``, ``max_precond_dim``: how the matrices are cut) are
  given as ``static_args``, the one departure from optax's text;
- updates keep the parameters' dtype (bfloat16, float32), ``MultiSteps`` returns exact zeros while it
  accumulates, and ``update`` under ``lax.cond`` keeps the state's shapes and dtypes (float16 to
  float64);
- a constant schedule and the same constant rate give the same parameters.

optax's sharding contract (``_sharding_test.py``, not shipped with the installed optax) is restated in
tests/test_optax_sharding_contract.py; tests/test_rotation_sharding.py checks the state's layout and
numbers on a mesh beyond it."""

import functools
import inspect

import jax
import jax.numpy as jnp
import optax
import pytest
from optax._src import test_utils

import rotation

LR = 1e-2  # the rate optax's contract gives Muon, the other matrix optimizer
UNINJECTABLE = ("block_size", "max_precond_dim")  # shape-fixing integers: static under inject_hyperparams


def _custom_inner(learning_rate):
  """The rotation around an inner transformation of the user's (AMSGrad: fields mu, nu, nu_max),
  chained with the learning rate as optax's aliases are."""
  return optax.chain(rotation.scale_by_basis_rotation(inner=optax.scale_by_amsgrad()),
                     optax.scale_by_learning_rate(learning_rate))


# (name, optax-style factory): the paper's alias, and every option that changes what the transformation
# computes or keeps: the other geometry and source, staggered refreshes, second moments rotated on a
# refresh, the two ablations (Adam in fixed random bases; bases frozen after a few refreshes) and a
# custom inner transformation
CASES = {
    "basis_rotation": rotation.basis_rotation,
    "unilateral": functools.partial(rotation.basis_rotation, geometry="unilateral"),
    "first order": functools.partial(rotation.basis_rotation, source="first"),
    "staggered": functools.partial(rotation.basis_rotation, stagger=True),
    "rotated second moments": functools.partial(rotation.basis_rotation, second_moments="rotate"),
    "random bases": functools.partial(rotation.basis_rotation,
                                      ablation=rotation.Ablation(jax.random.key(0), None)),
    "frozen bases": functools.partial(rotation.basis_rotation, ablation=rotation.Ablation(None, 30)),
    "custom inner": _custom_inner,
}


def _parabola(dtype):
  start, end = jnp.array([-1.0, 10.0, 1.0], dtype), jnp.array([1.0, -1.0, 1.0], dtype)
  return start, end, lambda p: jnp.sum(jnp.square(p - end))


def _rosenbrock(dtype):
  a, b = 1.0, 100.0
  start, end = jnp.array([0.0, 0.0], dtype), jnp.array([a, a**2], dtype)
  return start, end, lambda p: jnp.square(a - p[0]) + b * jnp.square(p[1] - p[0] ** 2)


def _matrix_parabola(dtype):
  start, end = jnp.zeros((2, 2), dtype), jnp.array([[3.0, -2.0], [1.0, 4.0]], dtype)
  return start, end, lambda p: jnp.sum(jnp.square(p - end))


def _mixed(dtype):
  end = (jnp.array([1.0, -1.0, 2.0], dtype), jnp.array([[1.0, 0.0], [-1.0, 1.0]], dtype))
  start = (jnp.zeros((3,), dtype), jnp.zeros((2, 2), dtype))
  return start, end, lambda p: jnp.sum(jnp.square(p[0] - end[0])) + jnp.sum(jnp.square(p[1] - end[1]))


@pytest.mark.parametrize("name", CASES)
def test_extra_args_are_accepted_and_the_second_update_does_not_recompile(name):
  opt = CASES[name](LR)
  start, _, objective = _rosenbrock(jnp.float32)

  @jax.jit
  def step(params, state):
    grads = jax.grad(objective)(params)
    updates, state = opt.update(grads, state, params, unexpected_extra_args_your_optimizer_doesnt_expect=1)
    return optax.apply_updates(params, updates), state

  params, state = start, opt.init(start)
  for _ in range(2):
    params, state = step(params, state)
  params, state = step(start, opt.init(start))
  with test_utils.log_compilations() as compilations:
    step(params, state)
  assert not compilations, "the second call to update recompiles"


@pytest.mark.parametrize("target", [_parabola, _rosenbrock, _matrix_parabola, _mixed])
@pytest.mark.parametrize("name", CASES)
def test_it_converges_on_optax_targets(name, target):
  opt = CASES[name](LR)
  start, end, objective = target(jnp.float32)

  def step(carry, _):
    params, state = carry
    updates, state = opt.update(jax.grad(objective)(params), state, params)
    return (optax.apply_updates(params, updates), state), None

  state = optax.tree.map_params(opt, lambda v: v, opt.init(start))  # a no-op map must work
  (params, _), _ = jax.jit(lambda c: jax.lax.scan(step, c, length=30_000))((start, state))
  test_utils.assert_trees_all_close(params, end, rtol=3e-2, atol=3e-2)


@pytest.mark.parametrize("name", CASES)
def test_inject_hyperparams_gives_the_same_updates_and_state(name):
  factory = CASES[name]
  # optax's contract makes static the hyper-parameters that fix shapes (GaLore's rank, Muon's
  # ns_steps, ...); rotation's are block_size and max_precond_dim, which cut the matrices
  static = [a for a in UNINJECTABLE if a in inspect.signature(factory).parameters]
  opt, injected = factory(LR), optax.inject_hyperparams(factory, static)(learning_rate=LR)
  params = [jnp.negative(jnp.ones((2, 3))), jnp.ones((2, 5, 2))]
  grads = [jnp.ones((2, 3)), jnp.negative(jnp.ones((2, 5, 2)))]
  updates, state = jax.jit(opt.update)(grads, jax.jit(opt.init)(params), params)
  updates_i, state_i = jax.jit(injected.update)(grads, jax.jit(injected.init)(params), params)
  test_utils.assert_trees_all_close(updates_i, updates, rtol=1e-5)
  test_utils.assert_trees_all_close(state_i.inner_state, state, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("shape", [(2,), (2, 3)])
@pytest.mark.parametrize("dtype", ["bfloat16", "float32"])
@pytest.mark.parametrize("name", CASES)
def test_updates_keep_the_parameters_dtype(name, dtype, shape):
  opt = CASES[name](LR)
  params = jnp.arange(1.0, 1.0 + jnp.prod(jnp.array(shape))).reshape(shape).astype(dtype)
  grads = jax.grad(lambda x: jnp.sum(x.astype(jnp.float32) ** 2))(params)
  updates, _ = jax.jit(opt.update)(grads, jax.jit(opt.init)(params), params)
  assert updates.dtype == params.dtype


@pytest.mark.parametrize("shape", [(2,), (2, 3)])
@pytest.mark.parametrize("dtype", ["bfloat16", "float32"])
@pytest.mark.parametrize("name", CASES)
def test_multisteps_returns_zeros_while_it_accumulates(name, dtype, shape):
  opt = optax.MultiSteps(CASES[name](LR), every_k_schedule=4)
  params = jnp.arange(1.0, 1.0 + jnp.prod(jnp.array(shape))).reshape(shape).astype(dtype)
  grads = jax.grad(lambda x: jnp.sum(x.astype(jnp.float32) ** 2))(params)
  updates, _ = jax.jit(opt.update)(grads, jax.jit(opt.init)(params), params)
  test_utils.assert_trees_all_equal(updates, jnp.zeros_like(grads))


@pytest.mark.parametrize("target", [_parabola, _matrix_parabola])
@pytest.mark.parametrize("dtype", ["float16", "bfloat16", "float32", "float64"])
@pytest.mark.parametrize("name", CASES)
def test_update_under_cond_keeps_the_state_stable(name, dtype, target):
  with jax.enable_x64(dtype == "float64"):
    dtype = jnp.dtype(dtype)
    opt = CASES[name](LR)
    start, _, objective = target(dtype)

    @jax.jit
    def step(params, state):
      grads = jax.grad(objective)(params)
      take = jax.random.randint(jax.random.key(0), (), 0, 2) == 0  # opaque to the compiler
      updates, state = jax.lax.cond(take, lambda: opt.update(grads, state, params), lambda: (params, state))
      return optax.apply_updates(params, updates), state

    params, state = start, opt.init(start)
    for _ in range(2):
      params, new_state = step(params, state)
      assert jax.tree.leaves(params)[0].dtype == dtype
      take = jax.random.randint(jax.random.key(0), (), 0, 2) == 0
      state = jax.lax.cond(take, lambda: state, lambda: new_state)  # noqa: B023


@pytest.mark.parametrize("name", CASES)
def test_a_constant_schedule_is_the_constant_rate(name):
  assert inspect.signature(rotation.basis_rotation).parameters["learning_rate"].annotation in (
      optax.ScalarOrSchedule, "optax.ScalarOrSchedule")
  start, _, objective = _matrix_parabola(jnp.float32)
  out = []
  for rate in (optax.constant_schedule(1e-3), 1e-3):
    opt = CASES[name](rate)
    params, state = start, opt.init(start)
    for _ in range(10):
      updates, state = opt.update(jax.grad(objective)(params), state, params)
      params = optax.apply_updates(params, updates)
    out.append(params)
  test_utils.assert_trees_all_close(out[0], out[1])

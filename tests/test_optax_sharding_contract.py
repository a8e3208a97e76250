"""optax's sharding contract for contributed optimizers (optax/contrib/_sharding_test.py in optax's
repository; not shipped with the installed package), restated for ``rotation.basis_rotation`` on 8
forced CPU devices (a subprocess: the device count is fixed when JAX starts), with its shapes,
dtypes and mesh. optax's current file asks one thing of every contrib optimizer, the second check
below; this project asks two more of its own (a superset):

- ``init`` accepts abstract parameters (a ``jax.ShapeDtypeStruct`` of shape (2, 4, 8));
- (optax's) on a mesh of 8 devices with explicit axes, float16 parameters of shape (2, 8, 4) split
  as ``P(None, "x")``: the state's types (shardings included) after one ``update`` equal ``init``'s;
- ``jax.jit(init)`` gives ``init``'s types, and ``jax.jit(update)`` gives ``update``'s.

optax's parameter is one 3-D leaf, which the default (every 2-D leaf) leaves to plain Adam; the
cases ``stacked`` and ``stacked, first order`` rotate it as a stack of two (8, 4) matrices, so that
the bases and statistics, laid out along their stack, are checked too. Before this test, ``jax.jit
(init)`` left a stack's bases replicated where an eager ``init`` split them (its
``float32[2,8@x,8]`` read ``float32[2,8,8]``)."""

SCRIPT = r"""
import json
import jax, jax.numpy as jnp
from optax._src import test_utils
import rotation

stacked = rotation.stacked(rotation.LINEAR)
CASES = {
    "basis_rotation": rotation.basis_rotation(1e-2),
    "unilateral": rotation.basis_rotation(1e-2, geometry="unilateral"),
    "stacked": rotation.basis_rotation(1e-2, weight_dimension_numbers=stacked),
    "stacked, first order": rotation.basis_rotation(1e-2, source="first", weight_dimension_numbers=stacked),
}
types = lambda tree: jax.tree.map(jax.typeof, tree)
mesh = jax.make_mesh((8,), ("x",), axis_types=(jax.sharding.AxisType.Explicit,))
sharding = jax.sharding.NamedSharding(mesh, jax.P(None, "x"))
got = {"devices": jax.device_count()}
for name, tx in CASES.items():
  abstract = tx.init(jax.ShapeDtypeStruct(shape=(2, 4, 8), dtype=jnp.float32))
  assert abstract is not None
  with jax.set_mesh(mesh):
    params = jnp.zeros((2, 8, 4), dtype=jnp.float16, out_sharding=sharding)
    state0 = tx.init(params)
    _, state1 = tx.update(params, state0, params)
    test_utils.assert_trees_all_equal(types(state0), types(state1))
    test_utils.assert_trees_all_equal(types(state0), types(jax.jit(tx.init)(params)))
    _, state3 = jax.jit(tx.update)(params, state0, params)
    test_utils.assert_trees_all_equal(types(state1), types(state3))
  got[name] = [str(t) for t in jax.tree.leaves(types(state0[0].bases))]
print(json.dumps(got))
"""


def test_optax_sharding_contract(forced_devices):
  got = forced_devices(SCRIPT, 8)
  assert got["devices"] == 8
  assert got["basis_rotation"] == got["unilateral"] == []  # the 3-D leaf is plain Adam by default
  # the stack's bases and statistics: K = 2 cannot be split 8 ways, so the rows are (8 divides 8)
  assert got["stacked"] == ["float32[2,8@x,8]", "float32[2,4,4]", "float32[2,8@x,8]", "float32[2,4,4]"]
  assert got["stacked, first order"] == ["float32[2,8@x,8]", "float32[2,4,4]"]

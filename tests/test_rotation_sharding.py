"""rotation's state on 8 forced CPU devices (a subprocess: the device count is fixed when JAX
starts): laid out like the parameters, its bases and statistics split along their stacks, its
types (shardings included) unchanged by an update, as optax's ``_sharding_test.py`` asks, and the
same numbers as on one device."""

import pytest

SCRIPT = r"""
import json
import jax, jax.numpy as jnp, numpy as np, optax
from jax.sharding import NamedSharding, PartitionSpec as P
from flax import nnx
import rotation

n = jax.device_count()
rng = np.random.default_rng(0)
shapes = {"embed": (4096, 64), "blocks": (8, 64, 256), "head": (64, 512), "bias": (256,)}
host = {k: jnp.asarray(rng.normal(size=s) * 0.05, jnp.float32) for k, s in shapes.items()}
dims = {"embed": rotation.LINEAR, "blocks": rotation.stacked(rotation.LINEAR), "head": rotation.LINEAR,
        "bias": None}
tx = rotation.basis_rotation(1e-2, weight_dimension_numbers=dims, block_size=512, refresh_every=100)
grads = [jax.tree.map(lambda x: jnp.asarray(rng.normal(size=x.shape), jnp.float32), host) for _ in range(3)]
got = {"devices": n}

def run(params, state, grads, out_shardings=None, sharded=True):
  update = jax.jit(tx.update, out_shardings=out_shardings)
  types = jax.tree.map(jax.typeof, state)
  shardings = jax.tree.map(lambda x: x.sharding, state)
  outs = []
  for g in grads:
    g = jax.tree.map(lambda x, p: jax.device_put(x, p.sharding), g, params)
    u, state = update(g, state, params)
    compiled = compiled if outs else update._cache_size()
    assert jax.tree.map(jax.typeof, state) == types  # shardings included, under explicit axes
    assert all(jax.tree.leaves(jax.tree.map(lambda x, s: x.sharding.is_equivalent_to(s, x.ndim), state,
                                            shardings)))
    outs.append(jax.tree.map(np.asarray, u))
  # compiled once: nothing added after the first call (one device: uncommitted inputs, then committed)
  assert update._cache_size() == compiled or not sharded
  return outs, state, u


single, _, _ = run(host, tx.init(host), grads, sharded=False)
nbytes = lambda x: x.size * x.dtype.itemsize
for kind in ("Auto", "Explicit"):
  mesh = jax.make_mesh((n,), ("fsdp",), axis_types=(getattr(jax.sharding.AxisType, kind),))
  spec = {"embed": P("fsdp", None), "blocks": P(None, None, "fsdp"), "head": P(None, "fsdp"), "bias": P()}
  shardings = {k: NamedSharding(mesh, s) for k, s in spec.items()}
  params = jax.device_put(host, shardings)
  eager = tx.init(params)
  jitted = jax.jit(tx.init, out_shardings=rotation.state_sharding(jax.eval_shape(tx.init, params),
                                                                  shardings))(params)
  assert jax.tree.map(jax.typeof, eager) == jax.tree.map(jax.typeof, jitted)
  # Under automatic axes the layout is jit's to choose unless given: state_sharding gives it.
  out = (shardings, rotation.state_sharding(eager, shardings)) if kind == "Auto" else None
  outs, state, last = run(params, eager, grads, out)
  per_device = [0] * n
  for x in jax.tree.leaves(state):
    for s in x.addressable_shards:
      per_device[s.device.id] += nbytes(s.data)
  total = sum(nbytes(x) for x in jax.tree.leaves(state))
  factors = sum(nbytes(x) for x in jax.tree.leaves(state[0].bases))
  err = np.concatenate([np.abs(a[k] - b[k]).ravel() for a, b in zip(outs, single) for k in a])
  scale = max(float(np.max(np.abs(b[k]))) for b in single for k in b)
  diff, frac = float(err.max()), float(np.mean(err > 1e-5 * scale))
  got[kind] = {"per_device": per_device, "total": total, "factors": factors, "diff": diff,
               "frac": frac, "scale": scale,
               "update_specs": {k: str(u.sharding.spec) for k, u in last.items()}}

# NNX: an eager nnx.Optimizer over a sharded model lays the state out so too
mesh = jax.make_mesh((n,), ("fsdp",), axis_types=(jax.sharding.AxisType.Auto,))
net = nnx.Linear(64, 1024, rngs=nnx.Rngs(0))
state = nnx.state(net, nnx.Param)
last = lambda x: NamedSharding(mesh, P(*[None] * (x.ndim - 1), "fsdp"))  # kernel and bias columns
nnx.update(net, jax.tree.map(lambda x: jax.device_put(x, last(x)), state))
opt = nnx.Optimizer(net, rotation.basis_rotation(1e-3, block_size=128), wrt=nnx.Param)
arrays = [x for x in jax.tree.leaves(nnx.state(opt, nnx.OptState)) if x.ndim >= 1]
got["nnx"] = {"leaves": len(arrays), "split": sum(not x.sharding.is_fully_replicated for x in arrays)}
print(json.dumps(got))
"""


@pytest.fixture(scope="module")
def got(forced_devices):
  return forced_devices(SCRIPT, 8)


@pytest.mark.parametrize("kind", ["Auto", "Explicit"])
def test_fsdp_state_is_split_over_the_devices(got, kind):
  r = got[kind]
  assert got["devices"] == 8
  # Every device holds at most 1.25 / 8 of the state (moments, bases and statistics alike).
  assert max(r["per_device"]) <= 1.25 / 8 * r["total"], r
  assert r["factors"] > 0.3 * r["total"]  # the bases and statistics are a real part of it
  def axes(spec):  # "P(None, 'fsdp', None)" -> ["None", "'fsdp'"]: trailing None axes mean nothing
    parts = [p.strip() for p in spec[2:-1].split(",") if p.strip()]
    while parts and parts[-1] == "None":
      parts.pop()
    return parts
  same = lambda a, b: axes(a) == axes(b)
  want = {"embed": "P('fsdp', None)", "blocks": "P(None, None, 'fsdp')", "head": "P(None, 'fsdp')",
          "bias": "P()"}
  assert all(same(r["update_specs"][k], v) for k, v in want.items()), r["update_specs"]


@pytest.mark.parametrize("kind", ["Auto", "Explicit"])
def test_eight_devices_equal_one(got, kind):
  """To round-off, as Adam's normalisation lets it show: the rotated gradient's entries are
  rescaled one by one, so a reduction summed in another order moves a few updates by more than
  float32's 1e-7 (measured: at most 2.5e-4 of the largest update, 0.04% of the entries above 1e-5
  of it, over three steps; a wrong layout or basis moves every entry by O(1))."""
  r = got[kind]
  assert r["diff"] <= 1e-3 * r["scale"] and r["frac"] < 1e-3, r


def test_an_nnx_optimizer_over_a_sharded_model_has_a_sharded_state(got):
  r = got["nnx"]
  assert r["split"] == r["leaves"] == 8, r  # 4 moments, 4 stacks: every one is split

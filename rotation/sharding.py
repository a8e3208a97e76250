"""Where basis rotation's state lives on a mesh: the moments like the parameters, the bases and
statistics split along their stack axis (``stack_sharding``); and how the transformation finds the
mesh (``mesh_of``) and the explicit axes it must run under (``explicit_axes``).

An eager ``init`` of sharded parameters (what ``nnx.Optimizer`` does) already lays the state out so;
``state_sharding`` gives the same layout as shardings, for ``jax.jit(tx.init, out_shardings=...)``,
``jax.jit(step, out_shardings=...)`` or an Orbax restore.
"""

from __future__ import annotations

import jax
from jax.sharding import NamedSharding, PartitionSpec

from rotation.state import BasisRotationState


def explicit_axes(tree) -> tuple:
  """The mesh axes of explicit type that ``tree``'s arrays are typed with (sharding in types)."""
  for x in jax.tree.leaves(tree):
    mesh = getattr(getattr(jax.typeof(x), "sharding", None), "mesh", None)
    types = getattr(mesh, "axis_types", None)
    if types:
      return tuple(n for n, t in zip(mesh.axis_names, types) if t == jax.sharding.AxisType.Explicit)
  return ()


def mesh_of(leaves):
  """The mesh of the first concrete parameter sharded by ``NamedSharding`` over several devices
  (an eager ``init`` of sharded parameters, what ``nnx.Optimizer`` does), else ``None``."""
  for x in leaves:
    sharding = getattr(x, "sharding", None)
    if isinstance(sharding, jax.sharding.NamedSharding) and not isinstance(x, jax.core.Tracer) \
        and len(sharding.mesh.devices.flat) > 1:
      return sharding.mesh
  return None


def stack_sharding(shape, mesh) -> jax.sharding.NamedSharding:
  """The sharding of a (K, a, a) stack of bases or statistics on ``mesh``: K split over the mesh
  axes (largest first) whose sizes multiply to a divisor of K, and the rows over the axes left
  whose sizes divide ``a`` (a leaf of few matrices, as a single large one, is still split)."""
  free = sorted((n for n in mesh.axis_names if mesh.shape[n] > 1), key=lambda n: -mesh.shape[n])
  spec = []
  for dim in shape[:2]:
    axes, size = [], 1
    for name in list(free):
      if dim % (size * mesh.shape[name]) == 0:
        axes.append(name)
        size *= mesh.shape[name]
        free.remove(name)
    spec.append(tuple(axes) if len(axes) > 1 else axes[0] if axes else None)
  return jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec(*spec, *([None] * (len(shape) - 2))))


def state_sharding(state, params_sharding):
  """Shardings for an optimizer state that holds ``BasisRotationState`` s.

  Args:
    state: the state, or its shapes (``jax.eval_shape(tx.init, params)``).
    params_sharding: the parameters' ``NamedSharding`` s (a tree with the parameters' structure),
      all on one mesh.

  Returns:
    A tree of ``NamedSharding`` with the state's structure: every subtree with the parameters'
    structure (the inner moments, and those of any other transformation in the chain) takes the
    parameters' shardings; every basis and statistic stack ``(K, a, a)`` is split along K over the
    mesh axes that divide it (``stack_sharding``); every other leaf (counts, hyper-parameters) is
    replicated.
  """
  leaves, treedef = jax.tree.flatten(params_sharding)
  if not leaves or not all(isinstance(s, NamedSharding) for s in leaves):
    raise ValueError("params_sharding must be a non-empty tree of jax.sharding.NamedSharding")
  mesh = leaves[0].mesh
  replicated = NamedSharding(mesh, PartitionSpec())
  is_params = lambda x: jax.tree.structure(x) == treedef
  is_node = lambda x: isinstance(x, BasisRotationState) or (not isinstance(x, (int, float)) and is_params(x))

  def shard(x):
    if isinstance(x, BasisRotationState):
      return BasisRotationState(replicated,
                                jax.tree.map(lambda a: stack_sharding(a.shape, mesh), x.bases),
                                state_sharding(x.inner_state, params_sharding))
    if is_params(x) and treedef.num_leaves > 1:
      return params_sharding
    return replicated

  return jax.tree.map(shard, state, is_leaf=is_node)

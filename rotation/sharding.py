"""Where basis rotation's state lives on a mesh: the moments like the parameters, the bases and
statistics split along their stack axis (``stack_spec``); and how the transformation finds the
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
  """The mesh of the first parameter sharded over several devices: a concrete array's
  ``NamedSharding`` (an eager ``init``, what ``nnx.Optimizer`` does), or the mesh in a traced array's
  type under explicit axes (``jax.jit(tx.init)``, sharding in types); else ``None`` (under jit with
  automatic axes the compiler lays the state out, or ``state_sharding`` does)."""
  for x in leaves:
    if isinstance(x, jax.core.Tracer):
      mesh = getattr(getattr(jax.typeof(x), "sharding", None), "mesh", None)
      if mesh is not None and explicit_axes([x]) and mesh.size > 1:
        return mesh
      continue
    sharding = getattr(x, "sharding", None)
    if isinstance(sharding, jax.sharding.NamedSharding) and sharding.mesh.size > 1:
      return sharding.mesh
  return None


def place(x, mesh, spec: PartitionSpec):
  """``x`` laid out as ``spec`` on ``mesh``: ``device_put`` for a concrete array, ``reshard`` for a
  traced one (its type then carries the layout, as an eager ``init``'s result does)."""
  sharding = NamedSharding(mesh, spec)
  return jax.sharding.reshard(x, sharding) if isinstance(x, jax.core.Tracer) else jax.device_put(x, sharding)


def spec_on(x, mesh) -> PartitionSpec:
  """The ``PartitionSpec`` ``x`` has on ``mesh`` (under explicit axes as its type writes it, which is
  how an update's outputs write it: ``P(None,)`` rather than ``P()``); replicated when ``x`` is not on
  ``mesh``."""
  if isinstance(x, jax.core.Tracer):
    typed = jax.typeof(x).sharding if explicit_axes([x]) else None
    return typed.spec if typed is not None and typed.mesh == mesh else PartitionSpec()
  sharding = getattr(x, "sharding", None)
  if getattr(sharding, "mesh", None) != mesh:
    return PartitionSpec()
  return jax.typeof(x).sharding.spec if explicit_axes([x]) else sharding.spec


def stack_spec(shape, mesh) -> PartitionSpec:
  """The layout of a (K, a, a) stack of bases or statistics on ``mesh`` (a ``Mesh`` or an
  ``AbstractMesh``): K split over the mesh
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
  return PartitionSpec(*spec, *([None] * (len(shape) - 2)))


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
    mesh axes that divide it (``stack_spec``); every other leaf (counts, hyper-parameters) is
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
      stacks = jax.tree.map(lambda a: NamedSharding(mesh, stack_spec(a.shape, mesh)), x.bases)
      return BasisRotationState(replicated, stacks, state_sharding(x.inner_state, params_sharding))
    if is_params(x) and treedef.num_leaves > 1:
      return params_sharding
    return replicated

  return jax.tree.map(shard, state, is_leaf=is_node)

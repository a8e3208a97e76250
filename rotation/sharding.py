"""Where basis rotation's state lives on a mesh: the moments like the parameters, the bases and
statistics split along their stack axis (``stack_sharding``).

An eager ``init`` of sharded parameters (what ``nnx.Optimizer`` does) already lays the state out so;
``state_sharding`` gives the same layout as shardings, for ``jax.jit(tx.init, out_shardings=...)``,
``jax.jit(step, out_shardings=...)`` or an Orbax restore.
"""

from __future__ import annotations

import jax
from jax.sharding import NamedSharding, PartitionSpec

from rotation.transform import BasisRotationState, stack_sharding


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

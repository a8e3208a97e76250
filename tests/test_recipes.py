"""docs/recipes.md stays true: each recipe runs as pasted and does what its text says."""

import pathlib
import re

import jax
import numpy as np

ROOT = pathlib.Path(__file__).resolve().parents[1]
RECIPES = re.findall(r"```python\n(.*?)```", (ROOT / "docs" / "recipes.md").read_text(), re.S)


def _run(code, name):
  scope = {}  # a fresh namespace: the recipe brings its own imports
  exec(compile(code, f"docs/recipes.md {name}", "exec"), scope)
  return scope


def test_attention_and_scanned_stack_recipe_rotates_each_layer_as_the_paper_does():
  scope = _run(RECIPES[0], "attention recipe")
  losses = np.asarray(scope["losses"])
  assert np.all(np.isfinite(losses)) and losses[-1] < 0.5 * losses[0], losses
  rotation, nnx = scope["rotation"], scope["nnx"]
  state = next(x for x in jax.tree.leaves(scope["opt"].opt_state, is_leaf=lambda x: isinstance(
      x, rotation.BasisRotationState)) if isinstance(x, rotation.BasisRotationState))
  params = nnx.state(scope["net"], nnx.Param)
  bases = rotation.leaf_bases(state, params)
  shapes = {jax.tree_util.keystr(p): None if e is None else [tuple(q.shape) for q in e[0]]
            for p, e in jax.tree_util.tree_leaves_with_path(
                bases, is_leaf=lambda x: x is None or isinstance(x, tuple))}
  layers, width = 3, 32
  for name in ("query", "key", "value", "out"):  # (3, 32, 4, 8) and (3, 4, 8, 32): 32 x 32 a layer
    assert shapes[f"['blocks']['attn']['{name}']['kernel']"] == [(layers, width, width)] * 2
    assert shapes[f"['blocks']['attn']['{name}']['bias']"] is None
  assert shapes["['blocks']['mlp']['layers'][0]['kernel']"] == [(layers, width, width),
                                                                 (layers, 4 * width, 4 * width)]
  assert shapes["['blocks']['mlp']['layers'][2]['kernel']"] == [(layers, 4 * width, 4 * width),
                                                                 (layers, width, width)]
  assert shapes["['embed']['kernel']"] is None and shapes["['head']['kernel']"] is None


def test_the_sharded_recipe_splits_the_state_over_eight_devices(forced_devices):
  code = RECIPES[1] + """
import json
leaves = jax.tree.leaves(state)
per_device = sum(s.data.nbytes for x in leaves for s in x.addressable_shards if s.device.id == 0)
print(json.dumps({"spec": str(state[0].bases["embed"][0].left.sharding.spec),
                  "fraction": per_device / sum(x.nbytes for x in leaves),
                  "finite": all(bool(jnp.all(jnp.isfinite(x))) for x in jax.tree.leaves(params))}))
"""
  got = forced_devices(code, 8)
  assert re.fullmatch(r"(PartitionSpec|P)\('fsdp'(, None)*,?\)", got["spec"]), got
  assert got["fraction"] <= 1.25 / 8 and got["finite"], got

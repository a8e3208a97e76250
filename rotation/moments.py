"""Which fields of the inner optimizer's state live in rotated coordinates, and how to read and write
them: fields shaped like the parameters, classified by name as first moments (re-expressed exactly
at a basis change) or second moments (permuted, or rotated, with the basis)."""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp

FIRST_MOMENTS = ("mu", "trace", "ema")
SECOND_MOMENTS = ("nu", "nu_max", "sum_of_squares")


def shaped_fields(inner_state, template) -> list[tuple[Any, str]]:
  """(key path, field name) of every subtree of ``inner_state`` shaped like ``template`` (the
  parameters): the fields that live in rotated coordinates."""
  treedef = jax.tree.structure(template)
  shapes = [jnp.shape(x) for x in jax.tree.leaves(template)]
  if not shapes:
    return []
  matches = lambda x: (jax.tree.structure(x) == treedef
                       and [jnp.shape(y) for y in jax.tree.leaves(x)] == shapes)
  out = []
  for path, x in jax.tree_util.tree_flatten_with_path(inner_state, is_leaf=matches)[0]:
    if not matches(x):
      continue
    names = [getattr(k, "name", getattr(k, "key", None)) for k in path]
    out.append((path, next((n for n in reversed(names) if isinstance(n, str)), "")))
  # A parameters tree of a single leaf matches every array of its shape: keep only named fields.
  return [(p, n) for p, n in out if n or treedef.num_leaves > 1]


def replace_at(tree, path, value):
  """``tree`` with the subtree at key ``path`` replaced by ``value``."""
  if not path:
    return value
  key, rest = path[0], path[1:]
  if isinstance(key, jax.tree_util.GetAttrKey):
    return tree._replace(**{key.name: replace_at(getattr(tree, key.name), rest, value)})
  if isinstance(key, jax.tree_util.SequenceKey):
    items = list(tree)
    items[key.idx] = replace_at(items[key.idx], rest, value)
    return type(tree)(items) if not hasattr(tree, "_fields") else type(tree)(*items)
  if isinstance(key, jax.tree_util.DictKey):
    new = dict(tree)
    new[key.key] = replace_at(tree[key.key], rest, value)
    return type(tree)(new) if type(tree) is not dict else new
  raise TypeError(f"cannot update the inner state at {jax.tree_util.keystr(path)}")


def at(tree, path):
  """The subtree of ``tree`` at key ``path``."""
  for key in path:
    if isinstance(key, jax.tree_util.GetAttrKey):
      tree = getattr(tree, key.name)
    elif isinstance(key, jax.tree_util.SequenceKey):
      tree = tree[key.idx]
    else:
      tree = tree[key.key]
  return tree


def moment_fields(inner_state, template) -> tuple[list, list, list]:
  """``(first-moment paths, second-moment paths, other (path, name) pairs)`` among the fields of
  ``inner_state`` shaped like ``template``."""
  fields = shaped_fields(inner_state, template)
  first = [p for p, n in fields if n in FIRST_MOMENTS]
  second = [p for p, n in fields if n in SECOND_MOMENTS]
  other = [(p, n) for p, n in fields if n not in FIRST_MOMENTS + SECOND_MOMENTS]
  return first, second, other

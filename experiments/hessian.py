"""``python -m experiments.hessian RUN_DIR``: Hessian (1,1)-norm of weight matrices, original vs
rotated basis, on a trained checkpoint (SPEC section 5).

For a weight matrix W (m x n) let H be the loss Hessian block of vec(W) (mn x mn).
- Row sums ``s_i = sum_j |H_ij|``: for z with i.i.d. standard Cauchy entries, ``(H z)_i`` is Cauchy
  with scale ``s_i``, so ``median_k |(H z_k)_i|`` estimates ``s_i``; the (1,1)-norm is ``sum_i s_i``.
- Diagonal ``H_ii``: Hutchinson's estimator ``mean_k z_k * (H z_k)`` with Rademacher z.
- Normalised misalignment = off-diagonal share of the (1,1)-norm,
  ``(||H||_{1,1} - sum_i |H_ii|) / ||H||_{1,1}``, in [0, 1): 0 for a perfectly aligned (diagonal) block.
The rotated basis is the run's own (U, V) from its optimizer state for rotation runs, otherwise the
eigenbases of the gradient statistics ``E[G G^T]``, ``E[G^T G]`` over a few batches; the Hessian in
that basis is ``(V x U)^T H (V x U)``, applied through HVPs as ``U^T H(U Z V^T) V``.
"""

from __future__ import annotations

import argparse
import json
import pathlib

import jax
import jax.numpy as jnp

import pipeline_sim as ps
from experiments import data as data_lib
from experiments import runs
from rotation import eigenbasis
from rotation.transform import BasisRotationState, leaf_bases


def _hvp(loss_fn, params, path, batch):
  """``Z -> H Z`` for the block of the leaf at ``path``, other leaves fixed."""
  leaf = _get(params, path)

  def loss_of_leaf(w):
    return loss_fn(_set(params, path, w), batch)

  grad = jax.grad(loss_of_leaf)
  return lambda z: jax.jvp(grad, (leaf,), (z,))[1]


def _get(tree, path):
  for k in path:
    tree = tree[k]
  return tree


def _set(tree, path, value):
  if not path:
    return value
  out = dict(tree)
  out[path[0]] = _set(tree[path[0]], path[1:], value)
  return out


def one_one_norm(hvp, shape, basis=None, samples: int = 64, seed: int = 0):
  """Estimates (||H||_{1,1}, sum_i |H_ii|) of the block, in ``basis = (U, V)`` if given."""
  u, v = basis if basis is not None else (jnp.eye(shape[0]), jnp.eye(shape[1]))
  mm = eigenbasis.mm
  rot_hvp = jax.jit(lambda z: mm(mm(u.T, hvp(mm(mm(u, z), v.T))), v))
  key_c, key_r = jax.random.split(jax.random.PRNGKey(seed))
  cauchy = jax.random.cauchy(key_c, (samples,) + shape)
  rade = jax.random.rademacher(key_r, (samples,) + shape).astype(jnp.float32)
  hz = jax.lax.map(rot_hvp, cauchy)
  row_scale = jnp.median(jnp.abs(hz), axis=0)
  diag = jnp.mean(rade * jax.lax.map(rot_hvp, rade), axis=0)
  return float(jnp.sum(row_scale)), float(jnp.sum(jnp.abs(diag)))


def misalignment(total: float, diagonal: float) -> float:
  return max(0.0, (total - min(diagonal, total)) / total) if total > 0 else 0.0


def gradient_bases(loss_fn, params, path, batches):
  """Eigenbases of E[G G^T] and E[G^T G] of the leaf over the given batches."""
  grad = jax.jit(jax.grad(lambda w, b: loss_fn(_set(params, path, w), b)))
  leaf = _get(params, path)
  gs = [grad(leaf, b) for b in batches]
  left = sum(eigenbasis.mm(g, g.T) for g in gs) / len(gs)
  right = sum(eigenbasis.mm(g.T, g) for g in gs) / len(gs)
  return eigenbasis.eigh_descending(left), eigenbasis.eigh_descending(right)


def run_bases(state, labels, num_stages):
  """Per-leaf (U, V) from a rotation run's per-stage optimizer states, or None."""
  parts = []
  for opt_state, part in zip(state.opt_states, ps.split_stages(state.params, labels, num_stages)):
    found = [x for x in jax.tree.leaves(opt_state, is_leaf=lambda x: isinstance(x, BasisRotationState))
             if isinstance(x, BasisRotationState)]
    if not found:
      return None
    parts.append(leaf_bases(found[0], part))
  return ps.merge_stages(parts, labels)


def analyse(run_dir, paths=None, samples: int = 64, batches: int = 4, data_path=None):
  """Rows per matrix: raw and normalised (1,1)-norm in the original and the rotated basis."""
  result = runs.load_result(run_dir)
  if result is None:
    raise FileNotFoundError(f"{str(run_dir)!r} holds no finished run (no result.json)")
  spec = runs.RunSpec(**result["spec"])
  cfg_context = spec.model_config(256).context
  ds = data_lib.load(data_path, context=cfg_context)
  pipe, state, loss_fn = runs.restore_state(spec, ds, run_dir)
  params, labels = state.params, pipe.labels
  bases = run_bases(state, labels, spec.stages)
  batch_list = [ds.batch(spec.seed + 777, j, spec.batch_size, cfg_context) for j in range(batches)]
  if paths is None:  # the first and last block's attention query and MLP input kernels
    last = spec.num_blocks or len(params["blocks"])
    paths = [("blocks", b, *leaf) for b in (0, last - 1)
             for leaf in (("attn", "q", "kernel"), ("mlp", "fc1", "kernel"))]
  rows = []
  for path in paths:
    leaf = _get(params, path)
    own = _get(bases, path) if bases is not None else None
    if own is not None and own[0].size and own[1].size:
      basis, source = _get(bases, path), "optimizer state"
    else:
      basis, source = gradient_bases(loss_fn, params, path, batch_list), "gradient statistics"
    hvp = _hvp(loss_fn, params, path, batch_list[0])
    orig = one_one_norm(hvp, leaf.shape, None, samples)
    rot = one_one_norm(hvp, leaf.shape, basis, samples)
    rows.append({"matrix": "/".join(map(str, path)), "shape": list(leaf.shape), "basis": source,
                 "norm_original": orig[0], "norm_rotated": rot[0],
                 "misalignment_original": misalignment(*orig), "misalignment_rotated": misalignment(*rot)})
  return rows


def main(argv=None):
  parser = argparse.ArgumentParser(prog="python -m experiments.hessian", description=__doc__,
                                   formatter_class=argparse.RawDescriptionHelpFormatter)
  parser.add_argument("run_dir", help="a finished run folder (results/<preset>/runs/<name>)")
  parser.add_argument("--samples", type=int, default=64, help="Cauchy / Rademacher probes per matrix")
  parser.add_argument("--data", help="the data file the run used (default: the default corpus)")
  args = parser.parse_args(argv)
  rows = analyse(pathlib.Path(args.run_dir), samples=args.samples, data_path=args.data)
  print("| matrix | shape | basis | (1,1)-norm orig | rotated | misalignment orig | rotated |")
  print("|---|---|---|---|---|---|---|")
  for r in rows:
    print(f"| {r['matrix']} | {r['shape']} | {r['basis']} | {r['norm_original']:.4g} | {r['norm_rotated']:.4g} "
          f"| {r['misalignment_original']:.4f} | {r['misalignment_rotated']:.4f} |")
  out = pathlib.Path(args.run_dir) / "hessian.json"
  out.write_text(json.dumps(rows, indent=1))
  print(f"written {out}")


if __name__ == "__main__":
  main()

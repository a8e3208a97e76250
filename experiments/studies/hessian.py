"""``python -m experiments.studies.hessian RUN_DIR``: Hessian (1,1)-norm of weight matrices, original vs
rotated basis, on a trained checkpoint (the paper's section on basis misalignment).

For a weight matrix W (m x n) let H be the loss Hessian block of vec(W) (mn x mn, row-major vec).
- Misalignment = off-diagonal share of the (1,1)-norm, ``(||H||_{1,1} - sum_i |H_ii|) / ||H||_{1,1}``:
  0 for a block that is diagonal in the basis, towards 1 for a dense one (for a random rotation of
  an n-entry block it is about ``1 - O(1 / sqrt(n))``).
- Normalised (1,1)-norm = ``||H||_{1,1} / (N ||H||_F)`` (N = mn): at most ``1 / sqrt(N)`` for a
  diagonal block, about 0.8 for a dense Gaussian-like one; the Frobenius norm is the same in every
  orthonormal basis, so it compares bases directly. The paper's normalisation of its
  0.5436 -> 0.1228 is not published; this is one candidate. A random orthogonal basis is reported
  as the fully misaligned reference.
- Blocks of up to ``exact_limit`` (4096) entries are measured exactly, from mn Hessian-vector
  products. Larger ones are estimated: row sums ``s_i = sum_j |H_ij|`` by Cauchy probes (for z with
  i.i.d. standard Cauchy entries ``(H z)_i`` is Cauchy with scale ``s_i``, so ``median_k |(H z_k)_i|``
  estimates ``s_i``) and the diagonal by Hutchinson's estimator, corrected for the bias of ``|.|``.
The rotated basis is the run's own (U, V) from its optimizer state for rotation runs, otherwise the
eigenbases of the gradient statistics ``E[G G^T]``, ``E[G^T G]`` over a few batches; the Hessian in
that basis is ``(V x U)^T H (V x U)``, applied through HVPs as ``U^T H(U Z V^T) V``.
"""

from __future__ import annotations

import argparse
import json
import pathlib
import sys

import jax
import jax.numpy as jnp
import numpy as np

import pipeline_sim as ps
import rotation
from experiments import cli
from experiments.harness import data as data_lib
from experiments.harness import provenance, runs
from experiments.harness.config import RunConfig
from experiments.sweep import folders


def mm(a, b):
  return jnp.matmul(a, b, precision=jax.lax.Precision.HIGHEST)


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


def _rotated(hvp, shape, basis):
  """``Z -> U^T H(U Z V^T) V``: the block's Hessian-vector product in the basis ``(U, V)``."""
  u, v = basis if basis is not None else (jnp.eye(shape[0]), jnp.eye(shape[1]))
  return jax.jit(lambda z: mm(mm(u.T, hvp(mm(mm(u, z), v.T))), v))


def exact_block(hvp, shape, basis=None, chunk: int = 256) -> np.ndarray:
  """The block's full Hessian (mn x mn, row-major vec) in ``basis``, from mn HVPs."""
  rot = _rotated(hvp, shape, basis)
  n = shape[0] * shape[1]
  rows = []
  for start in range(0, n, chunk):
    idx = jnp.arange(start, min(start + chunk, n))
    basis_vecs = jax.nn.one_hot(idx, n, dtype=jnp.float32).reshape((-1,) + tuple(shape))
    rows.append(np.asarray(jax.lax.map(rot, basis_vecs)).reshape(len(idx), n))
  return np.concatenate(rows).astype(np.float64)


def exact_norms(h: np.ndarray) -> tuple[float, float, float]:
  """(||H||_{1,1}, sum_i |H_ii|, ||H||_F) of a dense block."""
  return float(np.abs(h).sum()), float(np.abs(np.diag(h)).sum()), float(np.linalg.norm(h))


def one_one_norm(hvp, shape, basis=None, samples: int = 64, seed: int = 0):
  """Estimates (||H||_{1,1}, sum_i |H_ii|, ||H||_F) of the block, in ``basis = (U, V)`` if given.

  Row sums by Cauchy probes (``median_k |(H z_k)_i|``). Diagonal by Hutchinson's estimator with
  Rademacher probes, corrected for the bias of taking ``|.|`` of a noisy estimate:
  ``|H_ii| ~ sqrt(max(0, mean^2 - var / k))`` (``E[mean^2] = H_ii^2 + var / k``). Without the
  correction a dense block's diagonal reads too large and its misalignment too small. Frobenius
  norm from the same Rademacher probes: ``E ||H z||^2 = ||H||_F^2``.
  """
  rot_hvp = _rotated(hvp, shape, basis)
  key_c, key_r = jax.random.split(jax.random.PRNGKey(seed))
  cauchy = jax.random.cauchy(key_c, (samples,) + tuple(shape))
  rade = jax.random.rademacher(key_r, (samples,) + tuple(shape)).astype(jnp.float32)
  row_scale = jnp.median(jnp.abs(jax.lax.map(rot_hvp, cauchy)), axis=0)
  hz = jax.lax.map(rot_hvp, rade)
  d = rade * hz
  mean, var = jnp.mean(d, axis=0), jnp.var(d, axis=0, ddof=1)
  diag = jnp.sqrt(jnp.maximum(mean**2 - var / samples, 0.0))
  fro = jnp.sqrt(jnp.mean(jnp.sum(hz * hz, axis=tuple(range(1, hz.ndim)))))
  return float(jnp.sum(row_scale)), float(jnp.sum(diag)), float(fro)


def misalignment(total: float, diagonal: float) -> float:
  """Off-diagonal share of the (1,1)-norm: 0 for a diagonal block, towards 1 for a dense one."""
  return max(0.0, (total - min(diagonal, total)) / total) if total > 0 else 0.0


def normalised_one_one(total: float, fro: float, entries: int) -> float:
  """``||H||_{1,1} / (N ||H||_F)`` for an N x N block: at most ``1 / sqrt(N)`` for a diagonal block,
  about ``sqrt(2 / pi) = 0.8`` for a dense one with Gaussian-like entries. ``||H||_F`` is the same
  in every orthonormal basis, so this compares bases of one block directly."""
  return total / (entries * fro) if fro > 0 else 0.0


def random_basis(shape, seed: int = 0):
  """A random orthogonal ``(U, V)``: the reference of a fully misaligned basis."""
  ku, kv = jax.random.split(jax.random.PRNGKey(seed))
  q = lambda k, d: jnp.linalg.qr(jax.random.normal(k, (d, d)))[0]
  return q(ku, shape[0]), q(kv, shape[1])


def block_misalignment(hvp, shape, basis=None, samples: int = 64, exact_limit: int = 4096):
  """Misalignment of the block in ``basis``: exact up to ``exact_limit`` entries, else estimated.

  Returns ``(raw (1,1)-norm, misalignment, normalised (1,1)-norm, method)``.
  """
  n = shape[0] * shape[1]
  if n <= exact_limit:
    total, diag, fro = exact_norms(exact_block(hvp, shape, basis))
    method = "exact"
  else:
    total, diag, fro = one_one_norm(hvp, shape, basis, samples)
    method = f"estimate ({samples} probes)"
  return total, misalignment(total, diag), normalised_one_one(total, fro, n), method


def gradient_bases(loss_fn, params, path, batches):
  """Eigenbases of E[G G^T] and E[G^T G] of the leaf over the given batches."""
  grad = jax.jit(jax.grad(lambda w, b: loss_fn(_set(params, path, w), b)))
  leaf = _get(params, path)
  gs = [grad(leaf, b) for b in batches]
  left = sum(mm(g, g.T) for g in gs) / len(gs)
  right = sum(mm(g.T, g) for g in gs) / len(gs)
  return rotation.eigh_descending(left), rotation.eigh_descending(right)


def run_bases(state, labels, num_stages):
  """Per-leaf (U, V) from a rotation run's per-stage optimizer states, or None."""
  parts = []
  for opt_state, part in zip(state.opt_states, ps.split_stages(state.params, labels, num_stages)):
    is_state = lambda x: isinstance(x, rotation.BasisRotationState)
    found = [x for x in jax.tree.leaves(opt_state, is_leaf=is_state)
             if isinstance(x, rotation.BasisRotationState)]
    if not found:
      return None
    parts.append(rotation.leaf_bases(found[0], part))
  return ps.merge_stages(parts, labels)


def check_run_dir(run_dir) -> dict:
  """The finished run's result; a one-line error when ``run_dir`` is not a finished run's folder."""
  run_dir = pathlib.Path(run_dir)
  if not run_dir.exists():
    raise FileNotFoundError(f"run folder {str(run_dir)!r} does not exist")
  if not run_dir.is_dir():
    raise ValueError(f"{str(run_dir)!r} is a file; give a run folder (results/<preset>/runs/<name>)")
  if (run_dir / "runs").is_dir():
    names = sorted(p.name for p in (run_dir / "runs").iterdir() if p.is_dir())
    raise ValueError(f"{str(run_dir)!r} is a sweep's results folder; give one of its {len(names)} runs, "
                     f"e.g. {str(run_dir / 'runs' / (names[0] if names else '<name>'))!r}")
  result = runs.load_result(run_dir)
  if result is None:
    raise FileNotFoundError(f"{str(run_dir)!r} holds no finished run (no result.json)")
  return result


def analyse(run_dir, paths=None, samples: int = 64, batches: int = 4, data_path=None,
            exact_limit: int = 4096, progress=None):
  """Rows per matrix: raw and normalised (1,1)-norm in the original and the rotated basis.

  ``progress``: called with a one-line message before each matrix (the tool prints it)."""
  if samples < 1 or exact_limit < 0:
    raise ValueError(f"need samples >= 1 and exact_limit >= 0, got {samples} and {exact_limit}")
  run_dir = pathlib.Path(run_dir)
  result = check_run_dir(run_dir)
  config = RunConfig(**result["config"])
  cfg_context = config.model_config(256).context
  vocab = result["data"].get("vocab_size")
  ds = data_lib.load(data_path, context=cfg_context,
                     vocab_size=vocab if str(data_path).endswith(".bin") else None)
  pipe, state, loss_fn = runs.restore_state(config, ds, run_dir)  # checks data and settings
  params, labels = state.params, pipe.labels
  bases = run_bases(state, labels, config.stages)
  batch_list = [ds.batch(config.seed + 777, j, config.batch_size, cfg_context) for j in range(batches)]
  if paths is None:  # the first and last block's attention query and MLP input kernels
    last = config.num_blocks or len(params["blocks"])
    paths = [("blocks", b, *leaf) for b in (0, last - 1)
             for leaf in (("attn", "q", "kernel"), ("mlp", "fc1", "kernel"))]
  rows = []
  for k, path in enumerate(paths):
    if progress is not None:
      progress(f"{run_dir.name}: matrix {k + 1}/{len(paths)} {'/'.join(map(str, path))}")
    leaf = _get(params, path)
    own = _get(bases, path) if bases is not None else None
    if own is not None and own[0] is not None and own[1] is not None:
      basis, source = _get(bases, path), "optimizer state"
    else:
      basis, source = gradient_bases(loss_fn, params, path, batch_list), "gradient statistics"
    hvp = _hvp(loss_fn, params, path, batch_list[0])
    orig, rot, rand = (block_misalignment(hvp, leaf.shape, b, samples, exact_limit)
                       for b in (None, basis, random_basis(leaf.shape)))
    row = {"matrix": "/".join(map(str, path)), "shape": list(leaf.shape), "basis": source,
           "method": orig[3]}
    for name, r in (("original", orig), ("rotated", rot), ("random", rand)):
      row.update({f"norm_{name}": r[0], f"misalignment_{name}": r[1], f"normalised_{name}": r[2]})
    rows.append(row)
  return rows


def table(by_run: dict) -> list:
  """Markdown lines: one row per run and matrix (``by_run``: ``{run label: analyse rows}``)."""
  lines = ["| run | matrix | shape | basis | method | (1,1)-norm orig / rotated | off-diagonal share orig / "
           "rotated / random | normalised (1,1)-norm orig / rotated / random |",
           "|---|---|---|---|---|---|---|---|"]
  for label, rows in by_run.items():
    for r in rows:
      trio = lambda key, r=r: " / ".join(f"{r[f'{key}_{b}']:.4f}" for b in ("original", "rotated", "random"))
      lines.append(f"| {label} | {r['matrix']} | {r['shape']} | {r['basis']} | {r['method']} | "
                   f"{r['norm_original']:.4g} / {r['norm_rotated']:.4g} | {trio('misalignment')} | "
                   f"{trio('normalised')} |")
  return lines


def main(argv=None):
  parser = argparse.ArgumentParser(prog="python -m experiments.studies.hessian", description=__doc__,
                                   formatter_class=argparse.RawDescriptionHelpFormatter)
  parser.add_argument("run_dirs", nargs="+", metavar="run_dir",
                      help="finished run folders (results/<preset>/runs/<name>)")
  parser.add_argument("--samples", type=int, default=64, help="Cauchy / Rademacher probes per matrix")
  parser.add_argument("--data", help="the data file the runs used (default: the default corpus)")
  parser.add_argument("--exact-limit", type=int, default=4096, help="blocks with at most this many "
                      "entries are measured exactly from HVPs (default 4096), larger ones estimated")
  parser.add_argument("--markdown", help="also write the table (with the command) to this file")
  parser.add_argument("--json", help="also write every row (per run, per matrix) to this JSON file")
  args = parser.parse_args(argv)
  if args.samples < 1:
    raise ValueError(f"--samples must be >= 1, got {args.samples}")
  if args.exact_limit < 0:
    raise ValueError(f"--exact-limit must be >= 0, got {args.exact_limit}")
  outputs = [(flag, pathlib.Path(path)) for flag, path in (("--markdown", args.markdown),
                                                            ("--json", args.json)) if path]
  for flag, path in outputs:  # before the minutes of measurements
    folders.check_file(path, flag)
    if not path.parent.is_dir():
      raise ValueError(f"{flag} {str(path)!r}: the folder {str(path.parent)!r} does not exist")
  for run_dir in args.run_dirs:
    check_run_dir(run_dir)
  by_run = {}
  for run_dir in map(pathlib.Path, args.run_dirs):
    by_run[run_dir.name] = analyse(run_dir, samples=args.samples, data_path=args.data,
                                   exact_limit=args.exact_limit, progress=lambda m: print(m, flush=True))
  lines = table(by_run)
  print("\n".join(lines))
  if args.json:
    pathlib.Path(args.json).write_text(json.dumps(by_run, indent=1))
  if args.markdown:
    given = sys.argv[1:] if argv is None else list(argv)
    command = " ".join(["python -m experiments.studies.hessian"] + given)
    code = provenance.code_version()
    pathlib.Path(args.markdown).write_text(
        f"Command: `{command}`  \nCode: {code}\n\n" + "\n".join(lines) + "\n")
  if outputs:
    print(f"written {', '.join(str(p) for _, p in outputs)}")


if __name__ == "__main__":
  cli.exit_process(cli.run(main))

"""The study's rotation optimizer on the study's Transformer for four steps (a cold start and three
rotated steps): the case that ``tests/test_methods.py`` compares with the same steps taken at commit
bbcc4f9, before the rotation library's rewrite (``tests/data/study_rotation_bbcc4f9.npz``, written
by ``python tests/study_case.py OUT.npz`` from a checkout of that commit)."""

import sys

import jax
import jax.numpy as jnp
import numpy as np

from experiments.harness.methods import spec


def study_case(method: str = "rotation"):
  """Four steps inside the first refresh period (the cold start, then the statistics and the
  rotations). A warm refresh is left out: its QR of ``L Q`` amplifies round-off by the condition
  number of ``L`` (and a rank-deficient ``L`` leaves part of the basis to round-off), so two
  implementations that only sum in another order part by far more than round-off after one; the
  float64 reference tests in ``tests/test_transform.py`` check it."""
  from experiments.harness import methods
  from experiments.harness import model as model_lib
  from experiments.harness.runs import RunConfig

  cfg = model_lib.ModelConfig(num_blocks=2, width=32, num_heads=2, context=8, vocab_size=48,
                              mlp_ratio=4)
  _, params = model_lib.init(cfg, seed=0)
  params = jax.tree.map(lambda x: jnp.asarray(x, jnp.float32), params)
  config = RunConfig(optimizer=spec(method), stages=2, steps=100, lr=1e-2, warmup_steps=0)
  opt = methods.run_optimizers(config)[0]
  state = opt.init(params)
  rng = np.random.default_rng(0)
  update = jax.jit(opt.update)
  for _ in range(4):
    grads = jax.tree.map(lambda x: jnp.asarray(rng.normal(size=x.shape) * 0.01, jnp.float32), params)
    updates, state = update(grads, state, params)
    params = jax.tree.map(lambda p, u: p + u, params, updates)
  paths = [jax.tree_util.keystr(p) for p, _ in jax.tree_util.tree_leaves_with_path(params)]
  return dict(zip(paths, (np.asarray(x) for x in jax.tree.leaves(params))))


if __name__ == "__main__":
  np.savez_compressed(sys.argv[1], **study_case())

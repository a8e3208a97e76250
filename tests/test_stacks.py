"""rotation.stacks: same-shape small matrices of many leaves run as one stack, large ones apart, and
the split gives every element back exactly."""

import jax.numpy as jnp
import numpy as np

from rotation import stacks


def _args(k, a, b, seed):
  x = np.random.default_rng(seed).normal(size=(k, a, b)).astype(np.float32)
  return (jnp.asarray(x), jnp.asarray(x[:, :, :1] * 2))


def test_small_same_shape_matrices_share_a_stack_large_ones_do_not():
  side = int(np.sqrt(stacks.LARGE))
  args = [_args(1, 8, 8, 0), _args(2, 8, 8, 1), _args(1, side + 1, side, 2), _args(1, side + 1, side, 3),
          _args(3, 8, 8, 4), _args(1, 8, 4, 5)]
  got, split = stacks.stack(args, together=True)
  shapes = sorted(s[0].shape for s in got)
  assert shapes == sorted([(6, 8, 8), (1, side + 1, side), (1, side + 1, side), (1, 8, 4)]), shapes
  back = split(got)
  for a, b in zip(args, back):
    for x, y in zip(a, b):
      np.testing.assert_array_equal(np.asarray(x), np.asarray(y))
  apart, _ = stacks.stack(args, together=False)
  assert len(apart) == len(args)


def test_batched_runs_a_function_per_matrix_and_returns_each_elements_result():
  args = [_args(2, 8, 8, 0), _args(1, 8, 8, 1), _args(1, 200, 200, 2)]
  fn = lambda a: jnp.einsum("kab,kbc->kac", a[0], a[1])
  got = stacks.batched(fn, args, together=True)
  for a, y in zip(args, got):
    np.testing.assert_allclose(np.asarray(y), np.asarray(a[0]) @ np.asarray(a[1]), rtol=1e-5, atol=1e-5)

"""experiments/bench/compile_time.py: compile time of the update, unrolled layers against a scanned stack."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import rotation
from experiments.bench import compile_time


def _sides(state) -> int:
  is_piece = lambda x: isinstance(x, rotation.RotationPiece)
  return sum(x.shape[0] for pc in jax.tree.leaves(state, is_leaf=is_piece) if is_piece(pc)
             for x in (pc.left, pc.right) if x is not None)


def test_both_layouts_hold_the_same_weights_and_one_basis_per_side_per_layer():
  layers, width = 3, 4
  built = {}
  for name in compile_time.LAYOUTS:
    structs, dims = compile_time.layout(name, layers, width)
    params = jax.tree.map(lambda s: jnp.zeros(s.shape, s.dtype), structs)
    built[name] = (params, rotation.basis_rotation(1e-3, weight_dimension_numbers=dims).init(params))
  sizes = {n: sum(x.size for x in jax.tree.leaves(p)) for n, (p, _) in built.items()}
  assert sizes["unrolled"] == sizes["scanned"] == layers * width * width * (4 + 4 + 4)
  # two sides for each of the six kernels of every layer, in both layouts
  assert _sides(built["unrolled"][1]) == _sides(built["scanned"][1]) == 2 * 6 * layers
  with pytest.raises(ValueError, match="layout 'flat' is not one of"):
    compile_time.layout("flat", layers, width)


def test_every_cell_is_timed_and_the_ratio_is_of_the_same_run(capsys):
  rows = compile_time.main(["--layers", "1", "2", "--width", "4", "--repeat", "1"])
  assert set(rows) == {(n, name) for n in (1, 2) for name in compile_time.LAYOUTS}
  for row in rows.values():
    assert row["adamw"] > 0 and row["rotation"] > 0
    np.testing.assert_allclose(row["ratio"], row["rotation"] / row["adamw"])
  assert "| layers | layout | AdamW s | rotation s | rotation / AdamW |" in capsys.readouterr().out
  with pytest.raises(SystemExit):
    compile_time.main(["--repeat", "0"])
  assert "--layers, --width and --repeat must be >= 1, got 0" in capsys.readouterr().err

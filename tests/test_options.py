"""rotation.options through the public constructors: every bad option is one clear error at
construction (or init) naming the offending value."""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import rotation
from experiments.harness.methods import spec


@pytest.mark.parametrize("kwargs,match", [
    ({"source": "third"}, "unknown source 'third'"),
    ({"geometry": "trilateral"}, "unknown geometry 'trilateral'"),
    ({"second_moments": "shuffle"}, "unknown second_moments 'shuffle'"),
    ({"refresh_every": 0}, "refresh_every.*must be an int >= 1.*got 0"),
    ({"refresh_every": {"w": -2}}, "got -2"),
    ({"eps": -1e-8}, "eps must be >= 0, got -1e-08"),
    ({"orthonormalization": "svd"}, "unknown orthonormalization 'svd'"),
    ({"b1": 1.0}, r"b1 must be in \[0, 1\), got 1.0"),
    ({"b2": -0.5}, r"b2 must be in \[0, 1\), got -0.5"),
    ({"shampoo_beta": 2.0}, r"shampoo_beta must be in \[0, 1\), got 2.0"),
    ({"b1": np.float32(1.5)}, r"b1 must be in \[0, 1\), got np.float32\(1.5\)"),  # any scalar type
    ({"b2": np.asarray(1.0)}, r"b2 must be in \[0, 1\), got array\(1.\)"),  # a 0-d array
    ({"eps": np.float64(-1.0)}, r"eps must be >= 0, got np.float64\(-1.0\)"),
])
def test_bad_arguments(kwargs, match):
  with pytest.raises(ValueError, match=match):
    rotation.scale_by_basis_rotation(**kwargs)
  if set(kwargs) <= {"b1", "b2"}:  # the alias and the plain Adam refuse them too
    with pytest.raises(ValueError, match=match):
      rotation.basis_rotation(1e-3, **kwargs)
    with pytest.raises(ValueError, match=match):
      rotation.scale_by_adam(**kwargs)


@pytest.mark.parametrize("kwargs,match", [
    ({"learning_rate": "abc"}, "learning_rate must be a real scalar, got 'abc'"),
    ({"learning_rate": 1e-3, "b1": "0.9"}, "b1 must be a real scalar, got '0.9'"),
    ({"learning_rate": 1e-3, "b2": np.array([0.9, 0.99])}, "b2 must be a real scalar"),
    ({"learning_rate": 1e-3, "shampoo_beta": 0.9 + 0j},
     r"shampoo_beta must be a real scalar, got \(0.9\+0j\)"),
])
def test_non_numeric_hyperparameters_are_refused_by_name(kwargs, match):
  with pytest.raises(TypeError, match=match):
    rotation.basis_rotation(**kwargs)


def test_numeric_learning_rates_and_schedules_are_accepted():
  for lr in (1e-3, np.float32(1e-3), jnp.asarray(1e-3), optax.constant_schedule(1e-3)):
    rotation.basis_rotation(lr).init({"w": jnp.zeros((2, 2))})


@pytest.mark.parametrize("tx", [rotation.basis_rotation(1e-3), rotation.scale_by_adam()])
def test_complex_leaves_are_refused_at_init(tx):
  with pytest.raises(TypeError, match=r"parameter \['z'\] has dtype complex64: .*real floating-point"):
    tx.init({"w": jnp.zeros((3, 3)), "z": jnp.zeros((3, 3), jnp.complex64)})


def test_mask_structure_mismatch():
  tx = rotation.scale_by_basis_rotation(weight_dimension_numbers={"w": rotation.LINEAR})
  with pytest.raises(ValueError, match="weight_dimension_numbers does not match the parameters"):
    tx.init({"w": jnp.zeros((2, 2)), "v": jnp.zeros((2, 2))})


def test_an_ablation_is_given_as_a_rotation_ablation():
  """The ablation-only options come grouped; a dict (or the old keywords) is one clear error."""
  with pytest.raises(TypeError, match=r"ablation must be None or a rotation.Ablation, got "
                                      r"\{'freeze_after': 3\}"):
    rotation.basis_rotation(1e-3, ablation={"freeze_after": 3})
  with pytest.raises(TypeError, match="unexpected keyword argument 'freeze_after'"):
    rotation.scale_by_basis_rotation(freeze_after=3)
  with pytest.raises(ValueError, match="freeze_after must be None or an int >= 1, got -1"):
    rotation.basis_rotation(1e-3, ablation=rotation.Ablation(freeze_after=-1))


def test_a_learning_rate_given_as_inner_is_a_clear_error():
  with pytest.raises(TypeError, match="inner must be an optax.GradientTransformation.*basis_rotation"):
    rotation.scale_by_basis_rotation(1e-3)


@pytest.mark.parametrize("tx", [rotation.basis_rotation(1e-3), rotation.scale_by_adam()])
def test_integer_leaves_are_refused_at_init(tx):
  with pytest.raises(TypeError, match=r"parameter \['step'\] has dtype int32"):
    tx.init({"w": jnp.zeros((3, 3)), "step": jnp.zeros((), jnp.int32)})


def test_an_inner_state_field_that_cannot_follow_the_basis_is_refused_by_name():
  def init(params):
    return {"velocity": jax.tree.map(jnp.zeros_like, params)}

  def update(g, state, params=None):
    return g, state

  with pytest.raises(ValueError, match=r"inner state field\(s\) \['velocity'\] \(velocity\)"):
    rotation.scale_by_basis_rotation(optax.GradientTransformation(init, update)).init(
        {"w": jnp.zeros((3, 3)), "b": jnp.zeros(3)})


def test_the_statistics_decay_is_resolved_and_its_range_checked_in_one_place():
  """``None`` means ``b2`` (``options.statistics_decay``) for the library and the study alike, and
  a run config's decay is refused outside the library's own range, [0, 1)."""

  from experiments.harness import methods
  from experiments.harness.config import RunConfig
  from experiments.studies import lag
  from rotation.options import resolve, statistics_decay

  assert statistics_decay(None, 0.99) == 0.99 and statistics_decay(0.95, 0.99) == 0.95
  assert lag.decay_of({"method": "rotation", "shampoo_beta": None, "b2": 0.99}) == 0.99  # a recorded run
  kwargs = dict(source="second", geometry="bilateral", refresh_every=10, b1=None, eps=1e-8, block_size=None,
                max_precond_dim=None, precond_dtype=None, precision=None, first_order_step="paper",
                stagger=False, orthonormalization="qr", batch_refresh=None, fixed=False, freeze_after=None,
                second_moments="permute", custom_inner=False)
  assert resolve(b2=0.98, shampoo_beta=None, **kwargs).shampoo_beta == 0.98
  config = RunConfig(optimizer=spec("rotation", shampoo_beta=0.0))
  config.validate()  # no memory: allowed, as the library allows it
  with pytest.raises(ValueError, match=r"shampoo_beta must be in \[0, 1\), got 1"):
    spec("rotation", shampoo_beta=1.0)
  # rotation-stage-decay's per-stage decays start from the same resolution (b2 here)
  stage = RunConfig(optimizer=spec("rotation-stage-decay", b2=0.99), stages=4, steps=100, warmup_steps=0)
  assert len(methods.run_optimizers(stage)) == 4

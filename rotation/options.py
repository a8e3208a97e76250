"""Basis rotation's options: each checked once, at construction, with one meaning, and each default
resolved once into ``Options``, which the per-matrix math (``rotation.matrix``) takes as an argument."""

from __future__ import annotations

from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from rotation import eigenbasis as eb
from rotation.plan import check_periods, static_int

SOURCES = ("second", "first")
GEOMETRIES = ("bilateral", "unilateral")
FIRST_ORDER_STEPS = ("paper", "power")
SECOND_MOMENT_RULES = ("permute", "rotate")  # how second moments follow a basis change
DEFAULT_BLOCK_SIZE = 1024


def concrete(name: str, value) -> float | None:
  """``value`` as a Python float when it is known at construction (a Python or NumPy number, a 0-d
  array), ``None`` when it is traced (``optax.inject_hyperparams``); anything else is refused."""
  if isinstance(value, (str, bytes)) or np.ndim(value) != 0:
    raise TypeError(f"{name} must be a real scalar, got {value!r}")
  if isinstance(value, jax.core.Tracer):
    return None
  try:
    if np.iscomplexobj(value):
      raise TypeError
    return float(value)
  except (TypeError, ValueError):
    raise TypeError(f"{name} must be a real scalar, got {value!r}") from None


def check_decay(name: str, value) -> None:
  """A decay rate known at construction must lie in [0, 1) (0: no memory)."""
  v = concrete(name, value)
  if v is not None and not 0 <= v < 1:
    raise ValueError(f"{name} must be in [0, 1), got {value!r}")


def statistics_decay(shampoo_beta, b2):
  """The decay of the ``L``, ``R`` statistics: ``shampoo_beta``, or ``b2`` where it is ``None`` (the
  one place this default is resolved; the study's code calls it too)."""
  return b2 if shampoo_beta is None else shampoo_beta


def check_learning_rate(value) -> None:
  """A learning rate is a real scalar or a schedule (a callable of the step)."""
  if not callable(value):
    concrete("learning_rate", value)


def check_dtype(name: str, value):
  """``None`` or a floating dtype, as a ``jnp.dtype``."""
  if value is None:
    return None
  try:
    dtype = jnp.dtype(value)
  except TypeError:
    raise ValueError(f"{name} must be None or a floating dtype, got {value!r}") from None
  if not jnp.issubdtype(dtype, jnp.floating):
    raise ValueError(f"{name} must be None or a floating dtype, got {value!r}")
  return dtype


def compute_dtype(x):
  """The dtype the math runs in for a leaf ``x``: float32, or wider where the leaf is."""
  return jnp.promote_types(jnp.result_type(x), jnp.float32)


def _choice(name: str, value, choices) -> str:
  if value not in choices:
    raise ValueError(f"unknown {name} {value!r}; choose from {choices}")
  return value


class Ablation(NamedTuple):
  """Departures from the paper's method that only the mechanism's ablations use, grouped so that the
  method's own signature holds the method (``scale_by_basis_rotation(ablation=Ablation(...))``).

  Attributes:
    bases: ``None`` (estimate the bases, the paper's method) or *fixed* bases: a pytree with the
      parameters' structure holding, per rotated leaf of one block, ``(U, V)`` (``(a, a)``, or
      ``(K, a, a)`` for a stack; ``None`` for a side that is not rotated). The bases are then never
      refreshed and no statistics are kept: Adam in a given basis. A PRNG key
      (``jax.random.key(seed)``) draws random orthogonal (Haar) bases for every rotated side.
    freeze_after: ``None`` (refresh for ever) or a step count: no warm refresh after it, so the
      bases estimated by then stay frozen (the statistics are still kept).
  """

  bases: Any = None
  freeze_after: int | None = None


def check_ablation(value) -> Ablation:
  """``None`` (the paper's method) or an ``Ablation``."""
  if value is None:
    return Ablation()
  if not isinstance(value, Ablation):
    raise TypeError(f"ablation must be None or a rotation.Ablation, got {value!r}")
  return value


class Options(NamedTuple):
  """The resolved options of one ``scale_by_basis_rotation`` (see its docstring for each)."""

  source: str
  geometry: str
  b1: Any  # the look-ahead weight of the first-order source (and the default Adam's b1)
  shampoo_beta: Any  # the statistics' decay (``b2`` when not given)
  precision: jax.lax.Precision | None  # the per-step matmuls
  precond_dtype: Any  # storage of the statistics and bases (None: their compute dtype)
  orthonormalization: str
  first_order_step: str
  second_moments: str
  batch_refresh: bool | None
  block_size: Any
  max_precond_dim: Any
  freeze_after: Any
  stagger: bool
  fixed: bool  # given bases: no refresh and no statistics

  @property
  def second(self) -> bool:
    """Second-order statistics are kept (the second-order source with estimated bases)."""
    return self.source == "second" and not self.fixed


def resolve(*, source, geometry, refresh_every, b1, b2, eps, shampoo_beta, block_size, max_precond_dim,
            precond_dtype, precision, first_order_step, stagger, orthonormalization, batch_refresh,
            fixed, freeze_after, second_moments, custom_inner: bool) -> Options:
  """Every option checked (one clear error naming the value) and every default resolved."""
  _choice("source", source, SOURCES)
  _choice("geometry", geometry, GEOMETRIES)
  _choice("second_moments", second_moments, SECOND_MOMENT_RULES)
  _choice("first_order_step", first_order_step, FIRST_ORDER_STEPS)
  _choice("orthonormalization", orthonormalization, eb.ORTHONORMALIZATIONS)
  check_periods(refresh_every)
  freeze_after = static_int("freeze_after", freeze_after, 1, none_ok=True, traced_ok=True)
  if not isinstance(block_size, jax.core.Tracer):
    static_int("block_size", block_size, 1, none_ok=True)
  if not isinstance(max_precond_dim, jax.core.Tracer):
    static_int("max_precond_dim", max_precond_dim, 0, none_ok=True)
  eps_value = concrete("eps", eps)
  if eps_value is not None and eps_value < 0:
    raise ValueError(f"eps must be >= 0, got {eps!r}")
  for name, value in (("b1", b1), ("b2", b2), ("shampoo_beta", shampoo_beta)):
    if value is not None:
      check_decay(name, value)
  precond_dtype = check_dtype("precond_dtype", precond_dtype)
  try:
    precision = jax.lax.Precision(precision) if precision is not None else None
  except ValueError:
    raise ValueError(f"precision must be a jax.lax.Precision or its name, got {precision!r}") from None
  if source == "first" and custom_inner and b1 is None:
    raise ValueError("source='first' with a given inner needs b1= (the look-ahead weight: the inner "
                     "optimizer's first-moment decay)")
  return Options(source, geometry, 0.9 if b1 is None else b1, statistics_decay(shampoo_beta, b2),
                 precision, precond_dtype, orthonormalization, first_order_step, second_moments,
                 batch_refresh, block_size, max_precond_dim, freeze_after, stagger, fixed)

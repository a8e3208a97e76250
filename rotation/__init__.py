"""Basis rotation: Adam in a rotated Kronecker-factored eigenbasis, as Optax transformations."""

from rotation.adam import scale_by_adam
from rotation.dims import (
    ATTENTION_OUT,
    ATTENTION_QKV,
    LINEAR,
    RotationDimensionNumbers,
    stacked,
)
from rotation.eigenbasis import eigh_descending
from rotation.moments import FIRST_MOMENTS, SECOND_MOMENTS
from rotation.options import (
    DEFAULT_BLOCK_SIZE,
    FIRST_ORDER_STEPS,
    GEOMETRIES,
    SECOND_MOMENT_RULES,
    SOURCES,
    Ablation,
)
from rotation.refresh import ALLOCATIONS, refresh_budget, stage_aware_decay, stage_aware_refresh
from rotation.sharding import state_sharding
from rotation.state import BasisRotationState, RotationPiece, leaf_bases
from rotation.threads import limit_lapack_threads
from rotation.transform import basis_rotation, scale_by_basis_rotation

__all__ = [
    "ALLOCATIONS", "Ablation", "ATTENTION_OUT", "ATTENTION_QKV", "DEFAULT_BLOCK_SIZE", "FIRST_MOMENTS",
    "FIRST_ORDER_STEPS", "GEOMETRIES", "LINEAR", "SECOND_MOMENT_RULES", "SECOND_MOMENTS", "SOURCES",
    "BasisRotationState",
    "RotationDimensionNumbers", "RotationPiece", "basis_rotation", "eigh_descending", "leaf_bases",
    "limit_lapack_threads", "refresh_budget", "scale_by_adam", "scale_by_basis_rotation", "stacked",
    "stage_aware_decay",
    "stage_aware_refresh", "state_sharding",
]

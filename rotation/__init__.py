"""Basis rotation: Adam in a rotated Kronecker-factored eigenbasis, as Optax transformations."""

from rotation.eigenbasis import eigh_descending
from rotation.refresh import ALLOCATIONS, refresh_budget, stage_aware_refresh
from rotation.transform import (
    FIRST_ORDER_STEPS,
    GEOMETRIES,
    SOURCES,
    BasisRotationState,
    RotationGroup,
    basis_rotation,
    leaf_bases,
    scale_by_adam,
    scale_by_basis_rotation,
)

__all__ = [
    "ALLOCATIONS", "FIRST_ORDER_STEPS", "GEOMETRIES", "SOURCES", "BasisRotationState",
    "RotationGroup", "basis_rotation", "eigh_descending", "leaf_bases", "refresh_budget",
    "scale_by_adam", "scale_by_basis_rotation", "stage_aware_refresh",
]

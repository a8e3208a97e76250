"""Basis rotation: Adam in a rotated Kronecker-factored eigenbasis, as Optax transformations."""

from rotation.refresh import ALLOCATIONS, refresh_budget, stage_aware_refresh
from rotation.transform import (BasisRotationState, GEOMETRIES, SOURCES, basis_rotation,
                                leaf_bases, scale_by_adam, scale_by_basis_rotation)

__all__ = [
    "ALLOCATIONS", "BasisRotationState", "GEOMETRIES", "SOURCES", "basis_rotation", "leaf_bases",
    "refresh_budget", "scale_by_adam", "scale_by_basis_rotation", "stage_aware_refresh",
]

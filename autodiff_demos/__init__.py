"""Measured proof of why deep learning differentiates in reverse (docs/autodiff.md, in JAX)."""

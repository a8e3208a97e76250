"""Measured proof of why deep learning differentiates in reverse (the tutorial seed, in JAX)."""

"""Benchmarks of nimble.jit against jax.jit (see BENCHMARKS.md)."""

"""Compiler: a JAX function → a launch plan (pure data). Needs no GPU."""

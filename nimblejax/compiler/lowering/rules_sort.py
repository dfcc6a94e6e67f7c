"""Sorting kernels: sort (multi-operand, num_keys, stable) and top_k."""
from __future__ import annotations

"""Indexing kernels: gather and the scatter family (scatter, scatter-add/-mul/-min/-max)."""
from __future__ import annotations

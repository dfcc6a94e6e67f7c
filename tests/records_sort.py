"""Primitive records for rules_sort (see primitive_table.py)."""
from __future__ import annotations

from primitive_table import rec, f32, dt, i32, u32, boolean  # noqa: F401

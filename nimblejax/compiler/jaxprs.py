"""JAX's jaxpr objects, read the same way across JAX versions (no JAX import needed).

A module of its own so that the tracer (trace.py) and the modules it calls while
tracing (control.py, prng.py) share it without importing each other."""
from __future__ import annotations

from typing import Any


def open_jaxpr(j: Any) -> tuple[Any, list]:
    """(jaxpr, consts) of a ClosedJaxpr, or of a Jaxpr that carries its consts (≥0.11)."""
    inner = getattr(j, "jaxpr", j)
    consts = getattr(j, "consts", None)
    if consts is None:
        consts = getattr(inner, "consts", None) or []
    return inner, list(consts)

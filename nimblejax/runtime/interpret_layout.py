"""The interpreter's data-movement equations, evaluated with NumPy rather than JAX.

JAX evaluates a primitive outside `jit` by compiling a one-equation XLA program for each
new primitive, parameters and operand shapes; on the CPU that lowering and compiling
was most of the interpreter's time, and most of the programs it compiled were moves of
data (over a sample of the test suite: 1276 distinct programs, of which slice 149,
broadcast_in_dim 122, reshape 100, transpose 45, concatenate 38, iota 24, squeeze 12).
These equations copy or generate values without arithmetic, so NumPy gives exactly
XLA's bytes (NaN payloads and signed zeros included). `evaluate` returns None for an
equation it does not cover (the caller binds it with JAX): other primitives, a reshape
with its `dimensions`, a Python number as operand.
"""
from __future__ import annotations

from typing import Callable, Optional

import numpy as np


def _slice(x, start_indices, limit_indices, strides=None):
    steps = strides or (1,) * len(start_indices)
    return x[tuple(slice(a, b, s) for a, b, s in zip(start_indices, limit_indices, steps))]


def _broadcast_in_dim(x, shape, broadcast_dimensions, sharding=None):
    placed = [1] * len(shape)
    for axis, dim in enumerate(broadcast_dimensions):
        placed[dim] = x.shape[axis]
    return np.broadcast_to(x.reshape(placed), tuple(shape))


def _reshape(x, new_sizes, dimensions=None, sharding=None):
    return None if dimensions is not None else x.reshape(tuple(new_sizes))


def _iota(dtype, shape, dimension, sharding=None):
    line = np.arange(shape[dimension]).astype(np.dtype(dtype))
    placed = [1] * len(shape)
    placed[dimension] = shape[dimension]
    return np.broadcast_to(line.reshape(placed), tuple(shape))


UNARY: dict[str, Callable] = {
    "slice": _slice,
    "broadcast_in_dim": _broadcast_in_dim,
    "reshape": _reshape,
    "transpose": lambda x, permutation: np.transpose(x, permutation),
    "squeeze": lambda x, dimensions: np.squeeze(x, axis=tuple(dimensions)),
    "rev": lambda x, dimensions: np.flip(x, axis=tuple(dimensions)),
}


COVERED = frozenset(UNARY) | {"iota", "concatenate"}


def operand_array(v) -> Optional[np.ndarray]:
    """v as a NumPy array where it has a dtype of its own (a NumPy array or scalar, a JAX
    array on the CPU); None for a Python number, whose dtype the equation decides."""
    if isinstance(v, (np.ndarray, np.generic)):
        return np.asarray(v)
    if hasattr(v, "__array__") and hasattr(v, "dtype") and hasattr(v, "shape"):
        return np.asarray(v)
    return None


def evaluate(name: str, vals: list, params: dict) -> Optional[np.ndarray]:
    """The equation's one result by NumPy, or None where this module does not cover it
    (a parameter this JAX has and the table does not know included)."""
    if name not in COVERED:
        return None  # before any operand is converted: most equations are not moves
    try:
        if name == "iota" and not vals:
            return _iota(**params)
        vals = [operand_array(v) for v in vals]
        if not vals or any(v is None for v in vals):
            return None
        if name == "concatenate" and len({v.dtype for v in vals}) == 1 and set(params) == {"dimension"}:
            return np.concatenate(vals, axis=params["dimension"])
        fn = UNARY.get(name)
        return fn(vals[0], **params) if fn is not None and len(vals) == 1 else None
    except TypeError:  # parameters of another JAX version
        return None

"""The interpreter's exactly rounded arithmetic, evaluated with NumPy rather than JAX.

After the moves of data (interpret_layout.py), most of the one-equation programs JAX
compiled for the interpreter were integer and bit operations (a PRNG's xor, or, shifts)
and the four basic float operations (over test_flax.py, test_training.py and
test_random.py: 1,000 distinct programs, add 173, mul 111, xor 60, sub 55, or 41, shifts
63). IEEE 754 defines each of these to one result, and NumPy computes it as XLA does: a
float16, float32 or float64 result is rounded once to its own type (subnormal float32
and float64 operands and results flushed to zero, as XLA's CPU client does), integers
wrap. Max and min take a NaN, and +0 or -0 of two zeros, as XLA does; conversions
between floats and from integers round to nearest even (bfloat16 through ml_dtypes).

Left to JAX: anything whose result another library may round otherwise (exp, tanh,
integer_pow, integer division), a float converted to an integer, the float8s, and
bfloat16's arithmetic. NaNs' payloads aside, the bytes are XLA's (tests/runtime/
test_interpret_exact.py). `evaluate` returns None for an equation it does not cover, an
operand without a dtype of its own, or a result whose dtype or shape is not the
equation's.
"""
from __future__ import annotations

from typing import Callable, Optional

import numpy as np

from nimblejax.runtime.interpret_layout import operand_array


def _shift(x: np.ndarray, s: np.ndarray, right: bool, logical: bool) -> np.ndarray:
    """XLA's shifts: an amount of the type's width or more (read as unsigned) shifts every
    bit out, leaving 0, or the sign's bits for an arithmetic right shift, which reads
    an unsigned integer's top bit as a sign too."""
    bits, dtype = x.dtype.itemsize * 8, x.dtype
    signed, unsigned = np.dtype(f"int{bits}"), np.dtype(f"uint{bits}")
    amount = s.astype(unsigned)
    clipped = np.minimum(amount, bits - 1)
    if not right:
        shifted = np.left_shift(x.astype(unsigned), clipped)
        out = np.zeros_like(shifted)
    elif logical:
        shifted = np.right_shift(x.astype(unsigned), clipped)
        out = np.zeros_like(shifted)
    else:  # in the signed type, where NumPy's right shift copies the sign bit
        x = x.astype(signed)
        shifted, out = np.right_shift(x, clipped.astype(signed)), np.right_shift(x, bits - 1)
    return np.where(amount >= bits, out, shifted).astype(dtype)


def _flushed(a: np.ndarray) -> np.ndarray:
    """XLA's CPU client computes with subnormal floats of 32 and 64 bits read and
    written as zeros of their sign (float16 goes through float32, where its subnormals
    are normal numbers)."""
    if a.dtype.kind != "f" or a.dtype.itemsize < 4:
        return a
    return np.where(np.abs(a) < np.finfo(a.dtype).tiny, np.copysign(np.zeros((), a.dtype), a), a)


def _extreme(a: np.ndarray, b: np.ndarray, larger: bool) -> np.ndarray:
    """XLA's max and min: a NaN wins, and of two zeros max takes +0 and min -0."""
    r = np.maximum(a, b) if larger else np.minimum(a, b)
    if a.dtype.kind != "f":
        return r
    negative = np.signbit(a) & np.signbit(b) if larger else np.signbit(a) | np.signbit(b)
    zero = np.copysign(np.zeros((), a.dtype), np.where(negative, -1, 1).astype(a.dtype))
    return np.where((a == 0) & (b == 0), zero, r)


def _kind(dtype: np.dtype) -> str:
    """NumPy's kind letter, "f" for bfloat16 too (an ml_dtypes type, kind "V")."""
    return "f" if dtype.name == "bfloat16" else dtype.kind


def _convert(x: np.ndarray, params: dict) -> Optional[np.ndarray]:
    """convert_element_type where NumPy's cast is XLA's: to a float from a float, an
    integer or a bool (rounded to nearest even, subnormals kept: a conversion is not
    flushed), and to an integer from an integer or a bool (wrapping). A float to an
    integer or a bool (NaN, range, a subnormal's truth), and a float to float64, are
    left to JAX."""
    to = np.dtype(params.get("new_dtype"))
    if _kind(to) not in "fiu" or _kind(x.dtype) not in ("fiub" if _kind(to) == "f" else "iub"):
        return None
    if set(params) - {"new_dtype", "weak_type", "sharding"} or params.get("sharding") is not None:
        return None
    if to == np.float64 and _kind(x.dtype) == "f":
        return None  # XLA reads a subnormal float32 as zero here (it keeps it to bfloat16)
    with np.errstate(all="ignore"):
        return np.asarray(x.astype(to))


FLOATS = "f"
INTS = "iu"
BITS = "iub"
NUMBERS = "fiu"

# name -> (the operands' dtype kinds it covers, the function)
OPS: dict[str, tuple[str, Callable]] = {
    "add": (NUMBERS, np.add),
    "add_any": (NUMBERS, np.add),
    "sub": (NUMBERS, np.subtract),
    "mul": (NUMBERS, np.multiply),
    "neg": (NUMBERS, np.negative),  # a sign flip: XLA keeps a subnormal's bits
    "square": (NUMBERS, lambda x: np.multiply(x, x)),
    "div": (FLOATS, np.divide),
    "max": (NUMBERS, lambda a, b: _extreme(a, b, larger=True)),
    "min": (NUMBERS, lambda a, b: _extreme(a, b, larger=False)),
    "eq": (NUMBERS + "b", np.equal),
    "ne": (NUMBERS + "b", np.not_equal),
    "lt": (NUMBERS, np.less),
    "le": (NUMBERS, np.less_equal),
    "gt": (NUMBERS, np.greater),
    "ge": (NUMBERS, np.greater_equal),
    "and": (BITS, np.bitwise_and),
    "or": (BITS, np.bitwise_or),
    "xor": (BITS, np.bitwise_xor),
    "not": (BITS, np.invert),
    "shift_left": (INTS, lambda x, s: _shift(x, s, right=False, logical=False)),
    "shift_right_logical": (INTS, lambda x, s: _shift(x, s, right=True, logical=True)),
    "shift_right_arithmetic": (INTS, lambda x, s: _shift(x, s, right=True, logical=False)),
}


def evaluate(name: str, vals: list, params: dict, out) -> Optional[np.ndarray]:
    """`out`'s value (the equation's one output: shape, dtype) by NumPy, or None."""
    op = OPS.get(name)
    if op is None and name not in ("select_n", "convert_element_type"):
        return None  # before any operand is converted: most equations are not these
    arrays = [operand_array(v) for v in vals]
    if not arrays or any(a is None for a in arrays):
        return None
    if name == "convert_element_type":
        result = _convert(arrays[0], params) if len(arrays) == 1 else None
        if result is None:
            return None
    elif name == "select_n":
        if len(arrays) != 3 or arrays[0].dtype != np.bool_:
            return None
        result = np.where(arrays[0], arrays[2], arrays[1])
    else:
        kinds, fn = op
        if params or len({a.dtype for a in arrays}) != 1 or arrays[0].dtype.kind not in kinds:
            return None
        with np.errstate(all="ignore"):
            result = (np.asarray(fn(*arrays)) if name == "neg"
                      else _flushed(np.asarray(fn(*map(_flushed, arrays)))))
    if result.dtype != np.dtype(out.dtype) or result.shape != tuple(out.shape):
        return None
    return result

"""dtype facts for code generation: storage type, compute type, loads, stores, literals.

Half types (float16, bfloat16) are stored as themselves but computed in float; every
operation's result is rounded back to the storage type, as XLA does when it upcasts
one HLO op at a time, so fused chains round exactly where jax.jit rounds.
"""
from __future__ import annotations

import math

import numpy as np


STORAGE = {
    "float32": "float", "float16": "__half", "bfloat16": "__nv_bfloat16",
    "int32": "int", "uint32": "unsigned int", "int8": "signed char", "uint8": "unsigned char",
    "int16": "short", "uint16": "unsigned short", "bool": "bool",
}
COMPUTE = {
    "float32": "float", "float16": "float", "bfloat16": "float",
    "int32": "int", "uint32": "unsigned int", "int8": "int", "uint8": "unsigned int",
    "int16": "int", "uint16": "unsigned int", "bool": "bool",
}
SUPPORTED = frozenset(STORAGE)


_NAMES: dict = {}  # dtype (or str) -> its name: np.dtype(x).name costs ~10 µs a call


def name(dtype) -> str:
    try:
        return _NAMES[dtype]
    except KeyError:
        found = _NAMES[dtype] = np.dtype(dtype).name
        return found
    except TypeError:  # an unhashable spelling of a dtype
        return np.dtype(dtype).name


def is_supported(dtype) -> bool:
    return name(dtype) in SUPPORTED


def storage_type(dtype) -> str:
    return STORAGE[name(dtype)]


def compute_type(dtype) -> str:
    return COMPUTE[name(dtype)]


def is_float(dtype) -> bool:
    return name(dtype) in ("float32", "float16", "bfloat16")


def is_half(dtype) -> bool:
    return name(dtype) in ("float16", "bfloat16")


def is_unsigned_int(dtype) -> bool:
    return name(dtype) in ("uint32", "uint8", "uint16")


# Half types are stored as themselves and computed in float: (to float, from float).
_HALF_CONVERSIONS = {"float16": ("__half2float", "__float2half_rn"),
                     "bfloat16": ("__bfloat162float", "__float2bfloat16_rn")}


def load(dtype, ref: str) -> str:
    """Expression converting a stored element `ref` to the compute type."""
    conv = _HALF_CONVERSIONS.get(name(dtype))
    return f"{conv[0]}({ref})" if conv else ref


def store(dtype, value: str) -> str:
    """Expression converting a compute-type value to the storage type."""
    conv = _HALF_CONVERSIONS.get(name(dtype))
    return f"{conv[1]}({value})" if conv else value


def round_to(dtype, value: str) -> str:
    """Round a float compute value to the precision of `dtype` (identity for non-halves)."""
    return load(dtype, store(dtype, value))


def literal(value, dtype) -> str:
    """An exact C literal of `value` in the compute type of `dtype`."""
    n = name(dtype)
    v = np.asarray(value).astype(dtype).item()
    if n == "bool":
        return "true" if v else "false"
    if is_float(dtype):
        f = float(v)
        if math.isnan(f):
            return "__int_as_float(0x7fc00000)"
        if math.isinf(f):
            return "__int_as_float(0x7f800000)" if f > 0 else "__int_as_float(0xff800000)"
        return f"{float(np.float32(f)).hex()}f".replace("0x-", "-0x")
    if is_unsigned_int(dtype):
        return f"{int(v)}u"
    iv = int(v)
    # INT_MIN has no literal form in C: -2147483648 parses as -(2147483648), a long.
    return f"({iv + 1} - 1)" if iv == -(2 ** 31) else str(iv)


def lowest(dtype) -> str:
    """Identity of max: -inf for floats, the minimum for integers, false for bool."""
    if is_float(dtype):
        return literal(-np.inf, np.float32)
    if name(dtype) == "bool":
        return "false"
    return literal(np.iinfo(dtype).min, dtype)


def highest(dtype) -> str:
    if is_float(dtype):
        return literal(np.inf, np.float32)
    if name(dtype) == "bool":
        return "true"
    return literal(np.iinfo(dtype).max, dtype)

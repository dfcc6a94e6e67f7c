"""The elementwise family as data: primitive name → C expression, per operand class.

`{a}`, `{b}`, `{c}` are the operands, already in their compute type (float for every
float dtype, int, unsigned int or bool otherwise). Templates may repeat an operand:
the code generator only ever substitutes variable names or literals.
"""
from __future__ import annotations

import functools
import math

import numpy as np

# NaN-propagating max/min, as XLA's: if either side is NaN the result is NaN.
_FMAX = "(({a} != {a} || {a} > {b}) ? {a} : {b})"
_FMIN = "(({a} != {a} || {a} < {b}) ? {a} : {b})"

UNARY_FLOAT = {
    "neg": "(-{a})", "abs": "fabsf({a})", "sign": "({a} > 0.0f ? 1.0f : ({a} < 0.0f ? -1.0f : {a}))",
    "floor": "floorf({a})", "ceil": "ceilf({a})", "exp": "expf({a})",
    "log": "logf({a})", "log1p": "log1pf({a})", "expm1": "expm1f({a})",
    "sqrt": "sqrtf({a})",
    "rsqrt": "rsqrtf({a})", "cbrt": "cbrtf({a})", "sin": "sinf({a})", "cos": "cosf({a})",
    "tan": "tanf({a})", "asin": "asinf({a})", "acos": "acosf({a})", "atan": "atanf({a})",
    "sinh": "sinhf({a})", "cosh": "coshf({a})", "tanh": "nimble_tanh({a})", "asinh": "asinhf({a})",
    "acosh": "acoshf({a})", "atanh": "atanhf({a})",
    "erf": "nimble_erf({a})", "erfc": "nimble_erfc({a})", "erf_inv": "nimble_erf_inv({a})", "lgamma": "lgammaf({a})",
    "square": "__fmul_rn({a}, {a})", "is_finite": "isfinite({a})", "copy": "{a}",
    # jax >= 0.11 emits this for the derivative of tanh.
    "one_minus_square": "(1.0f - __fmul_rn({a}, {a}))",
}
# erf, erfc, erf_inv, tanh and division as XLA computes them on GPUs (xla_math.py), not as CUDA C does.
# Signed overflow is undefined in C (compilers fold `x + y > x` to `y > 0`); XLA wraps.
# So signed arithmetic goes through unsigned int, whose overflow wraps, and back.
UNARY_INT = {
    "neg": "(int)(0u - (unsigned int){a})",
    "abs": "({a} < 0 ? (int)(0u - (unsigned int){a}) : {a})",
    "sign": "(({a} > 0) - ({a} < 0))", "not": "(~{a})",
    "population_count": "__popc({a})", "clz": "__clz({a})",  # of 8/16 bits: _int_unary
    "square": "(int)((unsigned int){a} * (unsigned int){a})", "copy": "{a}",
}
UNARY_BOOL = {"not": "(!{a})", "copy": "{a}"}

# A float multiply is __fmul_rn, which NVRTC never fuses into the add that reads it: XLA's
# GPU code rounds an HLO multiply and an HLO add each (measured: JAX's erfc and erf_inv,
# sums of products, match jax.jit bit for bit only unfused), where CUDA C's `a * b + c`
# would be one fused multiply-add.
BINARY_FLOAT = {
    "add": "({a} + {b})", "sub": "({a} - {b})", "mul": "__fmul_rn({a}, {b})", "div": "nimble_div({a}, {b})",
    "rem": "fmodf({a}, {b})", "pow": "powf({a}, {b})", "max": _FMAX, "min": _FMIN,
    "atan2": "atan2f({a}, {b})", "nextafter": "nextafterf({a}, {b})",
}
BINARY_INT = {
    "add": "(int)((unsigned int){a} + (unsigned int){b})",
    "sub": "(int)((unsigned int){a} - (unsigned int){b})",
    "mul": "(int)((unsigned int){a} * (unsigned int){b})",
    # XLA: x / 0 is -1 and x % 0 is x for integers (no trap), so guard the divisor.
    # INT_MIN / -1 overflows (a trap in C): XLA wraps it to INT_MIN and gives rem 0.
    "div": "({b} == 0 ? -1 : ({b} == -1 ? (int)(0u - (unsigned int){a}) : {a} / {b}))",
    "rem": "({b} == 0 ? {a} : ({b} == -1 ? 0 : {a} % {b}))",
    "max": "max({a}, {b})", "min": "min({a}, {b})",
    "and": "({a} & {b})", "or": "({a} | {b})", "xor": "({a} ^ {b})",
    # Shifts by >= the bit width are defined in XLA (0 or the sign), undefined in C.
    "shift_left": "((unsigned int){b} < 32u ? ({a} << {b}) : 0)",
    "shift_right_arithmetic": "((unsigned int){b} < 32u ? ({a} >> {b}) : ({a} < 0 ? -1 : 0))",
    "shift_right_logical": "((unsigned int){b} < 32u ? (int)((unsigned int){a} >> {b}) : 0)",
}
BINARY_UINT = dict(BINARY_INT, **{
    "add": "({a} + {b})", "sub": "({a} - {b})", "mul": "({a} * {b})",
    "div": "({b} == 0u ? 0xffffffffu : {a} / {b})", "rem": "({b} == 0u ? {a} : {a} % {b})",
    "shift_left": "({b} < 32u ? {a} << {b} : 0u)",
    # (the right shifts of every integer width: _int_shift below)
})
BINARY_BOOL = {"and": "({a} && {b})", "or": "({a} || {b})", "xor": "({a} != {b})",
               "max": "({a} || {b})", "min": "({a} && {b})", "add": "({a} || {b})",
               "mul": "({a} && {b})"}
COMPARE = {"eq": "({a} == {b})", "ne": "({a} != {b})", "lt": "({a} < {b})",
           "le": "({a} <= {b})", "gt": "({a} > {b})", "ge": "({a} >= {b})"}

# add_any is the add that jax.grad emits to accumulate cotangents.
for _table in (BINARY_FLOAT, BINARY_INT, BINARY_UINT, BINARY_BOOL):
    _table["add_any"] = _table["add"]

UNARY = {"float": UNARY_FLOAT, "int": UNARY_INT, "uint": UNARY_INT, "bool": UNARY_BOOL}
BINARY = {"float": BINARY_FLOAT, "int": BINARY_INT, "uint": BINARY_UINT, "bool": BINARY_BOOL}


def _expansion(prim: str, dtype) -> str:
    """JAX's and XLA's expansions of logistic (1 / (1 + exp(−x))), exp2 (exp(ln2 · x)) and
    log2 (log(x) / ln2, a primitive of its own from jax 0.11), ln2 in the operand's type
    and each step rounded to it (identity in float32), as XLA's 16-bit steps round; XLA
    divides by a constant as a multiply by its reciprocal, rounded to the operand's type.
    Measured on an H200: float32 0 of 1.1M normal results differ (exp2f and log2f:
    286,327 and 156,552); bfloat16 log2 0 (divided by ln2: 82,501, one ulp), exp2 and
    logistic within one bfloat16 ulp (179 and 161)."""
    from nimblejax.compiler import dtypes

    r = functools.partial(dtypes.round_to, dtype)
    ln2_value = np.asarray(math.log(2.0)).astype(dtype)
    ln2, inv_ln2 = dtypes.literal(ln2_value, dtype), dtypes.literal(1.0 / float(ln2_value), dtype)
    return {"logistic": f"nimble_div(1.0f, {r('1.0f + ' + r('expf(-{a})'))})",
            "exp2": f"expf({r(f'__fmul_rn({ln2}, {{a}})')})",
            "log2": f"__fmul_rn({r('logf({a})')}, {inv_ln2})"}[prim]


EXPANDED = frozenset({"logistic", "exp2", "log2"})  # floats only: _expansion
UNARY_NAMES = frozenset(set(UNARY_FLOAT) | set(UNARY_INT) | set(UNARY_BOOL) | EXPANDED | {"round"})
BINARY_NAMES = frozenset(set(BINARY_FLOAT) | set(BINARY_INT) | set(BINARY_BOOL) | set(COMPARE))


def operand_class(dtype) -> str:
    from nimblejax.compiler import dtypes

    if dtypes.is_float(dtype):
        return "float"
    if dtypes.name(dtype) == "bool":
        return "bool"
    return "uint" if dtypes.is_unsigned_int(dtype) else "int"


# Integer widths: compute types are 32 bits wide, so the bit-counting and shifting ops
# of 8- and 16-bit types look at the value's own bits only (sign extension masked off).
INT_BITS = {"int8": 8, "uint8": 8, "int16": 16, "uint16": 16, "int32": 32, "uint32": 32}
_SIGNED_STORAGE = {8: "signed char", 16: "short", 32: "int"}


def _bits(dtype) -> int:
    from nimblejax.compiler import dtypes

    return INT_BITS[dtypes.name(dtype)]


def _int_unary(prim: str, dtype) -> str | None:
    bits = _bits(dtype)
    mask = f"0x{(1 << bits) - 1:x}u"
    if prim == "population_count":
        return f"__popc((unsigned int){{a}} & {mask})"
    if prim == "clz":
        return f"(__clz((unsigned int){{a}} & {mask}) - {32 - bits})"
    return None


def _int_shift(prim: str, dtype, cls: str) -> str | None:
    bits = _bits(dtype)
    if prim == "shift_right_logical":
        mask = f"0x{(1 << bits) - 1:x}u"
        ctype = "unsigned int" if cls == "uint" else "int"
        return (f"((unsigned int){{b}} < {bits}u ? "
                f"({ctype})(((unsigned int){{a}} & {mask}) >> {{b}}) : 0)")
    if prim == "shift_right_arithmetic" and cls == "uint":
        # XLA shifts the bits of an unsigned type arithmetically too (0x80u8 >> 1 = 0xc0).
        signed = f"(int)({_SIGNED_STORAGE[bits]}){{a}}"
        return f"(unsigned int)({signed} >> ({{b}} < {bits}u ? {{b}} : {bits - 1}u))"
    return None


def unary_template(prim: str, dtype, params) -> str:
    if operand_class(dtype) in ("int", "uint"):
        special = _int_unary(prim, dtype)
        if special is not None:
            return special
    if prim == "round" and operand_class(dtype) == "float":
        # rounding_method 0: away from zero (roundf); 1: to nearest even (rintf).
        return "rintf({a})" if int(params.get("rounding_method", 0)) == 1 else "roundf({a})"
    if prim in EXPANDED and operand_class(dtype) == "float":
        return _expansion(prim, dtype)
    table = UNARY[operand_class(dtype)]
    if prim not in table:
        raise NotImplementedError(f"{prim} is not supported for {dtype}")
    return table[prim]


def binary_template(prim: str, dtype) -> str:
    if prim in COMPARE:
        return COMPARE[prim]
    cls = operand_class(dtype)
    if cls in ("int", "uint"):
        special = _int_shift(prim, dtype, cls)
        if special is not None:
            return special
    table = BINARY[cls]
    if prim not in table:
        raise NotImplementedError(f"{prim} is not supported for {dtype}")
    return table[prim]

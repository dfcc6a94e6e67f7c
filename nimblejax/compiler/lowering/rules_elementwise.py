"""Fusible rules: each computes a node's output at one index inside a fused kernel."""
from __future__ import annotations

import numpy as np

from nimblejax.compiler.ir import Literal, Node
from nimblejax.compiler import dtypes
from nimblejax.compiler.kinds import RuleKind
from nimblejax.compiler.lowering.codegen import Index, KernelBuilder, operand_index
from nimblejax.compiler.lowering.elementwise import (BINARY_NAMES, UNARY_NAMES, binary_template,
                                            unary_template, _FMAX, _FMIN)
from nimblejax.compiler.lowering.registry import UnsupportedPrimitiveError, register


def _result(b: KernelBuilder, node: Node, expr: str) -> str:
    out = node.outputs[0]
    value = wrap_int(out.dtype, dtypes.round_to(out.dtype, expr))
    return b.tmp(dtypes.compute_type(out.dtype), value)


_NARROW_INTS = ("int8", "uint8", "int16", "uint16")


def wrap_int(dtype, expr: str) -> str:
    """8- and 16-bit integers are computed in 32 bits: wrap each result to its own width
    (as XLA's arithmetic does), so fused consumers see the stored value."""
    if dtypes.name(dtype) not in _NARROW_INTS:
        return expr
    return f"({dtypes.compute_type(dtype)})({dtypes.storage_type(dtype)})({expr})"


@register(*sorted(UNARY_NAMES), kind=RuleKind.ELEMENTWISE)
def unary(b: KernelBuilder, node: Node, idx: Index) -> str:
    x = node.inputs[0]
    a = b.value(x, idx)
    return _result(b, node, unary_template(node.name, x.dtype, node.params).format(a=a))


@register(*sorted(BINARY_NAMES), kind=RuleKind.ELEMENTWISE)
def binary(b: KernelBuilder, node: Node, idx: Index) -> str:
    x, y = node.inputs
    a, c = b.value(x, idx), b.value(y, idx)
    if node.name == "nextafter" and dtypes.is_half(x.dtype):
        return _half_nextafter(b, x.dtype, a, c)
    return _result(b, node, binary_template(node.name, x.dtype).format(a=a, b=c))


_TOTAL_ORDER = {"eq_to": "==", "le_to": "<=", "lt_to": "<"}


@register(*_TOTAL_ORDER, kind=RuleKind.ELEMENTWISE)
def total_order_compare(b: KernelBuilder, node: Node, idx: Index) -> str:
    """Comparisons in XLA's total order (jnp.searchsorted's `le_to`): -NaN < -inf < ... <
    -0 < +0 < ... < inf < +NaN. A float compares by its bits read as sign and magnitude:
    the magnitude bits flipped where the sign is set, as a signed integer. Half types use
    their own 16 bits, read from memory where the operand is a buffer (converting a half
    NaN to float on the GPU drops its sign). Integers compare by value."""
    x, y = node.inputs
    if dtypes.is_float(x.dtype):
        width = 16 if dtypes.is_half(x.dtype) else 32
        u, w = (b.tmp("int", _signed_bits(b, v, idx, width)) for v in (x, y))
        mask = "0x7fff" if width == 16 else "0x7fffffff"
        a, c = (f"({v} ^ (({v} >> 31) & {mask}))" for v in (u, w))
    else:
        a, c = b.value(x, idx), b.value(y, idx)
    return b.tmp("bool", f"({a} {_TOTAL_ORDER[node.name]} {c})")


def _signed_bits(b: KernelBuilder, atom, idx: Index, width: int) -> str:
    """The bits of `atom` at `idx` as a signed int (16-bit patterns sign-extended)."""
    if width == 32:
        return f"__float_as_int({b.value(atom, idx)})"
    if isinstance(atom, Literal):
        return str(int(np.asarray(atom.value).astype(atom.dtype).view(np.int16)))
    if atom in b.inlined:  # computed in float here: its half's bits
        return f"(int)(short){_HALF_BITS[dtypes.name(atom.dtype)][0].format(b.value(atom, idx))}"
    idx = operand_index(atom, idx)  # as KernelBuilder.value reads it
    return f"(int)((const short*){b.input(atom)})[{b.linear(idx, atom.shape)}]"


# bits of a half type, and back (cuda_fp16.h, cuda_bf16.h).
_HALF_BITS = {"float16": ("__half_as_ushort(__float2half_rn({}))",
                          "__half2float(__ushort_as_half({}))"),
              "bfloat16": ("__bfloat16_as_ushort(__float2bfloat16_rn({}))",
                           "__bfloat162float(__ushort_as_bfloat16({}))")}


def _half_nextafter(b: KernelBuilder, dtype, a: str, c: str) -> str:
    """nextafter steps one ulp of the half type itself (nextafterf would step a float
    ulp, which rounds back to the same half): one step of the 16-bit pattern."""
    to_bits, from_bits = _HALF_BITS[dtypes.name(dtype)]
    r = b.tmp("float", a)
    b.open(f"if ({a} != {a} || {c} != {c})")
    b.emit(f"{r} = {a} + {c};")
    b.close()
    b.open(f"else if ({a} == {c})")
    b.emit(f"{r} = {c};")
    b.close()
    b.open("else")
    bits = b.tmp("unsigned short", to_bits.format(a))
    b.emit(f"if ({a} == 0.0f) {bits} = {c} < 0.0f ? 0x8001 : 0x0001;")
    b.emit(f"else if (({a} < {c}) == ({a} > 0.0f)) {bits} += 1; else {bits} -= 1;")
    b.emit(f"{r} = {from_bits.format(bits)};")
    b.close()
    return r


@register("integer_pow", kind=RuleKind.ELEMENTWISE)
def integer_pow(b: KernelBuilder, node: Node, idx: Index) -> str:
    # Same multiplication order as JAX's lowering (square-and-multiply), so half
    # types round at the same steps.
    x = b.value(node.inputs[0], idx)
    y = int(node.params["y"])
    out = node.outputs[0]
    if y == 0:
        return dtypes.literal(1, out.dtype)
    reciprocal, y = y < 0, abs(y)
    mul = binary_template("mul", out.dtype)
    acc = None
    while y > 0:
        if y & 1:
            acc = x if acc is None else _result(b, node, mul.format(a=acc, b=x))
        y >>= 1
        if y > 0:
            x = _result(b, node, mul.format(a=x, b=x))
    if reciprocal:
        acc = _result(b, node, f"({dtypes.literal(1, out.dtype)} / {acc})")
    return acc


@register("convert_element_type", kind=RuleKind.ELEMENTWISE)
def convert(b: KernelBuilder, node: Node, idx: Index) -> str:
    src, dst = node.inputs[0].dtype, node.outputs[0].dtype
    a = b.value(node.inputs[0], idx)
    ctype = dtypes.compute_type(dst)
    return b.tmp(ctype, convert_expr(a, src, dst))


def convert_expr(a: str, src, dst) -> str:
    if dtypes.name(dst) == "bool":
        return f"({a} != 0)"
    if dtypes.name(src) == "bool":
        return f"({a} ? {dtypes.literal(1, dst)} : {dtypes.literal(0, dst)})"
    if dtypes.is_float(dst):
        return dtypes.round_to(dst, f"(float){a}")
    ctype = dtypes.compute_type(dst)
    if dtypes.is_float(src):
        # XLA saturates out-of-range floats and maps NaN to 0; a plain C cast is UB.
        lo, hi = dtypes.lowest(dst), dtypes.highest(dst)
        return (f"({a} != {a} ? ({ctype})0 : ({a} <= (float){lo} ? {lo} : "
                f"({a} >= (float){hi} ? {hi} : ({ctype}){a})))")
    return wrap_int(dst, f"({ctype}){a}")  # integer to integer: wraps to dst's width


@register("reduce_precision", kind=RuleKind.ELEMENTWISE)
def reduce_precision(b: KernelBuilder, node: Node, idx: Index) -> str:
    bits = (int(node.params["exponent_bits"]), int(node.params["mantissa_bits"]))
    target = {(8, 7): "bfloat16", (5, 10): "float16", (8, 23): "float32"}.get(bits)
    if target is None:
        raise NotImplementedError(f"reduce_precision to {bits} (exponent, mantissa) bits "
                                  f"is not supported (from {node.source})")
    return _result(b, node, dtypes.round_to(target, b.value(node.inputs[0], idx)))


@register("select_n", kind=RuleKind.ELEMENTWISE)
def select_n(b: KernelBuilder, node: Node, idx: Index) -> str:
    which, *cases = node.inputs
    w = b.value(which, idx)
    vals = [b.value(c, idx) for c in cases]
    if dtypes.name(which.dtype) == "bool":
        expr = f"({w} ? {vals[1]} : {vals[0]})" if len(vals) == 2 else vals[0]
    else:
        expr = vals[-1]
        for i in range(len(vals) - 2, -1, -1):
            expr = f"({w} == {i} ? {vals[i]} : {expr})"
    return b.tmp(dtypes.compute_type(node.outputs[0].dtype), expr)


@register("clamp", kind=RuleKind.ELEMENTWISE)
def clamp(b: KernelBuilder, node: Node, idx: Index) -> str:
    lo, x, hi = (b.value(a, idx) for a in node.inputs)
    if dtypes.is_float(node.outputs[0].dtype):
        inner = b.tmp("float", _FMAX.format(a=x, b=lo))
        return b.tmp("float", _FMIN.format(a=inner, b=hi))
    return b.tmp(dtypes.compute_type(node.outputs[0].dtype), f"min(max({x}, {lo}), {hi})")


@register("iota", kind=RuleKind.ELEMENTWISE)
def iota(b: KernelBuilder, node: Node, idx: Index) -> str:
    out = node.outputs[0]
    i = idx[int(node.params["dimension"])]
    return b.tmp(dtypes.compute_type(out.dtype), convert_expr(i, "int32", out.dtype))


# ---- index-only rules: they rewrite the index and read the operand there --------
@register("broadcast_in_dim", kind=RuleKind.ELEMENTWISE)
def broadcast_in_dim(b: KernelBuilder, node: Node, idx: Index) -> str:
    x = node.inputs[0]
    dims = node.params["broadcast_dimensions"]
    src = tuple("0" if x.shape[j] == 1 else idx[d] for j, d in enumerate(dims))
    return b.value(x, src)


@register("reshape", kind=RuleKind.ELEMENTWISE)
def reshape(b: KernelBuilder, node: Node, idx: Index) -> str:
    x, out = node.inputs[0], node.outputs[0]
    offset = b.linear(idx, out.shape) if idx else "0"
    flat = offset if offset.isidentifier() else b.tmp(
        "long long" if out.size >= 2 ** 31 else "int", offset)
    perm = node.params.get("dimensions")
    if perm is None:
        return b.value(x, b.index_vars(flat, x.shape))
    # reshape(x, dimensions=perm) reads x in the order of transpose(x, perm).
    t_idx = b.index_vars(flat, [x.shape[p] for p in perm])
    src = [""] * x.ndim
    for d, p in enumerate(perm):
        src[p] = t_idx[d]
    return b.value(x, tuple(src))


@register("squeeze", kind=RuleKind.ELEMENTWISE)
def squeeze(b: KernelBuilder, node: Node, idx: Index) -> str:
    x = node.inputs[0]
    dims = {d % x.ndim for d in node.params["dimensions"]}
    it = iter(idx)
    return b.value(x, tuple("0" if d in dims else next(it) for d in range(x.ndim)))


@register("transpose", kind=RuleKind.ELEMENTWISE)
def transpose(b: KernelBuilder, node: Node, idx: Index) -> str:
    perm = node.params["permutation"]
    src = [""] * len(perm)
    for d, p in enumerate(perm):
        src[p] = idx[d]
    return b.value(node.inputs[0], tuple(src))


@register("slice", kind=RuleKind.ELEMENTWISE)
def slice_(b: KernelBuilder, node: Node, idx: Index) -> str:
    starts = node.params["start_indices"]
    strides = node.params.get("strides") or (1,) * len(starts)
    src = tuple(b.picked_index(node, d, int(s)) if i == "0" else _affine(i, int(s), int(st))
                for d, (i, s, st) in enumerate(zip(idx, starts, strides)))
    return b.value(node.inputs[0], src)


@register("rev", kind=RuleKind.ELEMENTWISE)
def rev(b: KernelBuilder, node: Node, idx: Index) -> str:
    x = node.inputs[0]
    dims = set(node.params["dimensions"])
    src = tuple(f"({x.shape[d] - 1} - {i})" if d in dims else i for d, i in enumerate(idx))
    return b.value(x, src)


def _affine(i: str, start: int, stride: int) -> str:
    """start + i·stride, i an index name (slice_ gives an index of "0" to picked_index)."""
    term = i if stride == 1 else f"{i} * {stride}"
    return term if start == 0 else f"({start} + {term})"


# bitcast_convert_type between types of one width (jax.random turns bits into floats
# with it). Values are in their compute type: halves go through their 16-bit pattern,
# narrow ints through their storage type so the sign is reinterpreted, not kept.
_TO_BITS = {"float32": "__float_as_uint({})", "float16": _HALF_BITS["float16"][0],
            "bfloat16": _HALF_BITS["bfloat16"][0]}
_FROM_BITS = {"float32": "__uint_as_float({})", "float16": _HALF_BITS["float16"][1],
              "bfloat16": _HALF_BITS["bfloat16"][1]}


@register("bitcast_convert_type", kind=RuleKind.ELEMENTWISE)
def bitcast_convert_type(b: KernelBuilder, node: Node, idx: Index) -> str:
    x, out = node.inputs[0], node.outputs[0]
    src, dst = dtypes.name(x.dtype), dtypes.name(out.dtype)
    if x.dtype.itemsize != out.dtype.itemsize or "bool" in (src, dst):
        raise UnsupportedPrimitiveError(
            f"nimblejax supports bitcast_convert_type only between types of one width, not "
            f"{src} → {dst} (from {node.source}). Use nimble.jit(..., backend=\"jax\").")
    bits = {4: "unsigned int", 2: "unsigned short", 1: "unsigned char"}[x.dtype.itemsize]
    v = b.value(x, idx)
    raw = _TO_BITS[src].format(v) if src in _TO_BITS else f"({bits})({v})"
    raw = b.tmp(bits, raw)
    if dst in _FROM_BITS:
        return b.tmp("float", _FROM_BITS[dst].format(raw))
    return b.tmp(dtypes.compute_type(out.dtype), f"({dtypes.storage_type(out.dtype)}){raw}")

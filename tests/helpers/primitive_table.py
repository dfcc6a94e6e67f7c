"""Every primitive with a lowering rule, with a function that emits it and reference
inputs (random, never zeros). test_primitives.py checks each record against jax.jit
and a meta-test fails when a registered rule has no record here."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from tests.helpers import on_host


@dataclass(frozen=True)
class Record:
    primitive: str
    fn: Callable
    args: Callable[[np.random.Generator], tuple]
    label: str = ""

    @property
    def id(self) -> str:
        return f"{self.primitive}{'-' + self.label if self.label else ''}"


def f32(*shape, lo=-2.0, hi=2.0):
    return lambda r: on_host(r.uniform(lo, hi, shape), jnp.float32)


def dt(dtype, *shape, lo=-2.0, hi=2.0):
    return lambda r: on_host(r.uniform(lo, hi, shape), dtype)


def i32(*shape, lo=-50, hi=50):
    return lambda r: on_host(r.integers(lo, hi, shape), jnp.int32)


def u32(*shape):
    return lambda r: on_host(r.integers(0, 2 ** 32 - 1, shape, dtype=np.uint64), jnp.uint32)


def boolean(*shape):
    return lambda r: on_host(r.random(shape) > 0.5, bool)


def args(*makers):
    return lambda r: tuple(m(r) for m in makers)


RECORDS: list[Record] = []


def rec(prim, fn, *makers, label=""):
    RECORDS.append(Record(prim, fn, args(*makers), label))


# ---- unary float -------------------------------------------------------------------
UNARY_FLOAT = {
    "neg": lax.neg, "abs": lax.abs, "sign": lax.sign, "floor": lax.floor, "ceil": lax.ceil,
    "exp": lax.exp, "exp2": lax.exp2, "log": lax.log, "log1p": lax.log1p, "expm1": lax.expm1,
    "sqrt": lax.sqrt, "rsqrt": lax.rsqrt, "cbrt": lax.cbrt, "sin": lax.sin, "cos": lax.cos,
    "tan": lax.tan, "asin": lax.asin, "acos": lax.acos, "atan": lax.atan, "sinh": lax.sinh,
    "cosh": lax.cosh, "tanh": lax.tanh, "asinh": lax.asinh, "acosh": lax.acosh,
    "atanh": lax.atanh, "logistic": lax.logistic, "erf": lax.erf, "erfc": lax.erfc,
    "erf_inv": lax.erf_inv, "lgamma": lax.lgamma, "square": lax.square,
    "is_finite": lax.is_finite,
}
DOMAIN = {"log": (0.1, 4), "log1p": (-0.5, 3), "sqrt": (0.1, 4), "rsqrt": (0.1, 4),
          "asin": (-0.9, 0.9), "acos": (-0.9, 0.9), "acosh": (1.1, 4), "atanh": (-0.9, 0.9),
          "erf_inv": (-0.9, 0.9), "lgamma": (0.5, 4)}
for name, op in UNARY_FLOAT.items():
    lo, hi = DOMAIN.get(name, (-2.0, 2.0))
    rec(name, op, f32(5, 7, lo=lo, hi=hi))
for name in ("exp", "tanh", "neg", "sqrt"):
    lo, hi = DOMAIN.get(name, (-2.0, 2.0))
    rec(name, UNARY_FLOAT[name], dt(jnp.bfloat16, 33, lo=lo, hi=hi), label="bf16")
    rec(name, UNARY_FLOAT[name], dt(jnp.float16, 33, lo=lo, hi=hi), label="f16")
rec("round", lambda x: lax.round(x, lax.RoundingMethod.AWAY_FROM_ZERO), f32(40, lo=-5, hi=5))
rec("round", lambda x: lax.round(x, lax.RoundingMethod.TO_NEAREST_EVEN), f32(40, lo=-5, hi=5),
    label="even")
rec("copy", lambda x: lax.copy_p.bind(x), f32(6))
# log2 is a primitive from jax 0.11 (lax.log2); before, jnp.log2 is log(x) / log(2), so on
# older versions the record runs that instead. tests/compiler/test_newer_jax_primitives.py
# checks the rule's kernel with a stand-in primitive of the same name.
LOG2 = getattr(lax, "log2", jnp.log2)
rec("log2", LOG2, f32(5, 7, lo=0.05, hi=40), label="since-0.11")
rec("log2", LOG2, dt(jnp.bfloat16, 33, lo=0.1, hi=8), label="since-0.11-bf16")
rec("log2", LOG2, dt(jnp.float16, 33, lo=0.1, hi=8), label="since-0.11-f16")
rec("log2", jax.grad(lambda x: jnp.sum(LOG2(x) * x)), f32(9, lo=0.5, hi=3), label="since-0.11-grad")
# jax >= 0.11 only (the tanh derivative); older versions emit sub/mul instead.
rec("one_minus_square", jax.grad(lambda x: jnp.sum(jnp.tanh(x))), f32(8), label="since-0.11")
# ---- unary int / bool ------------------------------------------------------------
rec("neg", lax.neg, i32(9), label="i32")
rec("abs", lax.abs, i32(9), label="i32")
rec("sign", lax.sign, i32(9), label="i32")
rec("not", lax.bitwise_not, i32(9), label="i32")
rec("not", lax.bitwise_not, boolean(9), label="bool")
rec("population_count", lax.population_count, i32(9, lo=0, hi=1 << 30))
rec("clz", lax.clz, i32(9, lo=1, hi=1 << 30))
# ---- binary ----------------------------------------------------------------------
BINARY = {"add": lax.add, "sub": lax.sub, "mul": lax.mul, "div": lax.div, "rem": lax.rem,
          "max": lax.max, "min": lax.min, "atan2": lax.atan2, "nextafter": lax.nextafter,
          "pow": lax.pow}
for name, op in BINARY.items():
    lo = 0.2 if name in ("pow", "div", "rem") else -2.0
    rec(name, op, f32(4, 6, lo=lo), f32(4, 6, lo=lo))
for name in ("add", "mul", "max", "div"):
    rec(name, BINARY[name], dt(jnp.bfloat16, 17, lo=0.5), dt(jnp.bfloat16, 17, lo=0.5), label="bf16")
for name in ("add", "sub", "mul", "max", "min"):
    rec(name, BINARY[name], i32(8), i32(8), label="i32")
rec("div", lax.div, i32(8), i32(8, lo=1, hi=9), label="i32")
rec("rem", lax.rem, i32(8), i32(8, lo=1, hi=9), label="i32")
rec("add", lax.add, u32(8), u32(8), label="u32")
for name, op in {"and": lax.bitwise_and, "or": lax.bitwise_or, "xor": lax.bitwise_xor}.items():
    rec(name, op, i32(8), i32(8), label="i32")
    rec(name, op, boolean(8), boolean(8), label="bool")
for name, op in {"shift_left": lax.shift_left, "shift_right_arithmetic": lax.shift_right_arithmetic,
                 "shift_right_logical": lax.shift_right_logical}.items():
    rec(name, op, i32(8), i32(8, lo=0, hi=40))
for name, op in {"eq": lax.eq, "ne": lax.ne, "lt": lax.lt, "le": lax.le, "gt": lax.gt,
                 "ge": lax.ge}.items():
    rec(name, op, f32(12), f32(12))
    rec(name, op, i32(12, lo=-3, hi=3), i32(12, lo=-3, hi=3), label="i32")
rec("add_any", lambda x: jax.grad(lambda y: jnp.sum(jnp.sin(y) * y))(x), f32(7))
rec("select_n", lambda p, a, b: lax.select_n(p, a, b), boolean(10), f32(10), f32(10))
rec("select_n", lambda i, a, b, c: lax.select_n(i, a, b, c), i32(10, lo=0, hi=3), f32(10), f32(10),
    f32(10), label="int")
rec("clamp", lambda x: lax.clamp(-0.5, x, 0.7), f32(20))
rec("clamp", lambda x: lax.clamp(-3, x, 4), i32(20), label="i32")
rec("integer_pow", lambda x: lax.integer_pow(x, 5), f32(11))
rec("integer_pow", lambda x: lax.integer_pow(x, -3), f32(11, lo=0.5), label="neg")
rec("integer_pow", lambda x: lax.integer_pow(x, 3), dt(jnp.bfloat16, 11), label="bf16")
rec("pow", lambda x: x ** 2.5, f32(11, lo=0.1), label="scalar")
# ---- conversions -----------------------------------------------------------------
rec("convert_element_type", lambda x: x.astype(jnp.bfloat16), f32(9))
rec("convert_element_type", lambda x: x.astype(jnp.int32), f32(9, lo=-100, hi=100), label="f2i")
rec("convert_element_type", lambda x: x.astype(jnp.float16), i32(9), label="i2h")
rec("convert_element_type", lambda x: x.astype(jnp.float32), boolean(9), label="b2f")
rec("convert_element_type", lambda x: x.astype(bool), f32(9), label="f2b")
rec("reduce_precision", lambda x: lax.reduce_precision(x, 8, 7), f32(9))
# ---- shape and index ops -----------------------------------------------------------
rec("broadcast_in_dim", lambda x: lax.broadcast_in_dim(x, (3, 4, 5), (0, 2)) + 1.0, f32(3, 5))
rec("reshape", lambda x: jnp.sin(x).reshape(6, 4) * 2.0, f32(4, 6))
rec("reshape", lambda x: x.reshape(6, 4), f32(4, 6), label="view")
rec("squeeze", lambda x: jnp.cos(lax.squeeze(x, (1,))), f32(4, 1, 6))
rec("transpose", lambda x: jnp.transpose(x, (2, 0, 1)) * 3.0, f32(2, 3, 4))
rec("slice", lambda x: lax.slice(x, (1, 0), (6, 8), (2, 3)), f32(7, 9))
rec("rev", lambda x: lax.rev(x, (0,)), f32(5, 3))
rec("iota", lambda x: x + lax.broadcasted_iota(jnp.float32, (4, 5), 1), f32(4, 5))
rec("iota", lambda x: x + lax.iota(jnp.int32, 6), i32(6), label="i32")
rec("concatenate", lambda a, b: jnp.concatenate([a, b, a], axis=1), f32(3, 2), f32(3, 5))
# stack, unstack and tile have no rule: canonicalize/stacking.py rewrites them into
# reshapes, slices, broadcasts and a concatenate.
rec("stack", lambda a, b: jnp.stack([a, b, a]), f32(3, 5), f32(3, 5))
rec("stack", lambda a, b: jnp.stack([a, b], axis=1) * 2.0, f32(3, 5), f32(3, 5), label="axis1")
rec("stack", lambda a, b, c: jnp.stack([a, b, c], axis=-1), i32(4, 3), i32(4, 3), i32(4, 3), label="i32-last")
rec("stack", lambda a, b: jnp.stack([a, b], axis=1), boolean(6, 2), boolean(6, 2), label="bool")
rec("stack", lambda a, b: jnp.stack([a, b]), dt(jnp.bfloat16, 7), dt(jnp.bfloat16, 7), label="bf16")
rec("stack", lambda x: jnp.stack([x[0, 0], 2.5, x[1, 1]]), f32(2, 2), label="scalars-literal")
rec("stack", lambda x: jnp.stack([x]), u32(5), label="one")
rec("stack", jax.grad(lambda a, b: jnp.sum(jnp.stack([a, b * b], axis=1) ** 2 * jnp.arange(2.0)[:, None]),
                      argnums=(0, 1)), f32(3, 4), f32(3, 4), label="grad")
rec("unstack", lambda x: jnp.unstack(x), f32(3, 5))
rec("unstack", lambda x: [y * 2.0 for y in jnp.unstack(x, axis=1)], f32(4, 3, 2), label="axis1")
rec("unstack", lambda x: jnp.unstack(x, axis=-1)[2] + 1, i32(5, 4), label="i32-one-used")
rec("unstack", lambda x: jnp.unstack(x, axis=0), boolean(2, 6), label="bool")
rec("unstack", jax.grad(lambda x: sum(jnp.sum(y * (k + 1)) for k, y in enumerate(jnp.unstack(x, axis=1)))),
    f32(3, 4), label="grad")
rec("tile", lambda x: jnp.tile(x, (2, 3)), f32(3, 4))
rec("tile", lambda x: jnp.tile(x, (2, 1, 3)) + 1, i32(2, 5), label="i32-rank-up")
rec("tile", lambda x: lax.tile(x, (1, 2)), boolean(3, 2), label="bool")
rec("tile", jax.grad(lambda x: jnp.sum(jnp.tile(x, (3, 2)) ** 2)), f32(2, 3), label="grad")
rec("pad", lambda x: lax.pad(x, 1.5, ((1, 2, 0), (-1, 1, 2))), f32(4, 5))
rec("dynamic_slice", lambda x, i: lax.dynamic_slice(x, (i, 2), (3, 4)), f32(6, 7),
    lambda r: jnp.int32(r.integers(0, 8)))
rec("dynamic_update_slice", lambda x, u, i: lax.dynamic_update_slice(x, u, (i, 1)), f32(6, 7),
    f32(2, 3), lambda r: jnp.int32(r.integers(-2, 8)))
# ---- reductions and scans ----------------------------------------------------------
rec("reduce_sum", lambda x: jnp.sum(x, axis=1), f32(6, 50, 3))
rec("reduce_sum", lambda x: jnp.sum(x), f32(5000), label="full")
rec("reduce_sum", lambda x: jnp.sum(x, axis=-1), dt(jnp.bfloat16, 4, 40), label="bf16")
rec("reduce_sum", lambda x: jnp.sum(x, axis=0), i32(30, 3), label="i32")
rec("reduce_max", lambda x: jnp.max(x, axis=(0, 2)), f32(6, 5, 7))
rec("reduce_max", lambda x: jnp.max(x, axis=0), i32(6, 5), label="i32")
rec("reduce_min", lambda x: jnp.min(x, axis=-1), f32(6, 37))
rec("reduce_prod", lambda x: jnp.prod(x, axis=-1), f32(4, 9, lo=0.5, hi=1.5))
rec("reduce_or", lambda x: jnp.any(x > 1.0, axis=-1), f32(6, 9))
rec("reduce_and", lambda x: jnp.all(x > -1.5, axis=-1), f32(6, 9))
I32_ALL = {"lo": -2**31, "hi": 2**31 - 1}  # every int32 bit pattern
rec("reduce_xor", lambda x: jnp.bitwise_xor.reduce(x, axis=1), i32(6, 40, 3, **I32_ALL))
rec("reduce_xor", lambda x: jnp.bitwise_xor.reduce(x, axis=(0, 1)), i32(30, 7, 2, **I32_ALL),
    label="i32-axes")
rec("reduce_xor", lambda x: jnp.bitwise_xor.reduce(x), i32(3000, **I32_ALL), label="i32-full")
rec("reduce_xor", lambda x: (x ^ jnp.bitwise_xor.reduce(x, axis=-1, keepdims=True)) + 1,
    i32(6, 300, **I32_ALL), label="i32-row")
rec("reduce_xor", lambda x: jnp.bitwise_xor.reduce(x, axis=0), dt(jnp.int8, 33, 5, lo=-128, hi=127),
    label="i8")
rec("reduce_xor", lambda x: jnp.logical_xor.reduce(x, axis=-1), boolean(5, 33), label="bool")
rec("reduce_xor", lambda x: jnp.logical_xor.reduce(x > 0.5, axis=(0, 2)), f32(6, 5, 70),
    label="bool-axes")
rec("reduce_xor", lambda x: jnp.logical_xor.reduce(x > 0.0), f32(4, 1000), label="bool-full")
rec("argmax", lambda x: jnp.argmax(x, axis=1), f32(5, 70))
rec("argmin", lambda x: jnp.argmin(x, axis=0), f32(70, 5))
rec("cumsum", lambda x: jnp.cumsum(x, axis=1), f32(3, 20))
rec("cumsum", lambda x: lax.cumsum(x, axis=0, reverse=True), f32(9, 4), label="reverse")
rec("cumprod", lambda x: jnp.cumprod(x, axis=0), f32(9, 4, lo=0.5, hi=1.5))
rec("cummax", lambda x: lax.cummax(x, axis=0), f32(9, 4))
rec("cummin", lambda x: lax.cummin(x, axis=1), f32(4, 9))
# ---- matrix products ----------------------------------------------------------------
rec("dot_general", lambda a, b: a @ b, f32(5, 7), f32(7, 3))
rec("dot_general", lambda a, b: jnp.einsum("bij,bkj->bik", a, b), f32(2, 5, 7), f32(2, 4, 7),
    label="batched")
rec("dot_general", lambda a, b: jnp.einsum("ijb,jk->bik", a, b), f32(5, 7, 2), f32(7, 3),
    label="transposed")
rec("dot_general", lambda a, b: lax.dot(a, b, precision=lax.Precision.HIGHEST), f32(6, 8), f32(8, 4),
    label="highest")
rec("dot_general", lambda a, b: a @ b, dt(jnp.bfloat16, 6, 8), dt(jnp.bfloat16, 8, 4), label="bf16")
rec("dot_general", lambda a, b: a @ b, i32(4, 5, lo=-5, hi=5), i32(5, 3, lo=-5, hi=5), label="i32")
# ---- convolutions and pooling -------------------------------------------------------
NHWC = ("NHWC", "HWIO", "NHWC")
HIGHEST = lax.Precision.HIGHEST


def conv(x, w, strides=(1, 1), padding="SAME", **kw):
    return lax.conv_general_dilated(x, w, strides, padding, dimension_numbers=kw.pop("dn", NHWC), **kw)


rec("conv_general_dilated", lambda x, w: conv(x, w, (2, 2)), f32(2, 9, 9, 3), f32(3, 3, 3, 5), label="nhwc")
rec("conv_general_dilated", lambda x, w: conv(x, w, (1, 1), ((1, 0), (2, 1)), rhs_dilation=(2, 1),
                                              dn=("NCHW", "OIHW", "NCHW")),
    f32(2, 3, 9, 7), f32(5, 3, 3, 2), label="nchw-dilated")
rec("conv_general_dilated", lambda x, w: conv(x, w, padding="VALID"), f32(2, 5, 5, 8), f32(1, 1, 8, 6),
    label="1x1")
rec("conv_general_dilated", lambda x, w: conv(x, w, feature_group_count=2), f32(2, 6, 6, 4),
    f32(3, 3, 2, 6), label="grouped")
rec("conv_general_dilated", lambda x, w: conv(x, w, (2, 2), feature_group_count=4), f32(2, 7, 7, 4),
    f32(3, 3, 1, 8), label="depthwise")
rec("conv_general_dilated", lambda x, w: conv(x, w, padding=((2, 1), (2, 1)), lhs_dilation=(2, 2)),
    f32(2, 4, 4, 3), f32(3, 3, 3, 2), label="lhs-dilation")
rec("conv_general_dilated", lambda x, w: conv(x, w, (1, 1), "SAME"),
    dt(jnp.bfloat16, 2, 6, 6, 4), dt(jnp.bfloat16, 3, 3, 4, 4), label="bf16")
rec("conv_general_dilated", jax.grad(lambda x, w: jnp.sum(conv(x, w, (2, 2)) ** 2), argnums=(0, 1)),
    f32(2, 8, 8, 3), f32(3, 3, 3, 4), label="grad")
# Filter gradients (cuDNN's backward-filter call on the cuDNN path): symmetric padding,
# an explicit pad or crop where cuDNN's symmetric padding would change dy's size, dilation,
# another layout, bf16. The two with the longest sums (128 and 50 products per element)
# run in full float32: under TF32 both sides err by ~1% there, so only HIGHEST checks them.
for label, kw, xs, ws in [("same", {}, (2, 9, 9, 3), (3, 3, 3, 4)),
                          ("7x7-s2", dict(strides=(2, 2), precision=HIGHEST), (2, 16, 16, 3), (7, 7, 3, 4)),
                          ("pad-s2", dict(strides=(2, 2), padding=((1, 1), (1, 1))), (2, 8, 8, 3), (3, 3, 3, 4)),
                          ("dilated", dict(rhs_dilation=(2, 2)), (2, 9, 9, 3), (3, 3, 3, 4)),
                          ("1x1-s2", dict(strides=(2, 2)), (2, 9, 9, 3), (1, 1, 3, 4)),
                          ("valid", dict(padding="VALID", precision=HIGHEST), (2, 7, 7, 8), (3, 3, 8, 4)),
                          ("nchw", dict(padding=((1, 0), (2, 1)), rhs_dilation=(2, 1), dn=("NCHW", "OIHW", "NCHW")),
                           (2, 3, 9, 7), (5, 3, 3, 2))]:
    rec("conv_general_dilated", jax.grad(lambda x, w, kw=kw: jnp.sum(jnp.tanh(conv(x, w, **kw))), argnums=1),
        f32(*xs), f32(*ws), label=f"filter-grad-{label}")
# Input gradients of strided convolutions (cuDNN's backward-data call on the cuDNN path):
# "SAME" on an even size (cuDNN computes a row more, sliced off), odd, 7x7, 1x1 (TF32),
# VALID stride 3; 8 channels, the fewest that path takes. All but the 1x1 in full
# float32: each element sums a few products that nearly cancel, and TF32 errs by 1-4%
# there on both sides (seen on an H100).
for label, kw, xs, ws in [("s2-even", dict(strides=(2, 2), precision=HIGHEST), (2, 8, 8, 8), (3, 3, 8, 4)),
                          ("s2-odd", dict(strides=(2, 2), precision=HIGHEST), (2, 9, 9, 8), (3, 3, 8, 4)),
                          ("7x7-s2", dict(strides=(2, 2), precision=HIGHEST), (2, 16, 16, 8), (7, 7, 8, 4)),
                          ("1x1-s2", dict(strides=(2, 2)), (2, 8, 8, 8), (1, 1, 8, 4)),
                          ("valid-s3", dict(strides=(3, 3), padding="VALID", precision=HIGHEST), (2, 9, 9, 8), (3, 3, 8, 4))]:
    rec("conv_general_dilated", jax.grad(lambda x, w, kw=kw: jnp.sum(jnp.tanh(conv(x, w, **kw)))),
        f32(*xs), f32(*ws), label=f"data-grad-{label}")
for label, groups, ws in [("depthwise", 4, (3, 3, 1, 8)), ("grouped", 2, (3, 3, 2, 6))]:
    rec("conv_general_dilated", jax.grad(lambda x, w, g=groups: jnp.sum(jnp.tanh(conv(
        x, w, (2, 2), feature_group_count=g))), argnums=1), f32(2, 9, 9, 4), f32(*ws), label=f"filter-grad-{label}")
rec("conv_general_dilated", jax.grad(lambda x, w: jnp.sum(jnp.tanh(conv(x, w).astype(jnp.float32))), argnums=1),
    dt(jnp.bfloat16, 2, 6, 6, 4), dt(jnp.bfloat16, 3, 3, 4, 4), label="filter-grad-bf16")
rec("conv_general_dilated", jax.grad(lambda x, w: jnp.sum(conv(x, w, feature_group_count=4) ** 2),
                                     argnums=(0, 1)),
    f32(2, 6, 6, 4), f32(3, 3, 1, 4), label="grad-depthwise")
rec("conv_general_dilated", lambda x, w: lax.conv_general_dilated(
        x, w, (1,), "SAME", dimension_numbers=("NWC", "WIO", "NWC")), f32(2, 10, 3), f32(3, 3, 4),
    label="1d")
# nimble_im2col is nimblejax's own primitive: the GEMM path of a convolution emits it.
rec("nimble_im2col", lambda x, w: conv(x, w, (2, 1)), f32(1, 7, 6, 2), f32(2, 3, 2, 3), label="internal")
rec("reduce_window_max", lambda x: lax.reduce_window(x, -jnp.inf, lax.max, (1, 3, 3, 1), (1, 2, 2, 1),
                                                     "SAME"), f32(2, 9, 9, 3))
rec("reduce_window_min", lambda x: lax.reduce_window(x, jnp.inf, lax.min, (1, 2, 2, 1), (1, 2, 2, 1),
                                                     "VALID"), f32(2, 8, 8, 3))
rec("reduce_window_sum", lambda x: lax.reduce_window(x, 0.0, lax.add, (1, 3, 3, 1), (1, 1, 1, 1),
                                                     "SAME") / 9.0, f32(2, 7, 7, 3))
rec("reduce_window_sum", jax.grad(lambda x: jnp.sum(lax.reduce_window(x, 0.0, lax.add, (1, 3, 3, 1),
                                                                      (1, 2, 2, 1), "SAME") ** 2)),
    f32(2, 8, 8, 3), label="grad")
rec("select_and_scatter_add", jax.grad(lambda x: jnp.sum(lax.reduce_window(
    x, -jnp.inf, lax.max, (1, 3, 3, 1), (1, 2, 2, 1), "SAME") ** 2)), f32(2, 9, 9, 3))
rec("select_and_scatter_add", jax.grad(lambda x: jnp.sum(lax.reduce_window(
    x, -jnp.inf, lax.max, (1, 2, 2, 1), (1, 2, 2, 1), "VALID") * 3.0)), f32(2, 8, 8, 3), label="2x2")
# nimble_pool_select and nimble_pool_scatter are nimblejax's own: the max-pool gradient's
# rewrite (canonicalize/pool_grad.py) emits them; a min pool's gradient selects with `le`.
rec("nimble_pool_select", jax.grad(lambda x: jnp.sum(lax.reduce_window(
    x, jnp.inf, lax.min, (1, 3, 3, 1), (1, 2, 2, 1), "SAME") ** 2)), f32(2, 9, 9, 3), label="internal")
rec("nimble_pool_scatter", jax.grad(lambda x: jnp.sum(lax.reduce_window(
    x, -jnp.inf, lax.max, (3, 3), (1, 1), ((1, 1), (1, 1))) ** 2)), f32(7, 6), label="internal")
# nimble_cudnn_conv is emitted by the cuDNN rewrite (where cuDNN is installed, or with
# NIMBLE_CONV=cudnn; test_conv_paths_match_jax forces both paths).
rec("nimble_cudnn_conv", lambda x, w: conv(x, w, (2, 2)), f32(1, 7, 6, 2), f32(3, 3, 2, 3), label="internal")
rec("nimble_cudnn_conv_filter_grad", jax.grad(lambda x, w: jnp.sum(conv(x, w) ** 2), argnums=1),
    f32(2, 7, 6, 2), f32(3, 3, 2, 3), label="internal")
rec("nimble_cudnn_conv_data_grad", jax.grad(lambda x, w: jnp.sum(conv(x, w, (2, 2)) ** 2)),
    f32(2, 8, 6, 2), f32(3, 3, 2, 3), label="internal")
# nimble_while / nimble_switch are nimblejax's WHILE and SWITCH tasks, made only under
# loops="graph" (tests/compiler/test_loop_tasks.py runs them); under the default these
# records run through co-execution and a select.
rec("nimble_while", lambda x, n: lax.fori_loop(0, n, lambda i, x: jnp.sin(x) + x, x), f32(7),
    lambda r: jnp.int32(3), label="internal")
rec("nimble_switch", lambda i, x: lax.switch(i, [jnp.sin, jnp.cos], x), lambda r: jnp.int32(1),
    f32(5), label="internal")
# Long reductions with few outputs are split in two stages (lowering/split.py).
rec("reduce_sum", lambda x: jnp.sum(x * x, axis=(0, 1, 2)), f32(16, 32, 32, 8), label="split-column")
rec("reduce_max", lambda x: jnp.max(x, axis=-1), f32(3, 40000), label="split-row")

# bitcast_convert_type between types of one width (jax.random's bits → floats).
for src, dst, make in [("float32", "uint32", f32(5, 6, lo=-1e3, hi=1e3)), ("uint32", "float32", u32(40)),
                       ("float32", "int32", f32(9)), ("int32", "float32", i32(17, lo=-2**31, hi=2**31 - 1)),
                       ("int32", "uint32", i32(9, lo=-2**31, hi=2**31 - 1)), ("uint32", "int32", u32(9)),
                       ("float16", "uint16", dt(jnp.float16, 11)), ("uint16", "float16", dt(jnp.uint16, 13, lo=0, hi=30000)),
                       ("bfloat16", "int16", dt(jnp.bfloat16, 11)), ("int16", "bfloat16", dt(jnp.int16, 13, lo=-16000, hi=16000)),
                       ("int8", "uint8", dt(jnp.int8, 15, lo=-128, hi=127)), ("uint8", "int8", dt(jnp.uint8, 15, lo=0, hi=255))]:
    rec("bitcast_convert_type", lambda x, dst=dst: lax.bitcast_convert_type(x, dst) if dst.startswith(("u", "i"))
        else lax.bitcast_convert_type(x, dst) * 1.5, make, label=f"{src}-{dst}")

# Small dense linear algebra (lowering/rules_linalg.py; tests/compiler/lowering/
# test_linalg.py runs its kernels on the emulator and the GPU).
def spd(n, batch=()):
    def make(r):
        x = r.standard_normal((*batch, n, n)).astype(np.float32)
        return on_host(x @ np.swapaxes(x, -1, -2) + n * np.eye(n, dtype=np.float32), np.float32)
    return make


rec("cholesky", jnp.linalg.cholesky, spd(6, (2,)))
rec("triangular_solve", lambda a, b: jax.scipy.linalg.solve_triangular(a, b, lower=True),
    lambda r: jnp.tril(spd(5)(r)), f32(5, 3))
rec("lu", lambda a: lax.linalg.lu(a), f32(3, 6, 4))
rec("lu_pivots_to_permutation", lambda p: lax.linalg.lu_pivots_to_permutation(p, 7),
    lambda r: on_host(np.stack([r.integers(i, 7, 2) for i in range(5)], -1), jnp.int32))
# Comparisons in XLA's total order (jnp.searchsorted's le_to): signed zeros, both NaNs.
TOTAL = np.array([np.nan, -np.nan, -np.inf, np.inf, -0.0, 0.0, 1.0, -1.0, 2.5], np.float32)
for name, prim in (("eq_to", lax.eq_to_p), ("le_to", lax.le_to_p), ("lt_to", lax.lt_to_p)):
    rec(name, lambda x, y, prim=prim: prim.bind(x, y),
        lambda r: on_host(np.repeat(TOTAL, 9), np.float32),
        lambda r: on_host(np.tile(TOTAL, 9), np.float32))

# Records of the indexing, sorting, random-number and special-function rules live beside
# this file, one module per rule module; importing them appends to RECORDS.
from tests.helpers import records_indexing  # noqa: E402,F401
from tests.helpers import records_sort  # noqa: E402,F401
from tests.helpers import records_random  # noqa: E402,F401
from tests.helpers import records_special  # noqa: E402,F401

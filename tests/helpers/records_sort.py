"""Primitive records for rules_sort (see primitive_table.py), and for the shape ops and
scans next to them (split, pad, rev, concatenate, cumulative ops, argmin/argmax)."""
from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from tests.helpers import on_host
from tests.helpers.primitive_table import rec, f32, dt, i32, u32, boolean  # noqa: F401

SPECIALS = np.array([np.nan, -np.nan, np.inf, -np.inf, 0.0, -0.0], np.float32)


def special(dtype, *shape, lo=-2.0, hi=2.0):
    """Random floats with NaN (both signs), ±inf, ±0.0 and repeated values mixed in."""
    def make(r):
        x = r.uniform(lo, hi, shape).astype(np.float32)
        x = np.where(r.random(shape) < 0.3, np.round(x), x)  # ties
        picks = r.random(shape) < 0.25
        x = np.where(picks, SPECIALS[r.integers(0, len(SPECIALS), shape)], x)
        return on_host(x, dtype)
    return make


def ints(dtype, *shape, lo=-50, hi=50):
    return lambda r: on_host(r.integers(lo, hi, shape), dtype)


# ---- sort --------------------------------------------------------------------------
rec("sort", jnp.sort, f32(5, 37))
rec("sort", lambda x: jnp.sort(x, axis=0), f32(70, 3), label="axis0")
rec("sort", lambda x: jnp.sort(x, axis=1), f32(3, 9, 4), label="middle-axis")
rec("sort", jnp.sort, f32(6, 1), label="rows-of-1")
rec("sort", jnp.sort, f32(1), label="one-element")
rec("sort", jnp.sort, f32(3, 1500), label="row-1500")
rec("sort", jnp.sort, f32(2, 4096), label="row-4096")
rec("sort", jnp.sort, f32(2, 5000), label="row-5000-rank")
rec("sort", lambda x: jnp.sort(x, axis=0), f32(9000, 2), label="rank-axis0")
rec("sort", jnp.sort, special(jnp.float32, 4, 61), label="nan-inf-zeros")
rec("sort", jnp.sort, special(jnp.float32, 2, 6000), label="nan-rank")
rec("sort", jnp.sort, special(jnp.bfloat16, 3, 45), label="bf16")
rec("sort", jnp.sort, special(jnp.float16, 3, 45), label="f16")
for name, dtype in {"i8": jnp.int8, "i16": jnp.int16, "i32": jnp.int32, "u8": jnp.uint8,
                    "u16": jnp.uint16}.items():
    lo = 0 if name.startswith("u") else -100
    rec("sort", jnp.sort, ints(dtype, 4, 33, lo=lo, hi=100), label=name)
rec("sort", jnp.sort, u32(4, 33), label="u32")
rec("sort", jnp.sort, boolean(3, 30), label="bool")
rec("sort", lambda x: jnp.sort(x, descending=True), special(jnp.float32, 3, 20), label="descending")
# Multi-operand: keys move their payloads; ties keep their order (stable).
rec("sort", lambda k, a, b: lax.sort((k, a, b), num_keys=1, is_stable=True),
    i32(4, 50, lo=0, hi=6), f32(4, 50), dt(jnp.bfloat16, 4, 50), label="payloads-stable")
rec("sort", lambda k, a: lax.sort((k, a), num_keys=1, is_stable=True),
    special(jnp.float32, 3, 40), i32(3, 40), label="stable-nan-zero-ties")
rec("sort", lambda k1, k2, a: lax.sort((k1, k2, a), num_keys=2, is_stable=True),
    i32(3, 70, lo=0, hi=4), f32(3, 70, lo=0, hi=3), i32(3, 70), label="num-keys-2")
rec("sort", lambda k1, k2, a: lax.sort((k1, k2, a), dimension=0, num_keys=2, is_stable=True),
    dt(jnp.float16, 5000, 2, lo=0, hi=4), ints(jnp.uint8, 5000, 2, lo=0, hi=200), f32(5000, 2),
    label="num-keys-2-rank")
rec("sort", lambda k, a: lax.sort((k, a), num_keys=1), f32(6, 21), boolean(6, 21), label="unstable")
rec("sort", lambda x: jnp.argsort(x), i32(5, 40, lo=0, hi=5), label="argsort-ties")
rec("sort", lambda x: jnp.argsort(x, axis=0), special(jnp.float32, 31, 3), label="argsort-axis0")
rec("sort", lambda x: jnp.argsort(x, descending=True), f32(4, 2000), label="argsort-descending")
rec("sort", lambda x: jnp.argsort(x), f32(2, 4500), label="argsort-rank")
# ---- top_k -------------------------------------------------------------------------
rec("top_k", lambda x: lax.top_k(x, 5), f32(4, 37))
rec("top_k", lambda x: lax.top_k(x, 1), f32(7, 3), label="k1")
rec("top_k", lambda x: lax.top_k(x, 9), f32(3, 9), label="k-all")
rec("top_k", lambda x: lax.top_k(x, 4), special(jnp.float32, 5, 30), label="nan-inf-zeros")
rec("top_k", lambda x: lax.top_k(x, 4), special(jnp.bfloat16, 5, 30), label="bf16")
rec("top_k", lambda x: lax.top_k(x, 4), special(jnp.float16, 5, 30), label="f16")
rec("top_k", lambda x: lax.top_k(x, 6), i32(4, 40, lo=0, hi=8), label="i32-ties")
rec("top_k", lambda x: lax.top_k(x, 6), ints(jnp.uint8, 4, 40, lo=0, hi=250), label="u8")
rec("top_k", lambda x: lax.top_k(x, 3), u32(4, 40), label="u32")
rec("top_k", lambda x: lax.top_k(x, 8), f32(2, 50000), label="long-row")
rec("top_k", lambda x: lax.top_k(x, 5000), special(jnp.float32, 2, 6000), label="long-k")
rec("top_k", lambda x: jax.vmap(lambda r: lax.top_k(r, 3), in_axes=1, out_axes=1)(x), f32(20, 6),
    label="axis0")
# ---- scans -------------------------------------------------------------------------
rec("cumlogsumexp", lambda x: lax.cumlogsumexp(x, axis=1), f32(3, 20))
rec("cumlogsumexp", lambda x: lax.cumlogsumexp(x, axis=0, reverse=True), f32(9, 4), label="reverse")
# -inf terms after a finite first one (the outputs stay finite, so the comparison is tight).
rec("cumlogsumexp", lambda x: lax.cumlogsumexp(x, axis=1),
    lambda r: on_host(np.where((r.random((4, 12)) < 0.3) & (np.arange(12) > 0), -np.inf,
                               r.normal(size=(4, 12))), jnp.float32), label="neg-inf")
rec("cumlogsumexp", lambda x: lax.cumlogsumexp(x, axis=1), dt(jnp.bfloat16, 3, 16), label="bf16")
rec("cumsum", lambda x: jnp.cumsum(x, axis=1), i32(3, 20), label="i32")
rec("cumsum", lambda x: lax.cumsum(x, axis=1, reverse=True), i32(3, 20), label="i32-reverse")
rec("cumsum", lambda x: lax.cumsum(x, axis=0), u32(6, 3), label="u32")
rec("cumsum", lambda x: lax.cumsum(x, axis=1), dt(jnp.bfloat16, 3, 9), label="bf16")
rec("cumprod", lambda x: lax.cumprod(x, axis=1, reverse=True), i32(3, 8, lo=-3, hi=4), label="i32-reverse")
rec("cumprod", lambda x: lax.cumprod(x, axis=0, reverse=True), f32(9, 4, lo=0.5, hi=1.5), label="reverse")
rec("cummax", lambda x: lax.cummax(x, axis=1, reverse=True), i32(4, 9), label="i32-reverse")
rec("cummax", lambda x: lax.cummax(x, axis=0, reverse=True), f32(9, 4), label="reverse")
rec("cummin", lambda x: lax.cummin(x, axis=0), i32(9, 4), label="i32")
rec("cummin", lambda x: lax.cummin(x, axis=1, reverse=True), f32(4, 9), label="reverse")
rec("cummax", lambda x: lax.cummax(x, axis=1), ints(jnp.int8, 4, 9), label="i8")
# ---- argmin / argmax ---------------------------------------------------------------
ARG_DTYPES = {"f16": special(jnp.float16, 6, 45), "bf16": special(jnp.bfloat16, 6, 45),
              "f32-nan": special(jnp.float32, 6, 45), "i8": ints(jnp.int8, 6, 45),
              "i16": ints(jnp.int16, 6, 45), "i32": i32(6, 45, lo=-5, hi=5),
              "u8": ints(jnp.uint8, 6, 45, lo=0, hi=255), "u16": ints(jnp.uint16, 6, 45, lo=0, hi=9),
              "u32": u32(6, 45), "bool": boolean(6, 45)}
for label, maker in ARG_DTYPES.items():
    rec("argmax", lambda x: jnp.argmax(x, axis=1), maker, label=label)
    rec("argmin", lambda x: jnp.argmin(x, axis=0), maker, label=label)
rec("argmax", lambda x: jnp.argmax(x, axis=-1), f32(3, 5000), label="long")
rec("argmin", lambda x: jnp.argmin(x, axis=1), f32(4, 1, 3), label="length-1")
# Several NaNs a row: the index is the NaN XLA's GPU fusion keeps, which depends on the
# fusion XLA picks for the shape (nimblejax/compiler/lowering/xla_reduce_order.py).
rec("argmax", lambda x: jnp.argmax(x, axis=1), special(jnp.float32, 4, 300), label="nan-row-vec2")
rec("argmin", lambda x: jnp.argmin(x, axis=1), special(jnp.float16, 4, 300), label="nan-row-vec4")
rec("argmax", lambda x: jnp.argmax(x, axis=-1), special(jnp.bfloat16, 3, 5000),
    label="nan-row-10-warps")
rec("argmin", lambda x: jnp.argmin(x, axis=1), special(jnp.float32, 6, 32), label="nan-row-32")
rec("argmax", lambda x: jnp.argmax(x, axis=1), special(jnp.float16, 6, 64), label="nan-row-64")
rec("argmin", lambda x: jnp.argmin(x, axis=1), special(jnp.float32, 2, 33, 3), label="nan-loop")
rec("argmax", lambda x: jnp.argmax(x, axis=0), special(jnp.float32, 300, 2), label="nan-small-column")
rec("argmin", lambda x: jnp.argmin(x, axis=0), special(jnp.float32, 128, 6), label="nan-column")
rec("argmax", lambda x: jnp.argmax(x, axis=1), special(jnp.float32, 2, 20000), label="nan-split-row")
# ---- split, pad, rev, concatenate --------------------------------------------------
rec("split", lambda x: lax.split(x, (2, 5, 1), axis=1), f32(3, 8))
rec("split", lambda x: lax.split(x, (2, 0, 5), axis=0), i32(7, 3), label="empty-piece")
rec("split", jax.grad(lambda x, y: jnp.sum(jnp.concatenate([x, jnp.tanh(y), x * y], axis=-1) ** 2),
                      argnums=(0, 1)), f32(2, 3, 4), f32(2, 3, 4), label="concat-grad")
rec("pad", lambda x: lax.pad(x, 0.5, ((-2, -1, 1), (0, -3, 0))), f32(6, 7), label="negative")
rec("pad", lambda x: lax.pad(x, -1.0, ((1, 1, 2), (2, 0, 3))), f32(3, 4), label="interior")
rec("pad", lambda x: lax.pad(x, jnp.int32(7), ((0, 0, 0), (3, -2, 1))), i32(4, 5), label="i32")
rec("pad", lambda x: lax.pad(x, jnp.bfloat16(2), ((1, -1, 1),)), dt(jnp.bfloat16, 9), label="bf16")
rec("pad", lambda x: lax.pad(x, False, ((1, 2, 1), (0, 0, 0))), boolean(3, 4), label="bool")
rec("pad", jax.grad(lambda x: jnp.sum(lax.pad(x, 0.0, ((1, -1, 1), (-1, 2, 0))) ** 2)), f32(4, 5),
    label="grad")
rec("rev", lambda x: lax.rev(x, (0, 2)), f32(3, 4, 5), label="two-dims")
rec("rev", lambda x: lax.rev(x, (1,)), i32(4, 1), label="i32-length-1")
rec("rev", lambda x: lax.rev(x, (0,)), boolean(7), label="bool")
rec("concatenate", lambda *xs: jnp.concatenate(xs, axis=0), *[f32(k, 3) for k in range(1, 9)],
    label="eight")
rec("concatenate", lambda a, b: jnp.concatenate([a, jnp.zeros((3, 0), a.dtype), b], axis=1), f32(3, 2),
    f32(3, 5), label="empty-operand")
rec("concatenate", lambda a, b, c: jnp.concatenate([a, b, c], axis=1), f32(2, 1, 4), f32(2, 6, 4),
    f32(2, 3, 4), label="middle-axis")
rec("concatenate", lambda a, b: jnp.concatenate([a, b], axis=0), i32(2, 5), i32(3, 5), label="i32")
rec("concatenate", lambda a, b: jnp.concatenate([a, b]), boolean(4), boolean(3), label="bool")
rec("concatenate", lambda a, b: jnp.concatenate([a, b], axis=-1), dt(jnp.bfloat16, 3, 4),
    dt(jnp.bfloat16, 3, 2), label="bf16")

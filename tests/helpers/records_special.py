"""Primitive records for rules_special (see primitive_table.py), with inputs in the domains
JAX's own lax tests draw from (lax_test_util.lax_ops), and records of the integer and
half-precision corners of the elementwise family that those tests reach (8- and 16-bit
wrap-around, bit counts, shifts, nextafter of half types)."""
from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from tests.helpers import on_host
from tests.helpers.primitive_table import RECORDS, rec, f32, dt, i32, u32, boolean  # noqa: F401

_FIRST = len(RECORDS)  # this module's records are RECORDS[_FIRST:]

HALVES = {"bf16": jnp.bfloat16, "f16": jnp.float16}
INTS = {"i8": jnp.int8, "i16": jnp.int16, "i32": jnp.int32, "u8": jnp.uint8,
        "u16": jnp.uint16, "u32": jnp.uint32}


def normal(dtype, *shape, scale=3.0):
    return lambda r: on_host(r.normal(0.0, scale, shape), dtype)


def full_range(dtype, *shape):
    """Every bit pattern of an integer type equally likely."""
    info = np.iinfo(dtype)
    return lambda r: on_host(r.integers(info.min, info.max, shape, endpoint=True,
                                            dtype=np.int64), dtype)


def non_integers(*shape):
    """Positive and negative non-integers (digamma has poles at 0, -1, -2, ...)."""
    def make(r):
        x = r.uniform(-4.0, 6.0, shape)
        return on_host(np.where(np.abs(x - np.round(x)) < 0.05, x + 0.25, x), jnp.float32)
    return make


# ---- special functions -------------------------------------------------------------
rec("digamma", lax.digamma, f32(4, 9, lo=1.0, hi=3.0))
rec("digamma", lax.digamma, non_integers(5, 8), label="reflection")
rec("digamma", lambda x: lax.digamma(x * 7.0) + 1.0, f32(40, lo=0.01, hi=20.0), label="fused")
for label, dtype in HALVES.items():
    rec("digamma", lax.digamma, dt(dtype, 33, lo=1.0, hi=3.0), label=label)
    rec("zeta", lax.zeta, dt(dtype, 33, lo=1.5, hi=5.0), dt(dtype, 33, lo=0.1, hi=3.0), label=label)
    rec("polygamma", lambda x: lax.polygamma(jnp.ones_like(x), x), dt(dtype, 33, lo=0.5, hi=4.0),
        label=label)
    rec("bessel_i0e", lax.bessel_i0e, normal(dtype, 33), label=label)
    rec("bessel_i1e", lax.bessel_i1e, normal(dtype, 33), label=label)
    rec("regularized_incomplete_beta", lax.betainc, dt(dtype, 33, lo=0.05, hi=1.0),
        dt(dtype, 33, lo=0.05, hi=1.0), dt(dtype, 33, lo=0.0, hi=1.0), label=label)
rec("bessel_i0e", lax.bessel_i0e, normal(jnp.float32, 6, 7))
rec("zeta", lax.zeta, f32(5, 8, lo=1.0, hi=6.0), f32(5, 8, lo=0.05, hi=4.0))
rec("zeta", lambda x, q: lax.zeta(x * x + 1.5, q) * 2.0, f32(40, lo=-3.0, hi=3.0),
    f32(40, lo=-2.5, hi=30.0), label="fused")  # q < 0 too (x is not an integer there: NaN)
for m in range(4):  # polygamma(0, x) is digamma
    rec("polygamma", lambda x, m=m: lax.polygamma(jnp.full_like(x, m), x), non_integers(5, 8),
        label=f"m{m}")
rec("polygamma", lambda m, x: lax.polygamma(m, x) + 1.0, lambda r: on_host(
    r.integers(0, 4, 40), jnp.float32), f32(40, lo=0.1, hi=12.0), label="m-operand")
rec("polygamma", jax.grad(lambda x: lax.digamma(x).sum()), f32(6, 7, lo=0.2, hi=5.0),
    label="digamma-grad")  # digamma's derivative is polygamma(1, x)
rec("bessel_i1e", lax.bessel_i1e, normal(jnp.float32, 6, 7))
rec("bessel_i0e", lambda x: lax.bessel_i0e(x) * lax.bessel_i1e(x),
    normal(jnp.float32, 50, scale=40.0), label="large")
rec("igamma", lax.igamma, f32(5, 6, lo=1.0, hi=3.0), f32(5, 6, lo=1.0, hi=3.0))
rec("igamma", lax.igamma, f32(40, lo=0.5, hi=5.0), f32(40, lo=0.0, hi=12.0), label="wide")
rec("igammac", lax.igammac, f32(5, 6, lo=1.0, hi=3.0), f32(5, 6, lo=1.0, hi=3.0))
rec("igammac", lax.igammac, f32(40, lo=0.5, hi=5.0), f32(40, lo=0.0, hi=12.0), label="wide")
rec("regularized_incomplete_beta", lax.betainc, f32(4, 7, lo=0.0, hi=1.0),
    f32(4, 7, lo=0.0, hi=1.0), f32(4, 7, lo=0.0, hi=1.0))
rec("regularized_incomplete_beta", lax.betainc, f32(30, lo=0.5, hi=8.0), f32(30, lo=0.5, hi=8.0),
    f32(30, lo=0.0, hi=1.0), label="wide")

# ---- mulhi --------------------------------------------------------------------------
for label, dtype in INTS.items():
    rec("mulhi", lax.mulhi, full_range(dtype, 4, 9), full_range(dtype, 4, 9), label=label)

# ---- integer corners of the elementwise family ---------------------------------------
INTEGER_LABELS = frozenset(INTS) | {f"wrap-{k}" for k in INTS} | {
    f"by-minus-one-{k}" for k in INTS} | {"int-narrowing"}
for label, dtype in INTS.items():
    rec("population_count", lax.population_count, full_range(dtype, 40), label=label)
    rec("clz", lax.clz, full_range(dtype, 40), label=label)
    bits = 8 * np.dtype(dtype).itemsize
    shift = lambda r, d=dtype, n=bits: on_host(r.integers(0, n + 3, 40), d)  # noqa: E731
    rec("shift_right_logical", lax.shift_right_logical, full_range(dtype, 40), shift, label=label)
    rec("shift_right_arithmetic", lax.shift_right_arithmetic, full_range(dtype, 40), shift,
        label=label)
    rec("shift_left", lax.shift_left, full_range(dtype, 40), shift, label=label)
    # Sums wrap at the type's width before a fused consumer reads them.
    rec("add", lambda x, y: (x + y) > x, full_range(dtype, 40), full_range(dtype, 40),
        label=f"wrap-{label}")
for label in ("i8", "i16", "i32"):
    dtype = INTS[label]
    small = lambda r, d=dtype: on_host(r.choice([-1, 1, 2, -3, 7], 40), d)  # noqa: E731
    rec("div", lax.div, full_range(dtype, 40), small, label=f"by-minus-one-{label}")
    rec("rem", lax.rem, full_range(dtype, 40), small, label=f"by-minus-one-{label}")
    rec("neg", lambda x: -x < 0, full_range(dtype, 40), label=f"wrap-{label}")
rec("convert_element_type", lambda x: x.astype(jnp.int8) < 0, i32(40, lo=-1000, hi=1000),
    label="int-narrowing")
for label, dtype in HALVES.items():
    rec("nextafter", lax.nextafter, dt(dtype, 30), dt(dtype, 30), label=label)
rec("nextafter", lax.nextafter, f32(30), f32(30), label="f32")

# ---- igamma's gradient in a ---------------------------------------------------------
rec("igamma_grad_a", lambda a, x: jax.grad(lambda a: lax.igamma(a, x).sum())(a),
    f32(5, 6, lo=1.0, hi=3.0), f32(5, 6, lo=1.0, hi=3.0))
rec("igamma_grad_a", lambda a, x: jax.grad(lambda a: lax.igammac(a, x).sum())(a),
    f32(40, lo=0.5, hi=5.0), f32(40, lo=0.0, hi=12.0), label="igammac-wide")

# The integer records, whose kernels test_lax_peer.py also runs on the host, and
# primitive_table's bitwise reductions (integer and bool kernels too).
INTEGER_RECORDS = [r for r in RECORDS[_FIRST:] if r.label in INTEGER_LABELS] + [
    r for r in RECORDS[:_FIRST] if r.primitive in ("reduce_and", "reduce_or", "reduce_xor")]

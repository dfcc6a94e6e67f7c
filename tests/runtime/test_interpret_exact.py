"""The interpreter's NumPy arithmetic (runtime/interpret_exact.py) gives XLA's bytes:
each covered operation on values with its edge cases (NaN, infinities, signed zeros,
subnormals, the integers' ends, shift amounts of the width and beyond), against the
primitive bound by JAX."""
from __future__ import annotations

import jax
import ml_dtypes
import numpy as np
import pytest
from jax import lax

from nimblejax.compiler.ir import Var
from nimblejax.runtime import interpret_exact

r = np.random.default_rng(5)
N = 64


def values(dtype) -> np.ndarray:
    dtype = np.dtype(dtype)
    if dtype == np.bool_:
        return r.integers(0, 2, N).astype(bool)
    if dtype.kind in "iu":
        info = np.iinfo(dtype)
        edges = [info.min, info.max, 0, 1, -1 if dtype.kind == "i" else 2, info.max // 2]
        rest = r.integers(info.min, info.max, N - len(edges), dtype=dtype, endpoint=True)
        return np.concatenate([np.array(edges, dtype), rest]).astype(dtype)
    info = np.finfo(dtype)
    edges = [np.nan, np.inf, -np.inf, 0.0, -0.0, info.tiny, info.tiny / 4, -info.smallest_subnormal,
             info.max, -info.max]
    rest = r.standard_normal(N - len(edges)) * r.choice([1e-3, 1.0, 1e3], N - len(edges))
    return np.concatenate([np.array(edges, np.float64), rest]).astype(dtype)


def shift_amounts(dtype) -> np.ndarray:
    bits = np.dtype(dtype).itemsize * 8
    edges = [0, 1, bits - 1, bits, bits + 1, 2 * bits]
    if np.dtype(dtype).kind == "i":
        edges += [-1, np.iinfo(dtype).min]
    rest = r.integers(0, bits, N - len(edges))
    return np.concatenate([np.array(edges), rest]).astype(dtype)


BINARY = ["add", "add_any", "sub", "mul", "div", "max", "min", "eq", "ne", "lt", "le", "gt", "ge",
          "and", "or", "xor", "shift_left", "shift_right_logical", "shift_right_arithmetic"]
UNARY = ["neg", "square", "not"]
DTYPES = [np.float16, np.float32, np.float64, np.int8, np.int32, np.uint32, np.int64, np.bool_]


def primitive(name):
    return {"add_any": jax._src.ad_util.add_jaxvals_p}.get(name) or getattr(lax, f"{name}_p")


def bits_of(a) -> bytes:
    a = np.asarray(a)
    if a.dtype.kind == "f":  # NaNs' payloads are not compared (the module says so)
        a = np.where(np.isnan(a), np.array(np.nan, a.dtype), a)
    return a.dtype.str.encode() + str(a.shape).encode() + np.ascontiguousarray(a).tobytes()


COVERED = [(name, np.dtype(dtype)) for name in BINARY + UNARY for dtype in DTYPES
           if np.dtype(dtype).kind in interpret_exact.OPS[name][0]]


@pytest.mark.parametrize("name, dtype", COVERED, ids=[f"{n}-{d.name}" for n, d in COVERED])
def test_numpy_gives_xlas_bytes(name, dtype):
    x = values(dtype)
    operands = [x] if name in UNARY else [x, shift_amounts(dtype) if name.startswith("shift") else r.permutation(x)]
    x64 = jax.config.jax_enable_x64
    jax.config.update("jax_enable_x64", np.dtype(dtype).itemsize == 8)
    try:
        want = np.asarray(jax.jit(lambda *a: primitive(name).bind(*a))(*operands))
    finally:
        jax.config.update("jax_enable_x64", x64)
    got = interpret_exact.evaluate(name, operands, {}, Var(want.shape, want.dtype))
    assert got is not None
    assert bits_of(got) == bits_of(want), (name, dtype, np.flatnonzero(np.asarray(got) != want)[:5])


@pytest.mark.parametrize("dtype", [np.float32, np.int32])
def test_scalars_and_select(dtype):
    x, y = values(dtype), values(dtype)
    pred = r.integers(0, 2, N).astype(bool)
    got = interpret_exact.evaluate("select_n", [pred, x, y], {}, Var(x.shape, x.dtype))
    assert bits_of(got) == bits_of(lax.select_n(pred, x, y))
    s = np.asarray(x[7])  # 0-d operands give a 0-d result
    got = interpret_exact.evaluate("mul", [s, s], {}, Var((), x.dtype))
    assert got.shape == () and bits_of(got) == bits_of(lax.mul(s, s))


CASTS = [np.float16, np.float32, np.float64, ml_dtypes.bfloat16, np.int8, np.int32, np.uint32,
         np.int64, np.bool_]
CONVERSIONS = [(np.dtype(a), np.dtype(b)) for a in CASTS for b in CASTS
               if interpret_exact._convert(np.zeros(1, a), {"new_dtype": np.dtype(b)}) is not None]


@pytest.mark.parametrize("source, target", CONVERSIONS, ids=[f"{a.name}-{b.name}" for a, b in CONVERSIONS])
def test_conversions_give_xlas_bytes(source, target):
    if source.name == "bfloat16":
        x = values(np.float32).astype(source)
    else:
        x = values(source)
    params = {"new_dtype": target, "weak_type": False, "sharding": None}
    x64 = jax.config.jax_enable_x64
    jax.config.update("jax_enable_x64", 8 in (source.itemsize, target.itemsize))
    try:
        want = np.asarray(jax.jit(lambda a: lax.convert_element_type_p.bind(a, **params))(x))
    finally:
        jax.config.update("jax_enable_x64", x64)
    got = interpret_exact.evaluate("convert_element_type", [x], params, Var(want.shape, want.dtype))
    assert got is not None and bits_of(got) == bits_of(want), (source, target)


def test_what_is_left_to_jax():
    x = values(np.float32)
    out = Var(x.shape, x.dtype)
    assert interpret_exact.evaluate("exp", [x], {}, out) is None  # not exactly rounded
    to_int = {"new_dtype": np.dtype(np.int32), "weak_type": False, "sharding": None}
    assert interpret_exact.evaluate("convert_element_type", [x], to_int, Var(x.shape, np.int32)) is None
    b = x.astype(ml_dtypes.bfloat16)
    assert interpret_exact.evaluate("add", [b, b], {}, Var(b.shape, b.dtype)) is None
    assert interpret_exact.evaluate("add", [x, 2.0], {}, out) is None  # a Python number
    i = values(np.int32)
    assert interpret_exact.evaluate("div", [i, i], {}, Var(i.shape, i.dtype)) is None
    assert interpret_exact.evaluate("add", [x, x], {}, Var((3,), x.dtype)) is None  # not the output

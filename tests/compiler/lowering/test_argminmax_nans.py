"""argmax and argmin where a row holds NaNs: the index jax.jit returns on the GPU (XLA's
reduction order, nimblejax/compiler/lowering/xla_reduce_order.py) modelled against an
H100 probe and a literal simulation, the generated kernels run on the CPU
(tests/helpers/kernel_emulator.py) against that model, and on the GPU against jax.jit bit
for bit. Split out of test_sort.py."""
from __future__ import annotations

import base64
import ctypes
import gzip
import json
import math
import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from tests.helpers import kernel_emulator
import nimblejax as nimble
from tests.helpers.xla_argminmax_sim import (first_nan_by_rank, rows_reducer, simulate,
                                             xla_gpu_argminmax)
from nimblejax.compiler.lowering import xla_reduce_order as xo


# ---- argmax / argmin: the NaN XLA's GPU reduction returns ------------------------------
# JAX's reducer lets a NaN win, and between two NaNs its first operand, so the index of a
# row with several NaNs depends on how XLA's fusion combines the row
# (nimblejax/compiler/lowering/xla_reduce_order.py). The data: jax.jit on an H100 (jax
# 0.11.2) over random rows with NaNs (data/argmax_gpu_probe.json.gz beside this file): rows
# with two or more NaNs, their NaN positions and jax.jit's indices.
PROBE = os.path.join(os.path.dirname(__file__), "data", "argmax_gpu_probe.json.gz")


def test_xla_order_model_reproduces_the_gpu_probe():
    """Every probe row (two or more NaNs; 13078 rows of 52 shapes, 3 float dtypes): the
    rank model gives jax.jit's GPU index, and so does the literal simulation of XLA's
    fusion (rows up to 6000 long)."""
    doc = json.load(gzip.open(PROBE, "rt"))
    ranks, shapes, simulated = {}, set(), {}  # simulated: (key, op) -> ([NaN masks], [indices])
    for row in doc["rows"]:
        shape, axis, dtype = tuple(row["shape"]), row["axis"], row["dtype"]
        n = shape[axis]
        key = (shape, axis, dtype)
        if key not in ranks:  # the rank of a position, computed where a row has a NaN
            ranks[key] = xo.arrangement_for(shape, axis, jnp.dtype(dtype)), {}
        order, rank = ranks[key]
        if "pos" in row:
            nans = np.asarray(row["pos"])
        else:
            bits = np.unpackbits(np.frombuffer(base64.b64decode(row["nan"]), np.uint8))[:n]
            nans = np.flatnonzero(bits)
        assert len(nans) >= 2
        nan_ranks = [rank[i] if i in rank else rank.setdefault(i, xo.nan_rank(order, n, int(i)))
                     for i in nans]
        assert nans[np.argmin(nan_ranks)] == row["y"], (key, order)
        if n <= 6000:
            mask = np.zeros(n, bool)
            mask[nans] = True
            masks, want = simulated.setdefault((key, row["op"]), ([], []))
            masks.append(mask)
            want.append(row["y"])
        shapes.add((shape, axis))
    assert len(doc["rows"]) == 13078 and len(shapes) == 52
    # The simulation runs the rows of one shape and op together, each value an array of
    # one element per row (rows_reducer).
    for ((shape, axis, dtype), op), (masks, want) in simulated.items():
        is_max, values = op == "argmax", np.where(np.array(masks), math.nan, 0.0)
        elems = [(values[:, i], np.full(len(masks), i)) for i in range(values.shape[1])]
        init = (-math.inf if is_max else math.inf, 0)
        got = simulate(ranks[(shape, axis, dtype)][0], elems, rows_reducer(is_max), init)[1]
        np.testing.assert_array_equal(np.broadcast_to(got, len(want)), want,
                                      err_msg=str((shape, axis, dtype, op)))


# (shape, axis, dtype): one of each arrangement XLA picks (its kind noted).
MODEL_SHAPES = [
    ((6, 45), 1, "float32"),      # row, 32 threads
    ((45, 6), 0, "float32"),      # loop fusion (small column)
    ((6, 7), 1, "float16"),       # loop fusion (short row)
    ((2, 33, 3), 1, "float32"),   # loop fusion (small column)
    ((4, 300), 1, "float32"),     # row, vectors of 2
    ((4, 300), 1, "bfloat16"),    # row, vectors of 4
    ((3, 5000), 1, "float32"),    # row, 320 threads: 10 warps, shared memory
    ((6, 32), 1, "float32"),      # row, one warp
    ((6, 64), 1, "float16"),      # row, vectors of 2
    ((6, 8), 1, "float32"),       # row of 8 over a warp (never multi-row: see the model)
    ((5000, 64), 1, "float32"),   # row, vectors of 2
    ((4000, 128), 1, "float16"),  # row, vectors of 4
    ((6, 1000), 1, "float32"),    # row, 64 threads: two warps
    ((2, 50257), 1, "bfloat16"),  # split row, its second stage reading float32
    ((128, 6), 0, "float32"),     # column, 32 slots
    ((300, 2), 0, "float32"),     # small column, 32 slots
    ((64, 16), 0, "float32"),     # small column, 16 slots
    ((64, 32), 0, "float16"),     # small column, 16 slots (vectors of 4)
    ((3, 100, 16), 1, "float32"),  # small column, 16 slots
    ((2, 20000), 1, "float32"),   # split row: pieces, then a reduce of the pieces
    ((5000, 3), 0, "float32"),    # split column
]


def nan_rows(dtype, shape, r, nan=0.2):
    """Normal values with ties (rounded), ±0.0, ±inf and NaNs of both signs."""
    x = r.normal(size=shape).astype(np.float32)
    x = np.where(r.random(shape) < 0.3, np.round(x), x)
    sp = np.array([0.0, -0.0, np.inf, -np.inf], np.float32)
    x = np.where(r.random(shape) < 0.15, sp[r.integers(0, 4, shape)], x)
    x = np.where(r.random(shape) < nan, np.where(r.random(shape) < 0.5, np.nan, -np.nan), x)
    return np.asarray(jnp.asarray(x, dtype).astype(jnp.float32))


@pytest.mark.parametrize("shape,axis,dtype", MODEL_SHAPES, ids=str)
def test_rank_model_equals_the_literal_simulation(shape, axis, dtype):
    """The kernel keeps the lowest-ranked NaN (any combining order gives it); the
    simulation applies JAX's reducer in XLA's order: the same index, NaN or not."""
    r = np.random.default_rng(4)
    order = xo.arrangement_for(shape, axis, jnp.dtype(dtype))
    rows = min(math.prod(shape) // shape[axis], 24)
    x = np.moveaxis(nan_rows(dtype, shape, r, nan=r.choice([0.002, 0.05, 0.3])), axis, -1)
    x = x.reshape(-1, shape[axis])[:rows]
    for is_max in (True, False):
        want = xla_gpu_argminmax(x, 1, is_max, order, -np.inf if is_max else np.inf)
        np.testing.assert_array_equal(first_nan_by_rank(x, 1, is_max, order), want)


def test_plan_kinds():
    kind = lambda shape, axis, dt="float32": xo.arrangement_for(shape, axis, jnp.dtype(dt))  # noqa: E731
    assert kind((6, 7), 1).kind == kind((45, 6), 0).kind == kind((2, 33, 3), 1).kind == "seq"
    assert kind((6, 45), 1) == xo.Arrangement("row", threads=32, vec=1, tile=2)
    assert kind((4, 300), 1) == xo.Arrangement("row", threads=32, vec=2, tile=5)
    assert kind((4, 300), 1, "float16") == xo.Arrangement("row", threads=32, vec=4, tile=3)
    assert kind((3, 5000), 1) == xo.Arrangement("row", threads=320, vec=2, tile=8)
    assert kind((6, 32), 1) == kind((20000, 32), 1) == xo.Arrangement("row", threads=32, vec=1, tile=1)
    assert kind((6, 8), 1) == xo.Arrangement("row", threads=32, vec=1, tile=1)
    assert kind((5000, 64), 1) == xo.Arrangement("row", threads=32, vec=2, tile=1)
    assert kind((4000, 128), 1, "float16") == xo.Arrangement("row", threads=32, vec=4, tile=1)
    assert kind((6, 64), 1) == xo.Arrangement("row", threads=32, vec=2, tile=1)
    assert kind((128, 6), 0) == xo.Arrangement("col", threads=32)
    assert kind((64, 16), 0) == xo.Arrangement("col", threads=16)
    split = kind((2, 20000), 1)
    assert split.kind == "split" and split.k1 * split.k2 >= 20000
    for dt, vec in (("float32", 2), ("float16", 4), ("bfloat16", 2)):  # measured: 50257 = 140 x 359
        split = kind((2, 50257), 1, dt)
        assert (split.k1, split.k2, split.outer.vec) == (140, 359, vec)
    assert (kind((1, 300000), 1).k1, kind((1, 300000), 1).k2) == (500, 600)
    assert (kind((5000, 3), 0).k1, kind((5000, 3), 0).k2, kind((5000, 3), 0).inner.kind) == (50, 100, "seq")
    assert kind((2, 16384), 1).kind == "row" and kind((2, 16385), 1).kind == "split"


def test_generated_nan_rank_code_equals_the_model(tmp_path):
    """The C the kernel uses for a NaN's rank, compiled on the host, against nan_rank."""
    if kernel_emulator.compiler() is None:
        pytest.skip("no C++ compiler")
    shapes = MODEL_SHAPES + [((2, 50257), 1, "float32"), ((1, 300000), 1, "bfloat16"),
                             ((20000, 32), 1, "float32"), ((10000, 7), 0, "float32"),
                             ((3, 5000, 5), 1, "float16")]
    funcs, orders = [], []
    for k, (shape, axis, dtype) in enumerate(shapes):
        order = xo.arrangement_for(shape, axis, jnp.dtype(dtype))
        lines = []

        def tmp(ctype, expr):
            lines.append(f"    {ctype} t{len(lines)} = {expr};")
            return f"t{len(lines) - 1}"

        result = xo.emit_nan_rank(tmp, order, shape[axis], "r")
        funcs.append(f'extern "C" void rank{k}(long long* out, int n) {{\n'
                     f"  for (int r = 0; r < n; ++r) {{\n" + "\n".join(lines) +
                     f"\n    out[r] = {result};\n  }}\n}}\n")
        orders.append((order, shape[axis]))
    lib = kernel_emulator.compile_library("\n".join(funcs))
    for k, (order, n) in enumerate(orders):
        got = np.zeros(n, np.int64)
        getattr(lib, f"rank{k}")(got.ctypes.data_as(ctypes.c_void_p), ctypes.c_int(n))
        want = np.array([xo.nan_rank(order, n, i) for i in range(n)])
        np.testing.assert_array_equal(got, want, err_msg=str(order))
        assert len(set(want.tolist())) == n  # a permutation: no two positions tie
        assert want.max() < xo.rank_span(order, n)


EMULATED_ARG = [((6, 45), 1, "float32"), ((45, 6), 0, "float16"), ((6, 77), 1, "bfloat16"),
                ((4, 300), 1, "float32"), ((4, 300), 1, "float16"), ((3, 5000), 1, "float32"),
                ((3, 5000), 1, "bfloat16"), ((2, 33, 3), 1, "float32"), ((1, 45), 1, "float32"),
                ((128, 45), 1, "float32"), ((6, 32), 1, "float16"), ((6, 64), 1, "float32"),
                ((6, 7), 1, "float32"), ((6, 8), 1, "float32"), ((128, 6), 0, "float32"),
                ((300, 2), 0, "float32"), ((64, 16), 0, "bfloat16"), ((5000, 3), 0, "float32"),
                ((2, 20000), 1, "float32")]


def _arg_task(shape, axis, dtype, op):
    x = jax.ShapeDtypeStruct(shape, jnp.dtype(dtype))
    fn = lambda x: getattr(jnp, op)(x, axis=axis)  # noqa: E731
    (task,) = [t for t in nimble.jit(fn, backend="interpret").plan(x).tasks
               if t.kernel and t.eqns[-1].name == op]
    return task


@pytest.fixture(scope="module")
def arg_library():
    if kernel_emulator.compiler() is None:
        pytest.skip("no C++ compiler")
    return kernel_emulator.build([k for s in EMULATED_ARG for op in ("argmax", "argmin")
                                  for k in _arg_task(*s, op).kernel.launches])


@pytest.mark.parametrize("shape,axis,dtype", EMULATED_ARG, ids=str)
def test_argminmax_kernel_on_cpu_returns_xla_gpu_nan(shape, axis, dtype, arg_library):
    """The generated kernel, run on the CPU, against the simulation of XLA's GPU fusion:
    several NaNs per row, ±0.0, ±inf, ties."""
    r = np.random.default_rng(sum(shape) + axis)
    for nan in (0.3, 0.05, 0.0):
        x = nan_rows(dtype, shape, r, nan=nan)
        for op in ("argmax", "argmin"):
            task = _arg_task(shape, axis, dtype, op)
            xs = np.asarray(jnp.asarray(x, dtype))
            out = np.full(task.eqns[-1].outputs[0].shape, -7, np.int32)
            buffers = [out, np.ascontiguousarray(xs)]
            assert [v.dtype for v in task.kernel.params] == [np.int32, xs.dtype]
            kernel_emulator.launch(task.kernel, buffers, arg_library)
            is_max = op == "argmax"
            order = xo.arrangement_for(shape, axis, jnp.dtype(dtype))
            want = xla_gpu_argminmax(x, axis, is_max, order, -np.inf if is_max else np.inf)
            np.testing.assert_array_equal(out, want, err_msg=f"{op} nan={nan}")
            if nan == 0.0:  # no NaN: the lowest index of the best value, as on the CPU
                want_cpu = np.asarray(getattr(jnp, op)(jnp.asarray(x, dtype), axis=axis))
                np.testing.assert_array_equal(out, want_cpu)



# argmax/argmin on the GPU against jax.jit, bit for bit. ARG_GPU_SHAPES are those of the
# team's H100 probe, ARG_GPU_MORE some of the 40 of the later probes (all in
# data/argmax_gpu_probe.json.gz); ARG_GPU_OTHER were not measured themselves (their
# kinds of fusion were: a split row, a row of 24 warps, a column fusion).
ARG_GPU_SHAPES = [((6, 45), 1), ((45, 6), 0), ((4, 300), 1), ((3, 5000), 1), ((128, 45), 1),
                  ((6, 32), 1), ((6, 64), 1), ((6, 7), 1), ((2, 33, 3), 1)]
ARG_GPU_MORE = [((6, 8), 1), ((6, 16), 1), ((5000, 64), 1), ((4000, 128), 1), ((3, 1000), 1),
                ((128, 6), 0), ((300, 2), 0), ((64, 16), 0), ((64, 32), 0), ((3, 100, 16), 1),
                ((2, 50257), 1), ((5000, 3), 0), ((64, 20000), 1), ((20000, 40), 0)]
ARG_GPU_OTHER = [((3, 70000), 1), ((6, 12000), 1), ((700, 6), 0)]
ARG_INT_DTYPES = ["int8", "int16", "int32", "uint8", "uint16", "uint32", "bool"]


def _argminmax_bitwise(x, axis):
    for op in ("argmax", "argmin"):
        fn = lambda x: getattr(jnp, op)(x, axis=axis)  # noqa: E731
        got, want = np.asarray(nimble.jit(fn, backend="cuda")(x)), np.asarray(jax.jit(fn)(x))
        assert got.dtype == want.dtype and got.shape == want.shape, (got.dtype, want.dtype)
        bad = np.flatnonzero(got.ravel() != want.ravel())
        assert not bad.size, (op, x.dtype, x.shape, axis, bad[:8], got.ravel()[bad[:8]],
                              want.ravel()[bad[:8]])


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", ["float32", "float16", "bfloat16"])
@pytest.mark.parametrize("shape,axis", ARG_GPU_SHAPES + ARG_GPU_MORE + ARG_GPU_OTHER, ids=str)
def test_gpu_argminmax_nans_match_jax_bitwise(shape, axis, dtype):
    """Several NaNs (both signs) a row, ±0.0, ±inf, ties; and rows without NaNs."""
    r = np.random.default_rng(11 + sum(shape))
    for nan in (0.3, 0.08, 0.01, 0.0):
        _argminmax_bitwise(jnp.asarray(nan_rows(dtype, shape, r, nan=nan), dtype), axis)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", ARG_INT_DTYPES)
@pytest.mark.parametrize("shape,axis", ARG_GPU_SHAPES, ids=str)
def test_gpu_argminmax_integers_match_jax_bitwise(shape, axis, dtype):
    """Many ties (the lowest index wins) and the type's extremes."""
    r = np.random.default_rng(12 + sum(shape))
    if dtype == "bool":
        x = r.random(shape) < 0.5
    else:
        info = np.iinfo(dtype)
        x = r.integers(0, 4, shape).astype(dtype)
        x = np.where(r.random(shape) < 0.1, info.min, np.where(r.random(shape) < 0.1, info.max, x))
    _argminmax_bitwise(jnp.asarray(x, dtype), axis)

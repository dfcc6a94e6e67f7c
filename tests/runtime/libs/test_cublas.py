"""GPU tests for nimblejax.runtime.libs.cublas: numerics against numpy and graph capture.

Skipped as a whole when no CUDA device is visible.
"""

from __future__ import annotations

import itertools
import zlib
from collections.abc import Iterator

import numpy as np
import pytest

pytestmark = pytest.mark.gpu

cupy = pytest.importorskip("cupy")


def _device_count() -> int:
    # cupy raises (e.g. cudaErrorInsufficientDriver / NoDevice) without a GPU.
    try:
        return int(cupy.cuda.runtime.getDeviceCount())
    except Exception:
        return 0


if _device_count() == 0:
    pytest.skip("no CUDA device visible", allow_module_level=True)

from ml_dtypes import bfloat16  # noqa: E402  (jax depends on ml_dtypes)

from nimblejax.compiler.lowering.task import GemmCall  # noqa: E402
from nimblejax.runtime.libs.cublas import (  # noqa: E402
    CublasHandle,
    gemm_strided_batched,
    itemsize,
)

WORKSPACE_BYTES = 32 * 1024 * 1024

NUMPY_DTYPES: dict[str, type] = {
    "float32": np.float32,
    "float16": np.float16,
    "bfloat16": bfloat16,
}

# (dtype, compute, tolerance relative to |op(A)| @ |op(B)|). The f32 bound is
# far above FP32 accumulation error for k <= 64 but catches TF32 rounding;
# half outputs are limited by rounding C itself (2^-8 for bfloat16).
CASES = [
    ("float32", "f32", 1e-5),
    ("float32", "tf32", 1e-2),
    ("float16", "f32_from_half", 1e-2),
    ("bfloat16", "f32_from_half", 1e-2),
]
SHAPES = [(5, 7, 3), (64, 48, 32)]
TRANSPOSES = list(itertools.product([False, True], repeat=2))
BATCHES = [1, 3]


# ---------------------------------------------------------------------------
# helpers
# ---------------------------------------------------------------------------


def _random(rng: np.random.Generator, shape: tuple[int, ...], dtype: str) -> np.ndarray:
    # Magnitudes in [0.5, 1.5) with random signs: never zero, exactly
    # representable after the cast is what the reference uses.
    mag = rng.uniform(0.5, 1.5, size=shape)
    sign = rng.choice([-1.0, 1.0], size=shape)
    return (mag * sign).astype(NUMPY_DTYPES[dtype])


def _upload(x: np.ndarray) -> cupy.ndarray:
    # Raw bytes on the device: cupy has no bfloat16 dtype, cuBLAS only needs
    # the address.
    return cupy.asarray(np.ascontiguousarray(x).view(np.uint8).ravel())


def _download(buf: cupy.ndarray, dtype: str, shape: tuple[int, ...]) -> np.ndarray:
    return cupy.asnumpy(buf).view(NUMPY_DTYPES[dtype]).reshape(shape)


def _op(x: np.ndarray, trans: bool) -> np.ndarray:
    return np.swapaxes(x, -1, -2) if trans else x


def _assert_gemm_close(
    spec: GemmCall, a: np.ndarray, b: np.ndarray, c: np.ndarray, tol: float
) -> None:
    op_a = _op(a.astype(np.float64), spec.trans_a)
    op_b = _op(b.astype(np.float64), spec.trans_b)
    ref = op_a @ op_b
    # Error bound scaled per element by |op(A)| @ |op(B)|: robust to
    # cancellation, unlike a plain rtol on ref.
    scale = np.abs(op_a) @ np.abs(op_b)
    err = np.abs(c.astype(np.float64) - ref)
    assert np.all(np.isfinite(c)), "output holds NaN/Inf (not written?)"
    worst = float(np.max(err / scale))
    assert worst <= tol, f"{spec}: max scaled error {worst:.3g} > {tol}"


def _make_handle(stream: cupy.cuda.Stream) -> tuple[CublasHandle, cupy.ndarray]:
    workspace = cupy.empty(WORKSPACE_BYTES, dtype=cupy.uint8)
    handle = CublasHandle(stream.ptr, workspace.data.ptr, workspace.nbytes)
    return handle, workspace


def _poison(buf: cupy.ndarray) -> None:
    # 0xFF bytes are NaN in f32, f16 and bf16, so unwritten output fails.
    buf.fill(0xFF)


# ---------------------------------------------------------------------------
# fixtures
# ---------------------------------------------------------------------------


@pytest.fixture(scope="module")
def stream_handle() -> Iterator[tuple[cupy.cuda.Stream, CublasHandle]]:
    stream = cupy.cuda.Stream(non_blocking=True)
    handle, workspace = _make_handle(stream)
    yield stream, handle
    stream.synchronize()
    handle.destroy()
    del workspace


# ---------------------------------------------------------------------------
# tests
# ---------------------------------------------------------------------------


@pytest.mark.parametrize("batch", BATCHES)
@pytest.mark.parametrize("trans_a,trans_b", TRANSPOSES)
@pytest.mark.parametrize("m,n,k", SHAPES)
@pytest.mark.parametrize("dtype,compute,tol", CASES)
def test_gemm_matches_numpy(
    stream_handle: tuple[cupy.cuda.Stream, CublasHandle],
    dtype: str,
    compute: str,
    tol: float,
    m: int,
    n: int,
    k: int,
    trans_a: bool,
    trans_b: bool,
    batch: int,
) -> None:
    stream, handle = stream_handle
    spec = GemmCall(batch, m, n, k, trans_a, trans_b, dtype, compute)
    # crc32, not hash(): str hashing is salted per process.
    seed = zlib.crc32(repr((dtype, compute, m, n, k, trans_a, trans_b, batch)).encode())
    rng = np.random.default_rng(seed)
    a = _random(rng, spec.a_shape, dtype)
    b = _random(rng, spec.b_shape, dtype)
    a_dev, b_dev = _upload(a), _upload(b)
    c_dev = cupy.empty(int(np.prod(spec.c_shape)) * itemsize(spec.dtype), dtype=cupy.uint8)
    _poison(c_dev)
    # Uploads ran on the legacy stream; our stream is non-blocking.
    cupy.cuda.Device().synchronize()

    gemm_strided_batched(handle, spec, a_dev.data.ptr, b_dev.data.ptr, c_dev.data.ptr)
    stream.synchronize()

    _assert_gemm_close(spec, a, b, _download(c_dev, dtype, spec.c_shape), tol)


def test_alpha_beta(stream_handle: tuple[cupy.cuda.Stream, CublasHandle]) -> None:
    stream, handle = stream_handle
    spec = GemmCall(2, 6, 5, 4, False, True, "float32", "f32", alpha=0.5, beta=2.0)
    rng = np.random.default_rng(7)
    a, b = _random(rng, spec.a_shape, "float32"), _random(rng, spec.b_shape, "float32")
    c0 = _random(rng, spec.c_shape, "float32")
    a_dev, b_dev, c_dev = _upload(a), _upload(b), _upload(c0)
    cupy.cuda.Device().synchronize()

    gemm_strided_batched(handle, spec, a_dev.data.ptr, b_dev.data.ptr, c_dev.data.ptr)
    stream.synchronize()

    ref = 0.5 * (a.astype(np.float64) @ np.swapaxes(b, -1, -2)) + 2.0 * c0
    np.testing.assert_allclose(_download(c_dev, "float32", spec.c_shape), ref, rtol=1e-5, atol=1e-5)


def test_two_stream_graph_capture() -> None:
    s0 = cupy.cuda.Stream(non_blocking=True)
    s1 = cupy.cuda.Stream(non_blocking=True)
    # One handle + private workspace per stream, all configured before capture.
    h0, ws0 = _make_handle(s0)
    h1, ws1 = _make_handle(s1)
    spec0 = GemmCall(1, 64, 48, 32, False, False, "float32", "f32")
    spec1 = GemmCall(3, 5, 7, 3, True, True, "float16", "f32_from_half")
    rng = np.random.default_rng(1234)

    def fresh_inputs() -> list[np.ndarray]:
        return [
            _random(rng, spec0.a_shape, "float32"),
            _random(rng, spec0.b_shape, "float32"),
            _random(rng, spec1.a_shape, "float16"),
            _random(rng, spec1.b_shape, "float16"),
        ]

    inputs = fresh_inputs()
    a0, b0, a1, b1 = (_upload(x) for x in inputs)
    c0 = cupy.empty(int(np.prod(spec0.c_shape)) * 4, dtype=cupy.uint8)
    c1 = cupy.empty(int(np.prod(spec1.c_shape)) * 2, dtype=cupy.uint8)
    cupy.cuda.Device().synchronize()

    s0.begin_capture()
    fork = cupy.cuda.Event(disable_timing=True)
    fork.record(s0)
    s1.wait_event(fork)
    gemm_strided_batched(h0, spec0, a0.data.ptr, b0.data.ptr, c0.data.ptr)
    gemm_strided_batched(h1, spec1, a1.data.ptr, b1.data.ptr, c1.data.ptr)
    join = cupy.cuda.Event(disable_timing=True)
    join.record(s1)
    s0.wait_event(join)
    graph = s0.end_capture()

    try:
        for launch in range(2):
            if launch:
                # Same buffers, new contents: the graph must read live memory.
                inputs = fresh_inputs()
                for buf, x in zip((a0, b0, a1, b1), inputs):
                    buf.set(np.ascontiguousarray(x).view(np.uint8).ravel())
            _poison(c0)
            _poison(c1)
            cupy.cuda.Device().synchronize()

            graph.launch(s0)
            s0.synchronize()

            x0, y0, x1, y1 = inputs
            _assert_gemm_close(spec0, x0, y0, _download(c0, "float32", spec0.c_shape), 1e-5)
            _assert_gemm_close(spec1, x1, y1, _download(c1, "float16", spec1.c_shape), 1e-2)
    finally:
        del graph
        h0.destroy()
        h1.destroy()
        del ws0, ws1

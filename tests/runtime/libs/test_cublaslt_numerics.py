"""nimblejax.runtime.libs.cublaslt's GEMMs on the GPU (marked `gpu`): numerics against
numpy, the measured algorithm choice, epilogues and CUDA graph capture. The descriptor
math and the call sequence without a GPU: test_cublaslt.py.
"""

from __future__ import annotations

import math
import zlib
from collections.abc import Iterator

import numpy as np
import pytest

from nimblejax.compiler.lowering.task import Epilogue, GemmCall
from nimblejax.runtime.libs import cublaslt
from nimblejax.runtime.libs.cublaslt import fastest

WORKSPACE_BYTES = 32 * 1024 * 1024
ITEMSIZE = {"float32": 4, "float16": 2, "bfloat16": 2}


def _op(x: np.ndarray, trans) -> np.ndarray:
    return np.swapaxes(x, -1, -2) if trans else x

# (dtype, compute, out_dtype, tolerance relative to |op(A)| @ |op(B)|)
CASES = [
    ("float32", "f32", None, 1e-5),
    ("float32", "tf32", None, 1e-2),
    ("bfloat16", "f32_from_half", None, 1e-2),
    ("float16", "f32_from_half", None, 1e-2),
    ("bfloat16", "f32_from_half", "float32", 1e-2),
]
# (batch, m, n, k, trans_a, trans_b)
SHAPES = [
    (1, 1, 2048, 512, False, False),
    (1, 128, 768, 3072, False, False),
    (1, 128, 768, 3072, False, True),
    (1, 401408, 16, 32, False, False),
    (1, 7, 5, 3, False, False),
    (1, 7, 5, 3, True, False),
    (1, 7, 5, 3, True, True),
    (3, 7, 5, 3, False, True),
    (4, 64, 48, 32, True, True),
]


def _np_dtype(name: str):
    if name == "bfloat16":
        from ml_dtypes import bfloat16  # jax depends on ml_dtypes

        return bfloat16
    return np.dtype(name)


def _random(rng: np.random.Generator, shape: tuple[int, ...], dtype: str,
            low: float = 0.5, high: float = 1.5) -> np.ndarray:
    # Magnitudes in [low, high) with random signs; the cast value is the reference.
    mag = rng.uniform(low, high, size=shape)
    return (mag * rng.choice([-1.0, 1.0], size=shape)).astype(_np_dtype(dtype))


def _out(spec: GemmCall) -> str:
    return spec.out_dtype or spec.dtype


@pytest.fixture(scope="module")
def gpu() -> Iterator[tuple]:
    cupy = pytest.importorskip("cupy")
    stream = cupy.cuda.Stream(non_blocking=True)
    workspace = cupy.empty(WORKSPACE_BYTES, dtype=cupy.uint8)
    handle = cublaslt.LtHandle()
    yield cupy, stream, handle, workspace
    stream.synchronize()
    handle.destroy()


def _upload(cupy, x: np.ndarray):
    # Raw bytes: cupy has no bfloat16, cuBLASLt only needs the address.
    return cupy.asarray(np.ascontiguousarray(x).view(np.uint8).ravel())


def _empty_out(cupy, spec: GemmCall):
    c = cupy.empty(int(np.prod(spec.c_shape)) * ITEMSIZE[_out(spec)], dtype=cupy.uint8)
    c.fill(0xFF)  # NaN in f32/f16/bf16: unwritten output fails
    return c


def _download(cupy, buf, dtype: str, shape: tuple[int, ...]) -> np.ndarray:
    return cupy.asnumpy(buf).view(_np_dtype(dtype)).reshape(shape)


def _gelu_tanh(x: np.ndarray) -> np.ndarray:
    return 0.5 * x * (1.0 + np.tanh(math.sqrt(2.0 / math.pi) * (x + 0.044715 * x**3)))


def _gelu_erf(x: np.ndarray) -> np.ndarray:
    return 0.5 * x * (1.0 + np.vectorize(math.erf)(x / math.sqrt(2.0)))


ACTIVATIONS = {"none": lambda x: x, "relu": lambda x: np.maximum(x, 0.0), "gelu_tanh": _gelu_tanh}


def _reference(spec, a, b, bias=None, residual=None):
    """(pre-activation value, expected output, per-element error scale)."""
    op_a, op_b = _op(a.astype(np.float64), spec.trans_a), _op(b.astype(np.float64), spec.trans_b)
    pre = spec.alpha * (op_a @ op_b)
    scale = abs(spec.alpha) * (np.abs(op_a) @ np.abs(op_b))
    for extra in (bias, residual):
        if extra is not None:
            pre, scale = pre + extra.astype(np.float64), scale + np.abs(extra.astype(np.float64))
    return pre, ACTIVATIONS[spec.epilogue.activation](pre), scale


def _assert_close(spec, out: np.ndarray, ref: np.ndarray, scale: np.ndarray, tol: float) -> None:
    assert np.all(np.isfinite(out)), "output holds NaN/Inf (not written?)"
    worst = float(np.max(np.abs(out.astype(np.float64) - ref) / scale))
    assert worst <= tol, f"{spec}: max scaled error {worst:.3g} > {tol}"


def _ptr(buf) -> int | None:
    return None if buf is None else buf.data.ptr


def _tuned(cupy, handle, spec, workspace, a, b, c, bias=None, residual=None) -> cublaslt.LtGemm:
    buffers = cublaslt.GemmBuffers(a.data.ptr, b.data.ptr, c.data.ptr, workspace.data.ptr,
                                   bias=_ptr(bias), residual=_ptr(residual))
    return cublaslt.LtGemm(handle, spec, WORKSPACE_BYTES, buffers=buffers)


def _run(gemm, gpu, a, b, c, bias=None, residual=None) -> None:
    cupy, stream, handle, workspace = gpu
    cupy.cuda.Device().synchronize()  # uploads ran on the legacy stream
    gemm.run(handle, a.data.ptr, b.data.ptr, c.data.ptr, workspace.data.ptr,
             WORKSPACE_BYTES, stream.ptr, bias=_ptr(bias), residual=_ptr(residual))
    stream.synchronize()


@pytest.mark.gpu
@pytest.mark.parametrize("batch,m,n,k,trans_a,trans_b", SHAPES)
@pytest.mark.parametrize("dtype,compute,out_dtype,tol", CASES)
def test_gemm_matches_numpy(gpu, dtype, compute, out_dtype, tol, batch, m, n, k,
                            trans_a, trans_b) -> None:
    cupy, _, handle, workspace = gpu
    spec = GemmCall(batch, m, n, k, trans_a, trans_b, dtype, compute, out_dtype=out_dtype)
    rng = np.random.default_rng(zlib.crc32(repr(spec).encode()))
    a, b = _random(rng, spec.a_shape, dtype), _random(rng, spec.b_shape, dtype)
    a_dev, b_dev, c_dev = _upload(cupy, a), _upload(cupy, b), _empty_out(cupy, spec)
    gemm = _tuned(cupy, handle, spec, workspace, a_dev, b_dev, c_dev)
    try:
        # The measured choice: the fastest candidate that ran.
        assert gemm.timings_us is not None and 0 <= gemm.algo_index < len(gemm.timings_us)
        assert gemm.algo_index == fastest(list(gemm.timings_us))
        assert 0 <= gemm.workspace_needed <= WORKSPACE_BYTES
        c_dev.fill(0xFF)
        _run(gemm, gpu, a_dev, b_dev, c_dev)
    finally:
        gemm.close()
    _, ref, scale = _reference(spec, a, b)
    _assert_close(spec, _download(cupy, c_dev, _out(spec), spec.c_shape), ref, scale, tol)


@pytest.mark.gpu
def test_choice_is_cached(gpu) -> None:
    cupy, _, handle, workspace = gpu
    spec = GemmCall(2, 33, 17, 9, False, True, "float32", "tf32")
    rng = np.random.default_rng(3)
    a_dev = _upload(cupy, _random(rng, spec.a_shape, "float32"))
    b_dev = _upload(cupy, _random(rng, spec.b_shape, "float32"))
    c_dev = _empty_out(cupy, spec)
    first = _tuned(cupy, handle, spec, workspace, a_dev, b_dev, c_dev)
    second = _tuned(cupy, handle, spec, workspace, a_dev, b_dev, c_dev)
    unmeasured = cublaslt.LtGemm(handle, spec, WORKSPACE_BYTES)  # takes the measured entry
    try:
        assert second.timings_us is first.timings_us  # not re-timed
        assert unmeasured.algo_index == first.algo_index
    finally:
        for g in (first, second, unmeasured):
            g.close()


@pytest.mark.gpu
def test_without_buffers_uses_heuristic_zero_and_alpha_beta(gpu) -> None:
    cupy, _, handle, _ = gpu
    # alpha/beta come from the spec; beta != 0 reads C, so no timing on C.
    spec = GemmCall(2, 6, 5, 4, False, True, "float32", "f32", alpha=0.5, beta=2.0)
    rng = np.random.default_rng(7)
    a, b = _random(rng, spec.a_shape, "float32"), _random(rng, spec.b_shape, "float32")
    c0 = _random(rng, spec.c_shape, "float32")
    a_dev, b_dev, c_dev = _upload(cupy, a), _upload(cupy, b), _upload(cupy, c0)
    gemm = cublaslt.LtGemm(handle, spec, WORKSPACE_BYTES)
    try:
        assert gemm.algo_index == 0 and gemm.timings_us is None
        _run(gemm, gpu, a_dev, b_dev, c_dev)
    finally:
        gemm.close()
    ref = 0.5 * (a.astype(np.float64) @ np.swapaxes(b, -1, -2)) + 2.0 * c0
    np.testing.assert_allclose(_download(cupy, c_dev, "float32", spec.c_shape), ref,
                               rtol=1e-5, atol=1e-5)


@pytest.mark.gpu
@pytest.mark.parametrize("activation,bias,residual", [
    ("none", True, False), ("relu", False, False), ("relu", True, False),
    ("gelu_tanh", False, False), ("gelu_tanh", True, False),
    ("none", False, True), ("relu", True, True), ("gelu_tanh", True, True)])
@pytest.mark.parametrize("dtype,compute,out_dtype,tol", [
    ("float32", "f32", None, 1e-3),  # 1e-3: cuBLASLt's GELU may use a fast tanh
    ("float32", "tf32", None, 1e-2),
    ("bfloat16", "f32_from_half", None, 1e-2),
    ("bfloat16", "f32_from_half", "float32", 1e-2),
])
@pytest.mark.parametrize("batch", [1, 3])
def test_epilogues(gpu, activation, bias, residual, dtype, compute, out_dtype, tol, batch) -> None:
    cupy, _, handle, workspace = gpu
    spec = GemmCall(batch, 96, 40, 64, False, True, dtype, compute, out_dtype=out_dtype,
                    beta=1.0 if residual else 0.0,
                    epilogue=Epilogue(bias=bias, activation=activation, residual=residual))
    rng = np.random.default_rng(11)
    # |a|, |b| <= 1 and 0.75: pre-activations spread over about [-4, 4].
    a = _random(rng, spec.a_shape, dtype, 0.0, 1.0)
    b = _random(rng, spec.b_shape, dtype, 0.0, 0.75)
    bias_h = _random(rng, (spec.n,), _out(spec), 0.0, 1.0) if bias else None
    res_h = _random(rng, spec.c_shape, _out(spec), 0.0, 1.0) if residual else None
    a_dev, b_dev, c_dev = _upload(cupy, a), _upload(cupy, b), _empty_out(cupy, spec)
    bias_dev = None if bias_h is None else _upload(cupy, bias_h)
    res_dev = None if res_h is None else _upload(cupy, res_h)
    gemm = _tuned(cupy, handle, spec, workspace, a_dev, b_dev, c_dev, bias=bias_dev, residual=res_dev)
    try:
        c_dev.fill(0xFF)
        _run(gemm, gpu, a_dev, b_dev, c_dev, bias=bias_dev, residual=res_dev)
    finally:
        gemm.close()
    if res_h is not None:  # the residual is read, never written
        assert np.array_equal(_download(cupy, res_dev, _out(spec), spec.c_shape).view(np.uint8),
                              res_h.view(np.uint8))
    _, ref, scale = _reference(spec, a, b, bias_h, res_h)
    _assert_close(spec, _download(cupy, c_dev, _out(spec), spec.c_shape), ref, scale, tol)


@pytest.mark.gpu
def test_gelu_is_the_tanh_approximation(gpu) -> None:
    # The two GELU forms differ by up to 4.7e-4 near |x| = 2.7; on average the
    # output must sit closer to tanh-GELU than to erf-GELU where they differ.
    cupy, _, handle, workspace = gpu
    spec = GemmCall(1, 512, 64, 64, False, False, "float32", "f32",
                    epilogue=Epilogue(activation="gelu_tanh"))
    rng = np.random.default_rng(5)
    a = _random(rng, spec.a_shape, "float32", 0.0, 1.0)
    b = _random(rng, spec.b_shape, "float32", 0.0, 0.75)
    a_dev, b_dev, c_dev = _upload(cupy, a), _upload(cupy, b), _empty_out(cupy, spec)
    gemm = _tuned(cupy, handle, spec, workspace, a_dev, b_dev, c_dev)
    try:
        _run(gemm, gpu, a_dev, b_dev, c_dev)
    finally:
        gemm.close()
    pre, _, _ = _reference(spec, a, b)
    out = _download(cupy, c_dev, "float32", spec.c_shape).astype(np.float64)
    where = (np.abs(pre) > 1.5) & (np.abs(pre) < 4.0)
    assert where.sum() > 1000
    err_tanh = np.abs(out - _gelu_tanh(pre))[where].mean()
    err_erf = np.abs(out - _gelu_erf(pre))[where].mean()
    assert err_tanh < err_erf, f"mean error vs tanh-GELU {err_tanh:.3g}, vs erf-GELU {err_erf:.3g}"


@pytest.mark.gpu
def test_run_validates_pointers(gpu) -> None:
    cupy, stream, handle, workspace = gpu
    spec = GemmCall(1, 8, 8, 8, False, False, "float32", "f32",
                    epilogue=Epilogue(bias=True, activation="relu"))
    buf = cupy.zeros(1024, dtype=cupy.float32)
    gemm = cublaslt.LtGemm(handle, spec, WORKSPACE_BYTES)
    ptr, ws = buf.data.ptr, workspace.data.ptr
    try:
        with pytest.raises(ValueError, match="aligned"):
            gemm.run(handle, ptr + 4, ptr, ptr, ws, WORKSPACE_BYTES, stream.ptr, bias=ptr)
        with pytest.raises(ValueError, match="bias"):
            gemm.run(handle, ptr, ptr, ptr, ws, WORKSPACE_BYTES, stream.ptr)
    finally:
        gemm.close()


@pytest.mark.gpu
def test_graph_capture(gpu) -> None:
    cupy, _, handle, workspace = gpu
    stream = cupy.cuda.Stream(non_blocking=True)
    specs = [GemmCall(1, 128, 768, 3072, False, False, "float32", "tf32"),
             GemmCall(3, 7, 5, 3, True, True, "bfloat16", "f32_from_half")]
    tols = [1e-2, 1e-2]
    rng = np.random.default_rng(1234)

    def fresh() -> list[tuple[np.ndarray, np.ndarray]]:
        return [(_random(rng, s.a_shape, s.dtype), _random(rng, s.b_shape, s.dtype)) for s in specs]

    inputs = fresh()
    devs = [(_upload(cupy, a), _upload(cupy, b), _empty_out(cupy, s))
            for s, (a, b) in zip(specs, inputs)]
    gemms = [_tuned(cupy, handle, s, workspace, *d) for s, d in zip(specs, devs)]
    cupy.cuda.Device().synchronize()
    # Both GEMMs on one stream share the workspace (stream order serializes them).
    stream.begin_capture()
    for g, (a, b, c) in zip(gemms, devs):
        g.run(handle, a.data.ptr, b.data.ptr, c.data.ptr, workspace.data.ptr,
              WORKSPACE_BYTES, stream.ptr)
    graph = stream.end_capture()
    try:
        for launch in range(2):
            if launch:  # same buffers, new contents: the graph reads live memory
                inputs = fresh()
                for (a_dev, b_dev, _), (a, b) in zip(devs, inputs):
                    a_dev.set(np.ascontiguousarray(a).view(np.uint8).ravel())
                    b_dev.set(np.ascontiguousarray(b).view(np.uint8).ravel())
            for _, _, c in devs:
                c.fill(0xFF)
            cupy.cuda.Device().synchronize()
            graph.launch(stream)
            stream.synchronize()
            for s, (a, b), (_, _, c), tol in zip(specs, inputs, devs, tols):
                _, ref, scale = _reference(s, a, b)
                _assert_close(s, _download(cupy, c, _out(s), s.c_shape), ref, scale, tol)
    finally:
        del graph
        for g in gemms:
            g.close()

"""Tests for nimblejax.runtime.libs.cublaslt without a GPU: the ctypes struct layouts,
the enum values against cublasLt.h, the row-major -> column-major descriptor math (by
emulating cuBLASLt's layout semantics in numpy) and LtGemm's call sequence against a
fake library. Its GEMMs run on the GPU in test_cublaslt_numerics.py.
"""

from __future__ import annotations

import ctypes
import itertools
import os
import subprocess
import sys

import numpy as np
import pytest

from nimblejax.compiler.ir import Var
from nimblejax.compiler.lowering.task import Epilogue, GemmCall
from nimblejax.runtime.libs import cublas, cublaslt
from nimblejax.runtime.libs.cublas import CublasError
from nimblejax.runtime.libs.cublaslt import LtLayout, epilogue_code, fastest, lt_layouts

# ---------------------------------------------------------------------------
# CPU: ABI
# ---------------------------------------------------------------------------

# Values from cublasLt.h (CUDA 13; unchanged since 11.x, as nvmath-python's
# bindings generated across 11.0.3..13.1.0 show), cublas_api.h, library_types.h.
HEADER_VALUES = {
    "CUBLASLT_MATMUL_DESC_TRANSA": 3,
    "CUBLASLT_MATMUL_DESC_TRANSB": 4,
    "CUBLASLT_MATMUL_DESC_EPILOGUE": 7,
    "CUBLASLT_MATMUL_DESC_BIAS_POINTER": 8,
    "CUBLASLT_MATMUL_DESC_BIAS_BATCH_STRIDE": 10,
    "CUBLASLT_MATRIX_LAYOUT_BATCH_COUNT": 5,
    "CUBLASLT_MATRIX_LAYOUT_STRIDED_BATCH_OFFSET": 6,
    "CUBLASLT_MATMUL_PREF_MAX_WORKSPACE_BYTES": 1,
    "CUBLASLT_EPILOGUE_DEFAULT": 1,
    "CUBLASLT_EPILOGUE_RELU": 2,
    "CUBLASLT_EPILOGUE_BIAS": 4,
    "CUBLASLT_EPILOGUE_GELU": 32,
    "CUBLAS_STATUS_NOT_SUPPORTED": 15,
    "SCALE_TYPE": 0,  # CUDA_R_32F
}


@pytest.mark.parametrize("name,value", sorted(HEADER_VALUES.items()))
def test_enum_values_match_header(name: str, value: int) -> None:
    assert getattr(cublaslt, name) == value


def test_compute_and_data_types_match_header() -> None:
    # cublasComputeType_t / cudaDataType_t, shared with cublas.py.
    assert (cublas.CUBLAS_COMPUTE_32F, cublas.CUBLAS_COMPUTE_32F_FAST_TF32) == (68, 77)
    assert (cublas.CUDA_R_32F, cublas.CUDA_R_16F, cublas.CUDA_R_16BF) == (0, 2, 14)
    assert (cublas.CUBLAS_OP_N, cublas.CUBLAS_OP_T) == (0, 1)


def test_struct_layouts() -> None:
    algo, res = cublaslt.MatmulAlgo, cublaslt.HeuristicResult
    assert ctypes.sizeof(algo) == 64
    # { algo (64); size_t workspaceSize; cublasStatus_t state; float wavesCount; int reserved[4] }
    assert ctypes.sizeof(res) == 96
    offsets = {name: getattr(res, name).offset for name, _ in res._fields_}
    assert offsets == {"algo": 0, "workspaceSize": 64, "state": 72, "wavesCount": 76, "reserved": 80}


@pytest.mark.parametrize(
    "activation,bias,code",
    [("none", False, 1), ("relu", False, 2), ("gelu_tanh", False, 32),
     ("none", True, 4), ("relu", True, 6), ("gelu_tanh", True, 36)],  # RELU_BIAS, GELU_BIAS
)
@pytest.mark.parametrize("residual", [False, True])  # beta * C: no epilogue code of its own
def test_epilogue_code(activation: str, bias: bool, code: int, residual: bool) -> None:
    assert epilogue_code(Epilogue(bias=bias, activation=activation, residual=residual)) == code


def test_epilogue_rejects_unknown_activation() -> None:
    with pytest.raises(ValueError, match="silu"):
        Epilogue(activation="silu")


def test_gemmcall_epilogue_is_compared_and_checked() -> None:
    plain = GemmCall(2, 4, 8, 16, False, False, "float32", "tf32")
    relu = GemmCall(2, 4, 8, 16, False, False, "float32", "tf32", epilogue=Epilogue(activation="relu"))
    assert plain != relu and hash(plain) != hash(relu)  # distinct algorithm cache keys
    assert (plain.label, relu.label) == ("", "relu")
    with pytest.raises(ValueError, match="beta=1.0"):
        GemmCall(1, 2, 2, 2, False, False, "float32", "f32", epilogue=Epilogue(residual=True))
    v = [Var((1, 2, 2), np.dtype("float32")) for _ in range(3)]
    with pytest.raises(ValueError, match="bias operand"):
        GemmCall(1, 2, 2, 2, False, False, "float32", "f32", epilogue=Epilogue(bias=True),
                 a=v[0], b=v[1], c=v[2])


def test_fastest_skips_failed_candidates() -> None:
    assert fastest([3.0, None, 1.0, 2.0]) == 2
    with pytest.raises(CublasError, match="CUBLAS_STATUS_NOT_SUPPORTED"):
        fastest([None, None])


def test_cublas_type_helpers_match_header() -> None:
    # GemmCall's dtype names and compute modes -> cudaDataType_t, bytes, cublasComputeType_t.
    assert [cublas.cuda_dtype(d) for d in ("float32", "float16", "bfloat16")] == [0, 2, 14]
    assert [cublas.itemsize(d) for d in ("float32", "float16", "bfloat16")] == [4, 2, 2]
    calls = [GemmCall(1, 2, 3, 4, False, False, "float32", "f32"),
             GemmCall(1, 2, 3, 4, False, False, "float32", "tf32"),
             GemmCall(1, 2, 3, 4, False, False, "float16", "f32_from_half"),
             GemmCall(1, 2, 3, 4, False, False, "bfloat16", "f32_from_half")]
    assert [cublas.compute_type(c) for c in calls] == [68, 77, 68, 68]


def test_import_loads_nothing() -> None:
    code = ("import sys, nimblejax.runtime.libs.cublaslt as m, nimblejax.runtime.libs.cudnn, "
            "nimblejax.runtime.libs.loader as loader; "
            "assert not loader._loaded and 'cupy' not in sys.modules")
    # NIMBLE_PRELOAD=0: `import nimblejax` would import CuPy on its own thread where a GPU is.
    subprocess.run([sys.executable, "-c", code], check=True, env={**os.environ, "NIMBLE_PRELOAD": "0"})


# ---------------------------------------------------------------------------
# CPU: descriptor math
# ---------------------------------------------------------------------------


def test_layouts_plain_row_major() -> None:
    p = lt_layouts(GemmCall(1, 128, 768, 3072, False, False, "float32", "tf32"))
    assert (p.trans_a, p.trans_b) == (0, 0)
    # cuBLASLt's A is our B (3072 x 768 row-major = 768 x 3072 column-major).
    assert p.a == LtLayout(0, 768, 3072, 768, 1, 3072 * 768)
    assert p.b == LtLayout(0, 3072, 128, 3072, 1, 128 * 3072)
    assert p.c == LtLayout(0, 768, 128, 768, 1, 128 * 768)


def test_layouts_transposed_batched_mixed_dtype() -> None:
    p = lt_layouts(GemmCall(4, 5, 7, 3, True, True, "bfloat16", "f32_from_half",
                            out_dtype="float32"))
    assert (p.trans_a, p.trans_b) == (1, 1)
    # Our B stored (n, k) = (7, 3): column-major 3 x 7, ld 3, op T.
    assert p.a == LtLayout(14, 3, 7, 3, 4, 21)
    # Our A stored (k, m) = (3, 5): column-major 5 x 3, ld 5, op T.
    assert p.b == LtLayout(14, 5, 3, 5, 4, 15)
    assert p.c == LtLayout(0, 7, 5, 7, 4, 35)


def _op(x: np.ndarray, trans) -> np.ndarray:
    return np.swapaxes(x, -1, -2) if trans else x


def _read(buf: np.ndarray, lay: LtLayout) -> np.ndarray:
    """A batch of column-major matrices, read as cuBLASLt reads the layout."""
    i, j = np.meshgrid(np.arange(lay.rows), np.arange(lay.cols), indexing="ij")
    return np.stack([buf[b * lay.stride + i + j * lay.ld] for b in range(lay.batch)])


def _emulate(spec: GemmCall, a: np.ndarray, b: np.ndarray) -> np.ndarray:
    """D = op(A_lt) op(B_lt) over our buffers with lt_layouts' descriptors."""
    p = lt_layouts(spec)
    d = _op(_read(b.ravel(), p.a), p.trans_a) @ _op(_read(a.ravel(), p.b), p.trans_b)
    assert d.shape[1:] == (p.c.rows, p.c.cols) and p.c.ld >= p.c.rows
    c = np.full(spec.batch * spec.m * spec.n, np.nan)
    i, j = np.meshgrid(np.arange(p.c.rows), np.arange(p.c.cols), indexing="ij")
    for k in range(spec.batch):
        c[k * p.c.stride + i + j * p.c.ld] = d[k]
    return c.reshape(spec.c_shape)


@pytest.mark.parametrize("trans_a,trans_b", list(itertools.product([False, True], repeat=2)))
@pytest.mark.parametrize("batch", [1, 3])
def test_layouts_emulated_match_row_major_product(trans_a: bool, trans_b: bool, batch: int) -> None:
    spec = GemmCall(batch, 5, 7, 4, trans_a, trans_b, "float32", "f32")
    rng = np.random.default_rng(0)
    a, b = rng.standard_normal(spec.a_shape), rng.standard_normal(spec.b_shape)
    np.testing.assert_allclose(_emulate(spec, a, b), _op(a, trans_a) @ _op(b, trans_b), rtol=1e-12)


def test_bias_runs_along_n() -> None:
    # CUBLASLT_EPILOGUE_BIAS adds a vector as long as D's rows to every column
    # of D; D's rows are our n, so bias[j] lands on every row-major C[i, j].
    p = lt_layouts(GemmCall(1, 6, 9, 2, False, False, "float32", "f32"))
    assert (p.c.rows, p.c.cols) == (9, 6)
    d_cm = np.zeros((p.c.rows, p.c.cols)) + np.arange(9.0)[:, None]  # bias added per D row
    c = np.zeros(6 * 9)
    i, j = np.meshgrid(np.arange(9), np.arange(6), indexing="ij")
    c[i + j * p.c.ld] = d_cm
    assert np.array_equal(c.reshape(6, 9), np.tile(np.arange(9.0), (6, 1)))


# ---------------------------------------------------------------------------
# CPU: LtGemm's call sequence against a fake libcublasLt
# ---------------------------------------------------------------------------


class _FakeLt:
    """Records every cublasLt* call; creates return distinct fake handles and
    the heuristic returns three candidates (the middle one failing)."""

    def __init__(self) -> None:
        self.calls: list[tuple] = []
        self._next = 0x1000

    def __getattr__(self, name: str):
        def fn(*args):
            self.calls.append((name, args))
            if name.endswith("Create"):
                self._next += 0x100
                args[0]._obj.value = self._next  # byref(c_void_p) -> the c_void_p
            if name == "cublasLtMatmulAlgoGetHeuristic":
                results, count = args[8], args[9]._obj
                for i in range(3):
                    results[i].algo.data[0], results[i].workspaceSize = 100 + i, 1024 * i
                    results[i].state = 15 if i == 1 else 0
                count.value = 3
            return 0

        fn.__name__ = name
        return fn

    def named(self, name: str) -> list[tuple]:
        return [args for n, args in self.calls if n == name]


class _FakeHandle:
    def __init__(self) -> None:
        self.lib, self.raw = _FakeLt(), ctypes.c_void_p(0x42)


def _attr_values(lib: _FakeLt, name: str) -> dict:
    # (object, attribute) -> the scalar passed by reference, with its size.
    return {(args[0].value, args[1]): (args[2]._obj.value, args[3]) for args in lib.named(name)}


def test_ltgemm_descriptors_and_run_arguments(monkeypatch) -> None:
    monkeypatch.setattr(cublaslt, "_ALGO_CACHE", {})
    h = _FakeHandle()
    spec = GemmCall(3, 5, 7, 4, True, False, "bfloat16", "f32_from_half", out_dtype="float32",
                    epilogue=Epilogue(bias=True, activation="gelu_tanh"))
    gemm = cublaslt.LtGemm(h, spec, 4096)
    lib = h.lib
    (desc_args,) = lib.named("cublasLtMatmulDescCreate")
    assert desc_args[1:] == (cublas.CUBLAS_COMPUTE_32F, 0)
    desc = desc_args[0]._obj.value
    attrs = _attr_values(lib, "cublasLtMatmulDescSetAttribute")
    assert attrs[(desc, 3)] == (0, 4) and attrs[(desc, 4)] == (1, 4)  # TRANSA N, TRANSB T
    assert attrs[(desc, 7)] == (36, 4)  # GELU_BIAS, uint32
    assert attrs[(desc, 10)] == (0, 8)  # one bias for all 3 batch entries, int64
    layouts = [(a[0]._obj.value, a[1:]) for a in lib.named("cublasLtMatrixLayoutCreate")]
    p = lt_layouts(spec)
    assert [args for _, args in layouts] == [(x.dtype, x.rows, x.cols, x.ld) for x in (p.a, p.b, p.c)]
    battrs = _attr_values(lib, "cublasLtMatrixLayoutSetAttribute")
    for (handle, _), lay in zip(layouts, (p.a, p.b, p.c)):
        assert battrs[(handle, 5)] == (3, 4) and battrs[(handle, 6)] == (lay.stride, 8)
    pref_args, schemes = lib.named("cublasLtMatmulPreferenceSetAttribute")
    assert (pref_args[1], pref_args[2]._obj.value, pref_args[3]) == (1, 4096, 8)
    # every reduction scheme offered, as cuBLASLt's default (a knob for probes)
    assert (schemes[1], schemes[2]._obj.value, schemes[3]) == (3, 7, 4)
    # No buffers: heuristic #0, unmeasured.
    assert (gemm.algo_index, gemm.workspace_needed, gemm.timings_us) == (0, 0, None)

    gemm.run(h, 0x10000, 0x20000, 0x30000, 0x40000, 4096, 0x77, bias=0x50000)
    (mm,) = lib.named("cublasLtMatmul")
    (la, _), (lb, _), (lc, _) = layouts
    assert mm[0].value == 0x42 and mm[1].value == desc
    assert (mm[2]._obj.value, mm[7]._obj.value) == (1.0, 0.0)  # host alpha, beta
    # cuBLASLt's A is our B and its B our A; C and D are both our C.
    assert (mm[3], mm[5]) == (0x20000, 0x10000)
    assert (mm[4].value, mm[6].value, mm[9].value, mm[11].value) == (la, lb, lc, lc)
    assert (mm[8], mm[10]) == (0x30000, 0x30000)
    assert mm[12]._obj.data[0] == 100 and mm[13:] == (0x40000, 4096, 0x77)
    assert _attr_values(lib, "cublasLtMatmulDescSetAttribute")[(desc, 8)] == (0x50000, 8)

    gemm.close()
    destroyed = {n for n, _ in lib.calls if n.endswith("Destroy")}
    assert destroyed == {"cublasLtMatrixLayoutDestroy", "cublasLtMatmulPreferenceDestroy",
                         "cublasLtMatmulDescDestroy"}
    assert len(lib.named("cublasLtMatrixLayoutDestroy")) == 3
    gemm.close()  # idempotent
    assert len(lib.named("cublasLtMatrixLayoutDestroy")) == 3


def test_ltgemm_measured_choice_is_cached(monkeypatch) -> None:
    monkeypatch.setattr(cublaslt, "_ALGO_CACHE", {})
    timed = []

    def fake_time_all(self, handle, results, buffers):
        timed.append([r.algo.data[0] for r in results])
        return [5.0, 2.0][: len(results)]

    monkeypatch.setattr(cublaslt.LtGemm, "_time_all", fake_time_all)
    spec = GemmCall(1, 8, 8, 8, False, False, "float32", "tf32")
    bufs = cublaslt.GemmBuffers(0x100, 0x200, 0x300, 0x400)
    h = _FakeHandle()
    heuristic_only = cublaslt.LtGemm(h, spec, 4096)  # caches #0, unmeasured
    first = cublaslt.LtGemm(h, spec, 4096, buffers=bufs)  # measures anyway
    assert timed == [[100, 102]]  # the failing candidate (state != 0) is never timed
    assert (heuristic_only.algo_index, first.algo_index) == (0, 1)
    assert first.workspace_needed == 2048 and first.timings_us == (5.0, 2.0)
    # The same problem on other operands (a plan's Vars) shares the entry, and the
    # cache holds no operands.
    vars_ = [Var((1, 8, 8), np.dtype("float32")) for _ in range(3)]
    again = cublaslt.LtGemm(h, GemmCall(1, 8, 8, 8, False, False, "float32", "tf32",
                                        a=vars_[0], b=vars_[1], c=vars_[2]), 4096, buffers=bufs)
    assert all(key[0].operands == (None,) * 5 for key in cublaslt._ALGO_CACHE)
    plain = cublaslt.LtGemm(h, spec, 4096)
    assert len(timed) == 1 and again.algo_index == plain.algo_index == 1
    other_ws = cublaslt.LtGemm(h, spec, 0, buffers=bufs)  # workspace size is in the key
    assert len(timed) == 2
    for g in (heuristic_only, first, again, plain, other_ws):
        g.close()


def test_ltgemm_residual_is_read_as_c_and_written_as_d(monkeypatch) -> None:
    monkeypatch.setattr(cublaslt, "_ALGO_CACHE", {})
    h = _FakeHandle()
    spec = GemmCall(1, 8, 8, 8, False, False, "float32", "tf32", beta=1.0,
                    epilogue=Epilogue(residual=True, activation="relu"))
    gemm = cublaslt.LtGemm(h, spec, 4096)
    gemm.run(h, 0x100, 0x200, 0x300, 0x400, 4096, 0, residual=0x500)
    (mm,) = h.lib.named("cublasLtMatmul")
    assert (mm[7]._obj.value, mm[8], mm[10]) == (1.0, 0x500, 0x300)  # beta, C = R, D = our C
    assert _attr_values(h.lib, "cublasLtMatmulDescSetAttribute")[(mm[1].value, 7)] == (2, 4)
    with pytest.raises(ValueError, match="residual"):
        gemm.run(h, 0x100, 0x200, 0x300, 0x400, 4096, 0)
    gemm.close()


def test_ltgemm_run_validates(monkeypatch) -> None:
    monkeypatch.setattr(cublaslt, "_ALGO_CACHE", {})
    h = _FakeHandle()
    gemm = cublaslt.LtGemm(h, GemmCall(1, 8, 8, 8, False, False, "float32", "f32"), 4096)
    with pytest.raises(ValueError, match="aligned"):
        gemm.run(h, 0x104, 0x200, 0x300, 0x400, 4096, 0)
    with pytest.raises(ValueError, match="bias"):
        gemm.run(h, 0x100, 0x200, 0x300, 0x400, 4096, 0, bias=0x500)
    gemm.close()
    with pytest.raises(RuntimeError, match="closed"):
        gemm.run(h, 0x100, 0x200, 0x300, 0x400, 4096, 0)

"""Thin ctypes layer over libcublas (v2 API) that stays usable under stream capture.

CuPy refuses every cuBLAS call while a stream is capturing, but libcublas itself
is capture-safe as long as each capturing stream has its own handle, bound to
that stream and given its own workspace *before* capture begins (a workspace
shared by two streams is a data race, and cuBLAS allocating one lazily during
capture is not allowed). This module therefore exposes exactly that: one
`CublasHandle` per stream, plus a row-major strided-batched GEMM.

Nothing here touches the GPU or loads libcublas at import time, so the package
imports on machines without CUDA; `loader` finds and loads it on first use. The
problem is described by the plan's `GemmCall` record (its operands are not used here).

Constant values below are taken from the CUDA 13.0 headers
(cublas_api.h with CUBLAS_VER_MAJOR 13 / MINOR 0, and library_types.h).
"""

from __future__ import annotations

import ctypes
from dataclasses import dataclass
from typing import TYPE_CHECKING

from . import loader

if TYPE_CHECKING:
    from nimblejax.compiler.lowering.task import GemmCall

__all__ = [
    "CublasError",
    "CublasHandle",
    "ColumnMajorGemm",
    "column_major_gemm",
    "compute_type",
    "cuda_dtype",
    "gemm_strided_batched",
    "itemsize",
]

# ---------------------------------------------------------------------------
# Constants (values cited from the CUDA 13.0 headers)
# ---------------------------------------------------------------------------

# cublasStatus_t, cublas_api.h
_STATUS_NAMES: dict[int, str] = {
    0: "CUBLAS_STATUS_SUCCESS",
    1: "CUBLAS_STATUS_NOT_INITIALIZED",
    3: "CUBLAS_STATUS_ALLOC_FAILED",
    7: "CUBLAS_STATUS_INVALID_VALUE",
    8: "CUBLAS_STATUS_ARCH_MISMATCH",
    11: "CUBLAS_STATUS_MAPPING_ERROR",
    13: "CUBLAS_STATUS_EXECUTION_FAILED",
    14: "CUBLAS_STATUS_INTERNAL_ERROR",
    15: "CUBLAS_STATUS_NOT_SUPPORTED",
    16: "CUBLAS_STATUS_LICENSE_ERROR",
}

# cublasOperation_t, cublas_api.h: CUBLAS_OP_N = 0, CUBLAS_OP_T = 1
CUBLAS_OP_N = 0
CUBLAS_OP_T = 1

# cublasPointerMode_t, cublas_api.h: CUBLAS_POINTER_MODE_HOST = 0
CUBLAS_POINTER_MODE_HOST = 0

# cublasMath_t, cublas_api.h: CUBLAS_DEFAULT_MATH = 0
CUBLAS_DEFAULT_MATH = 0

# cublasGemmAlgo_t, cublas_api.h: CUBLAS_GEMM_DEFAULT = -1
CUBLAS_GEMM_DEFAULT = -1

# cublasComputeType_t, cublas_api.h
CUBLAS_COMPUTE_32F = 68
CUBLAS_COMPUTE_32F_FAST_TF32 = 77

# cudaDataType_t, library_types.h
CUDA_R_32F = 0
CUDA_R_16F = 2
CUDA_R_16BF = 14

_DTYPES: dict[str, tuple[int, int]] = {
    # name -> (cudaDataType_t, itemsize in bytes)
    "float32": (CUDA_R_32F, 4),
    "float16": (CUDA_R_16F, 2),
    "bfloat16": (CUDA_R_16BF, 2),
}

# cuBLAS compute type of each GemmCall.compute ('f32' on float32 is true FP32: no
# TF32, because handles are created with CUBLAS_DEFAULT_MATH; half inputs always
# accumulate in FP32). GemmCall checks which modes go with which dtype.
_COMPUTE_TYPES: dict[str, int] = {
    "f32": CUBLAS_COMPUTE_32F,
    "tf32": CUBLAS_COMPUTE_32F_FAST_TF32,
    "f32_from_half": CUBLAS_COMPUTE_32F,
}

# cuBLAS rejects a user workspace whose address is not 256-byte aligned.
_WORKSPACE_ALIGNMENT = 256


# ---------------------------------------------------------------------------
# Errors
# ---------------------------------------------------------------------------


class CublasError(loader.LibraryError):
    """A cuBLAS call returned a status other than CUBLAS_STATUS_SUCCESS."""

    @classmethod
    def name_of(cls, status: int) -> str:
        return status_name(status)


def status_name(status: int) -> str:
    return _STATUS_NAMES.get(status, f"CUBLAS_STATUS_UNKNOWN_{status}")


_check = CublasError.check


# ---------------------------------------------------------------------------
# Loading libcublas
# ---------------------------------------------------------------------------


_c_handle = ctypes.c_void_p


def _declare(lib: ctypes.CDLL) -> None:
    # Explicit prototypes: without them ctypes would truncate pointers and
    # 64-bit strides to C int.
    h, vp, i, ll = _c_handle, ctypes.c_void_p, ctypes.c_int, ctypes.c_longlong
    protos: dict[str, list[type]] = {
        "cublasCreate_v2": [ctypes.POINTER(_c_handle)],
        "cublasDestroy_v2": [h],
        "cublasSetStream_v2": [h, vp],
        "cublasSetWorkspace_v2": [h, vp, ctypes.c_size_t],
        "cublasSetMathMode": [h, i],
        "cublasSetPointerMode_v2": [h, i],
        # handle, transa, transb, m, n, k, alpha,
        # A, Atype, lda, strideA, B, Btype, ldb, strideB,
        # beta, C, Ctype, ldc, strideC, batchCount, computeType, algo
        "cublasGemmStridedBatchedEx": [
            h, i, i, i, i, i, vp,
            vp, i, i, ll, vp, i, i, ll,
            vp, vp, i, i, ll, i, i, i,
        ],
    }
    for name, argtypes in protos.items():
        fn = getattr(lib, name)
        fn.argtypes = argtypes
        fn.restype = ctypes.c_int


def _library() -> ctypes.CDLL:
    """libcublas with its prototypes declared, loaded on first use (never at import)."""
    return loader.load("cublas", _declare)


# ---------------------------------------------------------------------------
# Handles
# ---------------------------------------------------------------------------


class CublasHandle:
    """A cuBLAS handle bound to one CUDA stream with its own workspace.

    Create it (and keep `workspace_ptr` alive, e.g. a 32 MiB cupy.ndarray)
    before capturing `stream`; then any number of `gemm_strided_batched`
    calls on it can be captured into a graph. Never share a handle or a
    workspace between streams.
    """

    def __init__(self, stream: int, workspace_ptr: int, workspace_bytes: int) -> None:
        if workspace_ptr % _WORKSPACE_ALIGNMENT:
            raise ValueError(
                f"workspace pointer {workspace_ptr:#x} is not "
                f"{_WORKSPACE_ALIGNMENT}-byte aligned"
            )
        if workspace_bytes <= 0:
            raise ValueError("workspace_bytes must be positive")
        self.stream = int(stream)
        self.workspace_ptr = int(workspace_ptr)
        self.workspace_bytes = int(workspace_bytes)
        self._lib = _library()
        self._handle: ctypes.c_void_p | None = self._create()
        try:
            self._configure()
        except BaseException:
            self.destroy()
            raise

    def _create(self) -> ctypes.c_void_p:
        handle = _c_handle()
        _check("cublasCreate_v2", self._lib.cublasCreate_v2(ctypes.byref(handle)))
        return handle

    def _configure(self) -> None:
        lib, h = self._lib, self._handle
        # cublasSetStream resets the workspace to cuBLAS's default pool, so the
        # user workspace must be set after it.
        _check("cublasSetStream_v2", lib.cublasSetStream_v2(h, self.stream))
        _check(
            "cublasSetWorkspace_v2",
            lib.cublasSetWorkspace_v2(h, self.workspace_ptr, self.workspace_bytes),
        )
        # Default math keeps compute 'f32' true FP32 (no implicit TF32).
        _check("cublasSetMathMode", lib.cublasSetMathMode(h, CUBLAS_DEFAULT_MATH))
        # alpha/beta are host floats: read at enqueue time, so captured graphs
        # bake their values in and need no device scalars.
        _check(
            "cublasSetPointerMode_v2",
            lib.cublasSetPointerMode_v2(h, CUBLAS_POINTER_MODE_HOST),
        )

    @property
    def raw(self) -> ctypes.c_void_p:
        if self._handle is None:
            raise RuntimeError("cuBLAS handle already destroyed")
        return self._handle

    @property
    def lib(self) -> ctypes.CDLL:
        return self._lib

    def destroy(self) -> None:
        """Release the handle; idempotent. The workspace stays the caller's."""
        if self._handle is None:
            return
        handle, self._handle = self._handle, None
        _check("cublasDestroy_v2", self._lib.cublasDestroy_v2(handle))


# ---------------------------------------------------------------------------
# GEMM
# ---------------------------------------------------------------------------


def itemsize(dtype_name: str) -> int:
    """Bytes per element of a GEMM storage dtype ('float32', 'float16', 'bfloat16')."""
    return _DTYPES[dtype_name][1]


def cuda_dtype(dtype_name: str) -> int:
    """cudaDataType_t of a GEMM storage dtype."""
    return _DTYPES[dtype_name][0]


def compute_type(call: GemmCall) -> int:
    """cublasComputeType_t of a GEMM (from its `compute` mode)."""
    return _COMPUTE_TYPES[call.compute]


@dataclass(frozen=True)
class ColumnMajorGemm:
    """The column-major cuBLAS problem equivalent to a row-major GemmCall.

    `first` is what cuBLAS calls A (our B buffer), `second` its B (our A).
    """

    trans_first: int
    trans_second: int
    m: int
    n: int
    k: int
    ld_first: int
    ld_second: int
    ldc: int
    stride_first: int
    stride_second: int
    stride_c: int


def column_major_gemm(call: GemmCall) -> ColumnMajorGemm:
    """Map row-major C = op(A) op(B) to column-major C^T = op(B)^T op(A)^T.

    A row-major (r x c) buffer is, read column-major, its transpose (c x r,
    ld = c). So C's buffer is C^T (n x m, ldc = n), and we hand cuBLAS our B
    buffer as its first operand and our A buffer as its second, with the
    original transpose flags and m/n swapped. A row-major leading dimension (a
    stored row's distance to the next) is the column-major one of the transpose:
    the call's lda/ldb/ldc and batch strides carry over unchanged (GemmCall.layout).
    """
    (lda, stride_a), (ldb, stride_b), (ldc, stride_c) = (call.layout(w) for w in "abc")
    return ColumnMajorGemm(
        trans_first=CUBLAS_OP_T if call.trans_b else CUBLAS_OP_N,
        trans_second=CUBLAS_OP_T if call.trans_a else CUBLAS_OP_N,
        m=call.n,
        n=call.m,
        k=call.k,
        ld_first=ldb,
        ld_second=lda,
        ldc=ldc,
        stride_first=stride_b,
        stride_second=stride_a,
        stride_c=stride_c,
    )


def gemm_strided_batched(
    handle: CublasHandle, call: GemmCall, a_ptr: int, b_ptr: int, c_ptr: int
) -> None:
    """Enqueue C = alpha * op(A) @ op(B) + beta * C on the handle's stream.

    Pointers are device addresses of row-major buffers laid out as the call's
    lda/ldb/ldc and batch strides say (contiguous by default). Capture-safe when the handle was
    configured before capture started.
    """
    cm = column_major_gemm(call)
    dtype = cuda_dtype(call.dtype)
    # Scale type for every CUBLAS_COMPUTE_32F* compute type is float.
    alpha = ctypes.c_float(call.alpha)
    beta = ctypes.c_float(call.beta)
    status = handle.lib.cublasGemmStridedBatchedEx(
        handle.raw,
        cm.trans_first,
        cm.trans_second,
        cm.m,
        cm.n,
        cm.k,
        ctypes.byref(alpha),
        b_ptr,
        dtype,
        cm.ld_first,
        cm.stride_first,
        a_ptr,
        dtype,
        cm.ld_second,
        cm.stride_second,
        ctypes.byref(beta),
        c_ptr,
        cuda_dtype(call.out_dtype or call.dtype),
        cm.ldc,
        cm.stride_c,
        call.batch,
        compute_type(call),
        CUBLAS_GEMM_DEFAULT,
    )
    _check("cublasGemmStridedBatchedEx", status)

"""Thin ctypes layer over libcublas (v2 API) that stays usable under stream capture.

CuPy refuses every cuBLAS call while a stream is capturing, but libcublas itself
is capture-safe as long as each capturing stream has its own handle, bound to
that stream and given its own workspace *before* capture begins (a workspace
shared by two streams is a data race, and cuBLAS allocating one lazily during
capture is not allowed). This module therefore exposes exactly that: one
`CublasHandle` per stream, plus a row-major strided-batched GEMM.

Nothing here touches the GPU or loads libcublas at import time, so the package
imports on machines without CUDA.

Constant values below are taken from the CUDA 13.0 headers
(cublas_api.h with CUBLAS_VER_MAJOR 13 / MINOR 0, and library_types.h).
"""

from __future__ import annotations

import ctypes
import ctypes.util
import importlib.util
import os
import threading
from dataclasses import dataclass
from typing import Iterator

__all__ = [
    "CublasError",
    "CublasHandle",
    "CublasNotFoundError",
    "ColumnMajorGemm",
    "GemmSpec",
    "column_major_gemm",
    "find_libcublas",
    "gemm_strided_batched",
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

# Which compute modes make sense for which storage type. 'f32' on float32 is
# true FP32 (no TF32, because handles are created with CUBLAS_DEFAULT_MATH);
# half inputs always accumulate in FP32 ('f32_from_half').
_COMPUTE_FOR_DTYPE: dict[str, dict[str, int]] = {
    "float32": {"f32": CUBLAS_COMPUTE_32F, "tf32": CUBLAS_COMPUTE_32F_FAST_TF32},
    "float16": {"f32_from_half": CUBLAS_COMPUTE_32F},
    "bfloat16": {"f32_from_half": CUBLAS_COMPUTE_32F},
}

_INT32_MAX = 2**31 - 1
# cuBLAS rejects a user workspace whose address is not 256-byte aligned.
_WORKSPACE_ALIGNMENT = 256

_SONAMES = ("libcublas.so.13", "libcublas.so.12")
# Layouts of the NVIDIA pip wheels: CUDA 13 wheels share nvidia/cu13/lib,
# CUDA 12 wheels use one directory per library.
_WHEEL_LIB_DIRS = ("cu13/lib", "cublas/lib")
_ENV_OVERRIDE = "NIMBLEJAX_LIBCUBLAS"


# ---------------------------------------------------------------------------
# Errors
# ---------------------------------------------------------------------------


class CublasError(RuntimeError):
    """A cuBLAS call returned a status other than CUBLAS_STATUS_SUCCESS."""

    def __init__(self, function: str, status: int) -> None:
        self.function = function
        self.status = status
        self.status_name = status_name(status)
        super().__init__(f"{function} failed: {self.status_name} ({status})")


class CublasNotFoundError(OSError):
    """libcublas could not be located or loaded."""


def status_name(status: int) -> str:
    return _STATUS_NAMES.get(status, f"CUBLAS_STATUS_UNKNOWN_{status}")


def _check(function: str, status: int) -> None:
    if status != 0:
        raise CublasError(function, status)


# ---------------------------------------------------------------------------
# Locating and loading libcublas
# ---------------------------------------------------------------------------


def _nvidia_namespace_dirs() -> list[str]:
    # `nvidia` is a namespace package spread over site-packages; find_spec
    # avoids importing anything and returns every portion of it.
    try:
        spec = importlib.util.find_spec("nvidia")
    except (ImportError, ValueError):
        return []
    if spec is None or spec.submodule_search_locations is None:
        return []
    return list(spec.submodule_search_locations)


def _wheel_candidates() -> Iterator[str]:
    roots = _nvidia_namespace_dirs()
    # Prefer the CUDA 13 soname everywhere before falling back to CUDA 12.
    for soname in _SONAMES:
        for root in roots:
            for sub in _WHEEL_LIB_DIRS:
                yield os.path.join(root, sub, soname)


def _pathfinder_path() -> str | None:
    try:
        from cuda.pathfinder import load_nvidia_dynamic_lib
    except ImportError:
        return None
    try:
        # Loads libcublasLt too; the handle is cached by pathfinder and must
        # never be closed, so we only keep the path.
        return load_nvidia_dynamic_lib("cublas").abs_path
    except Exception:  # pathfinder raises several not-found error types
        return None


def _toolkit_candidates() -> Iterator[str]:
    roots = [os.environ.get(var) for var in ("CUDA_PATH", "CUDA_HOME")]
    # The conventional toolkit location, often not on the loader path.
    roots.append("/usr/local/cuda")
    for root in roots:
        if root:
            for soname in _SONAMES:
                yield os.path.join(root, "lib64", soname)


def find_libcublas() -> str:
    """Return a path (or loadable soname) for libcublas, CUDA 13 preferred.

    Order: $NIMBLEJAX_LIBCUBLAS, NVIDIA pip wheels (nvidia/cu13/lib,
    nvidia/cublas/lib), cuda.pathfinder (what CuPy uses), $CUDA_PATH /
    $CUDA_HOME / /usr/local/cuda, then the system loader via
    ctypes.util.find_library.
    """
    tried: list[str] = []
    override = os.environ.get(_ENV_OVERRIDE)
    if override:
        if os.path.exists(override):
            return override
        tried.append(f"${_ENV_OVERRIDE}={override}")
    for path in _wheel_candidates():
        if os.path.exists(path):
            return path
        tried.append(path)
    found = _pathfinder_path()
    if found:
        return found
    tried.append("cuda.pathfinder.load_nvidia_dynamic_lib('cublas')")
    for path in _toolkit_candidates():
        if os.path.exists(path):
            return path
        tried.append(path)
    soname = ctypes.util.find_library("cublas")
    if soname:
        return soname
    tried.append("ctypes.util.find_library('cublas')")
    raise CublasNotFoundError(
        "libcublas (.so.13 or .so.12) not found; install the 'nvidia-cublas' "
        "wheel or a CUDA toolkit. Tried: " + "; ".join(tried)
    )


_c_handle = ctypes.c_void_p
_lib: ctypes.CDLL | None = None
_lib_lock = threading.Lock()


def _preload_cublaslt(path: str) -> None:
    # libcublas depends on libcublasLt from the same directory; loading it
    # first (globally) avoids relying on the wheel's RPATH or LD_LIBRARY_PATH.
    directory = os.path.dirname(path)
    if not directory:
        return
    name = os.path.basename(path).replace("libcublas.", "libcublasLt.", 1)
    lt_path = os.path.join(directory, name)
    if os.path.exists(lt_path):
        ctypes.CDLL(lt_path, mode=ctypes.RTLD_GLOBAL)


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
    """Load libcublas once, on first use (never at import)."""
    global _lib
    with _lib_lock:
        if _lib is None:
            path = find_libcublas()
            try:
                _preload_cublaslt(path)
                lib = ctypes.CDLL(path)
            except OSError as exc:
                raise CublasNotFoundError(f"cannot load {path}: {exc}") from exc
            _declare(lib)
            _lib = lib
        return _lib


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

    def __enter__(self) -> CublasHandle:
        return self

    def __exit__(self, *exc: object) -> None:
        self.destroy()


# ---------------------------------------------------------------------------
# GEMM
# ---------------------------------------------------------------------------


@dataclass(frozen=True)
class GemmSpec:
    """Row-major batched GEMM: C[b] (m x n) = op(A[b]) @ op(B[b]).

    A[b] is stored row-major as (m, k), or (k, m) when trans_a; B[b] as
    (k, n), or (n, k) when trans_b; C[b] is contiguous (m, n). Consecutive
    batch entries are contiguous matrices (stride = matrix size).
    compute: 'f32' or 'tf32' for float32, 'f32_from_half' for float16/bfloat16.
    """

    batch: int
    m: int
    n: int
    k: int
    trans_a: bool
    trans_b: bool
    dtype: str
    compute: str
    alpha: float = 1.0
    beta: float = 0.0
    out_dtype: str | None = None  # C's dtype when it differs (bf16 x bf16 -> f32)

    def __post_init__(self) -> None:
        if self.out_dtype is not None and self.out_dtype not in _DTYPES:
            raise ValueError(f"GemmSpec.out_dtype={self.out_dtype!r}; expected one of {list(_DTYPES)}")
        for name in ("batch", "m", "n", "k"):
            value = getattr(self, name)
            if not 1 <= value <= _INT32_MAX:
                raise ValueError(f"GemmSpec.{name}={value} must be in [1, 2**31)")
        if self.dtype not in _DTYPES:
            raise ValueError(f"GemmSpec.dtype={self.dtype!r}; expected one of {list(_DTYPES)}")
        allowed = _COMPUTE_FOR_DTYPE[self.dtype]
        if self.compute not in allowed:
            raise ValueError(
                f"GemmSpec.compute={self.compute!r} invalid for dtype {self.dtype!r}; "
                f"expected one of {list(allowed)}"
            )

    @property
    def a_shape(self) -> tuple[int, int, int]:
        return (self.batch, self.k, self.m) if self.trans_a else (self.batch, self.m, self.k)

    @property
    def b_shape(self) -> tuple[int, int, int]:
        return (self.batch, self.n, self.k) if self.trans_b else (self.batch, self.k, self.n)

    @property
    def c_shape(self) -> tuple[int, int, int]:
        return (self.batch, self.m, self.n)

    @property
    def itemsize(self) -> int:
        return _DTYPES[self.dtype][1]

    @property
    def cuda_dtype(self) -> int:
        return _DTYPES[self.dtype][0]

    @property
    def compute_type(self) -> int:
        return _COMPUTE_FOR_DTYPE[self.dtype][self.compute]


@dataclass(frozen=True)
class ColumnMajorGemm:
    """The column-major cuBLAS problem equivalent to a row-major GemmSpec.

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


def column_major_gemm(spec: GemmSpec) -> ColumnMajorGemm:
    """Map row-major C = op(A) op(B) to column-major C^T = op(B)^T op(A)^T.

    A row-major (r x c) buffer is, read column-major, its transpose (c x r,
    ld = c). So C's buffer is C^T (n x m, ldc = n), and we hand cuBLAS our B
    buffer as its first operand and our A buffer as its second, with the
    original transpose flags and m/n swapped.
    """
    m, n, k = spec.m, spec.n, spec.k
    return ColumnMajorGemm(
        trans_first=CUBLAS_OP_T if spec.trans_b else CUBLAS_OP_N,
        trans_second=CUBLAS_OP_T if spec.trans_a else CUBLAS_OP_N,
        m=n,
        n=m,
        k=k,
        # Leading dim = row length of the row-major stored matrix.
        ld_first=k if spec.trans_b else n,
        ld_second=m if spec.trans_a else k,
        ldc=n,
        stride_first=k * n,
        stride_second=m * k,
        stride_c=m * n,
    )


def gemm_strided_batched(
    handle: CublasHandle, spec: GemmSpec, a_ptr: int, b_ptr: int, c_ptr: int
) -> None:
    """Enqueue C = alpha * op(A) @ op(B) + beta * C on the handle's stream.

    Pointers are device addresses of contiguous row-major buffers shaped
    spec.a_shape / b_shape / c_shape. Capture-safe when the handle was
    configured before capture started.
    """
    cm = column_major_gemm(spec)
    dtype = spec.cuda_dtype
    # Scale type for every CUBLAS_COMPUTE_32F* compute type is float.
    alpha = ctypes.c_float(spec.alpha)
    beta = ctypes.c_float(spec.beta)
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
        _DTYPES[spec.out_dtype or spec.dtype][0],
        cm.ldc,
        cm.stride_c,
        spec.batch,
        spec.compute_type,
        CUBLAS_GEMM_DEFAULT,
    )
    _check("cublasGemmStridedBatchedEx", status)

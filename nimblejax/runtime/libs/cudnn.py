"""A thin ctypes layer over cuDNN's convolution API (cudnnConvolutionForward).

Why ctypes: CuPy 14 has no cuDNN, the cuDNN frontend would have to travel as a wheel,
and the dozen calls needed are a stable C API. cuDNN itself is already on any machine
where JAX runs on CUDA (the nvidia-cudnn wheel JAX depends on). One handle per stream,
stream and workspace set before capture, as for cuBLAS.

The algorithm of each convolution shape is chosen by measuring
(cudnnFindConvolutionForwardAlgorithm) once, outside capture, and cached.
"""
from __future__ import annotations

import ctypes
import ctypes.util
import glob
import os
import threading
from dataclasses import dataclass
from typing import Optional

# cudnnDataType_t, cudnnTensorFormat_t, cudnnConvolutionMode_t, cudnnMathType_t (cudnn_graph.h)
DATA_TYPE = {"float32": 0, "float16": 2, "bfloat16": 9}
FORMAT_NHWC = 1
CROSS_CORRELATION = 1
DEFAULT_MATH, TENSOR_OP_MATH, FMA_MATH = 0, 1, 3
WORKSPACE_LIMIT = 64 << 20
GEMM_ALGOS = (0, 1, 2)  # cudnnConvolutionFwdAlgo_t: IMPLICIT_GEMM, IMPLICIT_PRECOMP_GEMM, GEMM


class CudnnError(RuntimeError):
    pass


@dataclass(frozen=True)
class ConvSpec:
    """y (N,OH,OW,K) NHWC = conv(x (N,H,W,C) NHWC, w (K,R,S,C/G) KRSC), symmetric padding."""

    x_shape: tuple[int, int, int, int]
    w_shape: tuple[int, int, int, int]
    y_shape: tuple[int, int, int, int]
    padding: tuple[int, int]
    strides: tuple[int, int]
    dilation: tuple[int, int]
    groups: int
    dtype: str
    out_dtype: str
    math: str  # 'tf32' | 'f32' | 'half'


class _Perf(ctypes.Structure):  # cudnnConvolutionFwdAlgoPerf_t
    _fields_ = [("algo", ctypes.c_int), ("status", ctypes.c_int), ("time", ctypes.c_float),
                ("memory", ctypes.c_size_t), ("determinism", ctypes.c_int),
                ("mathType", ctypes.c_int), ("reserved", ctypes.c_int * 3)]


_lib: Optional[ctypes.CDLL] = None
_lock = threading.Lock()
_algo_cache: dict[ConvSpec, tuple[int, int]] = {}


def find_libcudnn() -> str:
    tried = []
    env = os.environ.get("NIMBLEJAX_LIBCUDNN")
    if env:
        return env
    try:
        import nvidia

        for root in list(nvidia.__path__):
            for path in sorted(glob.glob(os.path.join(root, "cudnn", "lib", "libcudnn.so.*"))) + \
                    sorted(glob.glob(os.path.join(root, "cu13", "lib", "libcudnn.so.*"))):
                return path
            tried.append(os.path.join(root, "cudnn/lib"))
    except ImportError:
        tried.append("the nvidia namespace package")
    name = ctypes.util.find_library("cudnn")
    if name:
        return name
    raise CudnnError("libcudnn not found (tried " + ", ".join(tried) + ", the system loader); "
                     "install nvidia-cudnn-cu13 or set NIMBLEJAX_LIBCUDNN")


def lib() -> ctypes.CDLL:
    global _lib
    with _lock:
        if _lib is None:
            _lib = ctypes.CDLL(find_libcudnn(), mode=ctypes.RTLD_GLOBAL)
            _lib.cudnnGetErrorString.restype = ctypes.c_char_p
        return _lib


def check(status: int, what: str) -> None:
    if status != 0:
        msg = lib().cudnnGetErrorString(status).decode()
        raise CudnnError(f"{what} failed: {msg} ({status})")


def _new(kind: str) -> ctypes.c_void_p:
    d = ctypes.c_void_p()
    check(getattr(lib(), f"cudnnCreate{kind}Descriptor")(ctypes.byref(d)), f"cudnnCreate{kind}Descriptor")
    return d


class Handle:
    """A cuDNN handle bound to one CUDA stream."""

    def __init__(self, stream_ptr: int) -> None:
        self.raw = ctypes.c_void_p()
        check(lib().cudnnCreate(ctypes.byref(self.raw)), "cudnnCreate")
        check(lib().cudnnSetStream(self.raw, ctypes.c_void_p(stream_ptr)), "cudnnSetStream")

    def destroy(self) -> None:
        if self.raw:
            lib().cudnnDestroy(self.raw)
            self.raw = ctypes.c_void_p()


class Conv:
    """Descriptors and the measured algorithm of one convolution shape."""

    def __init__(self, spec: ConvSpec, handle: Handle) -> None:
        L = lib()
        self.spec = spec
        dt = DATA_TYPE[spec.dtype]
        self.x, self.w, self.y, self.conv = (_new("Tensor"), _new("Filter"), _new("Tensor"),
                                             _new("Convolution"))
        n, h, w_, c = spec.x_shape
        check(L.cudnnSetTensor4dDescriptor(self.x, FORMAT_NHWC, dt, n, c, h, w_), "x descriptor")
        k, r, s, cg = spec.w_shape
        check(L.cudnnSetFilter4dDescriptor(self.w, dt, FORMAT_NHWC, k, cg, r, s), "w descriptor")
        n, oh, ow, k = spec.y_shape
        check(L.cudnnSetTensor4dDescriptor(self.y, FORMAT_NHWC, DATA_TYPE[spec.out_dtype], n, k, oh, ow),
              "y descriptor")
        check(L.cudnnSetConvolution2dDescriptor(self.conv, *spec.padding, *spec.strides, *spec.dilation,
                                                CROSS_CORRELATION, 0), "convolution descriptor")
        check(L.cudnnSetConvolutionGroupCount(self.conv, spec.groups), "group count")
        math = {"tf32": DEFAULT_MATH, "f32": FMA_MATH, "half": TENSOR_OP_MATH}[spec.math]
        check(L.cudnnSetConvolutionMathType(self.conv, math), "math type")
        self.algo, self.workspace = self._choose(handle)

    def _choose(self, handle: Handle) -> tuple[int, int]:
        """The fastest algorithm that fits the workspace limit, measured once per shape."""
        if self.spec in _algo_cache:
            return _algo_cache[self.spec]
        perf = (_Perf * 8)()
        count = ctypes.c_int()
        check(lib().cudnnFindConvolutionForwardAlgorithm(handle.raw, self.x, self.w, self.conv, self.y, 8,
                                                         ctypes.byref(count), perf),
              "cudnnFindConvolutionForwardAlgorithm")
        for p in perf[: count.value]:
            # FFT and Winograd algorithms lose too much precision on half types (seen
            # failing jax.jit comparisons for bfloat16): implicit GEMMs only there.
            accurate = self.spec.dtype == "float32" or p.algo in GEMM_ALGOS
            if p.status == 0 and p.memory <= WORKSPACE_LIMIT and accurate:
                _algo_cache[self.spec] = (p.algo, p.memory)
                return p.algo, p.memory
        raise CudnnError(f"no cuDNN algorithm runs {self.spec}")

    def forward(self, handle: Handle, x: int, w: int, y: int, workspace: int, workspace_bytes: int) -> None:
        one, zero = ctypes.c_float(1.0), ctypes.c_float(0.0)
        check(lib().cudnnConvolutionForward(
            handle.raw, ctypes.byref(one), self.x, ctypes.c_void_p(x), self.w, ctypes.c_void_p(w),
            self.conv, self.algo, ctypes.c_void_p(workspace), ctypes.c_size_t(workspace_bytes),
            ctypes.byref(zero), self.y, ctypes.c_void_p(y)), "cudnnConvolutionForward")

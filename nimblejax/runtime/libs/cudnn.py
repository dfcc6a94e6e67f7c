"""A thin ctypes layer over cuDNN's convolution API (cudnnConvolutionForward, or
cudnnConvolutionBiasActivationForward for a convolution with a bias, residual and relu
epilogue, and cudnnConvolutionBackwardFilter / BackwardData for the gradients `jax.grad`
emits).

Why ctypes: CuPy 14 has no cuDNN, the cuDNN frontend would have to travel as a wheel,
and the dozen calls needed are a stable C API. cuDNN itself is already on any machine
where JAX runs on CUDA (the nvidia-cudnn wheel JAX depends on). One handle per stream,
stream and workspace set before capture, as for cuBLAS.

The algorithm of each convolution shape is chosen by measuring
(cudnnFind...Algorithm) once, outside capture, and cached. The shape is the
plan's `ConvCall` record (its operands are not used here). `loader` finds and loads
libcudnn on first use, never at import.
"""
from __future__ import annotations

import ctypes
import dataclasses
from typing import TYPE_CHECKING, Optional

from . import loader

if TYPE_CHECKING:
    from nimblejax.compiler.lowering.task import ConvCall

# cudnnDataType_t, cudnnTensorFormat_t, cudnnConvolutionMode_t, cudnnMathType_t (cudnn_graph.h)
DATA_TYPE = {"float32": 0, "float16": 2, "bfloat16": 9}
FORMAT_NHWC = 1
CROSS_CORRELATION = 1
DEFAULT_MATH, TENSOR_OP_MATH, FMA_MATH = 0, 1, 3
WORKSPACE_LIMIT = 64 << 20
ACTIVATION_RELU, PROPAGATE_NAN = 1, 1  # cudnnActivationMode_t, cudnnNanPropagation_t
# The algorithms without FFT or Winograd transforms, which lose too much precision on
# half types: cudnnConvolutionFwdAlgo_t IMPLICIT_GEMM, IMPLICIT_PRECOMP_GEMM, GEMM;
# cudnnConvolutionBwdFilterAlgo_t ALGO_0, ALGO_1, ALGO_3; cudnnConvolutionBwdDataAlgo_t
# ALGO_0, ALGO_1.
GEMM_ALGOS = {"forward": (0, 1, 2), "filter_grad": (0, 1, 3), "data_grad": (0, 1)}


class CudnnError(loader.LibraryError):
    """A cuDNN call returned a status other than CUDNN_STATUS_SUCCESS (or no algorithm
    runs a convolution)."""

    @classmethod
    def name_of(cls, status: int) -> str:
        return _library().cudnnGetErrorString(status).decode()


_check = CudnnError.check


class _Perf(ctypes.Structure):  # cudnnConvolutionFwdAlgoPerf_t (BwdFilter's and BwdData's: the same layout)
    _fields_ = [("algo", ctypes.c_int), ("status", ctypes.c_int), ("time", ctypes.c_float),
                ("memory", ctypes.c_size_t), ("determinism", ctypes.c_int),
                ("mathType", ctypes.c_int), ("reserved", ctypes.c_int * 3)]


# ConvCall without operands -> (algorithm, workspace bytes, math type)
_algo_cache: dict[ConvCall, tuple[int, int, int]] = {}


def _declare(lib: ctypes.CDLL) -> None:
    # The other calls take handles/descriptors (passed as c_void_p) and C ints, which
    # ctypes passes correctly without prototypes.
    lib.cudnnGetErrorString.restype = ctypes.c_char_p


def _library() -> ctypes.CDLL:
    """libcudnn (loaded RTLD_GLOBAL), on first use."""
    return loader.load("cudnn", _declare)


def _new(kind: str) -> ctypes.c_void_p:
    d = ctypes.c_void_p()
    create = f"cudnnCreate{kind}Descriptor"
    _check(create, getattr(_library(), create)(ctypes.byref(d)))
    return d


class Handle:
    """A cuDNN handle bound to one CUDA stream."""

    def __init__(self, stream_ptr: int) -> None:
        self.raw = ctypes.c_void_p()
        _check("cudnnCreate", _library().cudnnCreate(ctypes.byref(self.raw)))
        _check("cudnnSetStream", _library().cudnnSetStream(self.raw, ctypes.c_void_p(stream_ptr)))

    def destroy(self) -> None:
        if self.raw:
            _library().cudnnDestroy(self.raw)
            self.raw = ctypes.c_void_p()


class Conv:
    """Descriptors and the measured algorithm of one convolution shape (a ConvCall)."""

    def __init__(self, call: ConvCall, handle: Handle) -> None:
        L = _library()
        self.call = call
        dt = DATA_TYPE[call.dtype]
        self.x, self.w, self.y, self.conv = (_new("Tensor"), _new("Filter"), _new("Tensor"),
                                             _new("Convolution"))
        n, h, w_, c = call.x_shape
        _check("x descriptor", L.cudnnSetTensor4dDescriptor(self.x, FORMAT_NHWC, dt, n, c, h, w_))
        k, r, s, cg = call.w_shape
        _check("w descriptor", L.cudnnSetFilter4dDescriptor(self.w, dt, FORMAT_NHWC, k, cg, r, s))
        n, oh, ow, k = call.y_shape
        _check("y descriptor", L.cudnnSetTensor4dDescriptor(
            self.y, FORMAT_NHWC, DATA_TYPE[call.out_dtype], n, k, oh, ow))
        _check("convolution descriptor", L.cudnnSetConvolution2dDescriptor(
            self.conv, *call.padding, *call.strides, *call.dilation, CROSS_CORRELATION, 0))
        _check("group count", L.cudnnSetConvolutionGroupCount(self.conv, call.groups))
        math = {"tf32": DEFAULT_MATH, "f32": FMA_MATH, "half": TENSOR_OP_MATH}[call.math]
        _check("math type", L.cudnnSetConvolutionMathType(self.conv, math))
        self.bias = self.activation = None
        if call.epilogue:  # relu(conv + residual + bias): cudnnConvolutionBiasActivationForward
            self.bias, self.activation = _new("Tensor"), ctypes.c_void_p()
            _check("bias descriptor", L.cudnnSetTensor4dDescriptor(
                self.bias, FORMAT_NHWC, DATA_TYPE[call.out_dtype], 1, k, 1, 1))
            _check("cudnnCreateActivationDescriptor", L.cudnnCreateActivationDescriptor(
                ctypes.byref(self.activation)))
            _check("activation descriptor", L.cudnnSetActivationDescriptor(
                self.activation, ACTIVATION_RELU, PROPAGATE_NAN, ctypes.c_double(0.0)))
        self.algo, self.workspace, found_math = self._choose(handle)
        # cuDNN may measure an algorithm under another math type than the descriptor's
        # (tensor ops allowed to convert, say); forward with it then needs that math type
        # on the descriptor, or it fails with CUDNN_STATUS_BAD_PARAM (seen: bf16, C=4).
        _check("math type", L.cudnnSetConvolutionMathType(self.conv, found_math))

    def _choose(self, handle: Handle) -> tuple[int, int, int]:
        """The fastest algorithm that fits the workspace limit, measured once per shape."""
        # Without operands: equal anyway (they are not compared), and the cache keeps no
        # plan's Vars alive.
        key = dataclasses.replace(self.call, x=None, w=None, y=None, bias=None, residual=None)
        if key in _algo_cache:
            return _algo_cache[key]
        perf = (_Perf * 8)()
        count = ctypes.c_int()
        L, mode = _library(), self.call.mode
        if mode == "filter_grad":
            _check("cudnnFindConvolutionBackwardFilterAlgorithm", L.cudnnFindConvolutionBackwardFilterAlgorithm(
                handle.raw, self.x, self.y, self.conv, self.w, 8, ctypes.byref(count), perf))
        elif mode == "data_grad":
            _check("cudnnFindConvolutionBackwardDataAlgorithm", L.cudnnFindConvolutionBackwardDataAlgorithm(
                handle.raw, self.w, self.y, self.conv, self.x, 8, ctypes.byref(count), perf))
        else:
            _check("cudnnFindConvolutionForwardAlgorithm", L.cudnnFindConvolutionForwardAlgorithm(
                handle.raw, self.x, self.w, self.conv, self.y, 8, ctypes.byref(count), perf))
        for p in perf[: count.value]:
            # FFT and Winograd algorithms lose too much precision on half types (seen
            # failing jax.jit comparisons for bfloat16): implicit GEMMs only there.
            accurate = self.call.dtype == "float32" or p.algo in GEMM_ALGOS[mode]
            if p.status == 0 and p.memory <= WORKSPACE_LIMIT and accurate:
                _algo_cache[key] = (p.algo, p.memory, p.mathType)
                return _algo_cache[key]
        raise CudnnError(f"no cuDNN algorithm runs {self.call}")

    def run(self, handle: Handle, x: int, w: int, y: int, bias: Optional[int], residual: Optional[int],
            workspace: int, workspace_bytes: int) -> None:
        """Forward: y from x and w (and its epilogue's bias and residual); filter
        gradient: w from x and y (the output gradient); data gradient: x from w and y."""
        one, zero = ctypes.c_float(1.0), ctypes.c_float(0.0)
        if self.activation is not None:  # y = relu(conv(x, w) + residual + bias)
            z, alpha2 = (residual, one) if residual is not None else (y, zero)
            _check("cudnnConvolutionBiasActivationForward", _library().cudnnConvolutionBiasActivationForward(
                handle.raw, ctypes.byref(one), self.x, ctypes.c_void_p(x), self.w, ctypes.c_void_p(w),
                self.conv, self.algo, ctypes.c_void_p(workspace), ctypes.c_size_t(workspace_bytes),
                ctypes.byref(alpha2), self.y, ctypes.c_void_p(z), self.bias, ctypes.c_void_p(bias),
                self.activation, self.y, ctypes.c_void_p(y)))
            return
        if self.call.mode == "filter_grad":
            _check("cudnnConvolutionBackwardFilter", _library().cudnnConvolutionBackwardFilter(
                handle.raw, ctypes.byref(one), self.x, ctypes.c_void_p(x), self.y, ctypes.c_void_p(y),
                self.conv, self.algo, ctypes.c_void_p(workspace), ctypes.c_size_t(workspace_bytes),
                ctypes.byref(zero), self.w, ctypes.c_void_p(w)))
            return
        if self.call.mode == "data_grad":
            _check("cudnnConvolutionBackwardData", _library().cudnnConvolutionBackwardData(
                handle.raw, ctypes.byref(one), self.w, ctypes.c_void_p(w), self.y, ctypes.c_void_p(y),
                self.conv, self.algo, ctypes.c_void_p(workspace), ctypes.c_size_t(workspace_bytes),
                ctypes.byref(zero), self.x, ctypes.c_void_p(x)))
            return
        _check("cudnnConvolutionForward", _library().cudnnConvolutionForward(
            handle.raw, ctypes.byref(one), self.x, ctypes.c_void_p(x), self.w, ctypes.c_void_p(w),
            self.conv, self.algo, ctypes.c_void_p(workspace), ctypes.c_size_t(workspace_bytes),
            ctypes.byref(zero), self.y, ctypes.c_void_p(y)))

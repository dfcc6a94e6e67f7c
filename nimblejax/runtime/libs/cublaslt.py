"""Capture-safe cuBLASLt GEMM through ctypes, with a measured algorithm choice.

`LtGemm` computes what `cublas.gemm_strided_batched` does, via cublasLtMatmul,
plus the GemmCall's epilogue. Once per (GemmCall, workspace size) it takes up to
8 candidates from cublasLtMatmulAlgoGetHeuristic (asked with the epilogue) and,
given device buffers (for their stream and workspace), times each outside any capture
on fresh operands filled with random values of their dtypes, and keeps the fastest.
`run` only enqueues cublasLtMatmul with the frozen algorithm, descriptors and
host scalars: it can be graph-captured.

Epilogues (GemmCall.epilogue): `bias` adds a length-n vector (output dtype, the
bias type cuBLASLt assumes by default) to every row of the row-major C. Under
the row-major -> column-major swap cuBLASLt computes D' = C^T (n x m), and
CUBLASLT_EPILOGUE_BIAS adds a vector as long as D's *rows* (n) to each column
of D', i.e. bias[j] to C[i, j] for every i: exactly a dense layer's bias. One
bias serves every batch entry (BIAS_BATCH_STRIDE 0). `residual` reads a
separate matrix R of C's layout as cuBLASLt's C (beta = 1) and writes our C as
its D. 'relu' and 'gelu_tanh' are applied last. cuBLASLt's GELU is taken to be
the tanh approximation (jax.nn.gelu(approximate=True)), the form XLA fuses into
it; tests/runtime/libs/test_cublaslt_numerics.py::test_gelu_is_the_tanh_approximation checks this.

Nothing loads libcublasLt at import time (`loader` finds and loads it on first
use, next to libcublas). Constant values and struct layouts are from the CUDA 13
headers cublasLt.h and library_types.h (cross-checked with nvmath-python's
bindings generated from cublasLt.h 11.0.3..13.1.0).
"""

from __future__ import annotations

import contextlib
import ctypes
import dataclasses
from dataclasses import dataclass
from typing import TYPE_CHECKING


from . import cublas, fill, loader
from .fill import fill_values
from .cublas import CublasError, _check, column_major_gemm, compute_type, cuda_dtype

if TYPE_CHECKING:
    from nimblejax.compiler.lowering.task import Epilogue, GemmCall

__all__ = ["GemmBuffers", "LtGemm", "LtHandle", "LtLayout", "LtProblem",
           "epilogue_code", "lt_layouts"]

# cublasLtMatmulDescAttributes_t, cublasLt.h (value type in the comment)
CUBLASLT_MATMUL_DESC_TRANSA = 3         # int32 cublasOperation_t
CUBLASLT_MATMUL_DESC_TRANSB = 4         # int32 cublasOperation_t
CUBLASLT_MATMUL_DESC_EPILOGUE = 7       # uint32 cublasLtEpilogue_t
CUBLASLT_MATMUL_DESC_BIAS_POINTER = 8   # const void*
CUBLASLT_MATMUL_DESC_BIAS_BATCH_STRIDE = 10  # int64, in elements
# cublasLtMatrixLayoutAttribute_t, cublasLt.h
CUBLASLT_MATRIX_LAYOUT_BATCH_COUNT = 5           # int32
CUBLASLT_MATRIX_LAYOUT_STRIDED_BATCH_OFFSET = 6  # int64, in elements
# cublasLtMatmulPreferenceAttributes_t, cublasLt.h
CUBLASLT_MATMUL_PREF_MAX_WORKSPACE_BYTES = 1     # uint64
CUBLASLT_MATMUL_PREF_REDUCTION_SCHEME_MASK = 3   # uint32 of cublasLtReductionScheme_t bits
# cublasLtReductionScheme_t: how a K split is summed (no split needs none). INPLACE sums in
# the output inside the GEMM's own kernel; COMPUTE_TYPE and OUTPUT_TYPE sum partials kept
# in the workspace in a second kernel.
REDUCTION_INPLACE, REDUCTION_COMPUTE_TYPE, REDUCTION_OUTPUT_TYPE = 1, 2, 4
# cublasLtEpilogue_t, cublasLt.h: RELU_BIAS = RELU|BIAS, GELU_BIAS = GELU|BIAS
CUBLASLT_EPILOGUE_DEFAULT = 1
CUBLASLT_EPILOGUE_RELU = 2
CUBLASLT_EPILOGUE_BIAS = 4
CUBLASLT_EPILOGUE_GELU = 32
# cudaDataType_t, library_types.h: alpha/beta are float for all our compute types.
SCALE_TYPE = cublas.CUDA_R_32F
CUBLAS_STATUS_NOT_SUPPORTED = 15  # cublasStatus_t, cublas_api.h

REQUESTED_ALGOS = 8
# The reduction schemes the heuristic may offer (cuBLASLt's default: every one).
REDUCTION_SCHEMES = REDUCTION_INPLACE | REDUCTION_COMPUTE_TYPE | REDUCTION_OUTPUT_TYPE
TIMED_LAUNCHES = 10
# cuBLASLt's CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_*_BYTES default: chosen
# algorithms may assume every matrix pointer is this aligned.
POINTER_ALIGNMENT = 256
ACTIVATION_CODES = {"none": 0, "relu": CUBLASLT_EPILOGUE_RELU, "gelu_tanh": CUBLASLT_EPILOGUE_GELU}


class MatmulAlgo(ctypes.Structure):
    """cublasLtMatmulAlgo_t: typedef struct { uint64_t data[8]; }."""

    _fields_ = [("data", ctypes.c_uint64 * 8)]


class HeuristicResult(ctypes.Structure):
    """cublasLtMatmulHeuristicResult_t (96 bytes on 64-bit Linux)."""

    _fields_ = [("algo", MatmulAlgo), ("workspaceSize", ctypes.c_size_t),
                ("state", ctypes.c_int),  # cublasStatus_t
                ("wavesCount", ctypes.c_float), ("reserved", ctypes.c_int * 4)]


@dataclass(frozen=True)
class LtLayout:
    """One cublasLtMatrixLayout: a column-major matrix as stored (before op)."""

    dtype: int  # cudaDataType_t
    rows: int
    cols: int
    ld: int
    batch: int
    stride: int  # elements between batch entries


@dataclass(frozen=True)
class LtProblem:
    """The column-major cuBLASLt problem for a row-major GemmCall.

    In cuBLASLt's naming: `a` describes our B buffer, `b` our A buffer, and
    `c` our C buffer read column-major (n x m); D uses the same layout as C.
    """

    trans_a: int
    trans_b: int
    a: LtLayout
    b: LtLayout
    c: LtLayout


def lt_layouts(call: GemmCall) -> LtProblem:
    """Descriptor values for `call`, reusing `column_major_gemm`'s swap."""
    cm = column_major_gemm(call)
    in_type = cuda_dtype(call.dtype)
    out_type = cuda_dtype(call.out_dtype or call.dtype)
    # cuBLASLt layouts describe the stored matrix: op(X) = X^T is stored k x m.
    a_rows, a_cols = (cm.m, cm.k) if cm.trans_first == cublas.CUBLAS_OP_N else (cm.k, cm.m)
    b_rows, b_cols = (cm.k, cm.n) if cm.trans_second == cublas.CUBLAS_OP_N else (cm.n, cm.k)
    return LtProblem(
        trans_a=cm.trans_first,
        trans_b=cm.trans_second,
        a=LtLayout(in_type, a_rows, a_cols, cm.ld_first, call.batch, cm.stride_first),
        b=LtLayout(in_type, b_rows, b_cols, cm.ld_second, call.batch, cm.stride_second),
        c=LtLayout(out_type, cm.m, cm.n, cm.ldc, call.batch, cm.stride_c),
    )


def epilogue_code(epilogue: Epilogue) -> int:
    """cublasLtEpilogue_t of an epilogue's bias and activation (the residual is beta*C,
    not an epilogue code)."""
    code = ACTIVATION_CODES[epilogue.activation] | (CUBLASLT_EPILOGUE_BIAS if epilogue.bias else 0)
    return code or CUBLASLT_EPILOGUE_DEFAULT


def fastest(times_us: list[float | None]) -> int:
    """Index of the smallest time; None marks a candidate that failed."""
    valid = [(t, i) for i, t in enumerate(times_us) if t is not None]
    if not valid:
        raise CublasError("cublasLtMatmul (every heuristic candidate)", CUBLAS_STATUS_NOT_SUPPORTED)
    return min(valid)[1]


def _declare(lib: ctypes.CDLL) -> None:
    vp, i, sz = ctypes.c_void_p, ctypes.c_int, ctypes.c_size_t
    pvp = ctypes.POINTER(vp)
    protos: dict[str, list] = {
        "cublasLtCreate": [pvp], "cublasLtDestroy": [vp],
        "cublasLtMatmulDescCreate": [pvp, i, i],  # desc*, computeType, scaleType
        "cublasLtMatmulDescDestroy": [vp], "cublasLtMatmulDescSetAttribute": [vp, i, vp, sz],
        # layout*, type, uint64 rows, uint64 cols, int64 ld
        "cublasLtMatrixLayoutCreate": [pvp, i, ctypes.c_uint64, ctypes.c_uint64, ctypes.c_int64],
        "cublasLtMatrixLayoutDestroy": [vp], "cublasLtMatrixLayoutSetAttribute": [vp, i, vp, sz],
        "cublasLtMatmulPreferenceCreate": [pvp], "cublasLtMatmulPreferenceDestroy": [vp],
        "cublasLtMatmulPreferenceSetAttribute": [vp, i, vp, sz],
        # handle, desc, Adesc, Bdesc, Cdesc, Ddesc, pref, requested, results[], *returned
        "cublasLtMatmulAlgoGetHeuristic": [vp, vp, vp, vp, vp, vp, vp, i,
                                           ctypes.POINTER(HeuristicResult), ctypes.POINTER(i)],
        # handle, desc, alpha, A, Adesc, B, Bdesc, beta, C, Cdesc, D, Ddesc,
        # algo*, workspace, workspaceSize, stream
        "cublasLtMatmul": [vp] * 12 + [ctypes.POINTER(MatmulAlgo), vp, sz, vp],
    }
    for name, argtypes in protos.items():
        fn = getattr(lib, name)
        fn.argtypes, fn.restype = argtypes, ctypes.c_int


def _library() -> ctypes.CDLL:
    """libcublasLt with its prototypes declared, loaded on first use (never at import)."""
    return loader.load("cublasLt", _declare)


class LtHandle:
    """A cuBLASLt handle. Not bound to a stream: streams and workspaces are
    passed per call, so one handle serves every stream of a plan."""

    def __init__(self) -> None:
        self.lib = _library()
        handle = ctypes.c_void_p()
        _check("cublasLtCreate", self.lib.cublasLtCreate(ctypes.byref(handle)))
        self._handle: ctypes.c_void_p | None = handle

    @property
    def raw(self) -> ctypes.c_void_p:
        if self._handle is None:
            raise RuntimeError("cuBLASLt handle already destroyed")
        return self._handle

    def destroy(self) -> None:
        """Release the handle; idempotent."""
        if self._handle is not None:
            handle, self._handle = self._handle, None
            _check("cublasLtDestroy", self.lib.cublasLtDestroy(handle))


@dataclass(frozen=True)
class GemmBuffers:
    """The buffers a GEMM will run on, given when its algorithm is chosen: the timing
    runs on a private stream ordered after the work already queued on `stream`, with
    this workspace (it must hold the LtGemm's workspace_bytes), on fresh operands
    filled with random values (`LtGemm._filled`): the buffers given here are neither
    read nor written."""

    a: int
    b: int
    c: int
    workspace: int
    stream: int = 0
    bias: int | None = None
    residual: int | None = None
    l2_bytes: int = 0  # > 0: A and B are not in an L2 of this size when the GEMM runs
    # (fill.py's cold operands): each timed launch reads copies of its own


@dataclass(frozen=True)
class _Choice:
    algo: bytes  # the 64 bytes of cublasLtMatmulAlgo_t
    workspace_needed: int
    index: int
    timings_us: tuple[float | None, ...] | None  # None: heuristic #0, unmeasured


# (call without operands, epilogue included, workspace_bytes, REDUCTION_SCHEMES,
# REQUESTED_ALGOS, timed on cold operands) -> choice; valid for this process's library
# and device (a process mixing GPU models should not share it).
_ALGO_CACHE: dict[tuple, _Choice] = {}


def _set(fn, obj, attr: int, value: ctypes._SimpleCData) -> None:
    """Call a cublasLt*SetAttribute `fn` with a ctypes scalar of the attribute's size."""
    _check(fn.__name__, fn(obj, attr, ctypes.byref(value), ctypes.sizeof(value)))


class LtGemm:
    """C[b] = act(alpha op(A[b]) @ op(B[b]) + beta R[b] (+ bias)), row-major, where R is
    the residual operand if the epilogue has one, else C itself.

    Built once per GemmCall; `run` is capture-safe. `algo_index` is the position of
    the chosen algorithm in cuBLASLt's heuristic list, `workspace_needed` the
    bytes of workspace it needs, `timings_us` the measured mean per candidate
    (None where a candidate failed; None overall when nothing was timed).
    """

    def __init__(self, handle: LtHandle, call: GemmCall, workspace_bytes: int, *,
                 buffers: GemmBuffers | None = None) -> None:
        self.call, self.workspace_bytes = call, int(workspace_bytes)
        self.has_bias, self.has_residual = call.epilogue.bias, call.epilogue.residual
        self.problem = lt_layouts(call)
        self._lib = handle.lib
        self._alpha, self._beta = ctypes.c_float(call.alpha), ctypes.c_float(call.beta)
        self._desc = self._pref = None
        self._layouts: list[ctypes.c_void_p] = []
        try:
            self._build(epilogue_code(call.epilogue))
            self._adopt(self._choose(handle, buffers))
        except BaseException:
            self.close()
            raise

    def _build(self, epilogue: int) -> None:
        lib, p = self._lib, self.problem
        desc, pref = ctypes.c_void_p(), ctypes.c_void_p()
        _check("cublasLtMatmulDescCreate", lib.cublasLtMatmulDescCreate(
            ctypes.byref(desc), compute_type(self.call), SCALE_TYPE))
        self._desc = desc  # owned (so destroyed by close) only once created
        for attr, value in ((CUBLASLT_MATMUL_DESC_TRANSA, ctypes.c_int32(p.trans_a)),
                            (CUBLASLT_MATMUL_DESC_TRANSB, ctypes.c_int32(p.trans_b)),
                            (CUBLASLT_MATMUL_DESC_EPILOGUE, ctypes.c_uint32(epilogue))):
            _set(lib.cublasLtMatmulDescSetAttribute, desc, attr, value)
        if self.has_bias and self.call.batch > 1:  # one bias for every batch entry
            _set(lib.cublasLtMatmulDescSetAttribute, desc, CUBLASLT_MATMUL_DESC_BIAS_BATCH_STRIDE,
                 ctypes.c_int64(0))
        for layout in (p.a, p.b, p.c):
            self._add_layout(layout)
        _check("cublasLtMatmulPreferenceCreate", lib.cublasLtMatmulPreferenceCreate(ctypes.byref(pref)))
        self._pref = pref
        _set(lib.cublasLtMatmulPreferenceSetAttribute, pref,
             CUBLASLT_MATMUL_PREF_MAX_WORKSPACE_BYTES, ctypes.c_uint64(self.workspace_bytes))
        _set(lib.cublasLtMatmulPreferenceSetAttribute, pref,
             CUBLASLT_MATMUL_PREF_REDUCTION_SCHEME_MASK, ctypes.c_uint32(REDUCTION_SCHEMES))

    def _add_layout(self, layout: LtLayout) -> None:
        lib, handle = self._lib, ctypes.c_void_p()
        _check("cublasLtMatrixLayoutCreate", lib.cublasLtMatrixLayoutCreate(
            ctypes.byref(handle), layout.dtype, layout.rows, layout.cols, layout.ld))
        self._layouts.append(handle)  # owned (so destroyed by close) before any set
        if layout.batch > 1:
            setl = lib.cublasLtMatrixLayoutSetAttribute
            _set(setl, handle, CUBLASLT_MATRIX_LAYOUT_BATCH_COUNT, ctypes.c_int32(layout.batch))
            _set(setl, handle, CUBLASLT_MATRIX_LAYOUT_STRIDED_BATCH_OFFSET, ctypes.c_int64(layout.stride))

    def _heuristics(self, handle: LtHandle) -> list[HeuristicResult]:
        results = (HeuristicResult * REQUESTED_ALGOS)()
        count = ctypes.c_int(0)
        a, b, c = self._layouts
        _check("cublasLtMatmulAlgoGetHeuristic", self._lib.cublasLtMatmulAlgoGetHeuristic(
            handle.raw, self._desc, a, b, c, c, self._pref, REQUESTED_ALGOS, results,
            ctypes.byref(count)))
        usable = [r for r in results[: count.value] if r.state == 0]
        if not usable:
            raise CublasError(f"cublasLtMatmulAlgoGetHeuristic ({self.call})",
                              CUBLAS_STATUS_NOT_SUPPORTED)
        return usable

    def _choose(self, handle: LtHandle, buffers: GemmBuffers | None) -> _Choice:
        # Without operands: equal anyway (they are not compared), and the cache keeps
        # no plan's Vars alive.
        problem = dataclasses.replace(self.call, a=None, b=None, c=None, bias=None, residual=None)
        key = (problem, self.workspace_bytes, REDUCTION_SCHEMES, REQUESTED_ALGOS,
               buffers is not None and buffers.l2_bytes > 0)
        cached = _ALGO_CACHE.get(key)
        if cached is not None and (cached.timings_us is not None or buffers is None):
            return cached
        if self.has_bias and buffers is not None and buffers.bias:
            self._set_bias(buffers.bias)  # heuristics read its alignment
        results = self._heuristics(handle)
        timings = None if buffers is None else tuple(self._time_all(handle, results, buffers))
        index = 0 if timings is None else fastest(list(timings))
        best = results[index]
        choice = _Choice(bytes(best.algo), int(best.workspaceSize), index, timings)
        _ALGO_CACHE[key] = choice
        return choice

    def _adopt(self, choice: _Choice) -> None:
        self._algo = MatmulAlgo.from_buffer_copy(choice.algo)
        self.algo_index = choice.index
        self.workspace_needed = choice.workspace_needed
        self.timings_us = choice.timings_us

    def _time_all(self, handle: LtHandle, results: list[HeuristicResult],
                  buf: GemmBuffers) -> list[float | None]:
        import cupy  # lazy: only the measuring path needs cupy

        rt = cupy.cuda.runtime
        if rt.streamIsCapturing(buf.stream) != rt.streamCaptureStatusNone:
            raise RuntimeError("LtGemm must choose its algorithm outside stream capture")
        # A private stream, ordered after the work already queued on buf.stream.
        stream = cupy.cuda.Stream(non_blocking=True)
        ready = cupy.cuda.Event(disable_timing=True)
        ready.record(cupy.cuda.ExternalStream(buf.stream))
        stream.wait_event(ready)
        start, end = cupy.cuda.Event(), cupy.cuda.Event()
        held: list = []  # the filled operands, alive until the stream is done with them
        try:
            filled = self._filled(cupy, buf, stream, held)
            cold = None
            size = cublas.itemsize(self.call.dtype)
            # The flush and the cold copies take about twice the L2 each; where they do
            # not fit, timed warm.
            with contextlib.suppress(cupy.cuda.memory.OutOfMemoryError), stream:
                if buf.l2_bytes > 0:
                    flush = fill.l2_flusher(cupy, buf.l2_bytes, held)
                    cold = (fill.cold_operand_pairs(cupy, self.call.extent("a") * size,
                                                    self.call.extent("b") * size, self.call.dtype,
                                                    buf.l2_bytes, held, most=TIMED_LAUNCHES), flush)
            pairs, flush = cold or ([(filled.a, filled.b)], None)
            return [self._time_one(cupy, handle, r.algo, filled, pairs, flush, stream, start, end)
                    for r in results]
        finally:
            stream.synchronize()

    def _filled(self, cupy, buf: GemmBuffers, stream, held: list) -> GemmBuffers:
        """`buf` with the operands the GEMM reads moved to buffers of pseudo-random values
        of their dtypes (in [-1, 1), as XLA's autotuner fills its buffers): the inputs
        read from the shared fill arrays, C a fresh copy of one, on `stream`. So
        candidates are timed on realistic values, never on uninitialized memory
        (`compute-sanitizer --tool initcheck` stays clean), and the plan's own buffers
        (which may hold its inputs or constants already) are left untouched."""
        call = self.call
        out = call.out_dtype or call.dtype
        sizes = {"a": (call.extent("a"), call.dtype), "b": (call.extent("b"), call.dtype),
                 "c": (call.extent("c"), out)}
        if self.has_bias:
            sizes["bias"] = (call.n, out)
        if self.has_residual:
            sizes["residual"] = (call.extent("c"), out)
        fresh = {}
        with stream:
            for name, (elements, dtype) in sizes.items():
                held.append(fill_values(cupy, elements, dtype))
                if name == "c":  # written by the GEMM (and read where beta != 0): its own copy
                    values = held[-1]
                    held.append(cupy.empty(int(elements), dtype=values.dtype))
                    rt = cupy.cuda.runtime
                    rt.memcpyAsync(held[-1].data.ptr, values.data.ptr, held[-1].nbytes,
                                   rt.memcpyDeviceToDevice, stream.ptr)
                fresh[name] = held[-1].data.ptr
        return dataclasses.replace(buf, **fresh)

    def _time_one(self, cupy, handle, algo, buf, pairs, flush, stream, start, end) -> float | None:
        """Mean µs of one candidate, None if cuBLASLt refuses it or it does not
        capture. The launches are timed as one CUDA graph, so the GPU runs them
        back to back (no host gaps) exactly as a captured plan would; launch i reads
        the operands `pairs[i % len(pairs)]` (A, B), after `flush(stream)` where there
        is one (fill.py: cold operands)."""

        def launch(i: int = 0) -> int:
            a, b = pairs[i % len(pairs)]
            return self._matmul(handle, algo, a, b, buf.c, buf.workspace,
                                self.workspace_bytes, stream.ptr, buf.bias, buf.residual)

        if launch() != 0:  # warm-up, outside capture
            return None
        stream.begin_capture()
        try:
            statuses = [launch(i) for i in range(TIMED_LAUNCHES)]
        finally:
            try:
                graph = stream.end_capture()
            except cupy.cuda.runtime.CUDARuntimeError:
                graph = None  # capture invalidated: the candidate is unusable in a plan
        if graph is None or any(statuses):
            return None
        graph.launch(stream)  # warm-up of the graph itself
        if flush is not None:
            flush(stream.ptr)
        start.record(stream)
        graph.launch(stream)
        end.record(stream)
        end.synchronize()
        return cupy.cuda.get_elapsed_time(start, end) * 1000.0 / TIMED_LAUNCHES

    def _set_bias(self, bias: int) -> None:
        # A host-side descriptor write, read when cublasLtMatmul enqueues:
        # capture-safe, and each captured launch keeps the pointer it was given.
        _set(self._lib.cublasLtMatmulDescSetAttribute, self._desc,
             CUBLASLT_MATMUL_DESC_BIAS_POINTER, ctypes.c_void_p(bias))

    def _matmul(self, handle, algo, a, b, c, workspace, workspace_bytes, stream, bias,
                residual) -> int:
        for name, ptr, built in (("bias", bias, self.has_bias), ("residual", residual, self.has_residual)):
            if built != bool(ptr):
                raise ValueError(f"pass {name}=<device pointer> exactly when the GemmCall's "
                                 f"epilogue has one ({self.call.epilogue})")
        if bias:
            self._set_bias(bias)
        la, lb, lc = self._layouts
        # cuBLASLt's A is our B and its B our A (see column_major_gemm). Its C is the
        # residual (same layout as D) or our C itself; its D is our C.
        c_in = residual if residual else c
        return self._lib.cublasLtMatmul(
            handle.raw, self._desc, ctypes.byref(self._alpha), b, la, a, lb,
            ctypes.byref(self._beta), c_in, lc, c, lc, ctypes.byref(algo),
            workspace, workspace_bytes, stream)

    def run(self, handle: LtHandle, a: int, b: int, c: int, workspace_ptr: int,
            workspace_bytes: int, stream_ptr: int, bias: int | None = None,
            residual: int | None = None) -> None:
        """Enqueue the GEMM on `stream_ptr`; capture-safe (host scalars,
        caller's workspace, nothing allocated). Pointers must be 256-byte
        aligned, the workspace at least `workspace_needed` bytes."""
        if self._desc is None:
            raise RuntimeError("LtGemm already closed")
        if workspace_bytes < self.workspace_needed:
            raise ValueError(f"workspace {workspace_bytes} B < {self.workspace_needed} B "
                             f"needed by the chosen cuBLASLt algorithm")
        for name, ptr in (("a", a), ("b", b), ("c", c), ("bias", bias or 0), ("residual", residual or 0)):
            if ptr % POINTER_ALIGNMENT:
                raise ValueError(f"{name} pointer {ptr:#x} is not {POINTER_ALIGNMENT}-byte aligned")
        status = self._matmul(handle, self._algo, a, b, c, workspace_ptr, workspace_bytes,
                              stream_ptr, bias, residual)
        _check("cublasLtMatmul", status)

    def close(self) -> None:
        """Destroy the descriptors; idempotent."""
        lib = self._lib
        while self._layouts:
            _check("cublasLtMatrixLayoutDestroy", lib.cublasLtMatrixLayoutDestroy(self._layouts.pop()))
        if self._pref is not None:
            pref, self._pref = self._pref, None
            _check("cublasLtMatmulPreferenceDestroy", lib.cublasLtMatmulPreferenceDestroy(pref))
        if self._desc is not None:
            desc, self._desc = self._desc, None
            _check("cublasLtMatmulDescDestroy", lib.cublasLtMatmulDescDestroy(desc))

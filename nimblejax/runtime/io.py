"""Argument and result I/O of the direct (Python) call path: inputs copied into the
arena, outputs handed to JAX (one XLA call for many outputs) or returned as CuPy arrays.
The XLA FFI call path (runtime/xla_op.py) does all of this in C++ instead.
"""
from __future__ import annotations

import weakref
from typing import Callable, Optional

import numpy as np

from nimblejax.compiler.kinds import OutputKind
from nimblejax.compiler.plan import Plan
from nimblejax.runtime.runner import assemble


class OutOfMemoryError(MemoryError):
    pass


D2D, H2D = 3, 1  # cudaMemcpyKind

COPY_MANY = r"""
extern "C" __global__ void nimble_copy_many(const unsigned long long* table, int count) {
  // table holds (dst, src, bytes) per entry; blockIdx.y walks the entries.
  for (int e = blockIdx.y; e < count; e += gridDim.y) {
    char* dst = (char*)table[3 * e];
    const char* src = (const char*)table[3 * e + 1];
    unsigned long long n = table[3 * e + 2];
    unsigned long long n16 = ((((unsigned long long)dst | (unsigned long long)src) & 15ull) == 0) ? n / 16 : 0;
    unsigned long long step = (unsigned long long)gridDim.x * blockDim.x;
    for (unsigned long long i = blockIdx.x * blockDim.x + threadIdx.x; i < n16; i += step)
      ((uint4*)dst)[i] = ((const uint4*)src)[i];
    for (unsigned long long i = n16 * 16 + blockIdx.x * blockDim.x + threadIdx.x; i < n; i += step)
      dst[i] = src[i];
  }
}
"""


class BatchCopier:
    """Many device-to-device copies in one kernel launch (one per call instead of one
    memcpy per argument). The table goes up through pinned memory; calls synchronize
    before returning, so the next call may reuse it."""

    def __init__(self, cp) -> None:
        self.cp = cp
        self.kernel = None
        self.capacity = 0

    def __call__(self, entries: list, stream) -> None:
        cp = self.cp
        if self.kernel is None:
            from nimblejax.runtime.compile import runtime_kernel

            self.kernel = runtime_kernel(COPY_MANY, "nimble_copy_many")
        n = len(entries)
        if n > self.capacity:
            self.capacity = max(n, 64)
            self.pinned = cp.cuda.alloc_pinned_memory(self.capacity * 24)
            self.host = np.frombuffer(self.pinned, np.uint64, self.capacity * 3)
            self.device = cp.empty(self.capacity * 3, dtype=np.uint64)
        self.host[: 3 * n] = np.asarray(entries, dtype=np.uint64).reshape(-1)
        cp.cuda.runtime.memcpyAsync(self.device.data.ptr, self.host.ctypes.data, 24 * n, H2D, stream.ptr)
        largest = max(e[2] for e in entries)
        blocks = max(1, min(64, -(-largest // (256 * 16))))
        self.kernel((blocks, min(n, 65535), 1), (256, 1, 1), (self.device, np.int32(n)), stream=stream)
UNPACK_MIN_OUTPUTS = 2  # below this, one import per output is cheaper than an XLA call


def device_wait(x, stream) -> None:
    try:
        x.__dlpack__(stream=stream.ptr)  # the DLPack handshake: a device-side wait
    except Exception:  # deleted or donated by the user: it is complete, or XLA owns it
        pass


class XlaUnpacker:
    """Hands a call's outputs to JAX with one XLA call instead of one import each.

    Zero-copy jax.Arrays view the arena (one view per storage dtype); a jitted function
    slices each output out of them, so XLA allocates the fresh output buffers and
    copies into them on its own stream (plain slices of one operand, which XLA fuses
    horizontally into few kernels). The next call's graph waits on the device for that
    copy before it overwrites the arena.
    """

    def __init__(self, plan: Plan, views: dict) -> None:
        import jax

        self.plan = plan
        self.dtypes = sorted(views)
        self.views = [views[d] for d in self.dtypes]
        where = {d: i for i, d in enumerate(self.dtypes)}
        specs = [(where[cupy_dtype(a.dtype).str], plan.offset(a), a.shape, np.dtype(a.dtype))
                 for a in plan.output_buffers]
        self.fn = jax.jit(lambda *vs: tuple(_unpack(vs[i], off, shape, dt) for i, off, shape, dt in specs))

    @classmethod
    def create(cls, plan: Plan, arena) -> Optional["XlaUnpacker"]:
        buffers = plan.output_buffers
        if len(buffers) < UNPACK_MIN_OUTPUTS:
            return None
        views = {}
        for a in buffers:
            dt = cupy_dtype(a.dtype)
            if dt.str not in views:
                usable = arena.nbytes // dt.itemsize * dt.itemsize
                view = to_jax(arena[:usable].view(dt))
                if view.unsafe_buffer_pointer() != arena.data.ptr:
                    return None  # JAX copied instead of viewing: the view would go stale
                views[dt.str] = view
        return cls(plan, views)

    def __call__(self, leaves: list) -> list:
        import jax.numpy as jnp

        return assemble(self.plan, self.fn(*self.views), leaves.__getitem__, jnp.asarray)

    def witness(self, outs: list):
        """One output of the XLA call: its completion means the whole copy is done."""
        for slot, o in zip(self.plan.output_slots, outs):
            if slot.kind is OutputKind.BUFFER:
                return o
        return None


def _unpack(view, offset: int, shape, dtype: np.dtype):
    """Output `shape`/`dtype` at byte `offset` of the arena, from its view of the
    matching storage dtype."""
    import jax.numpy as jnp
    from jax import lax

    n = int(np.prod(shape, dtype=np.int64))
    if n == 0:
        return jnp.zeros(shape, dtype)
    start = offset // view.dtype.itemsize
    out = lax.slice(view, (start,), (start + n,)).reshape(shape)
    if dtype == np.bool_:
        return out != 0
    if out.dtype != dtype:  # bfloat16 stored as uint16
        return lax.bitcast_convert_type(out, dtype)
    return out


def cupy_dtype(dtype) -> np.dtype:
    """The dtype cupy holds `dtype`'s bytes in (bfloat16 as uint16)."""
    dtype = np.dtype(dtype)
    return np.dtype(np.uint16) if dtype.name == "bfloat16" else dtype


def on_gpu(x) -> bool:
    import jax

    # CUDA devices report platform "gpu" or "cuda" depending on the JAX version.
    return isinstance(x, jax.Array) and next(iter(x.devices())).platform != "cpu"


def copy_in(cp, stream, dst: int, var, x) -> None:
    """Copy argument `x` into the arena at `dst`, ordered after its producer."""
    import jax

    if on_gpu(x):
        if np.dtype(x.dtype) != np.dtype(var.dtype):
            x = x.astype(var.dtype)
        # The DLPack handshake makes `stream` wait, on the device, for XLA's producer.
        x.__dlpack__(stream=stream.ptr)
        cp.cuda.runtime.memcpyAsync(dst, x.unsafe_buffer_pointer(), var.nbytes, D2D, stream.ptr)
    elif hasattr(x, "__cuda_array_interface__"):
        arr = cp.ascontiguousarray(cp.asarray(x))
        if arr.dtype != cupy_dtype(var.dtype):
            arr = arr.astype(var.dtype)
        ready = cp.cuda.Event(disable_timing=True)
        ready.record(cp.cuda.get_current_stream())
        stream.wait_event(ready)
        cp.cuda.runtime.memcpyAsync(dst, arr.data.ptr, var.nbytes, D2D, stream.ptr)
    else:
        host = np.ascontiguousarray(np.asarray(x if not isinstance(x, jax.Array) else np.asarray(x),
                                               dtype=var.dtype))
        cp.cuda.runtime.memcpyAsync(dst, host.ctypes.data, var.nbytes, H2D, stream.ptr)
        stream.synchronize()  # pageable host memory must outlive the copy


def to_jax(arr):
    """jax.Array over a cupy array (zero-copy where JAX allows); the cupy memory lives
    as long as the jax.Array. jnp.asarray is used rather than the lower-level CUDA
    array interface import: measured on an H200, its result's first
    block_until_ready is free, while the raw import's costs ~35 µs."""
    import jax
    import jax.numpy as jnp

    out = jnp.asarray(arr)
    try:
        weakref.finalize(out, _keep, arr)
        return out
    except TypeError:  # not weak-referenceable: let DLPack own the lifetime instead
        return jax.dlpack.from_dlpack(arr)


def _keep(_arr) -> None:
    """Holds a reference until the jax.Array that views it is collected."""


def retry_after_freeing(make: Callable):
    try:
        return make()
    except Exception:
        import cupy

        cupy.get_default_memory_pool().free_all_blocks()
        return make()


def allocate(nbytes: int, what: str):
    import cupy

    # Zeroed once: a graph's warm-up launches every task before any operand is in its
    # slot, and must not read another plan's leftover bytes as indices.
    try:
        try:
            return cupy.zeros(max(nbytes, 1), dtype=np.uint8)
        except cupy.cuda.memory.OutOfMemoryError:
            cupy.get_default_memory_pool().free_all_blocks()  # cached blocks of dead plans
            return cupy.zeros(max(nbytes, 1), dtype=np.uint8)
    except cupy.cuda.memory.OutOfMemoryError as e:
        free, total = cupy.cuda.runtime.memGetInfo()
        raise OutOfMemoryError(
            f"nimblejax needs {nbytes} bytes for {what} but only {free} of {total} bytes of GPU "
            f"memory are free (JAX preallocates 75% by default; XLA_PYTHON_CLIENT_MEM_FRACTION "
            f"or XLA_PYTHON_CLIENT_PREALLOCATE=false leave more)") from e

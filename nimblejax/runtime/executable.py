"""The GPU runtime: one frozen multi-stream CUDA graph per plan.

A call copies changed inputs into their arena slots on stream 0, launches the graph
once on stream 0, and copies the outputs into fresh buffers. The graph itself forks
onto the planner's streams with events and joins back before it ends, so from the
outside it is ordered like one kernel on stream 0.
"""
from __future__ import annotations

import os
import threading
import weakref
from typing import Callable, Optional

import numpy as np

from nimblejax.lowering.task import Task
from nimblejax.runtime.plan import Plan

# cuBLAS workspace per stream (a shared one would race). NVIDIA recommends 32 MiB on
# Hopper; side streams run the small GEMMs of parallel branches and get 4 MiB, so a
# plan of 20+ streams does not hold most of a GiB (seen exhausting GPU memory beside
# JAX's preallocation in the model suite).
WORKSPACE_BYTES = 32 << 20
SIDE_WORKSPACE_BYTES = 4 << 20


class OutOfMemoryError(MemoryError):
    pass


class KernelLaunchError(RuntimeError):
    pass


def make_executable(plan: Plan, output: str = "jax", eager: Optional[bool] = None,
                    donate: frozenset = frozenset()) -> Callable[[list], list]:
    if eager is None:
        eager = os.environ.get("NIMBLE_EAGER", "") not in ("", "0")
    return Executable(plan, output=output, eager=eager, donate=donate)


class Executable:
    def __init__(self, plan: Plan, output: str = "jax", eager: bool = False,
                 donate: frozenset = frozenset()) -> None:
        import cupy

        from nimblejax.runtime.compile import compile_kernels

        self.plan, self.output, self.eager = plan, output, eager
        self.donate = sorted(donate)
        self.cupy = cupy
        self.lock = threading.Lock()
        self.stats = {"calls": 0, "graph_launches": 0, "task_launches": 0, "input_copies": 0}
        self.functions = compile_kernels(t.kernel for t in plan.tasks if t.kind == "kernel")
        self.arena = _allocate(plan.memory.arena_bytes, "the arena")
        self.base = self.arena.data.ptr
        # At least one stream: a plan of views only still launches (an empty graph).
        self.streams = [cupy.cuda.Stream(non_blocking=True)
                        for _ in range(max(1, plan.schedule.num_streams))]
        self.events = {u: cupy.cuda.Event(disable_timing=True) for u, _ in plan.schedule.syncs}
        # Library handles allocate outside CuPy's pool: when the device looks full, give
        # CuPy's cached free blocks back and try once more.
        self.use_lt = os.environ.get("NIMBLE_GEMM", "lt") != "cublas"
        self.handles, self.workspaces = _retry_after_freeing(self._cublas_handles)
        self.convs, self.cudnn_handles, self.cudnn_workspaces = _retry_after_freeing(self._cudnn_convs)

        self._upload_consts()
        self.last_inputs: list = [None] * len(plan.graph.inputs)
        # (leaf index, var, arena address) of every input the tasks read.
        self.input_slots = [(i, v, self.base + plan.offset(v)) for i, v in enumerate(plan.graph.inputs)
                            if v in plan.memory.offsets and v.nbytes]
        self.output_layout = _output_layout(plan)
        self.unpacker = XlaUnpacker.create(plan, self.arena) if output == "jax" else None
        self.pending = None  # an output of the last XLA unpack, not yet known complete
        self.returned_arrays: list = []
        self.returned: dict = {}
        self.copier = BatchCopier(self.cupy)
        self.args = {t: self._args(t) for t in plan.tasks}
        self.lt_handle, self.lt = self._lt_gemms()
        self.graph = None
        if not eager:
            self._capture()

    # ---- setup ------------------------------------------------------------------
    def _cublas_handles(self):
        """A GEMM workspace per stream that runs GEMMs and, under NIMBLE_GEMM=cublas, a
        cuBLAS handle bound to it (cuBLASLt takes stream and workspace per call)."""
        if not any(t.kind == "gemm" for t in self.plan.tasks):
            return [], []
        from nimblejax.runtime.cublas import CublasHandle

        used = {self.plan.schedule.stream[t] for t in self.plan.tasks if t.kind == "gemm"}
        sizes = [WORKSPACE_BYTES if i == 0 else SIDE_WORKSPACE_BYTES for i in range(len(self.streams))]
        workspaces = [_allocate(n, "a cuBLAS workspace") if i in used else None for i, n in enumerate(sizes)]
        if self.use_lt:
            return [], workspaces
        handles = [CublasHandle(s.ptr, w.data.ptr, n) if w is not None else None
                   for s, w, n in zip(self.streams, workspaces, sizes)]
        return handles, workspaces

    def _lt_gemms(self):
        """Per GEMM task a cuBLASLt matmul whose algorithm was measured on the task's own
        buffers and workspace (cuBLAS's default choice is several times slower on small
        and skinny shapes). NIMBLE_GEMM=cublas keeps the plain cuBLAS call."""
        tasks = [t for t in self.plan.tasks if t.kind == "gemm"]
        if not tasks or not self.use_lt:
            return None, {}
        from nimblejax.runtime import cublaslt

        handle = cublaslt.LtHandle()
        stream_of = self.plan.schedule.stream
        gemms = {}
        for t in tasks:
            s = stream_of[t]
            spec, a, b, c = self.args[t]
            ws = self.workspaces[s]
            buffers = cublaslt.GemmBuffers(a, b, c, ws.data.ptr, self.streams[s].ptr)
            gemms[t] = cublaslt.LtGemm(handle, spec, ws.nbytes, buffers=buffers)
        return handle, gemms

    def _cudnn_convs(self):
        """Per cuDNN task its descriptors and measured algorithm; per stream a handle and
        a workspace as large as its convolutions need (set before capture)."""
        tasks = [t for t in self.plan.tasks if t.kind == "cudnn"]
        if not tasks:
            return {}, {}, {}
        from nimblejax.runtime import cudnn

        stream_of = self.plan.schedule.stream
        handles = {s: cudnn.Handle(self.streams[s].ptr) for s in {stream_of[t] for t in tasks}}
        convs = {}
        for t in tasks:
            c = t.cudnn
            spec = cudnn.ConvSpec(c.x.shape, c.w.shape, c.y.shape, c.padding, c.strides, c.dilation,
                                  c.groups, np.dtype(c.x.dtype).name, np.dtype(c.y.dtype).name, c.math)
            convs[t] = cudnn.Conv(spec, handles[stream_of[t]])
        need: dict[int, int] = {}
        for t, conv in convs.items():
            need[stream_of[t]] = max(need.get(stream_of[t], 0), conv.workspace)
        workspaces = {s: _allocate(n, "a cuDNN workspace") for s, n in need.items()}
        return convs, handles, workspaces

    def _upload_consts(self) -> None:
        for var, value in self.plan.graph.consts.items():
            if var in self.plan.memory.offsets:
                host = np.ascontiguousarray(value, dtype=var.dtype)
                self._view(var).set(host.view(cupy_dtype(var.dtype)))

    def _view(self, var):
        """A cupy array over `var`'s bytes in the arena (dtypes cupy knows)."""
        return (self.arena[self.plan.offset(var): self.plan.offset(var) + var.nbytes]
                .view(cupy_dtype(var.dtype)).reshape(var.shape))

    def _args(self, task: Task) -> tuple:
        if task.kind == "kernel":
            return tuple(np.uint64(self.base + self.plan.offset(v)) for v in task.kernel.params)
        if task.kind == "cudnn":
            return tuple(self.base + self.plan.offset(v) for v in (task.cudnn.x, task.cudnn.w, task.cudnn.y))
        g = task.gemm
        from nimblejax.runtime.cublas import GemmSpec

        compute = g.compute if g.in_dtype == "float32" else "f32_from_half"
        spec = GemmSpec(g.batch, g.m, g.n, g.k, g.trans_a, g.trans_b, g.in_dtype, compute,
                        out_dtype=g.out_dtype if g.out_dtype != g.in_dtype else None)
        return spec, *(self.base + self.plan.offset(v) for v in (g.a, g.b, g.c))

    # ---- launching --------------------------------------------------------------
    def _launch(self, task: Task, s: int) -> None:
        stream = self.streams[s]
        if task.kind == "kernel":
            k = task.kernel
            try:
                self.functions[k.name](k.grid, k.block, self.args[task], stream=stream)
            except Exception as e:
                raise KernelLaunchError(f"launching {k.name} (from {task.source}) failed: {e}") from e
        elif task.kind == "cudnn":
            ws = self.cudnn_workspaces[s]
            self.convs[task].forward(self.cudnn_handles[s], *self.args[task], ws.data.ptr, ws.nbytes)
        elif task in self.lt:
            _, a, b, c = self.args[task]
            ws = self.workspaces[s]
            self.lt[task].run(self.lt_handle, a, b, c, ws.data.ptr, ws.nbytes, stream.ptr)
        else:
            from nimblejax.runtime.cublas import gemm_strided_batched

            spec, a, b, c = self.args[task]
            gemm_strided_batched(self.handles[s], spec, a, b, c)

    def _launch_all(self) -> None:
        """Every task on its stream, in launch order; fork from and join into stream 0."""
        sched = self.plan.schedule
        s0 = self.streams[0]
        fork = self.cupy.cuda.Event(disable_timing=True)
        fork.record(s0)
        for s in self.streams[1:]:
            s.wait_event(fork)
        for task in sched.order:
            s = sched.stream[task]
            for u in sched.waits(task):
                self.streams[s].wait_event(self.events[u])
            self._launch(task, s)
            if task in self.events:
                self.events[task].record(self.streams[s])
        for s in self.streams[1:]:
            join = self.cupy.cuda.Event(disable_timing=True)
            join.record(s)
            s0.wait_event(join)
        self.stats["task_launches"] += len(sched.order)

    def _capture(self) -> None:
        s0 = self.streams[0]
        self._launch_all()  # warm-up: loads modules, checks launches outside capture
        s0.synchronize()
        s0.begin_capture()
        try:
            self._launch_all()
        finally:
            graph = s0.end_capture()  # ends capture even on error, so s0 stays usable
        self.graph = graph

    def close(self) -> None:
        """Give back the library handles (their device memory is not CuPy's)."""
        for h in getattr(self, "handles", []) or []:
            if h is not None:
                h.destroy()
        self.handles = []
        for g in (getattr(self, "lt", None) or {}).values():
            g.close()
        self.lt = {}
        if getattr(self, "lt_handle", None) is not None:
            self.lt_handle.destroy()
            self.lt_handle = None
        for h in (getattr(self, "cudnn_handles", None) or {}).values():
            h.destroy()
        self.cudnn_handles = {}

    def __del__(self) -> None:
        try:
            self.close()
        except Exception:  # interpreter shutdown: the libraries may be gone already
            pass

    # ---- calling ----------------------------------------------------------------
    def __call__(self, leaves: list) -> list:
        with self.lock:  # one arena per plan: calls on one plan are serialized
            return self._call(leaves)

    def _bind_inputs(self, leaves: list) -> None:
        s0, last = self.streams[0], self.last_inputs
        ours = self.returned  # ids of the arrays the last call returned (kept alive there)
        batch = []
        for i, var, dst in self.input_slots:
            x = leaves[i]
            if x is last[i]:
                continue  # the same immutable jax.Array as last call: already in place
            if id(x) in ours and x.dtype == var.dtype:
                # Our own previous output (a training loop feeding back its state): the
                # wait on the last unpack covers its producer; batch its copy.
                batch.append((dst, x.unsafe_buffer_pointer(), var.nbytes))
            else:
                copy_in(self.cupy, s0, dst, var, x)
            last[i] = x if _on_gpu(x) else None
            self.stats["input_copies"] += 1
        if batch:
            self.copier(batch, s0)

    def _outputs(self, leaves: list) -> list:
        """Fresh copies of the output buffers (cupy arrays), enqueued on stream 0."""
        cp, s0 = self.cupy, self.streams[0]
        fresh: dict = {}
        outs = []
        for kind, a, src in self.output_layout:
            if kind == "buffer":
                arr = fresh.get(a)
                if arr is None:
                    arr = fresh[a] = cp.empty(a.shape, dtype=cupy_dtype(a.dtype))
                    if a.nbytes:
                        cp.cuda.runtime.memcpyAsync(arr.data.ptr, self.base + src, a.nbytes, D2D, s0.ptr)
                outs.append(arr)
            elif kind == "input":
                outs.append(leaves[src])
            elif kind == "literal":
                outs.append(np.asarray(a.value))
            else:
                outs.append(np.asarray(self.plan.graph.consts[a]))
        return outs

    def _call(self, leaves: list) -> list:
        s0 = self.streams[0]
        if self.pending is not None:
            # The last call's outputs are still being copied out of the arena by XLA:
            # stream 0 waits for that on the device before the graph overwrites them
            # (and before inputs that are those outputs are read).
            _device_wait(self.pending, s0)
            self.pending = None
        self._bind_inputs(leaves)
        if self.graph is not None:
            self.graph.launch(s0)
            self.stats["graph_launches"] += 1
        else:
            self._launch_all()
        if self.unpacker is not None:
            s0.synchronize()  # the arena holds this call's results before XLA reads them
            self._release_donated(leaves)
            self.stats["calls"] += 1
            outs = self.unpacker(leaves)
            self.pending = self.unpacker.witness(outs)
            self.returned_arrays = outs  # keeps the ids below unambiguous
            self.returned = {id(o): None for o in outs}
            return outs
        outs = self._outputs(leaves)
        s0.synchronize()  # outputs are complete before anyone else reads them
        self._release_donated(leaves)
        self.stats["calls"] += 1
        return [self._wrap(o, a.dtype) for o, a in zip(outs, self.plan.graph.outputs)]

    def _release_donated(self, leaves: list) -> None:
        """Donated jax.Arrays are consumed, as under jax.jit: their memory goes back to
        JAX's pool for reuse (their bytes were already copied into the arena)."""
        for i in self.donate:
            x = leaves[i]
            if _on_gpu(x) and not x.is_deleted():
                self.last_inputs[i] = None
                x.delete()

    def _wrap(self, out, dtype):
        cp = self.cupy
        if isinstance(out, cp.ndarray):
            return self._wrap_device(out, np.dtype(dtype))
        if self.output == "jax":
            import jax.numpy as jnp

            return jnp.asarray(out)
        if self.output == "cupy":
            return cp.asarray(out)
        return np.asarray(out)

    def _wrap_device(self, arr, dtype: np.dtype):
        if self.output == "jax":
            out = to_jax(arr)
            if arr.dtype != dtype:  # bfloat16 travels as its uint16 bits
                import jax

                out = jax.lax.bitcast_convert_type(out, dtype)
            return out
        if self.output == "numpy":
            return self.cupy.asnumpy(arr).view(dtype)
        if arr.dtype != dtype:
            raise TypeError(f"output='cupy' cannot return {dtype}: CuPy has no such dtype; "
                            f"use output='jax'")
        return arr


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
            self.kernel = cp.RawKernel(COPY_MANY, "nimble_copy_many")
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


def _device_wait(x, stream) -> None:
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

    def __init__(self, plan: Plan, views: dict, slots: list) -> None:
        import jax

        self.dtypes = sorted(views)
        self.views = [views[d] for d in self.dtypes]
        self.slots = slots  # per output: ('buffer', index) | ('input', leaf) | ('value', array)
        where = {d: i for i, d in enumerate(self.dtypes)}
        specs = [(where[cupy_dtype(a.dtype).str], plan.offset(a), a.shape, np.dtype(a.dtype))
                 for a in _distinct_buffers(plan)]
        self.fn = jax.jit(lambda *vs: tuple(_unpack(vs[i], off, shape, dt) for i, off, shape, dt in specs))

    @classmethod
    def create(cls, plan: Plan, arena) -> Optional["XlaUnpacker"]:
        buffers = _distinct_buffers(plan)
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
        index = {a: i for i, a in enumerate(buffers)}
        slots = []
        for a in plan.graph.outputs:
            kind = plan.output_kind(a)
            if kind == "buffer":
                slots.append(("buffer", index[a]))
            elif kind == "input":
                slots.append(("input", plan.graph.inputs.index(a)))
            else:
                value = a.value if kind == "literal" else plan.graph.consts[a]
                slots.append(("value", np.asarray(value)))
        return cls(plan, views, slots)

    def __call__(self, leaves: list) -> list:
        import jax.numpy as jnp

        made = self.fn(*self.views)
        return [made[x] if k == "buffer" else leaves[x] if k == "input" else jnp.asarray(x)
                for k, x in self.slots]

    def witness(self, outs: list):
        """One output of the XLA call: its completion means the whole copy is done."""
        for (kind, _), o in zip(self.slots, outs):
            if kind == "buffer":
                return o
        return None


def _distinct_buffers(plan: Plan) -> list:
    seen: dict = {}
    for a in plan.graph.outputs:
        if plan.output_kind(a) == "buffer":
            seen.setdefault(a, None)
    return list(seen)


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


def _output_layout(plan: Plan) -> list[tuple]:
    """(kind, atom, where) per output: the arena offset of a buffer, the leaf index of
    a passed-through input."""
    layout = []
    for a in plan.graph.outputs:
        kind = plan.output_kind(a)
        where = plan.offset(a) if kind == "buffer" else (
            plan.graph.inputs.index(a) if kind == "input" else None)
        layout.append((kind, a, where))
    return layout


def cupy_dtype(dtype) -> np.dtype:
    """The dtype cupy holds `dtype`'s bytes in (bfloat16 as uint16)."""
    dtype = np.dtype(dtype)
    return np.dtype(np.uint16) if dtype.name == "bfloat16" else dtype


def _on_gpu(x) -> bool:
    import jax

    # CUDA devices report platform "gpu" or "cuda" depending on the JAX version.
    return isinstance(x, jax.Array) and next(iter(x.devices())).platform != "cpu"


def copy_in(cp, stream, dst: int, var, x) -> None:
    """Copy argument `x` into the arena at `dst`, ordered after its producer."""
    import jax

    if _on_gpu(x):
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


def _retry_after_freeing(make: Callable):
    try:
        return make()
    except Exception:
        import cupy

        cupy.get_default_memory_pool().free_all_blocks()
        return make()


def _allocate(nbytes: int, what: str):
    import cupy

    try:
        try:
            return cupy.empty(max(nbytes, 1), dtype=np.uint8)
        except cupy.cuda.memory.OutOfMemoryError:
            cupy.get_default_memory_pool().free_all_blocks()  # cached blocks of dead plans
            return cupy.empty(max(nbytes, 1), dtype=np.uint8)
    except cupy.cuda.memory.OutOfMemoryError as e:
        free, total = cupy.cuda.runtime.memGetInfo()
        raise OutOfMemoryError(
            f"nimblejax needs {nbytes} bytes for {what} but only {free} of {total} bytes of GPU "
            f"memory are free (JAX preallocates 75% by default; XLA_PYTHON_CLIENT_MEM_FRACTION "
            f"or XLA_PYTHON_CLIENT_PREALLOCATE=false leave more)") from e

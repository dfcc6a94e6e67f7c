"""The direct GPU runtime: one frozen multi-stream CUDA graph per plan, called from Python.

A call copies changed inputs into their arena slots on stream 0, launches the graph
once on stream 0, and copies the outputs into fresh buffers. The graph itself forks
onto the planner's streams with events and joins back before it ends, so from the
outside it is ordered like one kernel on stream 0.

This path serves output="cupy"/"numpy", eager mode, and machines where the XLA FFI
handler cannot be built; otherwise runtime/xla_op.py launches the same captured graph
from C++ on XLA's stream.
"""
from __future__ import annotations

import threading
from typing import Callable

import numpy as np

from nimblejax.compiler.plan import Plan
from nimblejax.runtime.io import (D2D, BatchCopier, XlaUnpacker, allocate, copy_in, cupy_dtype,
                                  device_wait, on_gpu, to_jax)
from nimblejax.runtime.launch import Launchers
from nimblejax.runtime.runner import assemble


def make_executable(plan: Plan, output: str = "jax", eager: bool = False, gemm: str = "lt",
                    donate: frozenset = frozenset()) -> Callable[[list], list]:
    return Executable(plan, output=output, eager=eager, gemm=gemm, donate=donate)


class Executable:
    """`capture="cupy"`: a CuPy Graph launched from Python (this module's call path);
    `capture="raw"`: a cudaGraphExec handle (`raw_exec`) for the XLA FFI handler to launch
    from C++ (CuPy's Graph does not expose its handle). `bracket(stream, which)`, with a
    raw capture, enqueues work before the tasks (which 0) and after them (1): the FFI
    handler's copy nodes."""

    def __init__(self, plan: Plan, output: str = "jax", eager: bool = False, gemm: str = "lt",
                 donate: frozenset = frozenset(), capture: str = "cupy", bracket=None) -> None:
        import cupy

        self.plan, self.output, self.eager = plan, output, eager
        self.donate = sorted(donate)
        self.cupy = cupy
        self.device = cupy.cuda.Device().id  # the GPU its arena, streams and graph live on
        self.lock = threading.Lock()
        self.stats = {"calls": 0, "graph_launches": 0, "task_launches": 0, "input_copies": 0}
        self.arena = allocate(plan.memory.arena_bytes, "the arena")
        self.base = self.arena.data.ptr
        # At least one stream: a plan of views only still launches (an empty graph).
        self.streams = [cupy.cuda.Stream(non_blocking=True)
                        for _ in range(max(1, plan.schedule.num_streams))]
        self.events = {u: cupy.cuda.Event(disable_timing=True) for u, _ in plan.schedule.syncs}
        self.launchers = Launchers(plan, self.streams, self.base, gemm)
        self._upload_consts()
        self.last_inputs: list = [None] * len(plan.graph.inputs)
        # (leaf index, var, arena address) of every input the tasks read.
        self.input_slots = [(i, v, self.base + plan.offset(v)) for i, v in enumerate(plan.graph.inputs)
                            if v in plan.memory.offsets and v.nbytes]
        # (output buffer, its arena address): what _outputs copies out each call.
        self.output_sources = [(a, self.base + plan.offset(a)) for a in plan.output_buffers]
        self.unpacker = XlaUnpacker.create(plan, self.arena) if output == "jax" else None
        self.pending = None  # an output of the last XLA unpack, not yet known complete
        self.returned_arrays: list = []
        self.returned: dict = {}
        self.copier = BatchCopier(self.cupy)
        self.graph = None
        self.raw_graph = self.raw_exec = 0
        # Called before Python launches raw_exec itself (to time it): points the graph
        # back at the arena alone (set by the FFI runner, whose handler re-points it).
        self.rest = lambda: None
        if capture == "raw":
            self._capture_raw(bracket)
        elif not eager:
            self._capture()

    def _upload_consts(self) -> None:
        for var, value in self.plan.graph.consts.items():
            if var in self.plan.memory.offsets:
                host = np.ascontiguousarray(value, dtype=var.dtype)
                self._view(var).set(host.view(cupy_dtype(var.dtype)))

    def _view(self, var):
        """A cupy array over `var`'s bytes in the arena (dtypes cupy knows)."""
        return (self.arena[self.plan.offset(var): self.plan.offset(var) + var.nbytes]
                .view(cupy_dtype(var.dtype)).reshape(var.shape))

    # ---- launching --------------------------------------------------------------
    def launch_task(self, task) -> None:
        """One task on its planned stream (the profiler times tasks one at a time)."""
        self.launchers.launch(task, self.plan.schedule.stream[task])

    def launch_tasks(self) -> None:
        """Every task on its stream, in launch order; fork from and join into stream 0."""
        self.launchers.launch_all(self.events)
        self.stats["task_launches"] += len(self.plan.schedule.order)

    def launch(self) -> None:
        """One run of the plan on stream 0: the graph, or the tasks one by one (eager)."""
        if self.graph is not None:
            self.graph.launch(self.streams[0])
            self.stats["graph_launches"] += 1
        else:
            self.launch_tasks()

    def _warm_up(self) -> None:
        """Every launch once outside capture (modules loaded, launches checked), on an
        arena that holds no inputs yet: loops and branches read no condition."""
        from nimblejax.runtime.conditional import warming

        with warming():
            self.launch_tasks()
        self.streams[0].synchronize()

    def _capture(self) -> None:
        s0 = self.streams[0]
        self._warm_up()
        s0.begin_capture()
        try:
            self.launch_tasks()
        finally:
            graph = s0.end_capture()  # ends capture even on error, so s0 stays usable
        self.graph = graph

    def _capture_raw(self, bracket=None) -> None:
        rt = self.cupy.cuda.runtime
        s0 = self.streams[0]
        self._warm_up()
        rt.streamBeginCapture(s0.ptr)
        try:
            if bracket is not None:
                bracket(s0.ptr, 0)
            self.launch_tasks()
            if bracket is not None:
                bracket(s0.ptr, 1)
        finally:
            graph = rt.streamEndCapture(s0.ptr)
        self.raw_graph = graph
        self.raw_exec = rt.graphInstantiate(graph)

    def close(self) -> None:
        """Give back the library handles (their device memory is not CuPy's) and a raw
        graph (the FFI handler must have forgotten it first)."""
        launchers = getattr(self, "launchers", None)
        if launchers is not None:
            launchers.close()
        if getattr(self, "raw_exec", 0):
            self.cupy.cuda.runtime.graphExecDestroy(self.raw_exec)
            self.cupy.cuda.runtime.graphDestroy(self.raw_graph)
            self.raw_exec = self.raw_graph = 0

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
            last[i] = x if on_gpu(x) else None
            self.stats["input_copies"] += 1
        if batch:
            self.copier(batch, s0)

    def _outputs(self, leaves: list) -> list:
        """Fresh copies of the output buffers (cupy arrays), enqueued on stream 0."""
        cp, s0 = self.cupy, self.streams[0]
        fresh = []
        for a, src in self.output_sources:
            arr = cp.empty(a.shape, dtype=cupy_dtype(a.dtype))
            if a.nbytes:
                cp.cuda.runtime.memcpyAsync(arr.data.ptr, src, a.nbytes, D2D, s0.ptr)
            fresh.append(arr)
        return assemble(self.plan, fresh, leaves.__getitem__, np.asarray)

    def _call(self, leaves: list) -> list:
        s0 = self.streams[0]
        if self.pending is not None:
            # The last call's outputs are still being copied out of the arena by XLA:
            # stream 0 waits for that on the device before the graph overwrites them
            # (and before inputs that are those outputs are read).
            device_wait(self.pending, s0)
            self.pending = None
        self._bind_inputs(leaves)
        self.launch()
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
            if on_gpu(x) and not x.is_deleted():
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

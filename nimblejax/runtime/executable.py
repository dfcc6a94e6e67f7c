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

WORKSPACE_BYTES = 32 << 20  # cuBLAS workspace per stream (a shared one would race)


class OutOfMemoryError(MemoryError):
    pass


class KernelLaunchError(RuntimeError):
    pass


def make_executable(plan: Plan, output: str = "jax", eager: Optional[bool] = None,
                    donate: frozenset = frozenset()) -> Callable[[list], list]:
    if eager is None:
        eager = os.environ.get("NIMBLE_EAGER", "") not in ("", "0")
    return Executable(plan, output=output, eager=eager)


class Executable:
    def __init__(self, plan: Plan, output: str = "jax", eager: bool = False) -> None:
        import cupy

        from nimblejax.runtime.compile import compile_kernels

        self.plan, self.output, self.eager = plan, output, eager
        self.cupy = cupy
        self.lock = threading.Lock()
        self.stats = {"calls": 0, "graph_launches": 0, "task_launches": 0, "input_copies": 0}
        self.functions = compile_kernels(t.kernel for t in plan.tasks if t.kind == "kernel")
        self.arena = _allocate(plan.memory.arena_bytes, "the arena")
        self.base = self.arena.data.ptr
        self.streams = [cupy.cuda.Stream(non_blocking=True) for _ in range(plan.schedule.num_streams)]
        self.events = {u: cupy.cuda.Event(disable_timing=True) for u, _ in plan.schedule.syncs}
        self.handles, self.workspaces = self._cublas_handles()
        self._upload_consts()
        self.last_inputs: list = [None] * len(plan.graph.inputs)
        self.args = {t: self._args(t) for t in plan.tasks}
        self.graph = None
        if not eager:
            self._capture()

    # ---- setup ------------------------------------------------------------------
    def _cublas_handles(self):
        if not any(t.kind == "gemm" for t in self.plan.tasks):
            return [], []
        from nimblejax.runtime.cublas import CublasHandle

        workspaces = [_allocate(WORKSPACE_BYTES, "a cuBLAS workspace") for _ in self.streams]
        handles = [CublasHandle(s.ptr, w.data.ptr, WORKSPACE_BYTES)
                   for s, w in zip(self.streams, workspaces)]
        return handles, workspaces

    def _upload_consts(self) -> None:
        for var, value in self.plan.graph.consts.items():
            if var in self.plan.memory.offsets:
                self._view(var).set(np.ascontiguousarray(value, dtype=var.dtype))

    def _view(self, var):
        """A cupy array over `var`'s bytes in the arena."""
        off = self.plan.offset(var)
        mem = self.cupy.cuda.MemoryPointer(self.arena.data.mem, self.arena.data.ptr - self.arena.data.mem.ptr + off)
        return self.cupy.ndarray(var.shape, dtype=var.dtype, memptr=mem)

    def _args(self, task: Task) -> tuple:
        if task.kind == "kernel":
            return tuple(np.uint64(self.base + self.plan.offset(v)) for v in task.kernel.params)
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
        self.graph.upload(s0)
        s0.synchronize()

    # ---- calling ----------------------------------------------------------------
    def __call__(self, leaves: list) -> list:
        with self.lock:  # one arena per plan: calls on one plan are serialized
            return self._call(leaves)

    def _call(self, leaves: list) -> list:
        s0 = self.streams[0]
        with s0:
            self._bind_inputs(leaves)
            if self.graph is not None:
                self.graph.launch(s0)
                self.stats["graph_launches"] += 1
            else:
                self._launch_all()
            outs = [self._output(a, leaves) for a in self.plan.graph.outputs]
        s0.synchronize()  # outputs are complete before anyone else reads them
        self.stats["calls"] += 1
        return [self._wrap(o) for o in outs]

    def _bind_inputs(self, leaves: list) -> None:
        for i, (var, x) in enumerate(zip(self.plan.graph.inputs, leaves)):
            if var not in self.plan.memory.offsets:
                continue
            if x is self.last_inputs[i] and _immutable(x):
                continue  # the same immutable jax.Array as last call: already in place
            self._view(var)[...] = _to_cupy(self.cupy, x, var.dtype)
            self.last_inputs[i] = x
            self.stats["input_copies"] += 1

    def _output(self, atom, leaves):
        cp = self.cupy
        kind = self.plan.output_kind(atom)
        if kind == "literal":
            return cp.asarray(np.asarray(atom.value))
        if kind == "const":
            return cp.asarray(self.plan.graph.consts[atom])
        if kind == "input":
            return _to_cupy(cp, leaves[self.plan.graph.inputs.index(atom)], atom.dtype).copy()
        return self._view(atom).copy()

    def _wrap(self, arr):
        if self.output == "cupy":
            return arr
        if self.output == "numpy":
            return self.cupy.asnumpy(arr)
        return to_jax(arr)


def _immutable(x) -> bool:
    import jax

    return isinstance(x, jax.Array)


def _to_cupy(cp, x, dtype):
    import jax

    if isinstance(x, jax.Array):
        # from_dlpack makes our stream wait for XLA's producer on the device.
        return cp.from_dlpack(x)
    if hasattr(x, "__cuda_array_interface__"):
        return cp.asarray(x, dtype=dtype)
    return cp.asarray(np.asarray(x, dtype=dtype))


def to_jax(arr):
    """Zero-copy jax.Array over a cupy array; the cupy memory lives as long as it."""
    import jax
    import jax.numpy as jnp

    try:
        out = jnp.asarray(arr)
        if out.unsafe_buffer_pointer() == arr.data.ptr:
            weakref.finalize(out, _keep, arr)
            return out
    except TypeError:
        pass
    return jax.dlpack.from_dlpack(arr)


def _keep(_arr) -> None:
    """Holds a reference until the jax.Array that views it is collected."""


def _allocate(nbytes: int, what: str):
    import cupy

    try:
        return cupy.empty(max(nbytes, 1), dtype=np.uint8)
    except cupy.cuda.memory.OutOfMemoryError as e:
        free, total = cupy.cuda.runtime.memGetInfo()
        raise OutOfMemoryError(
            f"nimblejax needs {nbytes} bytes for {what} but only {free} of {total} bytes of GPU "
            f"memory are free (JAX preallocates 75% by default; XLA_PYTHON_CLIENT_MEM_FRACTION "
            f"or XLA_PYTHON_CLIENT_PREALLOCATE=false leave more)") from e

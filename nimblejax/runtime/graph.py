"""A plan built on one GPU: its arena, streams, events, launchers and captured CUDA graph.

Every GPU runner runs a plan through one of these: the direct Python path
(runtime/direct_runner.py) captures it as a CuPy graph and launches that from Python (or launches
the tasks one by one, eager); the XLA operation (runtime/ffi_runner.py) captures it raw
and hands the cudaGraphExec to the C++ FFI handler, which launches it on XLA's stream.
Either way the graph forks from stream 0 onto the planner's streams with events and joins
back before it ends, so from the outside it is ordered like one kernel on stream 0.
"""
from __future__ import annotations

from typing import Callable, Optional

import numpy as np

from nimblejax.compiler.plan import Plan
from nimblejax.runtime.io import allocate, cupy_dtype
from nimblejax.runtime.launch import Launchers

CAPTURES = ("cupy", "raw", "none")


class DeviceGraph:
    """`capture="cupy"`: a CuPy Graph, launched by `launch`; `capture="raw"`: a
    cudaGraphExec handle (`raw_exec`) for the FFI handler to launch; `capture="none"`:
    no graph, `launch` launches the tasks one by one (eager). `bracket(stream, which)`,
    with a raw capture, enqueues work before the tasks (which 0) and after them (1): the
    FFI handler's copy nodes. `segments` (raw capture): lists of tasks in launch order
    (compiler/segments.py), one graph each, `raw_graphs[k]` / `raw_execs[k]`, over
    the one arena; `raw_graph` / `raw_exec` are the first."""

    def __init__(self, plan: Plan, gemm: str = "lt", capture: str = "cupy",
                 bracket: Optional[Callable] = None, segments: Optional[list] = None,
                 *, pdl: bool) -> None:
        import cupy

        if capture not in CAPTURES:
            raise ValueError(f"capture must be one of {CAPTURES}, got {capture!r}")
        self.plan, self.cupy = plan, cupy
        self.device = cupy.cuda.Device().id  # the GPU its arena, streams and graph live on
        # Counters: graph and task launches here; the direct runner adds calls and copies.
        self.stats = {"calls": 0, "graph_launches": 0, "task_launches": 0, "input_copies": 0}
        self.arena = allocate(plan.memory.arena_bytes, "the arena")
        self.base = self.arena.data.ptr
        # At least one stream: a plan of views only still launches (an empty graph).
        self.streams = [cupy.cuda.Stream(non_blocking=True)
                        for _ in range(max(1, plan.schedule.num_streams))]
        self.events = {u: cupy.cuda.Event(disable_timing=True) for u, _ in plan.schedule.syncs}
        self.launchers = Launchers(plan, self.streams, self.base, gemm, pdl=pdl)
        self._upload_consts()
        self.graph = None
        self.raw_graph = self.raw_exec = 0
        self.raw_graphs: list = []
        self.raw_execs: list = []
        # Called before Python launches raw_exec itself (to time it): points the graph
        # back at the arena alone (set by the FFI runner, whose handler re-points it).
        self.rest = lambda: None
        if capture == "raw":
            self._warm_up()
            for tasks in segments or [None]:
                self._capture_raw(bracket, tasks)
            self.raw_graph, self.raw_exec = self.raw_graphs[0], self.raw_execs[0]
        elif capture == "cupy":
            self._capture()

    def slot(self, var) -> int:
        """`var`'s address in the arena; 0 where it has no bytes there."""
        return self.base + self.plan.offset(var) if var in self.plan.memory.offsets and var.nbytes else 0

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

    def launch_tasks(self, tasks=None) -> None:
        """Every task (or `tasks`, a segment) on its stream, in launch order; fork from
        and join into stream 0."""
        self.launchers.launch_all(self.events, tasks)
        self.stats["task_launches"] += len(self.plan.schedule.order if tasks is None else tasks)

    def launch(self) -> None:
        """One run of the plan on stream 0: the graph, or the tasks one by one (eager)."""
        if self.graph is not None:
            self.graph.launch(self.streams[0])
            self.stats["graph_launches"] += 1
        else:
            self.launch_tasks()

    def _warm_up(self) -> None:
        """Every launch once outside capture (modules loaded, launches checked), on an
        arena that holds no inputs yet (zeroed): loops and branches read no condition."""
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

    def _capture_raw(self, bracket=None, tasks=None) -> None:
        """One raw graph of the tasks (or of a segment's): the copy nodes around them."""
        rt = self.cupy.cuda.runtime
        s0 = self.streams[0]
        rt.streamBeginCapture(s0.ptr)
        try:
            if bracket is not None:
                bracket(s0.ptr, 0)
            self.launch_tasks(tasks)
            if bracket is not None:
                bracket(s0.ptr, 1)
        finally:
            graph = rt.streamEndCapture(s0.ptr)
        self.raw_graphs.append(graph)
        self.raw_execs.append(rt.graphInstantiate(graph))

    def close(self) -> None:
        """Give back the library handles (their device memory is not CuPy's) and a raw
        graph (the FFI handler must have forgotten it first)."""
        launchers = getattr(self, "launchers", None)
        if launchers is not None:
            launchers.close()
        for graph, exe in zip(getattr(self, "raw_graphs", ()), getattr(self, "raw_execs", ())):
            self.cupy.cuda.runtime.graphExecDestroy(exe)
            self.cupy.cuda.runtime.graphDestroy(graph)
        self.raw_graphs, self.raw_execs = [], []
        self.raw_exec = self.raw_graph = 0

    def __del__(self) -> None:
        try:
            self.close()
        except Exception:  # interpreter shutdown: the libraries may be gone already
            pass

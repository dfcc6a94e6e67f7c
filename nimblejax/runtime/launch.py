"""Launchers: how each kind of task runs on a stream (generated kernel, cuBLASLt or cuBLAS
GEMM, cuDNN convolution), with the library handles and workspaces they need.

Everything a launch needs is made here before capture (handles bound to their stream,
one workspace per stream, algorithms measured on the task's own buffers), so that a
launch under stream capture only enqueues work.
"""
from __future__ import annotations

from typing import Callable

import numpy as np

from nimblejax.compiler.lowering.task import Task
from nimblejax.compiler.plan import Plan
from nimblejax.compiler.kinds import TaskKind
from nimblejax.compiler.loops import LoopCall
from nimblejax.runtime.io import allocate, retry_after_freeing

# cuBLAS workspace per stream (a shared one would race). NVIDIA recommends 32 MiB on
# Hopper. Plain cuBLAS handles are bound to theirs: side streams run the small GEMMs of
# parallel branches and get 4 MiB, so a plan of 20+ streams does not hold most of a GiB
# (seen exhausting GPU memory beside JAX's preallocation in the model suite). cuBLASLt
# GEMMs all choose their algorithm with WORKSPACE_BYTES (one buffer, used for the timing
# only) and each stream then gets what its GEMMs' choices need: with 4 MiB cuBLASLt's
# heuristic offered slower candidates for a side stream's GEMMs (H100, GPT at batch 1:
# 128x512x2048 14.3 µs against 8.1 with 32 MiB; BERT: about 1 µs a GEMM).
WORKSPACE_BYTES = 32 << 20
SIDE_WORKSPACE_BYTES = 4 << 20


class KernelLaunchError(RuntimeError):
    pass


def plan_kernels(plan: Plan, pdl: bool, nested: bool = False) -> list:
    """The kernels the graph build of `plan` compiles: each KERNEL task's launches, in
    their programmatic-launch form where `pdl` (`pdl.applies`); with `nested`, those of its
    loop and branch plans too (each gets a Launchers of its own, with the same `pdl`)."""
    from nimblejax.runtime import pdl as pdl_mod

    kernels = [k for t in plan.tasks if t.kind is TaskKind.KERNEL for k in t.kernel.launches]
    if pdl:
        kernels = [pdl_mod.waiting(k) for k in kernels]
    if nested:
        for t in plan.tasks:
            if t.control is not None:
                subs = (t.control.step,) if isinstance(t.control, LoopCall) else t.control.branches
                kernels += [k for sub in subs for k in plan_kernels(sub, pdl, nested=True)]
    return kernels


class Launchers:
    """Per task, a ready launch on its planned stream. `gemm` is options.gemm: "lt"
    (cuBLASLt, algorithms measured per task) or "cublas"; `pdl` is options.pdl."""

    def __init__(self, plan: Plan, streams: list, base: int, gemm: str = "lt", *, pdl: bool) -> None:
        from nimblejax.runtime import pdl as pdl_mod
        from nimblejax.runtime.compile import compile_kernels, start_compiling

        self.plan, self.streams, self.base = plan, streams, base
        self.stream_of = plan.schedule.stream
        self.use_lt = gemm != "cublas"
        if not self.use_lt:
            _no_epilogues([t for t in plan.tasks if t.kind is TaskKind.GEMM])
        # Programmatic dependent launch (runtime/pdl.py): each kernel waits before its
        # first access, and is launched so that capture makes its edge programmatic.
        self.pdl = pdl_mod.Launcher() if pdl_mod.applies(pdl) else None
        kernels = plan_kernels(plan, self.pdl is not None)
        start_compiling(kernels)  # NVRTC in the background while the libraries get ready
        self.args = {t: self._addresses(t) for t in plan.tasks}
        # Library handles allocate outside CuPy's pool: when the device looks full, give
        # CuPy's cached free blocks back and try once more.
        self.handles, self.workspaces = retry_after_freeing(self._gemm_workspaces)
        self.convs, self.cudnn_handles, self.cudnn_workspaces = retry_after_freeing(self._cudnn_convs)
        self.lt_handle, self.lt = self._lt_gemms()
        self.functions = compile_kernels(kernels)
        # WHILE / SWITCH tasks (compiler/loops.py): CUDA conditional nodes.
        control = [t for t in plan.tasks if t.control is not None]
        self.control = None
        if control:
            from nimblejax.runtime.conditional import ControlLaunchers

            self.control = ControlLaunchers(
                control, self.address, lambda sub, streams, base: Launchers(sub, streams, base, gemm, pdl=pdl))

    def launch_all(self, events: dict, tasks=None) -> None:
        """Every task on its stream, in launch order, waiting on and recording the
        schedule's events (`events`: one per sync source); the other streams fork from
        and join into streams[0]. Captured, the events become the graph's edges.
        `tasks`: only these, in launch order (a segment, compiler/segments.py): an event
        of a task outside them is not waited on (an earlier segment ran to its end)."""
        import cupy

        sched, streams = self.plan.schedule, self.streams
        order = sched.order if tasks is None else tasks
        inside = None if tasks is None else frozenset(tasks)
        fork = cupy.cuda.Event(disable_timing=True)
        fork.record(streams[0])
        for s in streams[1:]:
            s.wait_event(fork)
        for task in order:
            s = sched.stream[task]
            for u in sched.waits(task):
                if inside is None or u in inside:
                    streams[s].wait_event(events[u])
            self.launch(task, s)
            if task in events:
                events[task].record(streams[s])
        for s in streams[1:]:
            join = cupy.cuda.Event(disable_timing=True)
            join.record(s)
            streams[0].wait_event(join)

    def _addresses(self, task: Task) -> tuple:
        """The device addresses a task runs on (kernel params, or a library call's operands:
        None for a GEMM epilogue operand it does not have)."""
        if task.kind is TaskKind.KERNEL:
            return (tuple(np.uint64(self.address(v)) for v in task.kernel.params)
                    + tuple(np.int64(s) for s in task.kernel.scalars))
        if task.control is not None:  # runtime/conditional.py holds its addresses
            return ()
        call = task.gemm if task.kind is TaskKind.GEMM else task.conv
        return tuple(None if v is None else self.address(v) for v in call.operands)

    def address(self, var) -> int:
        return self.base + self.plan.offset(var)

    # ---- setup ------------------------------------------------------------------
    def _gemm_workspaces(self):
        """A GEMM workspace per stream that runs GEMMs and, under gemm="cublas", a
        cuBLAS handle bound to it (cuBLASLt takes stream and workspace per call)."""
        gemm_streams = {self.stream_of[t] for t in self.plan.tasks if t.kind is TaskKind.GEMM}
        if not gemm_streams or self.use_lt:  # cuBLASLt: _lt_gemms sizes them
            return [], [None] * len(self.streams)
        from nimblejax.runtime.libs.cublas import CublasHandle

        sizes = [WORKSPACE_BYTES if i == 0 else SIDE_WORKSPACE_BYTES for i in range(len(self.streams))]
        workspaces = [allocate(n, "a cuBLAS workspace") if i in gemm_streams else None
                      for i, n in enumerate(sizes)]
        handles = [CublasHandle(s.ptr, w.data.ptr, n) if w is not None else None
                   for s, w, n in zip(self.streams, workspaces, sizes)]
        return handles, workspaces

    def _lt_gemms(self):
        """Per GEMM task a cuBLASLt matmul whose algorithm was measured on the task's own
        workspace (cuBLAS's default choice is several times slower on small and skinny
        shapes), with operands not in L2 where the plan's arena is larger than L2
        (libs/fill.py: its weights are read from device memory when it runs)."""
        tasks = [t for t in self.plan.tasks if t.kind is TaskKind.GEMM]
        if not tasks or not self.use_lt:
            return None, {}
        from nimblejax.runtime.libs import cublaslt, fill

        import cupy

        handle = cublaslt.LtHandle()
        gemms = {}
        l2_bytes = fill.cold_l2_bytes(cupy, self.plan.memory.arena_bytes)
        try:
            tuning = retry_after_freeing(lambda: allocate(WORKSPACE_BYTES, "a cuBLAS workspace"))
            for t in tasks:
                s = self.stream_of[t]
                a, b, c, bias, residual = self.args[t]
                buffers = cublaslt.GemmBuffers(a, b, c, tuning.data.ptr, self.streams[s].ptr,
                                               bias=bias, residual=residual, l2_bytes=l2_bytes)
                gemms[t] = cublaslt.LtGemm(handle, t.gemm, WORKSPACE_BYTES, buffers=buffers)
            del tuning
            need: dict[int, int] = {}
            for t, g in gemms.items():
                s = self.stream_of[t]
                need[s] = max(need.get(s, 0), g.workspace_needed)
            for s, n in need.items():  # at least one alignment unit: a valid pointer
                self.workspaces[s] = retry_after_freeing(
                    lambda n=n: allocate(max(n, cublaslt.POINTER_ALIGNMENT), "a cuBLAS workspace"))
        except BaseException:
            _close_all(gemms.values(), lambda g: g.close())
            handle.destroy()
            raise
        finally:
            fill.release_fill()  # the timing's operands, shared by the plan's GEMMs
        return handle, gemms

    def _cudnn_convs(self):
        """Per cuDNN task its descriptors and measured algorithm; per stream a handle and
        a workspace as large as its convolutions need (set before capture)."""
        tasks = [t for t in self.plan.tasks if t.kind is TaskKind.CUDNN]
        if not tasks:
            return {}, {}, {}
        from nimblejax.runtime.libs import cudnn

        handles = {s: cudnn.Handle(self.streams[s].ptr) for s in {self.stream_of[t] for t in tasks}}
        convs = {t: cudnn.Conv(t.conv, handles[self.stream_of[t]]) for t in tasks}
        need: dict[int, int] = {}
        for t, conv in convs.items():
            s = self.stream_of[t]
            need[s] = max(need.get(s, 0), conv.workspace)
        workspaces = {s: allocate(n, "a cuDNN workspace") for s, n in need.items()}
        return convs, handles, workspaces

    # ---- launching --------------------------------------------------------------
    def launch(self, task: Task, s: int) -> None:
        """Enqueue `task` on stream `s` (capture-safe)."""
        stream = self.streams[s]
        if task.control is not None:
            self.control.launch(task, stream)
        elif task.kind is TaskKind.KERNEL:
            try:
                for k in task.kernel.launches:  # all take the same arguments
                    if self.pdl is not None:
                        self.pdl.launch(self.functions[k.name], k.grid, k.block, self.args[task], stream.ptr)
                    else:
                        self.functions[k.name](k.grid, k.block, self.args[task], stream=stream)
            except Exception as e:
                raise KernelLaunchError(f"launching {k.name} (from {task.source}) failed: {e}") from e
        elif task.kind is TaskKind.CUDNN:
            ws = self.cudnn_workspaces[s]
            self.convs[task].run(self.cudnn_handles[s], *self.args[task], ws.data.ptr, ws.nbytes)
        elif task in self.lt:
            ws = self.workspaces[s]
            a, b, c, bias, residual = self.args[task]
            self.lt[task].run(self.lt_handle, a, b, c, ws.data.ptr, ws.nbytes, stream.ptr,
                              bias=bias, residual=residual)
        else:
            from nimblejax.runtime.libs.cublas import gemm_strided_batched

            gemm_strided_batched(self.handles[s], task.gemm, *self.args[task][:3])

    def close(self) -> None:
        """Give back the library handles (their device memory is not CuPy's)."""
        _close_all(self.handles or [], lambda h: h.destroy())
        self.handles = []
        _close_all(self.lt.values(), lambda g: g.close())
        self.lt = {}
        if self.lt_handle is not None:
            self.lt_handle.destroy()
            self.lt_handle = None
        _close_all(self.cudnn_handles.values(), lambda h: h.destroy())
        self.cudnn_handles = {}
        if self.control is not None:
            self.control.close()


def _no_epilogues(gemm_tasks: list[Task]) -> None:
    """Plain cuBLAS computes no epilogue; plans for it are built without (pipeline.py)."""
    for t in gemm_tasks:
        if t.gemm.epilogue or t.gemm.alpha != 1.0:
            raise ValueError(f"GEMM task {t.name} has an epilogue, which only cuBLASLt computes: "
                             "plan with options gemm='cublas' (NIMBLE_GEMM=cublas) to run on cuBLAS")


def _close_all(items, close: Callable) -> None:
    for item in list(items):
        if item is not None:
            close(item)

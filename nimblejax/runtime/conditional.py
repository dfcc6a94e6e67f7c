"""WHILE and SWITCH tasks (compiler/loops.py) on the GPU: CUDA conditional graph nodes.

CuPy has no API for conditional nodes, so this module calls the driver through
cuda-bindings (`from cuda.bindings import driver`). One `ControlLaunchers` serves a
plan's control tasks; `launch.Launchers.launch` hands it every task with `control`.

Each sub-plan (a loop's step, a branch) gets an arena of its own, its constants
uploaded, and its own `Launchers` over streams of its own whose first is the private
stream a conditional body is captured on. A body may hold no event nodes, but the
other streams join that capture by waiting on an event recorded in it, and events
between streams recorded and waited on inside one capture become the graph's edges: a
body runs the sub-plan's independent tasks side by side, as the plan's streams say.

Captured (the plan's graph is being captured on the task's stream), a WHILE task is
  one kernel that sets the loop's handle from the condition on the initial carry and
    copies the operands into the step plan's input slots (carry slots included)
  → a WHILE node whose body is captured on the private stream
    (cuStreamBeginCaptureToGraph): the step plan's launches, then one kernel that
    copies each next carry into its slot and sets the handle from the step's `pred`
  → one kernel copying the carry slots into the task's results.
A SWITCH task is a kernel that sets one handle per branch (the clamped index equal to
k) and one IF node per branch, whose body copies the operands in, runs the branch plan
and copies its results out (IF nodes need a 12.3 driver, SWITCH nodes 12.8). Every
group of copies is one kernel reading a (destination, source, bytes) table
(`CopyTable`): each kernel node of a WHILE body or around it costs about 1.5 µs on its
stream, and diffrax's stage loop had 22 copies around each run.
Not captured (eager mode), the same runs from the host, which reads each condition
back (a synchronization per iteration: correct, not fast). The warm-up run before
capture reads none (`warming`): its arena holds no inputs yet.

cuda-bindings 13 added edge data to cuGraphAddNode, cuStreamUpdateCaptureDependencies
and cuStreamGetCaptureInfo (12.x: no `dependencyData`, and the info has no edge data);
`_driver_call` passes what the installed bindings take.
"""
from __future__ import annotations

import contextlib
import contextvars
import inspect
from typing import Any, Iterator, Sequence

import numpy as np

from nimblejax.compiler import loops
from nimblejax.compiler.ir import Literal, Var
from nimblejax.compiler.lowering.task import Task

MIN_DRIVER = 12030  # conditional WHILE and IF nodes, and cuStreamBeginCaptureToGraph

# The device side of a conditional node: a kernel upstream of the node (or at the end
# of a WHILE body) sets the handle. The builtin is declared here as NVRTC sees no CUDA
# runtime headers (the same declaration cuda_device_runtime_api.h makes).
SOURCE = r"""
typedef unsigned long long cudaGraphConditionalHandle;
extern "C" __device__ __cudart_builtin__ void cudaGraphSetConditional(
    cudaGraphConditionalHandle handle, unsigned int value);

// One IF handle per branch: handle k is set where the clamped index is k (lax.switch).
extern "C" __global__ void nimble_set_branch(cudaGraphConditionalHandle handle, const int* index,
                                             int k, int n) {
    int i = *index;
    i = i < 0 ? 0 : (i >= n ? n - 1 : i);
    cudaGraphSetConditional(handle, i == k ? 1u : 0u);
}

// Copies between fixed slots, as kernels (a conditional body takes kernel nodes): a
// table of (dst, src, bytes), pair blockIdx.y, its bytes over blockIdx.x. One node
// instead of one per pair: each node on a body's one stream costs about 1.5 us.
struct NimbleCopy { unsigned long long dst, src, n; };

__device__ void nimble_copy_pair(const NimbleCopy p) {
    unsigned char* dst = (unsigned char*)p.dst;
    const unsigned char* src = (const unsigned char*)p.src;
    unsigned long long step = (unsigned long long)gridDim.x * blockDim.x;
    unsigned long long i = (unsigned long long)blockIdx.x * blockDim.x + threadIdx.x;
    if (p.n % 4 == 0 && p.dst % 4 == 0 && p.src % 4 == 0) {
        for (; i < p.n / 4; i += step) ((unsigned int*)dst)[i] = ((const unsigned int*)src)[i];
    } else {
        for (; i < p.n; i += step) dst[i] = src[i];
    }
}

extern "C" __global__ void nimble_copy_pairs(const NimbleCopy* pairs, int count) {
    if ((int)blockIdx.y < count) nimble_copy_pair(pairs[blockIdx.y]);
}

// A WHILE's entry (the handle from the condition on the initial carry, the operands into
// their slots) and the end of its body (the handle from the step's pred, each next carry
// into its slot) in one kernel node. The handle is read when the node before the body
// (or the body) ends, so setting it beside the copies is safe; the copies never write
// the flag (entry: it lives in the enclosing arena; body end: they read the step's
// results, never a slot).
extern "C" __global__ void nimble_set_and_copy(cudaGraphConditionalHandle handle, const bool* flag,
                                               const NimbleCopy* pairs, int count) {
    if (blockIdx.x == 0 && blockIdx.y == 0 && threadIdx.x == 0)
        cudaGraphSetConditional(handle, *flag ? 1u : 0u);
    if ((int)blockIdx.y < count) nimble_copy_pair(pairs[blockIdx.y]);
}
"""
COPY_BLOCK = 256
COPY_MAX_BLOCKS = 1024


def copy_blocks(nbytes: int) -> int:
    """Blocks of COPY_BLOCK threads for a copy of `nbytes` (four bytes a thread)."""
    return min(COPY_MAX_BLOCKS, max(1, -(-int(nbytes) // (4 * COPY_BLOCK))))


class CopyTable:
    """Copies between fixed addresses as the (dst, src, bytes) table that
    nimble_copy_pairs and nimble_set_and_copy read, in device memory; `blocks` per copy
    covers the largest."""

    def __init__(self, pairs: Sequence[tuple[int, int, int]]) -> None:
        import cupy

        pairs = [p for p in pairs if p[2]]
        self.count = len(pairs)
        self.blocks = max((copy_blocks(n) for _, _, n in pairs), default=1)
        table = np.asarray(pairs, np.uint64).reshape(-1, 3) if pairs else np.zeros((1, 3), np.uint64)
        self.buffer = cupy.asarray(table)
        self.address = self.buffer.data.ptr


# The warm-up run before capture (graph.py) launches a plan on whatever its arena
# holds: no inputs yet. A loop whose trip count comes from data could then run for ever
# (a Newton iteration on garbage never converges), so under `warming()` a WHILE task runs
# its step once and a SWITCH task each branch once, reading no condition: every launch
# is made once outside capture, which is what the warm-up is for.
_WARMING = contextvars.ContextVar("nimblejax_warming", default=False)


@contextlib.contextmanager
def warming() -> Iterator[None]:
    token = _WARMING.set(True)
    try:
        yield
    finally:
        _WARMING.reset(token)


def driver_version() -> int:
    from cuda.bindings import driver

    return int(_check(driver.cuDriverGetVersion())[0])


def check_supported() -> None:
    """Raise a RuntimeError the user can act on where conditional nodes cannot run."""
    try:
        version = driver_version()
    except ImportError as e:
        raise RuntimeError("WHILE/SWITCH tasks (loops='graph') need the cuda-bindings package "
                           "(pip install cuda-bindings); or plan with loops='unroll'") from e
    if version < MIN_DRIVER:
        raise RuntimeError(f"WHILE/SWITCH tasks (loops='graph') need CUDA conditional graph nodes "
                           f"(driver {MIN_DRIVER // 1000}.{MIN_DRIVER % 1000 // 10} or newer), "
                           f"found {version}; plan with loops='unroll'")


class ControlLaunchers:
    """Launches of a plan's WHILE and SWITCH tasks; `address(var)` is the enclosing
    arena's address of a value, `make_launchers(plan, streams, base)` the launchers of
    a sub-plan (launch.py's, handed in: launch.py imports this module)."""

    def __init__(self, tasks: Sequence[Task], address: Any, make_launchers: Any) -> None:
        import cupy

        check_supported()
        self.cupy = cupy
        module = _load_module()
        self.set_branch = module.get_function("nimble_set_branch")
        self.copy_pairs = module.get_function("nimble_copy_pairs")
        self.set_and_copy = module.get_function("nimble_set_and_copy")
        self.private = cupy.cuda.Stream(non_blocking=True)
        self.tasks = {t: _TaskLaunch(t, address, make_launchers, self.private) for t in tasks}

    def launch(self, task: Task, stream: Any) -> None:
        run = self.tasks[task]
        if _capturing(stream):
            (self._capture_while if run.loop else self._capture_switch)(run, stream)
        else:
            (self._host_while if run.loop else self._host_switch)(run, stream)

    def close(self) -> None:
        """Give back the sub-plans' library handles."""
        for run in self.tasks.values():
            subs = [run.step] if run.loop else [sub for sub, _, _ in run.branches]
            for sub in subs:
                sub.launchers.close()

    # ---- copies -------------------------------------------------------------------
    def _copy(self, table: CopyTable, stream: Any) -> None:
        if table.count:
            self.copy_pairs((table.blocks, table.count), (COPY_BLOCK,),
                            (np.uint64(table.address), np.int32(table.count)), stream=stream)

    def _set_and_copy(self, handle: Any, flag: int, table: CopyTable, stream: Any) -> None:
        self.set_and_copy((table.blocks, max(1, table.count)), (COPY_BLOCK,),
                          (np.uint64(int(handle)), np.uint64(flag), np.uint64(table.address),
                           np.int32(table.count)), stream=stream)

    # ---- WHILE ----------------------------------------------------------------------
    def _capture_while(self, run: "_TaskLaunch", stream: Any) -> None:
        from cuda.bindings import driver

        graph, _ = _capture_info(stream)
        handle = _check(driver.cuGraphConditionalHandleCreate(graph, _context(), 0, 0))[0]
        self._set_and_copy(handle, run.pred0, run.copy_in, stream)
        body = _add_conditional(stream, handle, driver.CUgraphConditionalNodeType.CU_GRAPH_COND_TYPE_WHILE)
        with _capturing_to(self.private, body):
            run.step.launch_all()
            self._set_and_copy(handle, run.flag, run.next_carry, self.private)
        self._copy(run.copy_out, stream)

    def _host_while(self, run: "_TaskLaunch", stream: Any) -> None:
        warming = _WARMING.get()  # one step, no condition read (see warming)
        self._copy(run.copy_in, stream)
        pred = warming or _read_bool(run.pred0, stream)
        self._join(stream, self.private)
        while pred:
            run.step.launch_all()
            self._copy(run.next_carry, self.private)
            pred = not warming and _read_bool(run.flag, self.private)
        self._copy(run.copy_out, self.private)
        self._join(self.private, stream)

    # ---- SWITCH ---------------------------------------------------------------------
    def _capture_switch(self, run: "_TaskLaunch", stream: Any) -> None:
        from cuda.bindings import driver

        n = len(run.branches)
        for k, (sub, copy_in, copy_out) in enumerate(run.branches):
            graph, _ = _capture_info(stream)
            handle = _check(driver.cuGraphConditionalHandleCreate(graph, _context(), 0, 0))[0]
            self.set_branch((1,), (1,), (np.uint64(int(handle)), np.uint64(run.index),
                                         np.int32(k), np.int32(n)), stream=stream)
            body = _add_conditional(stream, handle, driver.CUgraphConditionalNodeType.CU_GRAPH_COND_TYPE_IF)
            with _capturing_to(self.private, body):
                self._copy(copy_in, self.private)
                sub.launch_all()
                self._copy(copy_out, self.private)

    def _host_switch(self, run: "_TaskLaunch", stream: Any) -> None:
        if _WARMING.get():  # every branch once, no index read (see warming)
            taken = run.branches
        else:
            taken = [run.branches[loops.branch_index(_read(run.index, np.int32, stream),
                                                     len(run.branches))]]
        self._join(stream, self.private)
        for sub, copy_in, copy_out in taken:
            self._copy(copy_in, self.private)
            sub.launch_all()
            self._copy(copy_out, self.private)
        self._join(self.private, stream)

    def _join(self, before: Any, after: Any) -> None:
        event = self.cupy.cuda.Event(disable_timing=True)
        event.record(before)
        after.wait_event(event)


class _TaskLaunch:
    """One control task's sub-plans and the (destination, source, bytes) copies around
    them, all at fixed addresses."""

    def __init__(self, task: Task, address: Any, make_launchers: Any, private: Any) -> None:
        node = task.eqns[0]
        self.pool = _LiteralPool([a for a in node.inputs if isinstance(a, Literal)])
        src = [self.pool.address(a) if isinstance(a, Literal) else address(a) for a in node.inputs]
        call = task.control
        self.loop = isinstance(call, loops.LoopCall)
        if self.loop:
            self.step = _SubPlan(call.step, make_launchers, private)
            step = call.step.graph
            self.pred0 = src[0]
            self.copy_in = _pairs(self.step, step.inputs, src[1:])
            slots = step.inputs[call.nconsts:]
            self.next_carry = CopyTable([(self.step.address(s), self.step.address(o), s.nbytes)
                                         for s, o, passed in zip(slots, step.outputs[:-1], call.passed)
                                         if not passed])
            self.flag = self.step.address(step.outputs[-1])
            self.copy_out = CopyTable([(address(v), self.step.address(s), v.nbytes)
                                       for v, s in zip(node.outputs, slots)])
        else:
            self.index = src[0]
            self.branches = []
            for plan in call.branches:
                sub = _SubPlan(plan, make_launchers, private)
                copy_in = _pairs(sub, plan.graph.inputs, src[1:])
                copy_out = CopyTable([(address(v), sub.address(o), v.nbytes)
                                      for v, o in zip(node.outputs, plan.graph.outputs)])
                self.branches.append((sub, copy_in, copy_out))


def _pairs(sub: "_SubPlan", inputs: Sequence[Var], sources: Sequence[int]) -> CopyTable:
    return CopyTable([(sub.address(v), s, v.nbytes) for v, s in zip(inputs, sources)
                      if v in sub.plan.memory.offsets])


class _SubPlan:
    """A sub-plan's arena, constants and launches on streams of its own, the first the
    control launchers' private stream (a conditional body is captured there; the others
    join that capture through events, which become the body graph's edges)."""

    def __init__(self, plan: Any, make_launchers: Any, private: Any) -> None:
        from nimblejax.runtime.io import allocate, cupy_dtype

        self.plan = plan
        self.arena = allocate(max(plan.memory.arena_bytes, 1), "a loop's arena")
        self.base = self.arena.data.ptr
        for var, value in plan.graph.consts.items():
            if var in plan.memory.offsets:
                view = self.arena[plan.offset(var): plan.offset(var) + var.nbytes]
                view.view(cupy_dtype(var.dtype)).set(np.ascontiguousarray(value, var.dtype).reshape(-1)
                                                     .view(cupy_dtype(var.dtype)))
        import cupy

        self.streams = [private] + [cupy.cuda.Stream(non_blocking=True)
                                    for _ in range(plan.schedule.num_streams - 1)]
        self.events = {u: cupy.cuda.Event(disable_timing=True) for u, _ in plan.schedule.syncs}
        self.launchers = make_launchers(plan, self.streams, self.base)

    def address(self, var: Var) -> int:
        return self.base + self.plan.offset(var)

    def launch_all(self) -> None:
        """Every task on its stream, forked from and joined into the private stream
        (streams[0])."""
        self.launchers.launch_all(self.events)


class _LiteralPool:
    """Literal operands (a literal initial carry, a literal index) in device memory."""

    def __init__(self, literals: Sequence[Literal]) -> None:
        import cupy

        self.offset: dict[int, int] = {}
        blob = bytearray()
        for a in literals:
            self.offset[id(a)] = len(blob)
            blob += np.asarray(a.value).tobytes().ljust(8, b"\0")
        self.buffer = cupy.asarray(np.frombuffer(bytes(blob) or b"\0" * 8, np.uint8))

    def address(self, atom: Literal) -> int:
        return self.buffer.data.ptr + self.offset[id(atom)]


# ---- the kernels ---------------------------------------------------------------------
def ptx_of(source: str, arch: str) -> bytes:
    """PTX for `arch` (compute_90, say) by NVRTC. PTX, not a cubin: the driver's JIT
    resolves the cudaGraphSetConditional builtin where a cubin would need the device
    runtime linked in."""
    from cuda.bindings import nvrtc

    err, prog = nvrtc.nvrtcCreateProgram(source.encode(), b"nimble_conditional.cu", 0, [], [])
    opts = [f"--gpu-architecture={arch}".encode(), b"--std=c++17"]
    try:
        (err,) = nvrtc.nvrtcCompileProgram(prog, len(opts), opts)
        if err != nvrtc.nvrtcResult.NVRTC_SUCCESS:
            _, size = nvrtc.nvrtcGetProgramLogSize(prog)
            log = b" " * size
            nvrtc.nvrtcGetProgramLog(prog, log)
            raise RuntimeError(f"NVRTC failed on the conditional-node kernels: {log.decode()}")
        _, size = nvrtc.nvrtcGetPTXSize(prog)
        ptx = b" " * size
        nvrtc.nvrtcGetPTX(prog, ptx)
        return ptx
    finally:
        nvrtc.nvrtcDestroyProgram(prog)


def _load_module() -> Any:
    """The kernels as a CuPy module loaded from PTX (cuModuleLoadData)."""
    import cupy

    major, minor = cupy.cuda.Device().compute_capability[:-1], cupy.cuda.Device().compute_capability[-1]
    module = cupy.cuda.function.Module()
    module.load(ptx_of(SOURCE, f"compute_{major}{minor}"))
    return module


# ---- the driver --------------------------------------------------------------------
def _check(result: Any) -> tuple:
    from cuda.bindings import driver

    err, *rest = result if isinstance(result, tuple) else (result,)
    if err != driver.CUresult.CUDA_SUCCESS:
        raise RuntimeError(f"CUDA driver call failed: {err!r}")
    return tuple(rest)


def _takes_edge_data(fn: Any) -> bool:
    """Whether this cuda-bindings' `fn` takes a dependencyData argument (13.x)."""
    head = (fn.__doc__ or "").splitlines()[0] if fn.__doc__ else ""
    if head:
        return "dependencyData" in head
    try:
        return "dependencyData" in inspect.signature(fn).parameters
    except (TypeError, ValueError):
        return False


def _capturing(stream: Any) -> bool:
    from cuda.bindings import driver

    status = _check(driver.cuStreamIsCapturing(stream.ptr))[0]
    return status == driver.CUstreamCaptureStatus.CU_STREAM_CAPTURE_STATUS_ACTIVE


def _capture_info(stream: Any) -> tuple[Any, list]:
    """(the graph being captured, the nodes the next captured node depends on)."""
    from cuda.bindings import driver

    info = _check(driver.cuStreamGetCaptureInfo(stream.ptr))
    # 13.x: (status, id, graph, deps, edge data, count); 12.x: (status, id, graph, deps, count)
    graph, deps, count = info[2], info[3], info[-1]
    return graph, list(deps or [])[: int(count)]


def _context() -> Any:
    from cuda.bindings import driver

    return _check(driver.cuCtxGetCurrent())[0]


def _add_conditional(stream: Any, handle: Any, kind: Any) -> Any:
    """A conditional node after the stream's captured work, the stream's next work after
    it; its body graph."""
    from cuda.bindings import driver

    graph, deps = _capture_info(stream)
    params = driver.CUgraphNodeParams()
    params.type = driver.CUgraphNodeType.CU_GRAPH_NODE_TYPE_CONDITIONAL
    params.conditional.handle = handle
    params.conditional.type = kind
    params.conditional.size = 1
    params.conditional.ctx = _context()
    if _takes_edge_data(driver.cuGraphAddNode):
        node = _check(driver.cuGraphAddNode(graph, deps, None, len(deps), params))[0]
    else:
        node = _check(driver.cuGraphAddNode(graph, deps, len(deps), params))[0]
    flag = driver.CUstreamUpdateCaptureDependencies_flags.CU_STREAM_SET_CAPTURE_DEPENDENCIES
    if _takes_edge_data(driver.cuStreamUpdateCaptureDependencies):
        _check(driver.cuStreamUpdateCaptureDependencies(stream.ptr, [node], None, 1, flag))
    else:
        _check(driver.cuStreamUpdateCaptureDependencies(stream.ptr, [node], 1, flag))
    return params.conditional.phGraph_out[0]


class _capturing_to:
    """Capture what is enqueued on `stream` into `graph` (a conditional node's body)."""

    def __init__(self, stream: Any, graph: Any) -> None:
        self.stream, self.graph = stream, graph

    def __enter__(self) -> None:
        from cuda.bindings import driver

        mode = driver.CUstreamCaptureMode.CU_STREAM_CAPTURE_MODE_RELAXED
        _check(driver.cuStreamBeginCaptureToGraph(self.stream.ptr, self.graph, None, None, 0, mode))

    def __exit__(self, *exc: Any) -> None:
        from cuda.bindings import driver

        _check(driver.cuStreamEndCapture(self.stream.ptr))  # the body graph stays the node's


def _read(address: int, dtype: Any, stream: Any) -> np.ndarray:
    import cupy

    out = np.zeros((), dtype)
    stream.synchronize()
    cupy.cuda.runtime.memcpy(out.ctypes.data, address, out.nbytes,
                             cupy.cuda.runtime.memcpyDeviceToHost)
    return out


def _read_bool(address: int, stream: Any) -> bool:
    return bool(_read(address, np.bool_, stream))

"""The FFI runner: a plan's graph captured raw, registered with the C++ handler, and
emitted as an XLA custom call (runtime/ffi/handler.cc).

Operands and results that only generated kernels touch are read and written in place:
the handler re-points their kernel nodes to XLA's buffers each call (runtime/inplace.py
decides which). The others are copied into and out of the plan's arena by the graph's
first and last nodes, copy kernels whose tables the handler sets each call.

A segmented plan (`segments` > 1, compiler/segments.py) is captured as one graph per
segment over the one arena, each registered with the handler and emitted as its own
custom call: the first takes every operand, each later one the previous one's first
result (which orders them in XLA's program), and each returns the outputs it finished,
so that XLA may start on those (an all-reduce) while the next segment runs. Its operands
and results are copied, none re-pointed.
"""
from __future__ import annotations

import warnings

import jax
import jax.numpy as jnp
import numpy as np

from nimblejax.compiler.plan import Plan
from nimblejax.compiler.segments import plan_segments
from nimblejax.runtime import inplace as inplace_mod
from nimblejax.runtime import placement
from nimblejax.runtime.ffi import TARGET
from nimblejax.runtime.runner import PASSED, Runner, assemble


class FfiRunner(Runner):
    """The plan's graph captured raw and registered with the C++ FFI handler, once per
    GPU it runs on (each device of a shard_map launches its own copy: own arena, own
    graph, on XLA's stream of that device)."""

    def __init__(self, plan: Plan, library, gemm: str, donated: frozenset, segments: int = 1,
                 *, pdl: bool) -> None:
        self.plan, self.library, self.gemm, self.pdl = plan, library, gemm, pdl
        self.id = 0
        self.exes: dict = {}  # device ordinal -> DeviceGraph
        self.views: dict = {}  # operand sources -> the id of the view registered for them
        self.pending: list = []  # device ordinals whose graph is built after lowering
        self.donated = donated
        self.buffers = list(plan.output_buffers)
        self.out_specs = [jax.ShapeDtypeStruct(a.shape, a.dtype) for a in self.buffers]
        # Segments: their output buffer indices, and the handler's id of each (the first
        # is self.id); one segment of all outputs when the plan is not cut.
        self.segments = plan_segments(plan, segments)
        self.segment_ids: list = []
        self.first_buffers = [self.buffers[j] for j in self.segments[0].outputs]
        self.aliases = _aliases(plan.graph.inputs, self.first_buffers, donated)
        segmented = len(self.segments) > 1
        self.inplace = inplace_mod.NONE if segmented else inplace_mod.analyze(plan, donated)
        # Per device, what the handler really re-points (a node not found is copied).
        self.inplace_on: dict = {}
        # Per device, whether a call with nothing to copy launches the plan's one kernel
        # itself, no graph (the handler's nimble_ffi_set_direct).
        self.direct_on: dict = {}

    @property
    def exe(self):
        """The DeviceGraph of the first device this plan was placed on."""
        return next(iter(self.exes.values()))

    def graphs(self) -> list:
        return list(self.exes.values())

    def place(self, devices) -> None:
        todo = [d.local_hardware_id for d in devices if d.platform == "gpu"
                and d.local_hardware_id not in self.exes and d.local_hardware_id not in self.pending]
        pending = placement.deferring()
        if todo and pending is not None:  # built while XLA compiles (runtime/placement.py)
            if not self.segment_ids:  # the ids the custom calls name, registered later
                self.segment_ids = [self.library.reserve_id() for _ in self.segments]
                self.id = self.segment_ids[0]
            self.pending += todo
            if self not in pending:
                pending.append(self)
            return
        for ordinal in todo:
            self._register(ordinal)

    def finish_placement(self) -> None:
        """Build and register the graphs `place` deferred, under the ids it reserved."""
        while self.pending:
            self._register(self.pending[0])
            self.pending.pop(0)

    def abandon_placement(self) -> None:
        """After a deferred build failed: nothing is left pending, and where no device
        was placed, the reserved ids are given up (the next lowering registers anew)."""
        self.pending = []
        if not self.exes:
            self.id, self.segment_ids, self.views = 0, [], {}

    def _register(self, ordinal: int) -> None:
        import cupy

        from nimblejax.runtime.graph import DeviceGraph

        plan, library, segments = self.plan, self.library, self.segments
        with cupy.cuda.Device(ordinal):
            copy_fn = _copy_function(library, ordinal)
            exe = DeviceGraph(plan, gemm=self.gemm, capture="raw",
                              bracket=lambda stream, which: library.capture_copy_node(copy_fn, stream, which),
                              segments=[seg.tasks for seg in segments] if len(segments) > 1 else None,
                              pdl=self.pdl)
            in_dst = [exe.slot(v) for v in plan.graph.inputs]
            in_bytes = [v.nbytes if exe.slot(v) else 0 for v in plan.graph.inputs]
            ids = []
            for k, seg in enumerate(segments):  # a later segment's one operand is not copied
                outs = [self.buffers[j] for j in seg.outputs]
                ids.append(library.register(exe.raw_execs[k], copy_fn, in_dst if k == 0 else [0],
                                            in_bytes if k == 0 else [0],
                                            [exe.base + plan.offset(a) for a in outs], [a.nbytes for a in outs],
                                            plan_id=self.segment_ids[k] if self.segment_ids else 0,
                                            device=ordinal))
                self._set_copy_nodes(ids[k], exe.raw_graphs[k], ordinal)
            if len(ids) > 1:
                library.set_segments(ids, ordinal)
            self.id, self.segment_ids = ids[0], ids
            self.inplace_on[ordinal] = self._set_inplace(exe, ordinal)
            if len(ids) == 1 and not self.inplace_on[ordinal].empty:
                self.direct_on[ordinal] = library.set_direct(ids[0], ordinal, exe.raw_graphs[0])
            exe.rest = lambda: [library.rest(plan_id, ordinal) for plan_id in ids]
        self.exes[ordinal] = exe
        for sources, view in self.views.items():
            self._register_view(sources, view, ordinal)

    def _set_copy_nodes(self, plan_id: int, graph: int, ordinal: int) -> None:
        """The copies in and out run as the graph's first and last nodes, whose tables
        the handler sets each call (without the graph node entry points, copy kernels
        are launched beside the graph and the two nodes copy nothing)."""
        try:
            self.library.set_copy_nodes(plan_id, ordinal, graph)
        except RuntimeError as e:
            warnings.warn(f"nimblejax: {e}; copies are launched beside the graph", RuntimeWarning, stacklevel=3)

    def _set_inplace(self, exe, ordinal: int) -> inplace_mod.InPlace:
        """Find the kernel nodes of every in-place buffer in the captured graph and hand
        them to the handler; returns what is re-pointed (a buffer one of whose kernel
        launches is not found among the graph's nodes is copied instead)."""
        ip = self.inplace
        if ip.empty:
            return ip
        try:
            nodes = _kernel_nodes(self.library, exe)
        except RuntimeError as e:  # a driver without the graph node entry points
            warnings.warn(f"nimblejax: {e}; operands and results are copied", RuntimeWarning, stacklevel=2)
            self.inplace = inplace_mod.NONE
            return self.inplace
        targets = [(0, i, self.plan.graph.inputs[i]) for i in sorted(ip.inputs)]
        targets += [(1, j, self.plan.storage.get(a, a)) for j, a in enumerate(self.buffers) if a in ip.outputs]
        used: dict[int, int] = {}  # node -> position in the list handed over
        sites, n_params, kept_in, kept_out = [], [], set(), set()
        for kind, index, buf in targets:
            found = [(node, s.param, s.task.kernel.n_args) for s in ip.sites[buf]
                     for key in _launch_keys(exe, s.task) for node in nodes.get(key, ())]
            launches = sum(len(s.task.kernel.launches) for s in ip.sites[buf])
            if len(found) < launches:
                continue  # some launch was not found as a node: copy this buffer
            for node, param, n in found:
                if node not in used:
                    used[node] = len(used)
                    n_params.append(n)
                sites.append((used[node], param, kind, index))
            (kept_in if kind == 0 else kept_out).add(index)
        self.library.set_inplace(self.id, ordinal, list(used), n_params, sites)
        return inplace_mod.InPlace(frozenset(kept_in),
                                   frozenset(a for j, a in enumerate(self.buffers) if j in kept_out),
                                   ip.sites)

    def stats(self, ordinal: int = 0) -> dict:
        """The handler's counters for this plan's arena on one device (calls, copy
        kernels launched, kernel nodes re-pointed), its views included."""
        return self.library.stats(self.id, ordinal)

    def _register_view(self, sources: tuple, view_id: int, ordinal: int) -> int:
        """Operands PASSED are copied in from XLA's buffers (or read there in place); an
        operand fed back from output j is copied from j's buffer (in the arena, which the
        previous call's graph wrote and nothing has written since; or, for a result
        written in place, the XLA buffer the handler last pointed j at, which that very
        result array holds), or read there in place; HELD operands are not touched
        (still in their slot, or in the buffer the graph points at)."""
        plan, exe = self.plan, self.exes[ordinal]
        slot = exe.slot
        size = lambda v: v.nbytes if slot(v) else 0  # noqa: E731
        inputs = plan.graph.inputs
        passed = [i for i, src in enumerate(sources) if src == PASSED]
        fed = [(i, plan.graph.outputs[src]) for i, src in enumerate(sources) if src >= 0]
        buffer = {a: j for j, a in enumerate(self.buffers)}
        return self.library.register_view(
            self.id, passed, [slot(inputs[i]) for i in passed], [size(inputs[i]) for i in passed],
            view_id=view_id, device=ordinal, fed_index=[i for i, _ in fed],
            fed_out=[buffer[a] for _, a in fed],
            fed_dst=[slot(inputs[i]) for i, _ in fed], fed_src=[exe.base + plan.offset(a) for _, a in fed],
            fed_bytes=[size(inputs[i]) for i, _ in fed])

    def _view(self, sources: tuple) -> int:
        if all(src == PASSED for src in sources):
            return self.id
        view = self.views.get(sources)
        if view is None:  # (an id reserved where a device's graph is still to be built)
            view = self.library.reserve_id() if self.pending else 0
            for ordinal in self.exes:
                view = self._register_view(sources, view, ordinal)
            self.views[sources] = view
        return view

    def emit_resident(self, sources: tuple, *xs):
        positions = [i for i, src in enumerate(sources) if src == PASSED]
        donated = frozenset(k for k, i in enumerate(positions) if i in self.donated)
        inputs = [self.plan.graph.inputs[i] for i in positions]
        return self._emit(self._view(sources), positions, _aliases(inputs, self.first_buffers, donated), xs)

    def emit(self, *xs):
        return self._emit(self.id, range(len(xs)), self.aliases, xs)

    def _emit(self, plan_id: int, positions, aliases: dict, xs) -> list:
        """The custom calls of registration `plan_id` (and of the later segments), whose
        operands `xs` are the plan's inputs at `positions` (a plan input returned as it
        is is always among them)."""
        made: list = [None] * len(self.buffers)
        operands = xs
        for k, seg in enumerate(self.segments):
            specs = [self.out_specs[j] for j in seg.outputs]
            outs = jax.ffi.ffi_call(TARGET, specs, input_output_aliases=aliases if k == 0 else {})(
                *operands, plan=np.int64(plan_id if k == 0 else self.segment_ids[k]))
            outs = list(outs) if isinstance(outs, (list, tuple)) else [outs]
            for j, out in zip(seg.outputs, outs):
                made[j] = out
            operands = outs[:1]  # the next segment runs after this one
        operand = dict(zip(positions, xs))
        return assemble(self.plan, made, operand.__getitem__, jnp.asarray)

    def close(self) -> None:
        for plan_id in self.segment_ids:
            self.library.unregister(plan_id)
        self.id, self.segment_ids = 0, []
        for exe in self.exes.values():
            exe.close()
        self.exes.clear()


def _launch_keys(exe, task) -> list:
    """How each kernel launch of `task` appears among the graph's nodes: its CUfunction
    and its arguments (all 8-byte pointers, the same for every launch of a task)."""
    args = tuple(int(a) for a in exe.launchers.args[task])
    return [(_func_ptr(exe, k.name), args) for k in task.kernel.launches]


def _func_ptr(exe, name: str) -> int:
    """The CUfunction of a compiled kernel (a cupy RawKernel, loaded on this device)."""
    return exe.launchers.functions[name].kernel.ptr


def _kernel_nodes(library, exe) -> dict:
    """(CUfunction, arguments) -> the captured graph's kernel nodes launched so. Two
    tasks with equal keys do the same work on the same buffers and are patched alike."""
    n_params = {_func_ptr(exe, k.name): k.n_args
                for t in exe.plan.tasks if t.kernel is not None for k in t.kernel.launches}
    found: dict = {}
    for node, func in library.kernel_nodes(exe.raw_graph):
        if func in n_params:  # one of ours: its arguments are n 8 bytes each (pointers, scalars)
            found.setdefault((func, library.kernel_node_params(node, n_params[func])), []).append(node)
    return found


def _aliases(inputs, buffers, donated: frozenset) -> dict:
    """Donated operand → a result of its shape and dtype, each result at most once: XLA
    then writes that result into the donated buffer (a loop feeding back its state
    allocates nothing)."""
    aliases, taken = {}, set()
    for i in sorted(donated):
        v = inputs[i]
        for k, a in enumerate(buffers):
            if k not in taken and a.shape == v.shape and np.dtype(a.dtype) == np.dtype(v.dtype):
                aliases[i] = k
                taken.add(k)
                break
    return aliases


_COPY_FUNCTIONS: dict = {}  # device ordinal -> (RawKernel, CUfunction)


def _copy_function(library, ordinal: int) -> int:
    """The CUfunction of the handler's copy kernel on device `ordinal` (current), built
    with the handler (compile.runtime_kernel) and loaded once per process and device."""
    if ordinal not in _COPY_FUNCTIONS:
        from nimblejax.runtime.compile import runtime_kernel

        kernel = runtime_kernel(library.copy_kernel_source(), "nimble_ffi_copy")
        # The kernel must outlive every plan; .kernel loads it into the current context.
        _COPY_FUNCTIONS[ordinal] = (kernel, kernel.kernel.ptr)
    return _COPY_FUNCTIONS[ordinal][1]

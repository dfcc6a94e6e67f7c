"""The direct call path on the GPU: a plan's graph (runtime/graph.py) called from Python.

A call copies the changed inputs into their arena slots on stream 0, launches the graph
once on stream 0, and hands the outputs back: for output="jax" through one jitted XLA
call that slices them out of the arena (io.XlaUnpacker), else as fresh copies.

This path serves output="cupy"/"numpy", eager mode, and machines where the XLA FFI
handler cannot be built; otherwise runtime/ffi_runner.py launches the same graph build
from C++ on XLA's stream.
"""
from __future__ import annotations

import threading

import numpy as np

from nimblejax.compiler.plan import Plan
from nimblejax.runtime.graph import DeviceGraph
from nimblejax.runtime.io import D2D, BatchCopier, XlaUnpacker, copy_in, cupy_dtype, device_wait, on_gpu, to_jax
from nimblejax.runtime.runner import Runner, assemble


class DirectRunner(Runner):
    """Calls one plan's DeviceGraph from Python: `runner(leaves) -> outputs`."""

    def __init__(self, plan: Plan, output: str = "jax", eager: bool = False, gemm: str = "lt",
                 donate: frozenset = frozenset(), *, pdl: bool) -> None:
        import cupy

        self.plan, self.output, self.cupy = plan, output, cupy
        self.donate = sorted(donate)
        self.lock = threading.Lock()  # one arena per plan: calls on one plan are serialized
        self.graph = DeviceGraph(plan, gemm=gemm, capture="none" if eager else "cupy", pdl=pdl)
        self.stats = self.graph.stats
        self.last_inputs: list = [None] * len(plan.graph.inputs)
        # (leaf index, var, arena address) of every input the tasks read.
        self.input_slots = [(i, v, self.graph.slot(v)) for i, v in enumerate(plan.graph.inputs)
                            if self.graph.slot(v)]
        # (output buffer, its arena address): what _outputs copies out each call.
        self.output_sources = [(a, self.graph.slot(a)) for a in plan.output_buffers]
        self.unpacker = XlaUnpacker.create(plan, self.graph.arena) if output == "jax" else None
        self.pending = None  # an output of the last XLA unpack, not yet known complete
        self.returned_arrays: list = []
        self.returned: dict = {}
        self.copier = BatchCopier(cupy)

    def graphs(self) -> list:
        return [self.graph]

    def __call__(self, leaves: list) -> list:
        with self.lock:
            return self._call(leaves)

    def _call(self, leaves: list) -> list:
        s0 = self.graph.streams[0]
        if self.pending is not None:
            # The last call's outputs are still being copied out of the arena by XLA:
            # stream 0 waits for that on the device before the graph overwrites them
            # (and before inputs that are those outputs are read).
            device_wait(self.pending, s0)
            self.pending = None
        self._bind_inputs(leaves)
        self.graph.launch()
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

    def _bind_inputs(self, leaves: list) -> None:
        s0, last = self.graph.streams[0], self.last_inputs
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
        cp, s0 = self.cupy, self.graph.streams[0]
        fresh = []
        for a, src in self.output_sources:
            arr = cp.empty(a.shape, dtype=cupy_dtype(a.dtype))
            if a.nbytes:
                cp.cuda.runtime.memcpyAsync(arr.data.ptr, src, a.nbytes, D2D, s0.ptr)
            fresh.append(arr)
        return assemble(self.plan, fresh, leaves.__getitem__, np.asarray)

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

"""The interpret backend's runner: the CPU plan interpreter (runtime/interpret.py), called
directly (`runner(leaves)`, the Python path) or as a JAX operation (a host callback).
Each call takes another interleaving of the streams."""
from __future__ import annotations

import functools
import itertools
import threading

import jax
import numpy as np
from jax.interpreters import mlir

from nimblejax.compiler.plan import Plan
from nimblejax.runtime import interpret
from nimblejax.runtime.runner import PASSED, Runner


class InterpretRunner(Runner):
    """The CPU plan interpreter, called directly or behind a host callback.

    The callback is `jax.pure_callback`'s, emitted directly so that the interpreter gets
    the operands as the NumPy arrays XLA hands over: `jax.pure_callback` first copies
    them onto a JAX CPU device, and on the CPU that copy (above about 128 KiB) waits for
    a worker thread of JAX's CPU client, which every device of a shard_map over host
    devices may be holding while it waits in this callback. The interpreter then runs
    the equations on a CPU client of its own (`interpret.device()`)."""

    def __init__(self, plan: Plan, output: str = "jax") -> None:
        self.plan = plan
        self.out_shapes = [jax.ShapeDtypeStruct(a.shape, a.dtype) for a in plan.graph.outputs]
        # The direct path's results, NumPy arrays of the plan's dtypes: jax.device_put, not
        # jnp.asarray, which compiles a copy program for each new shape (11 ms each on a CPU).
        self.wrap = np.asarray if output == "numpy" else jax.device_put
        self.calls = itertools.count()
        self.held: list = [None] * len(plan.graph.inputs)  # the operands, as the GPU arena holds them
        self.last_outs: tuple = ()  # the previous call's results, as the arena's output buffers
        self.held_lock = threading.Lock()
        # The constants' host values now, outside any callback (a jax.Array keeps them),
        # so that no callback waits for one still being computed by JAX's CPU client.
        for value in plan.graph.consts.values():
            np.asarray(value)

    def __call__(self, leaves: list) -> list:
        return [self.wrap(o) for o in self._run(*leaves)]

    def _run(self, *xs):
        outs = interpret.run(self.plan, [np.asarray(x) for x in xs], seed=next(self.calls))
        return tuple(np.asarray(o, dtype=s.dtype).reshape(s.shape) for o, s in zip(outs, self.out_shapes))

    def lower(self, ctx, *args, sources: "tuple | None" = None):
        from nimblejax.runtime.xla_op import lowering_devices

        direct = _host_callback()
        cpus = [d for d in lowering_devices(ctx) if d.platform == "cpu"]
        if len(cpus) > 1 and (direct is None or not interpret.own_device()):
            raise NotImplementedError(
                f"backend='interpret' cannot run inside a computation over {len(cpus)} CPU "
                f"devices with this JAX (jax {jax.__version__}): its callback would wait for "
                "worker threads of JAX's CPU client that the computation holds. Run it on "
                "one device.")
        if direct is None:
            return super().lower(ctx, *args, sources=sources)
        emit, op_sharding = direct
        run = self._run if sources is None else functools.partial(self._run_resident, sources)
        sharding = op_sharding(ctx.module_context.axis_context, None, ctx.avals_out)
        results, _, _ = emit(ctx, run, None, list(args), ctx.avals_in, ctx.avals_out,
                             has_side_effect=False, returns_token=False, sharding=sharding)
        return results

    def emit(self, *xs):
        return list(jax.pure_callback(self._run, tuple(self.out_shapes), *xs))

    def _run_resident(self, sources: tuple, *xs):
        it = iter(xs)
        with self.held_lock:
            for i, src in enumerate(sources):
                if src == PASSED:
                    self.held[i] = np.array(next(it))  # a copy: XLA may reuse its buffer
                elif src >= 0:
                    self.held[i] = self.last_outs[src]
                elif self.held[i] is None:
                    raise RuntimeError(f"nimblejax: operand {i} is resident but was never passed")
            outs = self._run(*self.held)
            self.last_outs = outs  # as the GPU arena's output buffers keep them
        return outs

    def emit_resident(self, sources: tuple, *xs):
        """Only for a JAX without the direct callback (`lower`)."""
        run = functools.partial(self._run_resident, sources)
        return list(jax.pure_callback(run, tuple(self.out_shapes), *xs))


def _host_callback():
    """(emit_python_callback, the op sharding jax.pure_callback gives it), the pieces of
    jax.pure_callback's lowering; None for a JAX without them."""
    try:
        from jax._src.callback import _callback_op_sharding

        return mlir.emit_python_callback, _callback_op_sharding
    except (ImportError, AttributeError):
        return None

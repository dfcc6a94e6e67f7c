"""Ahead of time, in the names of JAX's own AOT API: `nimble.jit(f).lower(*args)` traces
and plans one signature (arguments may be `jax.ShapeDtypeStruct`; nothing runs, no GPU is
needed) and `.compile()` builds what a call runs, as `jax.jit(f).lower(*args).compile()`
does:

    lowered = nimble.jit(f).lower(jax.ShapeDtypeStruct((8, 256), jnp.float32))
    print(lowered.as_text())        # the program after every compiler pass
    lowered.plan, lowered.explain() # the launch plan; one line per task, then totals
    compiled = lowered.compile()    # the plan's kernels, graph and XLA executable
    compiled(x)                     # runs it (the arguments' shapes must match)

On the XLA call path (the default) `compile()` is JAX's own: the function's XLA
operation (one nimble_call custom call around the plan) lowered and compiled by
`jax.jit(...).lower(...).compile()`, and its `Compiled` object is what is returned, called
as JAX's is. The plan's kernels are compiled and its CUDA graph captured when XLA
compiles that executable. Under `backend="jax"` it is plain jax.jit's AOT. The Python
call path (`output="numpy"`/`"cupy"`, eager launches) has no XLA executable to compile:
there `compile()` refuses, naming the way out.
"""
from __future__ import annotations

from typing import TYPE_CHECKING, Any

from nimblejax.report import Report

if TYPE_CHECKING:
    from nimblejax.compiler.plan import Plan
    from nimblejax.compiler.stages import Stages


class Lowered:
    """One signature of a nimble function, traced and planned: each compiler pass's
    program (`stages`, `as_text()`), the launch plan (`plan`), `explain()`."""

    def __init__(self, fn: Any, args: tuple, kwargs: dict, stages: "Stages") -> None:
        # fn: the api.NimbleFunction that lowered it (api.py imports this module)
        self._fn, self._args, self._kwargs = fn, args, kwargs
        self.stages = stages

    @property
    def plan(self) -> "Plan":
        return self.stages.plan

    def as_text(self) -> str:
        """Every pass's program, as NIMBLE_DEBUG=2 prints it."""
        return str(self.stages)

    def explain(self) -> Report:
        """The plan's report: one line per task (stream, events, buffers), then totals."""
        return Report(self.plan)

    def compile(self) -> Any:
        """The executable a call of this signature runs, built now (a callable)."""
        fn = self._fn
        path = fn._prepare()
        if path == "jax":
            return fn._jax().lower(*self._args, **self._kwargs).compile()
        if path != "xla":
            raise NotImplementedError(
                "lower(...).compile() needs the XLA call path: the Python call path "
                f"(output={fn.output!r}, eager={fn.options.eager}, "
                f"call_path={fn.options.call_path!r}) compiles on the first call instead. Call "
                "the function once to build it, or use output='jax' and call_path='auto'.")
        return fn._op_jit_fn.lower(*self._args, **self._kwargs).compile()

    def __str__(self) -> str:
        return self.as_text()

    def __repr__(self) -> str:
        return f"Lowered({', '.join(self.stages)})"

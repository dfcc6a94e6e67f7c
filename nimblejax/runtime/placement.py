"""A first call builds its plan's graph while XLA compiles the call that launches it.

On the XLA path a new plan's graph (the arena, NVRTC's kernels waited for, cuBLASLt's
and cuDNN's algorithms, the capture) is built when JAX lowers the call, in the lowering
rule (runtime/xla_op.py: `runner.place`), and XLA compiles the lowered program only
after that. On an H200 (0554a39's tree, `perf_counter` around the parts of a cold first
call) XLA's compile of the one-custom-call program took 0.16 to 0.2 s after the graph
build: the MLP, the LSTM and ResNet-50 at batch 1.

`first_run` overlaps the two. It lowers the call with placement deferred: a runner's
`place` then reserves the handler's plan ids that its custom call names, builds nothing,
and adds itself to the list `deferring()` returns. XLA's compile starts on a thread (it
runs outside the GIL), the deferred graphs are built on this one meanwhile, and the call
runs once both are done: jax.jit takes the compiled program from the cache that
`lower(...).compile()` filled (jax 0.10.2: the call compiles nothing more). Where the
build fails the function's jax.jit caches are cleared, so that the next call lowers
again and builds as a call always did, in the lowering, naming its own ids.

On by default (`Options.defer_build`; NIMBLE_DEFER_BUILD=0 turns it off). Measured on
an H200 (5cbd1fb, `first_call --variant`, medians of two rounds, fresh processes), the
cold first call: the MLP 0.507 -> 0.428 s at batch 1 and 0.841 -> 0.704 s at 32, the
LSTM 0.718 -> 0.593 and 0.707 -> 0.599 s, ResNet-50 1.195 -> 1.083 and 1.051 -> 0.876 s.
"""
from __future__ import annotations

import contextlib
import threading
from typing import Callable, Optional

_local = threading.local()


def deferring() -> Optional[list]:
    """While `first_run` lowers a call: the list a runner that defers its placement
    appends itself to (it then has `finish_placement` and `abandon_placement`); else
    None: place now."""
    return getattr(_local, "pending", None)


def first_run(fn: Callable, args: tuple, kwargs: Optional[dict] = None, defer: bool = True):
    """`fn(*args, **kwargs)` for a jitted nimble call that may lower for the first time,
    its new graphs built while XLA compiles it where `defer`."""
    kwargs = kwargs or {}
    if not defer or deferring() is not None or _traced((args, kwargs)):
        return fn(*args, **kwargs)  # (under a transformation: lowered by the caller's program)
    _local.pending = pending = []
    try:
        lowered = fn.lower(*args, **kwargs)
    finally:
        _local.pending = None
    if not pending:  # compiled before, or nothing new to build: the plain call
        return fn(*args, **kwargs)
    # A compile error surfaces from the call below, which compiles again.
    compiling = threading.Thread(target=_compile, args=(lowered,), name="nimblejax-xla-compile", daemon=True)
    compiling.start()
    try:
        for runner in pending:
            runner.finish_placement()
    except BaseException:
        compiling.join()
        for runner in pending:
            runner.abandon_placement()
        fn.clear_cache()  # its program names plan ids nothing was registered under
        raise
    compiling.join()
    return fn(*args, **kwargs)


def _traced(tree) -> bool:
    import jax

    return any(isinstance(x, jax.core.Tracer) for x in jax.tree_util.tree_leaves(tree))


def _compile(lowered) -> None:
    with contextlib.suppress(Exception):
        lowered.compile()

"""Which runner runs a plan (runtime/runner.py lists them): the interpreter's on the
interpret backend; on the GPU the direct runner for a call from Python, the FFI runner
for a call as a JAX operation."""
from __future__ import annotations

from typing import Any, Callable

from nimblejax.compiler.plan import Plan
from nimblejax.options import Options
from nimblejax.runtime.runner import Runner


def make_runner(plan: Plan, *, backend: str, direct: bool, options: Options, output: str = "jax",
                library: Any = None, donated: frozenset = frozenset()) -> Runner:
    """The runner of `plan` for `backend` ("cuda" or "interpret"): called from Python
    (`direct`) or as a JAX operation. `library` is the loaded FFI handler (cuda, not
    direct); `donated`: flat operand indices whose buffers are donated."""
    if backend == "interpret":
        from nimblejax.runtime.interpret_runner import InterpretRunner

        return InterpretRunner(plan, output)
    if direct:
        from nimblejax.runtime.direct_runner import DirectRunner

        return DirectRunner(plan, output=output, eager=options.eager, gemm=options.gemm, donate=donated,
                            pdl=options.pdl)
    from nimblejax.runtime.ffi_runner import FfiRunner

    return FfiRunner(plan, library, options.gemm, donated, options.segments, pdl=options.pdl)


def runner_maker(backend: str, options: Options, library: Any = None) -> Callable:
    """`make_runner` for the XLA operation, as a Body's `make_runner(plan, donated)`."""
    return lambda plan, donated: make_runner(plan, backend=backend, direct=False, options=options,
                                             library=library, donated=donated)

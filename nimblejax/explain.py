"""`nimble.explain`: the plan printed like a jaxpr, annotated with streams, events,
kernels and buffers."""
from __future__ import annotations

from typing import Any, Callable

from nimblejax.report import CoexecReport, Report


def explain(fun: Callable, *args: Any, **kwargs: Any) -> "Report | CoexecReport":
    """Plan `fun` for these arguments and return a printable report (nothing runs). A
    function nimble cannot plan whole is partitioned (unless fallback="error"): the
    report lists its regions and what went to XLA."""
    from nimblejax.api import NimbleFunction, jit
    from nimblejax.compiler.errors import UnsupportedPrimitiveError

    nf = fun if isinstance(fun, NimbleFunction) else jit(fun, backend="interpret")
    try:
        return Report(nf.plan(*args, **kwargs))
    except UnsupportedPrimitiveError:
        if nf.options.fallback == "error":
            raise
    return _coexec_report(nf, nf.partition(*args, **kwargs))


def _coexec_report(nf: Any, program: Any) -> CoexecReport:
    import functools

    import jax

    from nimblejax.compiler.pipeline import compile_function
    from nimblejax.runtime import coexec

    plans = {}
    for region in program.regions():
        specs = [jax.ShapeDtypeStruct(v.aval.shape, v.aval.dtype, weak_type=v.aval.weak_type)
                 for v in region.inputs]
        plans[region.name] = compile_function(functools.partial(coexec.run_region, region),
                                              specs, nf.options)[0]
    return CoexecReport(program, plans)

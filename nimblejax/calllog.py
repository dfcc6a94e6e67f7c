"""NIMBLE_DEBUG=3: one line per call on stderr, saying how the call ran.

The line names the function, the call path ("xla": the JAX operation; "python": the
direct path; "jax": plain jax.jit), whether the plan cache hit, and on the XLA path how
the residency check placed the leaves (held in the arena, fed back from the previous
call's results, or passed to JAX; runtime/residency.py) and whether the call reused the
last record (steady) or made a new one. At this level every call takes the residency
check, so that there is something to log: the direct hand-off of small functions to
JAX's dispatch (xla_path.DIRECT_MAX_LEAVES) is off.
"""
from __future__ import annotations

import itertools
import sys
from typing import Any, Callable

from nimblejax.runtime.runner import HELD, PASSED


def logged(fn: Any, entry: Callable, path: str) -> Callable:
    """`entry` (a NimbleFunction's call path) writing one line per call to stderr."""
    calls = itertools.count(1)
    name = getattr(fn.fun, "__name__", "function")

    def call(*args, **kwargs):
        plans, record = fn.cache_size, getattr(fn, "_resident", None)
        out = entry(*args, **kwargs)
        print(line(name, next(calls), path, plans, fn.cache_size, record, getattr(fn, "_resident", None)),
              file=sys.stderr)
        return out

    return call


def line(name: str, n: int, path: str, plans_before: int, plans_after: int, before, after) -> str:
    cache = (f"plan cache miss ({plans_after} plans)" if plans_after > plans_before
             else f"plan cache hit ({plans_after} plans)")
    text = f"nimblejax: {name} call {n}: path={path}, {cache}"
    if path != "xla":
        return text
    if after is None:
        return text + ", every leaf passed (a transformation or a new kind of argument)"
    sources = list(after.sources)
    held, passed = sources.count(HELD), sources.count(PASSED)
    fed = len(sources) - held - passed
    kind = "steady" if after is before else "new record"
    return text + f", residency {kind}: {held} held, {fed} fed back, {passed} passed"

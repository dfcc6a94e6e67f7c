"""Co-execution's partition: a jaxpr → nimble regions and XLA equations (pure).

A function with equations nimble cannot lower still runs (runtime/coexec.py evaluates
what this module decides, inside one jax.jit):

1. flatten: the jaxpr's equations in order, each classified by nimble's own tracer and
   checker (`classify`: None when nimble lowers it, else why not). A call-like equation
   (nested jit, custom_jvp, custom_vjp, checkpoint) that nimble cannot take whole is
   opened and its body flattened in its place; a `while`, `cond` or `scan` that stays
   with XLA keeps its place, its bodies partitioned in turn (`Step.inner`), so a
   run-time while loop is XLA's loop around nimble-planned bodies.
2. regions: the supported equations are grouped by their XLA depth, the most XLA
   equations on any path from the inputs to them. Grouping by depth makes every region
   convex: a path that leaves a region through an XLA equation reaches only larger
   depths, so it never comes back (a region may hold independent parts: they run on
   parallel streams of one graph). Effectful XLA equations (debug prints, callbacks)
   are chained, which keeps them in program order.
3. tiny regions go back to XLA (`worth_a_plan`), and the depths are recomputed until
   no region changes.

Equations whose results nothing reads (and without effects) are dropped first (`_live`).
"""
from __future__ import annotations

import re
import types
from dataclasses import dataclass
from typing import Any, Callable, Optional, Union

from nimblejax.compiler.errors import UnsupportedPrimitiveError
from nimblejax.compiler.jaxprs import open_jaxpr

# A region is worth a plan when it holds one of these (work XLA would launch a kernel or
# a library call for anyway) or at least MIN_REGION_EQNS equations. XLA fuses an
# elementwise chain into one kernel of its own, and a nimble_call adds its custom call.
# Measured on an H100 (examples/gpu/probe_region_threshold.py, 86163ef: a chain beside
# an FFT left to XLA, planned against left to XLA, looped): chains of 6 to 66 equations,
# 4K and 1M elements, ran 0.95-1.12x as long planned (median 1.06x), so an elementwise
# region stays with XLA up to at least that length; a region of column reductions
# (HEAVY) ran 1.02-1.08x at 4K elements and 0.84-0.97x at 1M.
MIN_REGION_EQNS = 128
HEAVY = frozenset({
    "dot_general", "conv_general_dilated", "reduce_sum", "reduce_max", "reduce_min",
    "reduce_prod", "reduce_and", "reduce_or", "reduce_xor", "argmax", "argmin", "cumsum",
    "cumprod", "cummax", "cummin", "cumlogsumexp", "sort", "scatter", "scatter-add", "scatter_add",
    "scatter-mul", "scatter-min", "scatter-max", "gather", "reduce_precision",
    "reduce_window_sum", "reduce_window_max", "reduce_window_min", "scan", "while",
    "random_bits", "threefry2x32", "scatter-sub", "cholesky", "triangular_solve", "lu",
    "custom_linear_solve",
})  # and the same inside the body of a call-like equation (`_weight`)
CALL_LIKE = frozenset({"pjit", "jit", "closed_call", "core_call", "call", "eval_jaxpr",
                       "custom_jvp_call", "custom_vjp_call", "custom_vjp_call_jaxpr", "remat",
                       "remat2", "checkpoint"})
CONTROL = frozenset({"while", "cond", "scan"})
# Custom derivative rules kept: the equation stays, its `call_jaxpr` partitioned, so JAX
# still differentiates it by the library's rule (optimistix's implicit function theorem
# around a while loop that is not reverse-differentiable itself).
CUSTOM_RULES = frozenset({"custom_jvp_call", "custom_vjp_call"})


@dataclass(frozen=True, eq=False)
class Value:
    """One value of the flattened program (compared by identity)."""

    aval: Any


@dataclass(frozen=True, eq=False)
class Const:
    """A literal or a constant of the traced function: regions close over it."""

    value: Any


Atom = Union[Value, Const]


@dataclass(frozen=True, eq=False)
class Step:
    """One JAX equation of the flattened program. `why` is None when nimble lowers it;
    else the reason it stays with XLA. `inner`: a while/cond/scan kept by XLA, its
    bodies partitioned (cond, body for `while`; the branches of `cond`; the body of
    `scan`)."""

    eqn: Any
    ins: tuple
    outs: tuple  # Value, or None for an output nobody reads
    source: str
    why: Optional[str] = None
    inner: tuple = ()

    @property
    def name(self) -> str:
        return self.eqn.primitive.name

    @property
    def effectful(self) -> bool:
        return bool(getattr(self.eqn, "effects", None))


@dataclass(frozen=True, eq=False)
class Region:
    """Supported equations planned by nimble as one `nimble_call`. `name` is unique in
    the whole partition (nested bodies included) and stable across traces."""

    name: str
    steps: tuple
    inputs: tuple
    outputs: tuple


@dataclass(frozen=True, eq=False)
class Program:
    """A partitioned jaxpr: its parts in an order that runs."""

    inputs: tuple
    outputs: tuple
    parts: tuple  # Region | Step

    def regions(self) -> list[Region]:
        """Every region, nested bodies' included."""
        found = []
        for part in self.parts:
            if isinstance(part, Region):
                found.append(part)
            else:
                for inner in part.inner:
                    found += inner.regions()
        return found

    def xla_steps(self) -> list[Step]:
        """Every equation left to XLA, nested bodies' included."""
        found = []
        for part in self.parts:
            if isinstance(part, Step):
                found.append(part)
                for inner in part.inner:
                    found += inner.xla_steps()
        return found


Classify = Callable[[Any, list], Optional[str]]


def partition(closed: Any, classify: Classify) -> Program:
    """Partition a closed jaxpr; `classify(eqn, ins)` says why nimble cannot lower an
    equation (None: it can), given its inputs (Const where known)."""
    return _partition(closed, classify, "")


def _partition(closed: Any, classify: Classify, prefix: str) -> Program:
    jaxpr, consts = open_jaxpr(closed)
    inputs = tuple(Value(v.aval) for v in jaxpr.invars)
    env: dict = dict(zip(jaxpr.constvars, map(Const, consts)))
    env.update(zip(jaxpr.invars, inputs))
    steps: list[Step] = []
    _flatten(jaxpr, env, classify, steps, prefix, "<unknown>")
    outputs = tuple(_read(env, v) for v in jaxpr.outvars)
    return Program(inputs, outputs, _group(_live(steps, outputs), outputs, prefix))


def _live(steps: list[Step], outputs: tuple) -> list[Step]:
    """The steps the outputs or an effect need. A jaxpr keeps dead equations (XLA drops
    them when it compiles): numpyro's argument validation leaves an `eigh` whose result
    nothing reads. Kept, it would be named as left to XLA and cut the regions around it."""
    live = {a for a in outputs if isinstance(a, Value)}
    kept = []
    for s in reversed(steps):
        if s.effectful or any(v in live for v in s.outs if v is not None):
            kept.append(s)
            live.update(a for a in s.ins if isinstance(a, Value))
    return kept[::-1]


def _read(env: dict, v: Any) -> Atom:
    return Const(v.val) if type(v).__name__ == "Literal" else env[v]


def _flatten(jaxpr: Any, env: dict, classify: Classify, steps: list, prefix: str,
             outer: str) -> None:
    """`jaxpr`'s steps appended to `steps`; `outer` is the user line of the call being
    opened (a cached body, jnp.linalg's, has none of its own)."""
    from nimblejax.compiler.trace import INLINED, RESOLVED, _body, platform_index, source_line

    for eqn in jaxpr.eqns:
        ins = [_read(env, v) for v in eqn.invars]
        name = eqn.primitive.name
        src = source_line(eqn)
        src = outer if src == "<unknown>" else src
        if name in RESOLVED:  # CUDA's branch, known now: the cond it feeds keeps that branch
            env[eqn.outvars[0]] = Const(platform_index(eqn.params["platforms"], src).value)
            continue
        why = classify(eqn, ins)
        if why is not None and name in CUSTOM_RULES and "call_jaxpr" in eqn.params:
            outs = [None if type(v).__name__ == "DropVar" else Value(v.aval) for v in eqn.outvars]
            where = f"{prefix}{name}{len(steps)}"
            body = _partition(eqn.params["call_jaxpr"], classify, f"{where}.0/")
            steps.append(Step(eqn, tuple(ins), tuple(outs), src, why,
                              (body,) if body.regions() else ()))
        elif why is not None and name in CALL_LIKE and name in INLINED and _body(eqn) is not None:
            body, consts = open_jaxpr(_body(eqn))  # open it: part of it may be nimble's
            inner = dict(zip(body.constvars, map(Const, consts)))
            inner.update(zip(body.invars, ins))
            _flatten(body, inner, classify, steps, prefix, src)
            outs = [_read(inner, v) for v in body.outvars]
        else:
            outs = [None if type(v).__name__ == "DropVar" else Value(v.aval) for v in eqn.outvars]
            where = f"{prefix}{name}{len(steps)}"
            inner_progs = _inner(eqn, classify, where) if why is not None and name in CONTROL else ()
            steps.append(Step(eqn, tuple(ins), tuple(outs), src, why, inner_progs))
        for v, a in zip(eqn.outvars, outs):
            if a is not None and type(v).__name__ != "DropVar":
                env[v] = a


def _inner(eqn: Any, classify: Classify, where: str) -> tuple:
    """The bodies of a while/cond/scan that stays with XLA, each partitioned; () when
    no body holds a region (the equation then runs as it is)."""
    p = eqn.params
    name = eqn.primitive.name
    bodies = ((p["cond_jaxpr"], p["body_jaxpr"]) if name == "while" else
              tuple(p["branches"]) if name == "cond" else (p["jaxpr"],))
    progs = tuple(_partition(b, classify, f"{where}.{k}/") for k, b in enumerate(bodies))
    return progs if any(prog.regions() for prog in progs) else ()


# ---- regions ---------------------------------------------------------------------------
def _group(steps: list[Step], outputs: tuple, prefix: str) -> tuple:
    """Regions of the supported steps, by XLA depth; tiny ones back to XLA until none
    changes."""
    xla = {s for s in steps if s.why is not None}
    while True:
        depth = _depths(steps, xla)
        levels: dict[int, list[Step]] = {}
        for s in steps:
            if s not in xla:
                levels.setdefault(depth[s], []).append(s)
        tiny = [m for m in levels.values() if not worth_a_plan(m)]
        if not tiny:
            break
        for members in tiny:
            xla.update(members)
    parts: list = []
    xla_by_depth: dict[int, list[Step]] = {}
    for s in steps:
        if s in xla:
            xla_by_depth.setdefault(depth[s], []).append(s)
    for d in sorted(set(levels) | set(xla_by_depth)):
        region = _region(f"{prefix}r{len(parts)}", levels[d], steps, outputs) if d in levels else None
        if region is not None and region.outputs:  # a region nothing reads is dead code
            parts.append(region)
        parts += [s if s.why is not None else _demoted(s) for s in xla_by_depth.get(d, [])]
    return tuple(parts)


def _depths(steps: list[Step], xla: set) -> dict[Step, int]:
    """Each step's XLA depth: the most XLA steps on a path from the inputs to it (the
    step itself not counted). Effectful XLA steps depend on the one before."""
    depth: dict[Step, int] = {}
    made_by: dict[Value, Step] = {}
    last_effect: Optional[Step] = None
    for s in steps:
        preds = [made_by[a] for a in s.ins if isinstance(a, Value) and a in made_by]
        if s in xla and s.effectful and last_effect is not None:
            preds.append(last_effect)
        depth[s] = max((depth[p] + (p in xla) for p in preds), default=0)
        if s in xla and s.effectful:
            last_effect = s
        for v in s.outs:
            if v is not None:
                made_by[v] = s
    return depth


def worth_a_plan(steps: list[Step]) -> bool:
    """Whether a region is worth a nimble plan (see MIN_REGION_EQNS): equations inside
    nested calls count, and so does a GEMM there."""
    weights = [_weight(s.eqn) for s in steps]
    return sum(n for n, _ in weights) >= MIN_REGION_EQNS or any(h for _, h in weights)


def _weight(eqn: Any) -> tuple[int, bool]:
    """(equations, whether one is HEAVY) of `eqn`, its nested bodies included."""
    from nimblejax.compiler.control import _sub_jaxprs

    count, heavy = 1, eqn.primitive.name in HEAVY
    for sub in _sub_jaxprs(eqn.params):
        for inner in open_jaxpr(sub)[0].eqns:
            n, h = _weight(inner)
            count, heavy = count + n, heavy or h
    return count, heavy


def _demoted(step: Step) -> Step:
    return Step(step.eqn, step.ins, step.outs, step.source,
                f"in a region too small for a plan (< {MIN_REGION_EQNS} equations, no "
                "GEMM, reduction or loop): XLA fuses it as well")


def _region(name: str, members: list[Step], steps: list[Step], outputs: tuple) -> Region:
    inside = set(members)
    made = {v for s in members for v in s.outs if v is not None}
    inputs = tuple(dict.fromkeys(a for s in members for a in s.ins
                                 if isinstance(a, Value) and a not in made))
    read_outside = {a for s in steps if s not in inside for a in s.ins}
    read_outside |= set(outputs)
    outs = tuple(v for s in members for v in s.outs if v is not None and v in read_outside)
    return Region(name, tuple(members), inputs, outs)


# ---- classification by nimble's own tracer and checker ---------------------------------
def nimble_classify(eqn: Any, ins: list) -> Optional[str]:
    """None when nimble traces and lowers `eqn` (its inputs known where Const), else
    the reason it does not, from the error nimble would raise."""
    from nimblejax.compiler.canonicalize import REWRITTEN
    from nimblejax.compiler.ir import fresh_ids
    from nimblejax.compiler.lowering.registry import check_supported
    from nimblejax.compiler.trace import GraphBuilder

    variables = [v for v in eqn.invars if type(v).__name__ != "Literal"]
    args = [a for v, a in zip(eqn.invars, ins) if type(v).__name__ != "Literal"]
    alone = types.SimpleNamespace(constvars=[], invars=variables, eqns=[eqn],
                                  outvars=[v for v in eqn.outvars if type(v).__name__ != "DropVar"])
    try:
        with fresh_ids():
            builder = GraphBuilder()
            atoms = [builder.const(a.value) if isinstance(a, Const) else builder.new_var(a.aval)
                     for a in args]
            builder.inline(alone, atoms)
            check_supported(builder.nodes, REWRITTEN)
    except UnsupportedPrimitiveError as e:
        return short_reason(str(e))
    return None


def short_reason(message: str) -> str:
    """An UnsupportedPrimitiveError's message without its advice to use backend="jax"
    (co-execution is what runs it) and without the line (explain names the step's own)."""
    return re.sub(r" \(from [^()]*\)", "", message.split(" Use nimble.jit(")[0]).strip()

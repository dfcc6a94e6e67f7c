"""Co-execution: a partitioned function (compiler/partition.py) evaluated inside the
caller's jax.jit, each nimble region one `nimble_call` (runtime/xla_op.py) and every
other equation an ordinary JAX equation, so XLA compiles the rest around nimble's
graphs and runs them on the same stream, with no host round trip.

A `while`, `cond` or `scan` left to XLA whose bodies hold regions is emitted again with
lax.while_loop / lax.switch / lax.scan over the partitioned bodies. JAX differentiates
and batches the XLA equations; the regions carry nimble_call's own VJP and batching
rules.
"""
from __future__ import annotations

import contextlib
from typing import Any, Callable, Sequence

import jax
from jax import lax

from nimblejax.compiler import control
from nimblejax.compiler.partition import (CUSTOM_RULES, Const, Program, Region, Step, nimble_classify,
                                          partition)

# (region, its operands) → its results: a nimble_call of the region (api.py makes it).
CallRegion = Callable[[Region, list], list]


def partition_function(flat_fun: Callable, args: Sequence[Any], options: Any = None) -> Program:
    """`flat_fun` traced at `args`' types and partitioned by nimble's own checker, which
    judges each equation as planning under `options` would: with loops="graph", a
    `while` nimble can plan (no side effects, every body equation lowered) is a WHILE
    task inside a region, not XLA's loop (a diffrax solve beside an equinox callback)."""
    # A tracer's own type: inside shard_map it carries the mesh axes it varies over.
    specs = [jax.typeof(a) if isinstance(a, jax.core.Tracer) else
             jax.ShapeDtypeStruct(_shape(a), _dtype(a), weak_type=_weak(a)) for a in args]
    closed = jax.make_jaxpr(flat_fun)(*specs)
    if options is None:
        return partition(closed, nimble_classify)
    from nimblejax.compiler import loops
    from nimblejax.compiler.pipeline import SUB_PLANNER

    with loops.planning(options, SUB_PLANNER):
        return partition(closed, nimble_classify)


def _shape(a: Any) -> tuple:
    return tuple(a.shape) if hasattr(a, "shape") else ()


def _dtype(a: Any) -> Any:
    return a.dtype if hasattr(a, "dtype") else jax.numpy.result_type(a)


def _weak(a: Any) -> bool:
    aval = getattr(a, "aval", None)
    return bool(getattr(aval, "weak_type", getattr(a, "weak_type", False)))


def evaluate(program: Program, args: Sequence[Any], call_region: CallRegion) -> list:
    """Run `program` on `args` (tracers of the caller's jit, or arrays)."""
    env: dict = dict(zip(program.inputs, args))
    for part in program.parts:
        if isinstance(part, Region):
            outs = call_region(part, [env[v] for v in part.inputs])
            env.update(zip(part.outputs, _typed_as(outs, part.outputs)))
        else:
            outs = run_step(part, [_read(env, a) for a in part.ins], call_region)
            env.update((v, o) for v, o in zip(part.outs, outs) if v is not None)
    return [_read(env, a) for a in program.outputs]


def run_region(region: Region, *args: Any) -> list:
    """A region's equations, in order: the flat function a region's plan is made of."""
    env: dict = dict(zip(region.inputs, args))
    for step in region.steps:
        outs = bind(step.eqn, [_read(env, a) for a in step.ins])
        env.update((v, o) for v, o in zip(step.outs, outs) if v is not None)
    return [env[v] for v in region.outputs]


def _read(env: dict, atom: Any) -> Any:
    return atom.value if isinstance(atom, Const) else env[atom]


def bind(eqn: Any, args: list, params: dict | None = None) -> list:
    """Apply one jaxpr equation as jax.core.eval_jaxpr does (its params, or `params`, and
    its user line)."""
    params = eqn.primitive.get_bind_params(eqn.params if params is None else params)
    subfuns, params = params if isinstance(params, tuple) else ((), params)  # (subfuns, params) ≤0.4
    ctx = getattr(getattr(eqn, "ctx", None), "manager", None) or contextlib.nullcontext()
    with _user_line(eqn), ctx:
        outs = eqn.primitive.bind(*subfuns, *args, **params)
    return list(outs) if eqn.primitive.multiple_results else [outs]


def _user_line(eqn: Any) -> Any:
    """The equation's source info while it is bound again, so that the jaxpr (and any
    error) still names the user's line; a no-op where JAX's private helper moved."""
    try:
        from jax._src import source_info_util as siu

        return siu.user_context(eqn.source_info.traceback, name_stack=eqn.source_info.name_stack)
    except Exception:  # private JAX API
        return contextlib.nullcontext()


def run_step(step: Step, args: list, call_region: CallRegion) -> list:
    """An equation left to XLA: as it is, or its loop or branches around partitioned
    bodies."""
    if not step.inner:
        return bind(step.eqn, args)
    if step.name in CUSTOM_RULES:
        return _custom_rule(step, args, call_region)
    if step.name == "while":
        return _while(step, args, call_region)
    if step.name == "cond":
        return _cond(step, args, call_region)
    return _scan(step, args, call_region)


def _custom_rule(step: Step, args: list, call_region: CallRegion) -> list:
    """custom_jvp_call / custom_vjp_call bound again with its partitioned body as its
    `call_jaxpr`: the library's derivative rule stays (run by JAX as it is)."""
    (prog,) = step.inner
    specs = [jax.ShapeDtypeStruct(a.shape, a.dtype, weak_type=a.weak_type) for a in map(jax.typeof, args)]
    closed = jax.make_jaxpr(lambda *xs: evaluate(prog, list(xs), call_region))(*specs)
    return bind(step.eqn, args, dict(step.eqn.params, call_jaxpr=closed))


def _while(step: Step, args: list, call_region: CallRegion) -> list:
    p = step.eqn.params
    ncc, nbc = int(p["cond_nconsts"]), int(p["body_nconsts"])
    cc, bc, init = args[:ncc], args[ncc:ncc + nbc], args[ncc + nbc:]
    cond_prog, body_prog = step.inner

    def cond(carry):
        return evaluate(cond_prog, list(cc) + list(carry), call_region)[0]

    def body(carry):
        return tuple(evaluate(body_prog, list(bc) + list(carry), call_region))

    return list(lax.while_loop(cond, body, tuple(init)))


def _cond(step: Step, args: list, call_region: CallRegion) -> list:
    index, ops = args[0], args[1:]
    branches = [lambda *xs, prog=prog: evaluate(prog, list(xs), call_region) for prog in step.inner]
    return list(lax.switch(index, branches, *ops))


def _scan(step: Step, args: list, call_region: CallRegion) -> list:
    p = step.eqn.params
    nc, nk = control._scan_counts(p)
    consts, init, xs = args[:nc], args[nc:nc + nk], args[nc + nk:]
    (body_prog,) = step.inner

    def body(carry, x):
        outs = evaluate(body_prog, list(consts) + list(carry) + list(x), call_region)
        return tuple(outs[:nk]), tuple(outs[nk:])

    carry, ys = lax.scan(body, tuple(init), tuple(xs), length=int(p["length"]),
                         reverse=bool(p["reverse"]), unroll=p.get("unroll", 1))
    return list(carry) + list(ys)


# ---- what a user is told -------------------------------------------------------------
def summary(program: Program) -> str:
    """One paragraph: the primitives left to XLA (not the tiny regions) and their lines."""
    steps = [s for s in program.xla_steps() if not s.why.startswith("in a region too small")]
    by_name: dict[str, list[str]] = {}
    for s in steps:
        by_name.setdefault(s.name, [])
        if s.source not in by_name[s.name]:
            by_name[s.name].append(s.source)
    names = "; ".join(f"'{n}' ({', '.join(lines[:3])}{', ...' if len(lines) > 3 else ''})"
                      for n, lines in by_name.items())
    return (f"{len(program.regions())} nimble region(s); primitives nimble cannot lower run "
            f"under XLA beside them: {names}")


def describe(program: Program, plan_of: Callable[[Region], Any] | None = None) -> list[str]:
    """explain's lines: every region with its size (and its plan's tasks), then every
    equation left to XLA and why."""
    lines = ["co-execution: nimble regions (nimble_call) and equations left to XLA, in order:"]
    lines += _describe(program, plan_of, "  ")
    return lines


def _describe(program: Program, plan_of, indent: str) -> list[str]:
    lines = []
    for part in program.parts:
        if isinstance(part, Region):
            names = sorted({s.name for s in part.steps})
            planned = ""
            if plan_of is not None:
                plan = plan_of(part)
                planned = f" → {len(plan.tasks)} tasks, {plan.schedule.num_streams} streams"
                inlined = sorted({d.primitive for d in plan.control if d.choice == "inlined"})
                planned += f"; library primitives inlined: {', '.join(inlined)}" if inlined else ""
            lines.append(f"{indent}region {part.name}: {len(part.steps)} equations, "
                         f"{len(part.inputs)} in, {len(part.outputs)} out{planned} "
                         f"[{', '.join(names[:8])}{', ...' if len(names) > 8 else ''}]")
        else:
            lines.append(f"{indent}xla {part.name} ({part.source}): {part.why}")
            for k, inner in enumerate(part.inner):
                lines.append(f"{indent}  body {k}:")
                lines += _describe(inner, plan_of, indent + "    ")
    return lines


def run(body: Any, operands: Sequence[Any], warned: set, warn: Callable[[str], None]) -> list:
    """A nimble function's flat body (an xla_op.Body nimble cannot plan whole),
    partitioned and evaluated; `warn` is called once per message (`warned` holds those
    given), naming the primitives left to XLA and their lines."""
    program = partition_function(body.flat_fun, operands, body.options)
    message = f"nimblejax: {summary(program)}. Pass fallback='error' to refuse them."
    if message not in warned:
        warned.add(message)
        warn(message)
    return evaluate(program, operands, region_caller(body, operands))


# ---- regions as nimble_calls ---------------------------------------------------------
def region_caller(parent: Any, operands: Sequence[Any]) -> CallRegion:
    """Each region a `nimble_call` of a Body derived from `parent` (a runtime/xla_op.py
    Body): keyed by the parent's key, the operands' types and the region's name, so a
    retrace finds its plans; no donation (the caller's jax.jit donates); a region that
    cannot be planned after all falls back again (`fallback`)."""
    import dataclasses
    import functools

    from nimblejax.runtime import xla_op

    sigs = tuple((_shape(x), str(_dtype(x)), _weak(x)) for x in operands)

    def call_region(region: Region, xs: list) -> list:
        body = dataclasses.replace(parent, key=parent.key + ("region", sigs, region.name),
                                   flat_fun=functools.partial(run_region, region),
                                   donated=frozenset(), arena="", fallback=fallback, owned=False)
        return xla_op.call(body, xs)

    return call_region


def _typed_as(outs: list, values: tuple) -> list:
    """Inside shard_map, a region's results varying over the mesh axes the traced
    program says (`values`' types): nimble_call's custom VJP drops them, and the JAX
    equations beside it are bound one by one, without the pvary JAX's tracing inserts."""
    fixed = []
    for o, v in zip(outs, values):
        missing = _varying(v.aval) - _varying(jax.typeof(o))
        fixed.append(_pvary(o, tuple(sorted(missing))) if missing else o)
    return fixed


def _varying(aval: Any) -> frozenset:
    """The mesh axes a value of type `aval` varies over inside shard_map:
    `manual_axis_type.varying` (jax 0.10), `vma` before; empty outside shard_map."""
    manual = getattr(aval, "manual_axis_type", None)
    return frozenset(manual.varying if manual is not None else getattr(aval, "vma", ()))


def _pvary(x: Any, axes: tuple) -> Any:
    """lax.pcast(x, axes, to="varying") (jax ≥0.10), lax.pvary before."""
    if hasattr(lax, "pcast"):
        return lax.pcast(x, axes, to="varying")
    return lax.pvary(x, axes)


def fallback(body: Any, operands: list) -> list:
    """A Body nimble cannot plan (xla_op.Body.fallback), partitioned and run: its regions
    planned, the rest left to XLA. When nimble takes every equation one by one but not
    together, the whole body runs as plain JAX (and no region repeats it forever)."""
    program = partition_function(body.flat_fun, operands, body.options)
    if not program.xla_steps():
        return list(body.flat_fun(*operands))
    return evaluate(program, operands, region_caller(body, operands))

"""Control flow at trace time: `scan`, `while` and `cond` flattened into the graph.

Called from `GraphBuilder.inline` (trace.py) for each control-flow equation:

- `scan` with a static trip count (always: `length`), and `while` whose trip count is
  static (the pattern `fori_loop` emits: an integer counter starting from a known value,
  `lt counter bound` as the whole condition, `counter + 1` in the body, a known bound),
  are UNROLLED when trip count × body size ≤ UNROLL_MAX_EQNS: the body is inlined once
  per iteration with the carry threaded through, xs sliced per iteration (slice +
  squeeze), ys stacked (reshape + concatenate). `reverse`, `length` without xs and the
  body's own constants are handled; `unroll` is ignored (everything is unrolled). A
  counting carry (the fori_loop index) becomes a literal in each iteration.
- `while` whose trip count is data-dependent but bounded by a counter term of its
  condition (`... & (i < n)`, through `and`s and equinox's batching markers: equinox's
  `while_loop(..., max_steps=n)`, diffrax's stage loop) is UNROLLED, PREDICATED, when
  the bound is at most PREDICATED_MAX_TRIPS: each iteration evaluates the condition and
  the body and keeps the old carry where the condition failed (`select_n`), so no WHILE
  node runs, at the cost of the iterations the loop would have skipped.
- `cond` (`lax.cond`, `lax.switch`) whose branches have no side effects becomes a
  `select_n` over all branches' outputs, the index clamped into range as lax.switch does.

With `Options.loops="graph"` (read through `loops.planning`), a `while` that cannot be
unrolled (its trip count is not static, or it is too large) becomes a WHILE task and a
cond/switch whose branches hold BRANCH_TASK_MIN_EQNS equations or more a SWITCH task,
their bodies plans of their own (compiler/loops.py).

Anything else (a dynamic trip count or a loop too large to unroll under "unroll", side
effects) raises UnsupportedPrimitiveError naming the primitive, the reason, the user's
line and `backend="jax"`. Each decision, and why, is recorded in a `ControlDecision`
that the plan keeps and `nimble.explain` prints.
"""
from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Any, Callable, Optional, Sequence

import jax
import numpy as np
from jax import lax

from nimblejax.compiler.errors import UnsupportedPrimitiveError
from nimblejax.compiler.ir import Atom, Inliner, Literal, Node, Var
from nimblejax.compiler.jaxprs import open_jaxpr
from nimblejax.compiler import loops
from nimblejax.compiler.emit import emit

PRIMITIVES = frozenset({"scan", "while", "cond"})

# Unroll a loop when trip count × body equations stays under this. On an H200 (issue 14)
# the unrolled graph beat a WHILE conditional node at every size measured (RNN T=64:
# 187 vs 422 µs; T=256: 729 vs 1630 µs), so the limit is planning time and graph size,
# not run time: the planners are near-linear in tasks and 8192 equations plan in seconds.
UNROLL_MAX_EQNS = 8192
# A while whose trip count is data-dependent but at most this (a counter term in its
# condition: equinox's max_steps) is unrolled with each iteration's carry selected by the
# condition: every iteration runs, so only where few are wasted (diffrax's Tsit5 stage
# loop: at most 7, runs 6 or 7). Measured on the GPU, docs/design.md.
PREDICATED_MAX_TRIPS = 8
# Stacked ys are concatenated this many slices at a time: one generated concat kernel
# takes one pointer per operand and tests them in a chain.
CONCAT_CHUNK = 32


@dataclass(frozen=True)
class ControlDecision:
    """What was done with one control-flow equation, and why."""

    primitive: str
    source: str
    choice: str  # "unrolled" | "select" | "constant" | "while task" | "switch task" | "inlined"
    reason: str

    def __str__(self) -> str:
        return f"{self.primitive} ({self.source}): {self.choice}, {self.reason}"


def inline_control(builder: Inliner, eqn: Any, ins: list[Atom], src: str) -> list[Atom]:
    """The equation's outputs, built from ordinary primitives in `builder`'s graph."""
    name = eqn.primitive.name
    if name == "scan":
        return _scan(builder, eqn, ins, src)
    if name == "while":
        return _while(builder, eqn, ins, src)
    return _cond(builder, eqn, ins, src)


def _decide(builder, name: str, src: str, choice: str, reason: str) -> None:
    builder.control.append(ControlDecision(name, src, choice, reason))


def _refuse(name: str, src: str, reason: str) -> NotImplementedError:
    """A loop or branch that would have to stay one where it cannot: under
    loops="unroll", with side effects in its body, or while co-execution decides what
    nimble plans (it probes each equation without the options, so such a loop stays
    XLA's, around nimble-planned bodies)."""
    return UnsupportedPrimitiveError(
        f"nimblejax cannot flatten primitive '{name}' (from {src}): {reason}; it stays a "
        f"loop (a CUDA WHILE or IF node) only under loops=\"graph\" (the default), with no "
        f"side effects in its body, in a function nimble plans whole. "
        f"Use nimble.jit(..., backend=\"jax\") to run this function with plain jax.jit.")


# ---- sizes ----------------------------------------------------------------------
def body_size(jaxpr: Any) -> int:
    """Equations of `jaxpr` once unrolled: nested bodies counted, scan bodies × length."""
    total = 0
    for eqn in jaxpr.eqns:
        inner = sum(body_size(open_jaxpr(j)[0]) for j in _sub_jaxprs(eqn.params))
        times = int(eqn.params["length"]) if eqn.primitive.name == "scan" else 1
        total += max(1, inner * times)
    return total


def _sub_jaxprs(params: dict) -> list:
    found = []
    for v in params.values():
        for item in (v if isinstance(v, (tuple, list)) else (v,)):
            if hasattr(item, "eqns") or hasattr(getattr(item, "jaxpr", None), "eqns"):
                found.append(item)
    return found


def _fits(trips: int, size: int) -> bool:
    return trips * size <= UNROLL_MAX_EQNS


def _why(trips: int, size: int) -> str:
    op = "≤" if _fits(trips, size) else ">"
    return (f"{trips} iterations × {size} equations = {trips * size} {op} "
            f"UNROLL_MAX_EQNS ({UNROLL_MAX_EQNS})")


# ---- scan -----------------------------------------------------------------------
def _scan(builder, eqn, ins, src) -> list[Atom]:
    p = eqn.params
    body, body_consts = open_jaxpr(p["jaxpr"])
    trips, size = int(p["length"]), body_size(body)
    nc, nk = _scan_counts(p)
    if loops.graph_options() is not None and not _fits(trips, size) and not _effectful(body):
        _decide(builder, "scan", src, "while task", f"{_why(trips, size)}: run as a while loop "
                f"over one body plan, xs read and ys written at a counter")
        jaxpr, consts = open_jaxpr(loops.scan_as_while(eqn, nc, nk))
        return builder.inline(jaxpr, [builder.const(c) for c in consts] + list(ins), src)
    if not _fits(trips, size) or _effectful(body):
        why = "the body has side effects" if _effectful(body) else _why(trips, size)
        raise _refuse("scan", src, why)
    _decide(builder, "scan", src, "unrolled", _why(trips, size))
    consts = [builder.const(c) for c in body_consts] + list(ins[:nc])
    carry, xs = list(ins[nc: nc + nk]), list(ins[nc + nk:])
    slices = [emit(builder, _unstack_fn(trips), [x], src) for x in xs]
    steps = range(trips - 1, -1, -1) if p["reverse"] else range(trips)
    ys: list[list[Atom]] = [[None] * trips for _ in body.outvars[nk:]]
    counters = _counters(builder, body, nc, carry)
    for n, t in enumerate(steps):
        outs = builder.inline(body, consts + carry + [s[t] for s in slices], src)
        carry = _fold(outs[:nk], counters, n + 1)
        for k, y in enumerate(outs[nk:]):
            ys[k][t] = y
    stacked = [_stack(builder, col, v.aval, src) for col, v in zip(ys, body.outvars[nk:])]
    return carry + stacked


def _scan_counts(p: dict) -> tuple[int, int]:
    """(consts, carry) counts: `num_consts`/`num_carry` params (≤0.10), or the first
    two parts of the `ft_in` flat tree (consts, carry, xs) (≥0.11)."""
    if "num_consts" in p:
        return int(p["num_consts"]), int(p["num_carry"])
    consts, carry, _xs = p["ft_in"].unpack()
    return len(consts), len(carry)


@functools.lru_cache(maxsize=None)
def _unstack_fn(trips: int) -> Callable:
    return lambda x: [lax.index_in_dim(x, t, 0, keepdims=False) for t in range(trips)]


def _stack(builder, col: list[Atom], aval: Any, src: str) -> Atom:
    """The slices of one ys output stacked along a new leading axis."""
    if not col:  # length 0
        return builder.const(np.zeros((0, *aval.shape), aval.dtype))
    col = [_as_var(builder, a, aval, src) for a in col]
    rows = emit(builder, _expand_fn, col, src)
    while len(rows) > 1:
        rows = [emit(builder, _concat_fn, rows[i: i + CONCAT_CHUNK], src)[0]
                for i in range(0, len(rows), CONCAT_CHUNK)]
    return rows[0]


def _expand_fn(*ys):
    return [lax.reshape(y, (1, *y.shape)) for y in ys]


def _concat_fn(*rows):
    return [lax.concatenate(rows, 0)] if len(rows) > 1 else list(rows)


def _as_var(builder, atom: Atom, aval: Any, src: str) -> Atom:
    """A body output that is a literal becomes a full array of its aval."""
    if isinstance(atom, Var):
        return atom
    return emit(builder, _full_fn(tuple(aval.shape), np.dtype(aval.dtype)), [atom], src)[0]


@functools.lru_cache(maxsize=None)
def _full_fn(shape: tuple[int, ...], dtype: np.dtype) -> Callable:
    return lambda v: [lax.full(shape, v, dtype)]


# ---- while ----------------------------------------------------------------------
def _while(builder, eqn, ins, src) -> list[Atom]:
    p = eqn.params
    body, body_jconsts = open_jaxpr(p["body_jaxpr"])
    size = body_size(body)
    trips = static_trip_count(builder, eqn, ins)
    if trips is None and not _effectful(body):
        bound = bounded_trip_count(builder, eqn, ins)
        cond_size = body_size(open_jaxpr(p["cond_jaxpr"])[0])
        if bound is not None and bound <= PREDICATED_MAX_TRIPS and _fits(bound, size + cond_size):
            _decide(builder, "while", src, "unrolled, predicated",
                    f"at most {bound} iterations (a counter bound in its condition) ≤ "
                    f"PREDICATED_MAX_TRIPS ({PREDICATED_MAX_TRIPS}): each iteration computed, "
                    f"its carry kept where the condition failed")
            return _predicated(builder, eqn, ins, src, bound)
    options = loops.graph_options()
    if options is not None and not _effectful(body) and not (trips is not None and _fits(trips, size)):
        why = "the trip count is not static" if trips is None else _why(trips, size)
        outs = loops.while_node(builder, eqn, ins, src, options)
        step = builder.nodes[-1].params["call"].step
        _decide(builder, "while", src, "while task",
                f"{why}; a step plan of {len(step.tasks)} tasks, run until its condition fails")
        return outs
    if trips is None or not _fits(trips, size) or _effectful(body):
        why = ("the trip count is not static" if trips is None else
               "the body has side effects" if _effectful(body) else _why(trips, size))
        raise _refuse("while", src, why)
    _decide(builder, "while", src, "unrolled",
            f"static trip count (counter loop); {_why(trips, size)}")
    ncc, nbc = int(p["cond_nconsts"]), int(p["body_nconsts"])
    consts = [builder.const(c) for c in body_jconsts] + list(ins[ncc: ncc + nbc])
    carry = list(ins[ncc + nbc:])
    counters = _counters(builder, body, nbc, carry)
    for n in range(trips):
        carry = _fold(builder.inline(body, consts + carry, src), counters, n + 1)
    return carry


def _predicated(builder, eqn, ins, src, trips: int) -> list[Atom]:
    """A while that runs at most `trips` times, unrolled: each iteration evaluates the
    condition and the body on the carry, and keeps the old carry where the condition
    failed (after `trips` iterations it has failed: its counter term says so)."""
    p = eqn.params
    cond, cond_jconsts = open_jaxpr(p["cond_jaxpr"])
    body, body_jconsts = open_jaxpr(p["body_jaxpr"])
    ncc, nbc = int(p["cond_nconsts"]), int(p["body_nconsts"])
    cond_consts = [builder.const(c) for c in cond_jconsts] + list(ins[:ncc])
    consts = [builder.const(c) for c in body_jconsts] + list(ins[ncc: ncc + nbc])
    carry = list(ins[ncc + nbc:])
    for _ in range(trips):
        pred = builder.inline(cond, cond_consts + carry, src)[0]
        if isinstance(pred, Literal) and not bool(pred.value):
            break  # known to have stopped here
        new = builder.inline(body, consts + carry, src)
        if isinstance(pred, Literal):
            carry = list(new)
            continue
        carry = [old if nxt is old else
                 emit(builder, _select_fn, [pred, _as_var(builder, old, v.aval, src),
                                            _as_var(builder, nxt, v.aval, src)], src)[0]
                 for old, nxt, v in zip(carry, new, eqn.outvars)]
    return carry


def _counters(builder, body, nconsts: int, init: list[Atom]) -> dict[int, np.ndarray]:
    """Carries that count (known integer start, `+ 1` per iteration), by position: the
    fori_loop index. Their value at each iteration is folded into a literal; left as
    `i + 1 + 1 + ...`, the chain would be fused into one ever deeper expression."""
    found = {}
    for k, atom in enumerate(init):
        start = _value(builder, atom)
        if (start is not None and np.issubdtype(np.asarray(start).dtype, np.integer)
                and _increments(body, nconsts, k)):
            found[k] = np.asarray(start)
    return found


def _fold(carry: list[Atom], counters: dict[int, np.ndarray], done: int) -> list[Atom]:
    """`carry` after `done` iterations, counters replaced by their known values."""
    carry = list(carry)
    for k, start in counters.items():
        carry[k] = Literal(np.asarray(start + done, dtype=start.dtype))
    return carry


def static_trip_count(builder, eqn, ins: Sequence[Atom]) -> Optional[int]:
    """The trip count of a counter loop (`i < bound`, `i = i + 1`, known start and
    bound), the pattern fori_loop emits as a while; None for any other loop."""
    cond, _ = open_jaxpr(eqn.params["cond_jaxpr"])
    if len(cond.eqns) != 1 or cond.eqns[0].outvars[0] is not cond.outvars[0]:
        return None
    return _counter_trips(builder, eqn, ins, cond.eqns[0])


def bounded_trip_count(builder, eqn, ins: Sequence[Atom]) -> Optional[int]:
    """At most how many times a while runs whose condition is a conjunction with a
    counter test among its terms (`... & (i < bound)`, `i = i + 1`, known start and
    bound): equinox's `while_loop(..., max_steps=n)`, diffrax's stage loop. None when
    no term bounds it."""
    cond, _ = open_jaxpr(eqn.params["cond_jaxpr"])
    made = {v: e for e in cond.eqns for v in e.outvars}
    bounds = [_counter_trips(builder, eqn, ins, made[v]) for v in _conjuncts(cond.outvars[0], made)
              if v in made and made[v].primitive.name == "lt"]
    bounds = [b for b in bounds if b is not None]
    return min(bounds) if bounds else None


# Scalar boolean pass-throughs between a condition's terms and its result: equinox's
# batching markers (the identity outside vmap) and bool → bool conversions.
_PASS_THROUGH = frozenset({"nonbatchable", "unvmap_any", "unvmap_all", "convert_element_type"})


def _conjuncts(var: Any, made: dict) -> list:
    """The terms whose `and` is `var` (a scalar bool), through _PASS_THROUGH."""
    eqn = made.get(var)
    if eqn is None or getattr(var.aval, "shape", None) != () or var.aval.dtype != np.bool_:
        return [var]
    if eqn.primitive.name == "and":
        return [t for v in eqn.invars if type(v).__name__ != "Literal" for t in _conjuncts(v, made)]
    if eqn.primitive.name in _PASS_THROUGH and len(eqn.invars) == 1:
        inner = eqn.invars[0]
        if (type(inner).__name__ != "Literal" and getattr(inner.aval, "shape", None) == ()
                and inner.aval.dtype == np.bool_):
            return _conjuncts(inner, made)
    return [var]


def _counter_trips(builder, eqn, ins: Sequence[Atom], test: Any) -> Optional[int]:
    """Iterations until the condition's term `test` (`lt counter bound`) fails, where
    the counter is a carry with a known integer start that the body adds 1 to and the
    bound is known; None otherwise."""
    p = eqn.params
    cond, cond_jconsts = open_jaxpr(p["cond_jaxpr"])
    body, _ = open_jaxpr(p["body_jaxpr"])
    ncc, nbc = int(p["cond_nconsts"]), int(p["body_nconsts"])
    init = list(ins[ncc + nbc:])
    if test.primitive.name != "lt":
        return None
    known: dict[Any, Any] = dict(zip(cond.constvars, cond_jconsts))
    known.update({v: _value(builder, a) for v, a in zip(cond.invars[:ncc], ins[:ncc])})
    carry_pos = {v: k for k, v in enumerate(cond.invars[ncc:])}
    lhs, rhs = test.invars
    if lhs not in carry_pos:
        return None
    k = carry_pos[lhs]
    start = _value(builder, init[k])
    bound = _bound(builder, rhs, known, carry_pos, body, nbc, init)
    if start is None or bound is None or not np.issubdtype(np.asarray(start).dtype, np.integer):
        return None
    if not _increments(body, nbc, k):
        return None
    return max(0, int(bound) - int(start))


def _bound(builder, rhs, known, carry_pos, body, nbc, init) -> Optional[Any]:
    if type(rhs).__name__ == "Literal":
        return rhs.val
    if rhs in known:
        return known[rhs]
    j = carry_pos.get(rhs)
    if j is not None and body.outvars[j] is body.invars[nbc + j]:  # unchanged by the body
        return _value(builder, init[j])
    return None


def _increments(body, nbc: int, k: int) -> bool:
    """Whether the body's k-th carry output is its k-th carry input + 1."""
    counter, out = body.invars[nbc + k], body.outvars[k]
    for e in body.eqns:
        if out in e.outvars:
            if e.primitive.name != "add":
                return False
            a, b = e.invars
            one = b if a is counter else a if b is counter else None
            return one is not None and type(one).__name__ == "Literal" and one.val == 1
    return False


def _value(builder, atom: Atom) -> Optional[Any]:
    """The value of a scalar known at trace time (a literal or a constant), else None."""
    if isinstance(atom, Literal):
        return atom.value
    value = builder.consts.get(atom)
    return value if value is not None and np.ndim(value) == 0 else None


# ---- cond -----------------------------------------------------------------------
def _cond(builder, eqn, ins, src) -> list[Atom]:
    branches = [open_jaxpr(b) for b in eqn.params["branches"]]
    if any(_effectful(j) for j, _ in branches):
        raise _refuse("cond", src, "a branch has side effects")
    index, ops = ins[0], list(ins[1:])
    if isinstance(index, Literal):  # known when planning: lax.platform_dependent's, say
        k = int(np.clip(index.value, 0, len(branches) - 1))  # lax.switch clamps too
        _decide(builder, "cond", src, "constant", f"the index is known when planning: "
                f"branch {k} of {len(branches)} alone")
        jaxpr, consts = branches[k]
        return builder.inline(jaxpr, [builder.const(c) for c in consts] + ops, src)
    size = sum(body_size(j) for j, _ in branches)
    options = loops.graph_options()
    if options is not None and len(branches) > 1 and size >= loops.BRANCH_TASK_MIN_EQNS:
        _decide(builder, "cond", src, "switch task",
                f"{len(branches)} branches of {size} equations ≥ BRANCH_TASK_MIN_EQNS "
                f"({loops.BRANCH_TASK_MIN_EQNS}): only the taken one runs")
        return loops.switch_node(builder, eqn, ins, src, options)
    outs = [builder.inline(j, [builder.const(c) for c in consts] + ops, src)
            for j, consts in branches]
    _decide(builder, "cond", src, "select",
            f"{len(branches)} side-effect-free branches of {size} equations, all evaluated, "
            f"then select_n")
    if len(branches) == 1:
        return outs[0]
    which = emit(builder, _clamp_fn(len(branches)), [index], src)[0]
    result = []
    for k, v in enumerate(eqn.outvars):
        cases = [o[k] for o in outs]
        if all(c is cases[0] for c in cases):
            result.append(cases[0])
            continue
        cases = [_as_var(builder, c, v.aval, src) for c in cases]
        result.append(emit(builder, _select_fn, [which] + cases, src)[0])
    return result


@functools.lru_cache(maxsize=None)
def _clamp_fn(n: int) -> Callable:
    return lambda i: [lax.clamp(0, lax.convert_element_type(i, np.int32), n - 1)]


def _select_fn(which, *cases):
    # `which` broadcast to the cases' shape: the generated select reads it per element.
    w = lax.broadcast_in_dim(which, cases[0].shape, ())
    return [lax.select_n(w, *cases)]


# ---- helpers --------------------------------------------------------------------
def _effectful(jaxpr: Any) -> bool:
    return bool(getattr(jaxpr, "effects", None))

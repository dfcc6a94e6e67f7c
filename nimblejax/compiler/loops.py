"""Loops and branches kept as loops and branches: WHILE and SWITCH tasks.

With `Options.loops="graph"`, control.py turns
- a `while` whose trip count is not static (or too large to unroll) into one
  `nimble_while` node, lowered to a WHILE task that holds the loop's step as a plan of
  its own (`LoopCall.step`): (loop constants..., carry...) → (next carry..., pred), the
  body followed by the condition on the next carry. The condition on the initial carry
  is computed in the enclosing plan and is the task's first operand. So one iteration is
  one sub-plan run, and a CUDA WHILE node's body is that plan's launches plus the copies
  of the next carry into the carry slots and the kernel that sets the loop's handle
  from `pred` (runtime/conditional.py).
- a `cond`/`switch` whose branches are costly (BRANCH_TASK_MIN_EQNS) into one
  `nimble_switch` node, lowered to a SWITCH task holding one plan per branch
  (`SwitchCall.branches`: operands... → results...); the select is kept for tiny ones.

Every sub-plan is built by the same passes (pipeline.build_plan) under the same
options, so its kernels, streams and memory are planned like any other plan's, nested
loops included.

The carry lives in fixed buffers: the step plan's carry inputs are its carry slots
(pinned inputs of its own arena). Each result of a sub-plan is a buffer the sub-plan
computes (`_materialized`: a result that would be an operand, a constant or a literal
gets a copy node), except a carry the step passes through unchanged. So after a step,
copying each next carry into its slot never overwrites a slot another copy still reads.
The CPU interpreter (runtime/interpret.py) runs these tasks exactly that way.
"""
from __future__ import annotations

import contextlib
import contextvars
import functools
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Callable, Optional, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from nimblejax.compiler.emit import emit
from nimblejax.compiler.ir import Atom, Graph, Inliner, Literal, Node, Var, fresh_ids
from nimblejax.compiler.jaxprs import open_jaxpr
from nimblejax.compiler.kinds import CONTROL_PRIMITIVES, RuleKind
from nimblejax.compiler.lowering.registry import register

if TYPE_CHECKING:
    from nimblejax.compiler.plan import Plan
    from nimblejax.options import Options


@dataclass(frozen=True)
class Planner:
    """How a sub-plan is made, given by the pipeline (which imports this module, so
    this module cannot import it): a graph builder, the graph's clean-up (common
    subexpressions, dead code) and the passes from a graph to a plan."""

    builder: Callable[[], Inliner]
    tidy: Callable[[Graph], Graph]
    build: Callable[[Graph, "Options"], "Plan"]


# The plan being traced (pipeline.compile_function sets it): its options, which say
# whether loops and branches may stay loops and branches, and how sub-plans are planned.
# None (co-execution's classification, a bare trace): unroll or refuse.
_PLANNING: contextvars.ContextVar[Optional[tuple["Options", Planner]]] = contextvars.ContextVar(
    "nimble_planning", default=None)


@contextlib.contextmanager
def planning(options: "Options", planner: Planner):
    """Trace under `options` (its `loops` setting decides what becomes a task)."""
    token = _PLANNING.set((options, planner))
    try:
        yield
    finally:
        _PLANNING.reset(token)


def graph_options() -> Optional["Options"]:
    """The options when loops may stay loops (`loops="graph"`), else None."""
    current = _PLANNING.get()
    return current[0] if current is not None and current[0].loops == "graph" else None

# A cond/switch becomes a SWITCH task when its branches hold at least this many
# equations together; below, every branch is computed and a select picks (control.py).
# A conditional node costs about 4 µs of GPU time (issue 32: a bare CUDA WHILE
# iteration on the H100), about two small kernels of a graph, and a select's branches
# fuse with each other and their readers; 32 equations are several kernels. An estimate
# until measured against the select on the GPU.
BRANCH_TASK_MIN_EQNS = 32


def _never_bound(*args: Any, **params: Any) -> Any:
    raise NotImplementedError("nimble_while / nimble_switch are run by their task "
                              "(runtime/interpret.py, runtime/conditional.py), never bound")


def _primitive(name: str) -> Any:
    try:
        from jax.extend.core import Primitive
    except ImportError:  # older JAX
        from jax.core import Primitive
    p = Primitive(name)
    p.multiple_results = True
    p.def_impl(_never_bound)
    return p


nimble_while_p = _primitive("nimble_while")
nimble_switch_p = _primitive("nimble_switch")
PRIMITIVES = frozenset(CONTROL_PRIMITIVES)


@dataclass(frozen=True, eq=False)
class LoopCall:
    """A WHILE task's loop. `step` maps (constants..., carry...) to (next carry..., pred);
    the task's operands are (pred on the initial carry, constants..., initial carry...),
    its results the final carry. `passed[k]`: the step returns carry k unchanged (its slot
    needs no copy)."""

    step: "Plan"
    nconsts: int
    passed: tuple[bool, ...]

    @property
    def ncarry(self) -> int:
        return len(self.passed)

    def __str__(self) -> str:
        return (f"while: a step plan of {len(self.step.tasks)} tasks on "
                f"{self.step.schedule.num_streams} streams, {self.ncarry} carried values")


@dataclass(frozen=True, eq=False)
class SwitchCall:
    """A SWITCH task's branches, each a plan (operands...) → (results...); the task's
    operands are (index, operands...). The index is clamped into range, as lax.switch."""

    branches: tuple["Plan", ...]

    def __str__(self) -> str:
        sizes = ", ".join(str(len(b.tasks)) for b in self.branches)
        return f"switch: {len(self.branches)} branch plans of {sizes} tasks"


# Registered as kernel rules so that the check and fusion treat the node as a group of
# its own; lowering/__init__.py makes the task (`control_task` there), never a kernel.
@register(*PRIMITIVES, kind=RuleKind.KERNEL)
def _rule(node: Node, *args: Any, **kwargs: Any) -> Any:
    raise AssertionError(f"{node.name} is lowered to a task by control_task, not a kernel")


# ---- building the nodes (called by control.py while tracing) ----------------------
def while_node(builder: Inliner, eqn: Any, ins: list[Atom], src: str,
               options: "Options") -> list[Atom]:
    """The loop as one nimble_while node of `builder`'s graph; its results."""
    p = eqn.params
    ncc, nbc = int(p["cond_nconsts"]), int(p["body_nconsts"])
    cond, cond_consts = open_jaxpr(p["cond_jaxpr"])
    body, body_consts = open_jaxpr(p["body_jaxpr"])
    init = list(ins[ncc + nbc:])
    cond_in = lambda b, consts, carry: b.inline(  # noqa: E731
        cond, [b.const(c) for c in cond_consts] + list(consts[:ncc]) + list(carry), src)[0]
    batched = tuple(cond.outvars[0].aval.shape)  # a vmapped loop's predicate, one per row
    pred0 = cond_in(builder, ins, init)
    if batched:
        pred0 = emit(builder, _any, [pred0], src)[0]
    loop_consts = list(ins[:ncc + nbc])
    avals = [v.aval for v in list(cond.invars[:ncc]) + list(body.invars[:nbc])]
    carry_avals = [v.aval for v in body.invars[nbc:]]

    def make(b: Inliner) -> tuple[list[Var], list[Atom], list[Optional[Var]]]:
        consts = [_operand(b, builder, a, aval) for a, aval in zip(loop_consts, avals)]
        carry = [b.new_var(aval) for aval in carry_avals]
        nxt = b.inline(body, [b.const(c) for c in body_consts] + consts[ncc:] + carry, src)
        if batched:  # rows whose predicate is false keep their carry (XLA's lowering)
            rows = cond_in(b, consts, carry)
            nxt = [emit(b, _keep_finished, [rows, n, c], src)[0] for n, c in zip(nxt, carry)]
        pred = cond_in(b, consts, nxt)
        if batched:
            pred = emit(b, _any, [pred], src)[0]
        inputs = [c for c in consts if isinstance(c, Var) and c not in b.consts] + carry
        return inputs, nxt + [pred], carry + [None]

    step = sub_plan(make, src, options)
    ncarry = len(carry_avals)
    passed = tuple(step.graph.outputs[k] is step.graph.inputs[len(step.graph.inputs) - ncarry + k]
                   for k in range(ncarry))
    call = LoopCall(step, len(step.graph.inputs) - ncarry, passed)
    kept = [a for a, aval in zip(loop_consts, avals) if _kept_as_operand(builder, a)]
    outs = [builder.new_var(aval) for aval in carry_avals]
    builder.nodes.append(Node(nimble_while_p, (pred0, *kept, *init), tuple(outs), {"call": call}, src))
    return outs


def _any(pred):
    return jnp.any(pred)


def _keep_finished(rows, new, old):
    """`new` where the row's predicate holds, else `old` (rows: the leading axes)."""
    if tuple(new.shape[:rows.ndim]) != tuple(rows.shape):
        raise NotImplementedError(f"a vmapped while_loop whose carry of shape {new.shape} is "
                                  f"not batched like its predicate {rows.shape}")
    return jnp.where(rows.reshape(rows.shape + (1,) * (new.ndim - rows.ndim)), new, old)


def switch_node(builder: Inliner, eqn: Any, ins: list[Atom], src: str,
                options: "Options") -> list[Atom]:
    """The cond/switch as one nimble_switch node; its results."""
    branches = [open_jaxpr(b) for b in eqn.params["branches"]]
    ops = list(ins[1:])
    avals = [v.aval for v in branches[0][0].invars]
    plans = []
    for jaxpr, consts in branches:
        def make(b, jaxpr=jaxpr, consts=consts):
            args = [_operand(b, builder, a, aval) for a, aval in zip(ops, avals)]
            outs = b.inline(jaxpr, [b.const(c) for c in consts] + args, src)
            return [a for a in args if isinstance(a, Var) and a not in b.consts], outs, [None] * len(outs)
        plans.append(sub_plan(make, src, options))
    kept = [a for a in ops if _kept_as_operand(builder, a)]
    outs = [builder.new_var(v.aval) for v in eqn.outvars]
    node = Node(nimble_switch_p, (ins[0], *kept), tuple(outs), {"call": SwitchCall(tuple(plans))}, src)
    builder.nodes.append(node)
    return outs


def scan_as_while(eqn: Any, nconsts: int, ncarry: int) -> Any:
    """A scan as the equivalent while loop (a closed jaxpr over the scan's operands):
    a counter in the carry, each x read at the counter (dynamic index), each y written
    there into a stacked carry (dynamic update). Inlined, its `while` is too large to
    unroll whenever the scan was, so it becomes a WHILE task around one body plan."""
    p = eqn.params
    body, body_consts = open_jaxpr(p["jaxpr"])
    length, reverse = int(p["length"]), bool(p["reverse"])
    y_avals = [v.aval for v in body.outvars[ncarry:]]

    def scan(*args: Any) -> list:
        consts, init, xs = args[:nconsts], args[nconsts:nconsts + ncarry], args[nconsts + ncarry:]
        ys0 = [lax.full((length, *a.shape), 0, a.dtype) for a in y_avals]

        def step(c: tuple) -> tuple:
            i, carry, ys = c
            t = length - 1 - i if reverse else i
            x = [lax.dynamic_index_in_dim(a, t, 0, keepdims=False) for a in xs]
            outs = _evaluate(body, body_consts, [*consts, *carry, *x])
            ys = [lax.dynamic_update_index_in_dim(y, o, t, 0) for y, o in zip(ys, outs[ncarry:])]
            return i + 1, list(outs[:ncarry]), ys

        _, carry, ys = lax.while_loop(lambda c: c[0] < length, step, (0, list(init), ys0))
        return [*carry, *ys]

    specs = [jax.ShapeDtypeStruct(v.aval.shape, v.aval.dtype, weak_type=getattr(v.aval, "weak_type", False))
             for v in eqn.invars]
    with _user_line(eqn):  # the loop's equations name the scan's line
        return jax.make_jaxpr(scan)(*specs)


def _evaluate(jaxpr: Any, consts: Sequence, args: Sequence) -> list:
    """`jaxpr` applied to `args`, each equation bound again (inside a trace)."""
    env = dict(zip(list(jaxpr.constvars) + list(jaxpr.invars), list(consts) + list(args)))

    def read(v: Any) -> Any:
        return v.val if type(v).__name__ == "Literal" else env[v]

    for eqn in jaxpr.eqns:
        # As jax.core.eval_jaxpr binds (a (subfuns, params) pair up to JAX 0.4), under
        # the equation's own source info, so the body's nodes still name the user's line.
        params = eqn.primitive.get_bind_params(eqn.params)
        subfuns, params = params if isinstance(params, tuple) else ((), params)
        with _user_line(eqn):
            outs = eqn.primitive.bind(*subfuns, *[read(v) for v in eqn.invars], **params)
        outs = outs if eqn.primitive.multiple_results else [outs]
        env.update(zip(eqn.outvars, outs))
    return [read(v) for v in jaxpr.outvars]


def _user_line(eqn: Any) -> Any:
    try:
        from jax._src import source_info_util as siu

        return siu.user_context(eqn.source_info.traceback, name_stack=eqn.source_info.name_stack)
    except Exception:  # private JAX API: the nodes then name the scan's line
        return contextlib.nullcontext()


def _kept_as_operand(parent: Inliner, atom: Atom) -> bool:
    """An operand the sub-plan takes as an input: not a literal or a known constant
    (those are written into the sub-plan)."""
    return isinstance(atom, Var) and atom not in parent.consts


def _operand(b: Inliner, parent: Inliner, atom: Atom, aval: Any) -> Atom:
    """`atom` of the enclosing graph as seen inside a sub-plan's graph builder `b`."""
    if isinstance(atom, Literal):
        return atom
    if atom in parent.consts:
        return b.const(parent.consts[atom])
    return b.new_var(aval)


def sub_plan(make: Callable, src: str, options: "Options") -> "Plan":
    """A plan of its own: `make(builder)` → (inputs, outputs, keep) builds its graph,
    where keep[k] is the input output k may stay (a carry passed through), else None."""
    planner = _PLANNING.get()[1]
    with fresh_ids():
        b = planner.builder()
        inputs, outputs, keep = make(b)
        outputs = _materialized(b, outputs, keep, inputs, src)
        graph = planner.tidy(Graph(tuple(inputs), tuple(outputs), tuple(b.nodes), b.consts))
        graph = Graph(graph.inputs, graph.outputs, graph.nodes, graph.consts,
                      control=tuple(dict.fromkeys(b.control)))
        return planner.build(graph, options)


def _materialized(b: Inliner, outputs: Sequence[Atom], keep: Sequence[Optional[Var]],
                  inputs: Sequence[Var], src: str) -> list[Atom]:
    """Each output a value some node of the graph computes: an input (other than its
    `keep`), a constant or a literal is copied, and so is an output whose bytes would be
    an input's (a reshape of one is a view of its bytes)."""
    made = {o for n in b.nodes for o in n.outputs}
    views = _view_of_input(b.nodes, set(inputs))
    out = []
    for a, k in zip(outputs, keep):
        if a is k:
            out.append(a)
        elif isinstance(a, Literal) or a not in made or a in views:
            out.append(emit(b, _copy_fn(tuple(a.shape), np.dtype(a.dtype)), [a], src)[0])
        else:
            out.append(a)
    return out


VIEW_PRIMS = frozenset({"reshape", "squeeze", "expand_dims"})


def _view_of_input(nodes: Sequence[Node], inputs: set) -> set:
    """Values that may share an input's bytes: chains of reshapes from an input."""
    shared = set(inputs)
    for n in nodes:
        if n.name in VIEW_PRIMS and n.inputs and n.inputs[0] in shared:
            shared.update(n.outputs)
    return shared - set(inputs)


@functools.lru_cache(maxsize=None)
def _copy_fn(shape: tuple[int, ...], dtype: np.dtype) -> Callable:
    return lambda v: [lax.copy_p.bind(v)]


def node_operands(node: Node, read: Callable[[Var], np.ndarray]) -> list:
    """A control node's operands as arrays: literals by value, variables through `read`."""
    return [np.asarray(a.value) if isinstance(a, Literal) else read(a) for a in node.inputs]


def branch_index(index: Any, n: int) -> int:
    """The branch a SWITCH task runs: the index clamped into range (lax.switch's rule)."""
    return int(np.clip(int(np.asarray(index)), 0, n - 1))


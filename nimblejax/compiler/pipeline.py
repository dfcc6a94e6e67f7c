"""The compiler's stages, in order: a function → one launch plan.

    trace (trace.py)            jaxpr → graph IR: inlined, CSE, dead code dropped
    check                       every primitive has a rule, every dtype is supported
    canonicalize (canonicalize/) conv paths, reduction splits, GEMM-ready dots
    fuse (fusion.py)            nodes → groups, one group per kernel or library call
    lower (lowering/)           groups → Tasks: generated kernels, GemmCall, ConvCall, views
    streams (streams/)          Nimble's stream assignment and the minimal events
    memory (memory.py)          one arena; reuse only after every use happens-before
    verify (streams/verify.py)  no two unordered tasks touch overlapping bytes

Each stage runs once; nothing here touches a GPU. With `debug=2` (NIMBLE_DEBUG=2) the
program is printed to stderr after trace, canonicalize, fuse, lower, streams and memory
(compiler/printing.py).
"""
from __future__ import annotations

from typing import Any, Callable, Sequence

import jax
import networkx as nx

from nimblejax.compiler.canonicalize import REWRITTEN, canonicalize
from nimblejax.compiler.fusion import fuse
from nimblejax.compiler.ir import Graph, Var, fresh_ids
from nimblejax.compiler.kinds import TaskKind
from nimblejax.compiler.lowering import lower
from nimblejax.compiler.lowering.registry import check_supported
from nimblejax.compiler.memory import plan_memory
from nimblejax.compiler import printing
from nimblejax.compiler.plan import Plan
from nimblejax.compiler.streams import critical_path, make_schedule, verify
from nimblejax.compiler.trace import make_graph
from nimblejax.options import Options


class PlanVerificationError(AssertionError):
    """A plan whose streams and memory would race: a bug in nimblejax's planners."""


def compile_function(fun: Callable, specs: Sequence[jax.ShapeDtypeStruct],
                     options: Options = Options()) -> tuple[Plan, Any]:
    """Trace `fun` (flat arguments → flat outputs) at `specs` and plan it. Value ids are
    numbered from 0 for each plan."""
    with fresh_ids():
        graph, out_shapes = make_graph(fun, specs)
        _print(options, "trace", printing.graph_text, graph)
        return build_plan(graph, options), out_shapes


def build_plan(graph: Graph, options: Options = Options()) -> Plan:
    check_supported(graph.nodes, REWRITTEN)
    control = graph.control  # canonicalize rebuilds the graph without it
    graph = canonicalize(graph, options)
    _print(options, "canonicalize", printing.graph_text, graph)
    # Plain cuBLAS has no epilogues: there a bias or activation stays a kernel. Neither
    # has the small-M kernel (lowering/gemm_small.py), which the library call is not.
    groups = fuse(graph, gemm_epilogues=options.gemm != "cublas", small_gemm=options.small_gemm)
    _print(options, "fuse", printing.groups_text, groups)
    all_tasks = lower(groups, small_gemm=options.small_gemm)
    _print(options, "lower", printing.tasks_text, all_tasks)
    views = tuple(t for t in all_tasks if t.kind is TaskKind.VIEW)
    # Values that share a buffer: views, and outputs computed in an input's bytes.
    storage: dict[Var, Var] = {}
    for t in all_tasks:  # topological: a value's buffer is known before its views'
        pairs = ((t.outputs[0], t.inputs[0]),) if t.kind is TaskKind.VIEW else t.aliases
        for out, src in pairs:
            storage[out] = storage.get(src, src)
    tasks = [t for t in all_tasks if t.kind is not TaskKind.VIEW]
    root = lambda v: storage.get(v, v)  # noqa: E731
    reads = {t: tuple(dict.fromkeys(root(v) for v in t.inputs)) for t in tasks}
    writes = {t: tuple(root(v) for v in t.outputs) for t in tasks}
    dag = _task_dag(tasks, reads, writes)
    schedule = make_schedule(dag, options.max_streams)
    _print(options, "streams", printing.schedule_text, schedule, critical_path(dag))
    sizes = _sizes(graph, reads, writes)
    pinned = set(graph.inputs) | set(graph.consts)
    pinned |= {root(a) for a in graph.outputs if isinstance(a, Var)}
    memory = plan_memory(schedule, sizes, reads, writes, pinned=[b for b in sizes if b in pinned])
    plan = Plan(graph, tuple(groups), tuple(schedule.order), views, dag, schedule, memory,
                storage, sizes, reads, writes, control)
    _print(options, "memory", printing.memory_text, plan)
    if options.verify:
        verify_plan(plan)
    return plan


def _print(options: Options, stage: str, text: Callable[..., str], *args: Any) -> None:
    if options.print_passes:
        printing.emit(stage, text(*args))


def verify_plan(plan: Plan) -> None:
    """Raise PlanVerificationError if two unordered tasks touch overlapping bytes."""
    found = verify(plan.schedule, plan.memory, plan.sizes, plan.reads, plan.writes)
    if found:
        raise PlanVerificationError(f"{len(found)} race(s) in the plan; first: {found[0]}")


def _task_dag(tasks, reads, writes) -> nx.DiGraph:
    """An edge from the last task before t (in topological order) that wrote a buffer t
    reads. A buffer has one writer, or several in a chain of in-place updates (each
    writer the only reader of the value before it)."""
    last: dict = {}
    dag = nx.DiGraph()
    dag.add_nodes_from(tasks)
    for t in tasks:
        for b in reads[t]:
            if b in last:
                dag.add_edge(last[b], t)
        for b in writes[t]:
            last[b] = t
    return dag


def _sizes(graph: Graph, reads, writes) -> dict[Var, int]:
    sizes: dict[Var, int] = {v: v.nbytes for v in graph.inputs}
    sizes.update({v: v.nbytes for v in graph.consts})
    for bufs in list(reads.values()) + list(writes.values()):
        for b in bufs:
            sizes[b] = b.nbytes
    return sizes

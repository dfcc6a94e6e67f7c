"""The compiler's passes, in order: a function → one launch plan.

    trace (trace.py)            jaxpr → graph IR: inlined, CSE, dead code dropped
    check                       every primitive has a rule, every dtype is supported
    canonicalize (canonicalize/) conv paths, reduction splits, GEMM-ready dots
    fuse (fusion.py)            nodes → groups, one group per kernel or library call
    lower (lowering/)           groups → Tasks: generated kernels, GemmCall, ConvCall, views;
                                attention's two GEMMs and softmax as one kernel (attention.py)
    buffers (buffers.py)        shared bytes, each task's reads and writes, the task DAG
    streams (streams/)          Nimble's stream assignment and the minimal events
    memory (memory.py)          one arena; reuse only after every use happens-before
    verify (streams/verify.py)  no two unordered tasks touch overlapping bytes

`PASSES` is that list after trace: each a named function Program → Program that fills
in one more field of the frozen `Program`. Each runs once; nothing here touches a GPU.
A pass with a text is a stage (compiler/stages.py): with `debug=2` (NIMBLE_DEBUG=2) it
is printed to stderr as soon as its pass has run, and `trace_stages` returns them all.
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any, Callable, Optional, Sequence

import jax

from nimblejax.compiler import loops, printing
from nimblejax.compiler.buffers import Buffers, analyze_buffers
from nimblejax.compiler.canonicalize import REWRITTEN, canonicalize
from nimblejax.compiler.fusion import Group, fuse
from nimblejax.compiler.fusion_conv_post import fuse_conv_posts
from nimblejax.compiler.fusion_gemm_gates import fuse_gemm_gates
from nimblejax.compiler.fusion_gemm_post import fuse_gemm_posts
from nimblejax.compiler.fusion_horizontal import pack_horizontal
from nimblejax.compiler.fusion_siblings import merge_sibling_reductions
from nimblejax.compiler.ir import Graph, fresh_ids
from nimblejax.compiler.lowering import lower
from nimblejax.compiler.lowering.attention import fuse_attention
from nimblejax.compiler.lowering.registry import check_supported
from nimblejax.compiler.lowering.task import Task
from nimblejax.compiler.memory import plan_memory
from nimblejax.compiler.plan import Plan
from nimblejax.compiler.stages import Stage, Stages
from nimblejax.compiler.costs import estimate_us
from nimblejax.compiler.streams import Schedule, critical_path, make_schedule, verify
from nimblejax.compiler.trace import GraphBuilder, common_subexpressions, drop_dead_code, make_graph
from nimblejax.options import Options


class PlanVerificationError(AssertionError):
    """A plan whose streams and memory would race: a bug in nimblejax's planners."""


@dataclass(frozen=True)
class Program:
    """What the passes have made so far; each pass fills in the next field."""
    graph: Graph  # the traced graph, then the canonicalized one
    control: tuple = ()  # the trace's loop and cond decisions (canonicalize drops them)
    groups: Optional[tuple[Group, ...]] = None  # fuse
    lowered: Optional[tuple[Task, ...]] = None  # lower: every task, views included
    buffers: Optional[Buffers] = None  # buffers
    schedule: Optional[Schedule] = None  # streams
    plan: Optional[Plan] = None  # memory


@dataclass(frozen=True)
class Pass:
    name: str
    run: Callable[[Program, Options], Program]
    made: Optional[str] = None  # the Program field it fills: its stage's value
    text: Optional[Callable[[Program], str]] = None  # its stage's text; None: a check only


# ---- the passes -------------------------------------------------------------------------
def _check(p: Program, options: Options) -> Program:
    check_supported(p.graph.nodes, REWRITTEN)
    return p


def _canonicalize(p: Program, options: Options) -> Program:
    return dataclasses.replace(p, graph=canonicalize(p.graph, options))


def _fuse(p: Program, options: Options) -> Program:
    # Plain cuBLAS has no epilogues: there a bias or activation stays a kernel. Neither
    # has the small-M kernel (lowering/gemm_small.py), which the library call is not.
    groups = merge_sibling_reductions(
        fuse(p.graph, gemm_epilogues=options.gemm != "cublas", small_gemm=options.small_gemm))
    if options.tc_gemm and options.gemm != "cublas":
        groups = fuse_gemm_posts(groups, p.graph, small_gemm=options.small_gemm)
        groups = fuse_gemm_gates(groups, p.graph, small_gemm=options.small_gemm)
    groups = fuse_conv_posts(groups, p.graph)
    if options.horizontal:
        groups = pack_horizontal(groups)
    return dataclasses.replace(p, groups=tuple(groups))


def _lower(p: Program, options: Options) -> Program:
    tasks = lower(p.groups, small_gemm=options.small_gemm, tc_gemm=options.tc_gemm)
    return dataclasses.replace(p, lowered=tuple(fuse_attention(p.groups, tasks, p.graph.outputs)))


def _buffers(p: Program, options: Options) -> Program:
    return dataclasses.replace(p, buffers=analyze_buffers(p.graph, p.lowered))


def _streams(p: Program, options: Options) -> Program:
    return dataclasses.replace(p, schedule=make_schedule(p.buffers.dag, options.max_streams,
                                                         weight=estimate_us))


def _memory(p: Program, options: Options) -> Program:
    b, schedule = p.buffers, p.schedule
    memory = plan_memory(schedule, b.sizes, b.reads, b.writes, pinned=b.pinned)
    plan = Plan(p.graph, p.groups, tuple(schedule.order), b.views, b.dag, schedule, memory,
                b.storage, b.sizes, b.reads, b.writes, p.control)
    return dataclasses.replace(p, plan=plan)


def _verify(p: Program, options: Options) -> Program:
    if options.verify:
        verify_plan(p.plan)
    return p


PASSES: tuple[Pass, ...] = (
    Pass("check", _check),
    Pass("canonicalize", _canonicalize, "graph", lambda p: printing.graph_text(p.graph)),
    Pass("fuse", _fuse, "groups", lambda p: printing.groups_text(p.groups)),
    Pass("lower", _lower, "lowered", lambda p: printing.tasks_text(p.lowered)),
    Pass("buffers", _buffers, "buffers", lambda p: printing.buffers_text(p.buffers)),
    Pass("streams", _streams, "schedule",
         lambda p: printing.schedule_text(p.schedule, critical_path(p.buffers.dag))),
    Pass("memory", _memory, "plan", lambda p: printing.memory_text(p.plan)),
    Pass("verify", _verify),
)
TRACE = Pass("trace", lambda p, options: p, "graph", lambda p: printing.graph_text(p.graph))
# The stages, in order: what NIMBLE_DEBUG=2 prints and `trace_stages` returns.
STAGES: tuple[str, ...] = tuple(p.name for p in (TRACE, *PASSES) if p.text is not None)


# ---- running them -------------------------------------------------------------------------
# How compiler/loops.py plans a loop's body or a branch: the same trace clean-up and passes.
SUB_PLANNER = loops.Planner(GraphBuilder, lambda g: drop_dead_code(common_subexpressions(g)),
                            lambda g, options: build_plan(g, options))
def compile_function(fun: Callable, specs: Sequence[jax.ShapeDtypeStruct],
                     options: Options = Options(),
                     kept: Optional[list[Stage]] = None) -> tuple[Plan, Any]:
    """Trace `fun` (flat arguments → flat outputs) at `specs` and plan it. Value ids are
    numbered from 0 for each plan. Each stage is appended to `kept` when given."""
    with fresh_ids(), loops.planning(options, SUB_PLANNER):  # loops kept as tasks
        graph, out_shapes = make_graph(fun, specs)
        _after(TRACE, Program(graph, graph.control), options, kept)
        return build_plan(graph, options, kept), out_shapes


def trace_stages(fun: Callable, specs: Sequence[jax.ShapeDtypeStruct],
                 options: Options = Options()) -> Stages:
    """Every stage of planning `fun` at `specs`: pass name → Stage, in order."""
    kept: list[Stage] = []
    compile_function(fun, specs, options, kept)
    return Stages(kept)


def build_plan(graph: Graph, options: Options = Options(),
               kept: Optional[list[Stage]] = None) -> Plan:
    """Run every pass of `PASSES` over a traced graph."""
    program = Program(graph, graph.control)
    for p in PASSES:
        program = p.run(program, options)
        _after(p, program, options, kept)
    return program.plan


def _after(p: Pass, program: Program, options: Options, kept: Optional[list[Stage]]) -> None:
    """Print the pass's stage (NIMBLE_DEBUG=2) and keep it, where asked to."""
    if p.text is None or not (options.print_passes or kept is not None):
        return
    stage = Stage(p.name, getattr(program, p.made), lambda: p.text(program))
    if options.print_passes:
        printing.emit(str(stage))
    if kept is not None:
        kept.append(stage)


def verify_plan(plan: Plan) -> None:
    """Raise PlanVerificationError if two unordered tasks touch overlapping bytes."""
    found = verify(plan.schedule, plan.memory, plan.sizes, plan.reads, plan.writes)
    if found:
        raise PlanVerificationError(f"{len(found)} race(s) in the plan; first: {found[0]}")

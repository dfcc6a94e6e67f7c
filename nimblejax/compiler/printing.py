"""The program as text after each compiler pass (`NIMBLE_DEBUG=2`, and the Stage
objects of compiler/stages.py), and the pieces `nimble.explain` shares: event numbers,
one line per task, byte sizes.

    trace         the graph IR, each node with its user line; loop and cond decisions
    canonicalize  the graph IR after the rewrites
    fuse          one line per group: kind, value written, values read, the primitives
                  ("in place": a scatter updating its operand's buffer; "epilogue
                  bias+relu": what a GEMM computes after its product)
    lower         one line per task: kind, name (a GEMM's ends in its epilogue:
                  gemm_float32_1x4x8x16[bias+relu]), launches (grid × block) or the
                  library call, values written and read (and an output computed in an
                  input's bytes); views
    buffers       the values sharing another's bytes, the pinned buffers, then one
                  line per task (t0, t1, ...): buffers written and read, the tasks it
                  runs after (its edges in the task DAG)
    streams       the launch order: stream, events waited on and recorded, task
    memory        the same with each buffer's arena offset and size, then the arena

Every line is made from the plan's own records, numbered per plan (value ids from 0,
events in launch order), so one function prints the same text every time.
Everything here only reads. Readers: compiler/stages.py (the pass texts), the pipeline
and explain.py (the shared pieces; `format_bytes` lives in memory.py, which this imports,
so that memory.py → printing.py → plan.py → memory.py is no circle).
"""
from __future__ import annotations

import re
import sys
from typing import TYPE_CHECKING, Any, Mapping, Sequence, TextIO

from nimblejax.compiler.kinds import TaskKind
from nimblejax.compiler.memory import format_bytes

if TYPE_CHECKING:
    from nimblejax.compiler.buffers import Buffers
    from nimblejax.compiler.fusion import Group
    from nimblejax.compiler.ir import Graph
    from nimblejax.compiler.lowering.task import Task
    from nimblejax.compiler.plan import Plan
    from nimblejax.compiler.streams import Schedule

_ADDRESS = re.compile(r" at 0x[0-9a-fA-F]+")  # object reprs in params: not deterministic


def header(stage: str) -> str:
    return f"=== nimblejax after {stage} ==="


def clean(text: str) -> str:
    """`text` without object addresses (which differ from run to run)."""
    return _ADDRESS.sub("", text)


def section(stage: str, text: str) -> str:
    """One pass's text under its header, as NIMBLE_DEBUG=2 writes it."""
    return f"{header(stage)}\n{text}\n"


def emit(section_text: str, file: TextIO | None = None) -> None:
    """Write one pass's section (to stderr by default)."""
    out = file if file is not None else sys.stderr
    out.write(section_text)
    out.flush()


# ---- trace, canonicalize ----------------------------------------------------------------
def graph_text(graph: Graph) -> str:
    lines = [graph.pretty()]
    if graph.control:  # loops and conds flattened at trace time (compiler/control.py)
        lines.append("control flow:")
        lines += [f"  {d}" for d in graph.control]
    return "\n".join(lines)


# ---- fuse ---------------------------------------------------------------------------------
def groups_text(groups: Sequence[Group]) -> str:
    lines = []
    for i, g in enumerate(groups):
        outs = ", ".join(map(repr, g.outputs))
        ins = ", ".join(map(repr, g.inputs))
        ops = " ".join(n.name for n in g.nodes)
        place = "  in place" if g.in_place else ""  # the root updates its operand's buffer
        epilogue = f"  epilogue {g.epilogue.label}" if g.epilogue is not None else ""
        epilogue += f"  then {' '.join(n.name for n in g.post.nodes)}" if g.post is not None else ""
        epilogue += f" (through {g.gates} gates)" if g.gates else ""
        lines.append(f"  g{i} {g.kind:<9} {outs} <- {ins}  [{ops}]{place}{epilogue}")
    return f"{len(groups)} groups\n" + "\n".join(lines)


# ---- lower --------------------------------------------------------------------------------
def launch_text(task: Task) -> str:
    """How a task runs: its kernels' grids and blocks, or its library call."""
    if task.kind is TaskKind.KERNEL:
        text = " then ".join(f"{k.name} grid{list(k.grid)} block{list(k.block)}"
                             for k in task.kernel.launches)
        # A kernel computing a GEMM (lowering/gemm_tc.py): which one.
        return text + (f" computing {task.gemm!r}" if task.gemm is not None else "")
    if task.kind is TaskKind.GEMM:
        return repr(task.gemm)
    if task.kind is TaskKind.CUDNN:
        return repr(task.conv)
    if task.control is not None:  # WHILE / SWITCH (compiler/loops.py)
        return str(task.control)
    return "no launch: shares its input's bytes"


def tasks_text(tasks: Sequence[Task]) -> str:
    lines = []
    for t in tasks:
        outs = ", ".join(map(repr, t.outputs))
        ins = ", ".join(map(repr, t.inputs))
        shared = "".join(f"  ({o!r} in {i!r}'s bytes)" for o, i in t.aliases)
        lines.append(f"  {t.kind:<6} {t.name}  {outs} <- {ins}{shared}\n           {launch_text(t)}")
    views = sum(t.kind is TaskKind.VIEW for t in tasks)
    return f"{len(tasks) - views} tasks (+{views} views)\n" + "\n".join(lines)


# ---- buffers ------------------------------------------------------------------------------
def buffers_text(buffers: Buffers) -> str:
    tasks = buffers.tasks
    edges = buffers.dag.number_of_edges()
    lines = [f"{len(tasks)} tasks, {edges} edges (last writer -> reader), "
             f"{len(buffers.sizes)} buffers, {len(buffers.pinned)} pinned"]
    if buffers.storage:
        lines.append("  shared: " + ", ".join(f"{v!r} in {b!r}" for v, b in buffers.storage.items()))
    if buffers.pinned:
        lines.append("  pinned: " + " ".join(map(repr, buffers.pinned)))
    number = {t: i for i, t in enumerate(tasks)}  # names may repeat: t0, t1, ... do not
    for t in tasks:
        outs = " ".join(map(repr, buffers.writes[t]))
        ins = " ".join(map(repr, buffers.reads[t]))
        after = sorted(number[u] for u in buffers.dag.predecessors(t))
        runs_after = f"  after {', '.join(f't{i}' for i in after)}" if after else ""
        lines.append(f"  t{number[t]} {t.name}  {outs} <- {ins}{runs_after}")
    return "\n".join(lines)


# ---- streams ------------------------------------------------------------------------------
def event_numbers(schedule: Schedule) -> dict[Any, int]:
    """Each recording task → its event's number, in launch order."""
    recorders = [u for u in schedule.order if schedule.records(u)]
    return {u: i for i, u in enumerate(recorders)}


def _sync_text(schedule: Schedule, task: Any, events: Mapping[Any, int]) -> str:
    waits = [f"e{events[u]}" for u in schedule.waits(task)]
    wait = f" wait {','.join(waits)}" if waits else ""
    rec = f" record e{events[task]}" if task in events else ""
    return f"s{schedule.stream[task]}{wait}{rec}"


def schedule_text(schedule: Schedule, critical_path: int) -> str:
    events = event_numbers(schedule)
    lines = [f"  {_sync_text(schedule, t, events)}  {t.name}" for t in schedule.order]
    return (f"{len(schedule.order)} tasks on {schedule.num_streams} streams, "
            f"{len(schedule.syncs)} events, critical path {critical_path} tasks\n" + "\n".join(lines))


# ---- memory -------------------------------------------------------------------------------
def task_line(plan: Plan, task: Task, events: Mapping[Any, int]) -> str:
    """stream, events, name, then each value written and read at its arena offset."""
    ins = " ".join(f"{v!r}@{plan.offset(v)}" for v in plan.reads[task])
    outs = " ".join(f"{v!r}@{plan.offset(v)}({format_bytes(v.nbytes)})" for v in plan.writes[task])
    return f"  {_sync_text(plan.schedule, task, events)}  {task.name}  {outs} <- {ins}"


def memory_text(plan: Plan) -> str:
    events = event_numbers(plan.schedule)
    lines = [plan.memory.describe()]
    lines += [task_line(plan, t, events) for t in plan.tasks]
    pinned = [v for v in list(plan.graph.inputs) + list(plan.graph.consts) if v in plan.memory.offsets]
    if pinned:
        lines.append("  inputs and constants: " + " ".join(f"{v!r}@{plan.offset(v)}" for v in pinned))
    return "\n".join(lines)

"""The buffer analysis: the stage between lowering and the stream assignment.

From the lowered tasks it decides which values share bytes, what each task reads and
writes, and the order that forces on the tasks:

- storage: a view's output lives in its input's buffer, and so does a task's output
  computed in an input's bytes (`Task.aliases`: a scatter updating its operand);
  chains resolve to the first buffer (a view of a view shares the root's bytes);
- reads and writes: per task (views excluded: they launch nothing), in buffers;
- the task DAG: an edge from the last task before t (in topological order) that wrote
  a buffer t reads. A buffer has one writer, or several in a chain of in-place updates
  (each writer the only reader of the value before it), so the last writer is the one
  whose value t reads;
- sizes, and the pinned buffers: inputs, constants and the outputs' buffers, which the
  memory planner never lets another buffer reuse.

Pure data out of pure data: the streams and memory passes read only this record.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Mapping, Sequence

import networkx as nx

from nimblejax.compiler.ir import Graph, Var
from nimblejax.compiler.kinds import TaskKind
from nimblejax.compiler.lowering.task import Task


@dataclass(frozen=True, eq=False)
class Buffers:
    tasks: tuple[Task, ...]  # GPU work in topological order (views excluded)
    views: tuple[Task, ...]
    storage: Mapping[Var, Var]  # value → the buffer holding it (views, in-place updates)
    reads: Mapping[Task, tuple[Var, ...]]  # buffers, each once, in operand order
    writes: Mapping[Task, tuple[Var, ...]]
    dag: nx.DiGraph  # tasks; an edge from a buffer's last writer to each reader
    sizes: Mapping[Var, int]  # every buffer: inputs, constants, what tasks read and write
    pinned: tuple[Var, ...]  # never reused: inputs, constants, outputs (in `sizes` order)

    def root(self, value: Var) -> Var:
        """The buffer holding `value`."""
        return self.storage.get(value, value)


def analyze_buffers(graph: Graph, lowered: Sequence[Task]) -> Buffers:
    """`lowered`: every task in topological order, views included."""
    storage = _storage(lowered)
    root = lambda v: storage.get(v, v)  # noqa: E731
    tasks = tuple(t for t in lowered if t.kind is not TaskKind.VIEW)
    reads = {t: tuple(dict.fromkeys(root(v) for v in t.inputs)) for t in tasks}
    writes = {t: tuple(root(v) for v in t.outputs) for t in tasks}
    sizes = _sizes(graph, reads, writes)
    pinned = set(graph.inputs) | set(graph.consts)
    pinned |= {root(a) for a in graph.outputs if isinstance(a, Var)}
    return Buffers(tasks, tuple(t for t in lowered if t.kind is TaskKind.VIEW), storage,
                   reads, writes, task_dag(tasks, reads, writes), sizes,
                   tuple(b for b in sizes if b in pinned))


def _storage(lowered: Sequence[Task]) -> dict[Var, Var]:
    """Values that share a buffer: views, and outputs computed in an input's bytes."""
    storage: dict[Var, Var] = {}
    for t in lowered:  # topological: a value's buffer is known before its views'
        pairs = ((t.outputs[0], t.inputs[0]),) if t.kind is TaskKind.VIEW else t.aliases
        for out, src in pairs:
            storage[out] = storage.get(src, src)
    return storage


def task_dag(tasks: Sequence[Task], reads: Mapping[Task, tuple[Var, ...]],
             writes: Mapping[Task, tuple[Var, ...]]) -> nx.DiGraph:
    """An edge from the last task before t (in `tasks` order) that wrote a buffer t reads."""
    last: dict[Var, Task] = {}
    dag = nx.DiGraph()
    dag.add_nodes_from(tasks)
    for t in tasks:
        for b in reads[t]:
            if b in last:
                dag.add_edge(last[b], t)
        for b in writes[t]:
            last[b] = t
    return dag


def _sizes(graph: Graph, reads: Mapping[Task, tuple[Var, ...]],
           writes: Mapping[Task, tuple[Var, ...]]) -> dict[Var, int]:
    sizes: dict[Var, int] = {v: v.nbytes for v in graph.inputs}
    sizes.update({v: v.nbytes for v in graph.consts})
    for bufs in list(reads.values()) + list(writes.values()):
        for b in bufs:
            sizes[b] = b.nbytes
    return sizes

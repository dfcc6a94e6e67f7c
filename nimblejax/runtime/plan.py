"""The launch plan: tasks in launch order, their streams and events, and the memory plan.

Pure data built from the graph by pure planners; nothing here touches a GPU.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Mapping, Optional

import networkx as nx

from nimblejax.fusion import Group, fuse
from nimblejax.ir import Graph, Literal, Var
from nimblejax.lowering import lower
from nimblejax.lowering.task import Task
from nimblejax.runtime.memory import MemoryPlan, plan_memory
from nimblejax.streams import Schedule, critical_path, make_schedule


@dataclass(frozen=True, eq=False)
class Plan:
    graph: Graph
    groups: tuple[Group, ...]
    tasks: tuple[Task, ...]  # GPU work in launch order (views excluded)
    views: tuple[Task, ...]
    dag: nx.DiGraph
    schedule: Schedule
    memory: MemoryPlan
    storage: Mapping[Var, Var]  # every materialized value → the buffer that holds it
    sizes: Mapping[Var, int]
    reads: Mapping[Task, tuple[Var, ...]]
    writes: Mapping[Task, tuple[Var, ...]]

    def offset(self, var: Var) -> int:
        return self.memory.offsets[self.storage.get(var, var)]

    @property
    def num_events(self) -> int:
        return len(self.schedule.syncs)

    @property
    def critical_path(self) -> int:
        return critical_path(self.dag)

    def output_kind(self, atom) -> str:
        """'literal', 'input' (passed through), 'const', or 'buffer'."""
        if isinstance(atom, Literal):
            return "literal"
        if atom in self.graph.consts:
            return "const"
        if atom in self.graph.inputs:
            return "input"
        return "buffer"


def build_plan(graph: Graph, max_streams: Optional[int] = None) -> Plan:
    groups = fuse(graph)
    all_tasks = lower(groups)
    storage: dict[Var, Var] = {}
    for t in all_tasks:
        if t.kind == "view":
            src = t.inputs[0]
            storage[t.outputs[0]] = storage.get(src, src)
    tasks = [t for t in all_tasks if t.kind != "view"]
    root = lambda v: storage.get(v, v)  # noqa: E731
    reads = {t: tuple(dict.fromkeys(root(v) for v in t.inputs)) for t in tasks}
    writes = {t: tuple(root(v) for v in t.outputs) for t in tasks}
    producer = {b: t for t in tasks for b in writes[t]}
    dag = nx.DiGraph()
    dag.add_nodes_from(tasks)
    for t in tasks:
        for b in reads[t]:
            if b in producer and producer[b] is not t:
                dag.add_edge(producer[b], t)
    schedule = make_schedule(dag, max_streams)
    sizes = _sizes(graph, reads, writes)
    pinned = set(graph.inputs) | set(graph.consts)
    pinned |= {root(a) for a in graph.outputs if isinstance(a, Var)}
    memory = plan_memory(schedule, sizes, reads, writes, pinned=[b for b in sizes if b in pinned])
    ordered = tuple(schedule.order)
    return Plan(graph, tuple(groups), ordered, tuple(t for t in all_tasks if t.kind == "view"),
                dag, schedule, memory, storage, sizes, reads, writes)


def _sizes(graph: Graph, reads, writes) -> dict[Var, int]:
    sizes: dict[Var, int] = {v: v.nbytes for v in graph.inputs}
    sizes.update({v: v.nbytes for v in graph.consts})
    for bufs in list(reads.values()) + list(writes.values()):
        for b in bufs:
            sizes[b] = b.nbytes
    return sizes

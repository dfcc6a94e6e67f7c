"""The launch plan: tasks in launch order, their streams and events, and the memory plan.

Pure data, built by compiler/pipeline.py; the runtime reads it and nothing else of the
compiler.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Mapping

import networkx as nx

from nimblejax.compiler.ir import Graph, Literal, Var
from nimblejax.compiler.lowering.task import Task
from nimblejax.compiler.memory import MemoryPlan
from nimblejax.compiler.streams import Schedule, critical_path

if TYPE_CHECKING:
    from nimblejax.compiler.fusion import Group


@dataclass(frozen=True, eq=False)
class Plan:
    graph: Graph
    groups: tuple[Group, ...]
    tasks: tuple[Task, ...]  # GPU work in launch order (views excluded)
    views: tuple[Task, ...]
    dag: nx.DiGraph
    schedule: Schedule
    memory: MemoryPlan
    storage: Mapping[Var, Var]  # value → the buffer holding it (views, in-place updates)
    sizes: Mapping[Var, int]
    reads: Mapping[Task, tuple[Var, ...]]
    writes: Mapping[Task, tuple[Var, ...]]
    control: tuple = ()  # ControlDecisions (compiler/control.py): unrolled or select

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

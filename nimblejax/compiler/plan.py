"""The launch plan: tasks in launch order, their streams and events, and the memory plan.

Pure data, built by compiler/pipeline.py; the runtime reads it and nothing else of the
compiler.
"""
from __future__ import annotations

from dataclasses import dataclass
from functools import cached_property
from typing import TYPE_CHECKING, Any, Mapping

import networkx as nx
import numpy as np

from nimblejax.compiler.ir import Graph, Literal, Var
from nimblejax.compiler.kinds import OutputKind
from nimblejax.compiler.lowering.task import Task
from nimblejax.compiler.memory import MemoryPlan
from nimblejax.compiler.streams import Schedule, critical_path

if TYPE_CHECKING:
    from nimblejax.compiler.fusion import Group


@dataclass(frozen=True)
class OutputSlot:
    """Where one flat output of a plan comes from: `kind` BUFFER (`index`: its position
    in `Plan.output_buffers`), INPUT (`index`: the plan input passed through), or VALUE
    (a literal or a constant: `value`, a NumPy array of the output's dtype)."""

    kind: OutputKind
    index: int = -1
    value: Any = None


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

    @cached_property
    def output_buffers(self) -> tuple[Var, ...]:
        """The outputs the tasks compute, each distinct value once, in output order: what
        a runner hands back as the call's results."""
        return tuple(dict.fromkeys(a for a in self.graph.outputs if self.output_kind(a) is OutputKind.BUFFER))

    @cached_property
    def output_slots(self) -> tuple[OutputSlot, ...]:
        """Per flat output, where it comes from (every runner assembles its results so)."""
        index = {a: i for i, a in enumerate(self.output_buffers)}
        slots = []
        for a in self.graph.outputs:
            kind = self.output_kind(a)
            if kind is OutputKind.BUFFER:
                slots.append(OutputSlot(OutputKind.BUFFER, index[a]))
            elif kind is OutputKind.INPUT:
                slots.append(OutputSlot(OutputKind.INPUT, self.graph.inputs.index(a)))
            else:
                raw = a.value if kind is OutputKind.LITERAL else self.graph.consts[a]
                slots.append(OutputSlot(OutputKind.VALUE, value=np.asarray(raw, dtype=a.dtype)))
        return tuple(slots)

    def output_kind(self, atom) -> OutputKind:
        """LITERAL, INPUT (passed through), CONST or BUFFER."""
        if isinstance(atom, Literal):
            return OutputKind.LITERAL
        if atom in self.graph.consts:
            return OutputKind.CONST
        if atom in self.graph.inputs:
            return OutputKind.INPUT
        return OutputKind.BUFFER

"""The report of a plan (`nimble.explain`, `Lowered.explain`): one line per task, with
its stream, the events it records and waits on and the buffers it reads and writes
(their arena offsets), then totals; and the report of a co-executed function."""
from __future__ import annotations

from typing import Any

from nimblejax.compiler import printing
from nimblejax.compiler.kinds import TaskKind
from nimblejax.compiler.pipeline import Plan


class Report:
    """What nimble.jit would run: one line per task, then totals."""

    def __init__(self, plan: Plan) -> None:
        self.plan = plan
        self.event_of = printing.event_numbers(plan.schedule)

    @property
    def num_tasks(self) -> int:
        return len(self.plan.tasks)

    @property
    def num_streams(self) -> int:
        return self.plan.schedule.num_streams

    @property
    def num_events(self) -> int:
        return len(self.plan.schedule.syncs)

    @property
    def arena_bytes(self) -> int:
        return self.plan.memory.arena_bytes

    @property
    def chained_kernels(self) -> tuple[int, int]:
        """(generated-kernel tasks launched right after another task on their stream,
        all generated-kernel tasks): the first are the launches that programmatic
        dependent launch (`pdl`, on Hopper and later) lets start while the task before
        them ends; the others wait for events or start their stream."""
        sched, after, kernels = self.plan.schedule, 0, 0
        for s in range(sched.num_streams):
            for i, t in enumerate(sched.tasks_on(s)):
                if t.kind is TaskKind.KERNEL:
                    kernels += 1
                    after += i > 0
        return after, kernels

    def task_line(self, task) -> str:
        return printing.task_line(self.plan, task, self.event_of)

    def __str__(self) -> str:
        p = self.plan
        lines = [f"nimblejax plan: {len(p.graph.nodes)} equations → {self.num_tasks} tasks "
                 f"(+{len(p.views)} views)"]
        for t in p.tasks:
            lines.append(self.task_line(t))
            lines += _nested(t)
        if p.control:  # loops and conds flattened at trace time (compiler/control.py)
            lines.append("control flow:")
            lines += [f"  {d}" for d in p.control]
        after, kernels = self.chained_kernels
        lines.append(f"totals: {self.num_tasks} tasks, {self.num_streams} streams, "
                     f"{self.num_events} events, {p.memory.describe()}, "
                     f"{after} of {kernels} kernels after a task on their stream, "
                     f"critical path {p.critical_path} tasks")
        return "\n".join(lines)

    __repr__ = __str__


def _nested(task) -> list[str]:
    """A WHILE or SWITCH task's sub-plans (compiler/loops.py), indented under its line."""
    if task.control is None:
        return []
    plans = getattr(task.control, "branches", None)
    named = ([(f"branch {k}", b) for k, b in enumerate(plans)] if plans is not None
             else [("step (body, then the condition on the next carry)", task.control.step)])
    lines = [f"      {task.control}"]
    for name, plan in named:
        lines.append(f"      {name}:")
        lines += [f"        {line}" for line in str(Report(plan)).splitlines()]
    return lines


class CoexecReport:
    """What a co-executed function runs (runtime/coexec.py): each nimble region with its
    size and plan, each equation left to XLA and why, the library primitives inlined."""

    def __init__(self, program: Any, plans: dict) -> None:
        self.program = program
        self.plans = plans  # region name → Plan
        self.regions = program.regions()
        self.xla = program.xla_steps()

    def __str__(self) -> str:
        from nimblejax.runtime import coexec

        lines = [f"nimblejax co-execution: {len(self.regions)} nimble region(s), "
                 f"{len(self.xla)} equation(s) left to XLA"]
        lines += coexec.describe(self.program, lambda r: self.plans[r.name])
        return "\n".join(lines)

    __repr__ = __str__

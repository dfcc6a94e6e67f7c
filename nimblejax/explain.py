"""`nimble.explain`: the plan printed like a jaxpr, annotated with streams, events,
kernels and buffers."""
from __future__ import annotations

from typing import Any, Callable

from nimblejax.compiler import printing
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

    def task_line(self, task) -> str:
        return printing.task_line(self.plan, task, self.event_of)

    def __str__(self) -> str:
        p = self.plan
        lines = [f"nimblejax plan: {len(p.graph.nodes)} equations → {self.num_tasks} tasks "
                 f"(+{len(p.views)} views)"]
        lines += [self.task_line(t) for t in p.tasks]
        if p.control:  # loops and conds flattened at trace time (compiler/control.py)
            lines.append("control flow:")
            lines += [f"  {d}" for d in p.control]
        lines.append(f"totals: {self.num_tasks} tasks, {self.num_streams} streams, "
                     f"{self.num_events} events, {p.memory.describe()}, "
                     f"critical path {p.critical_path} tasks")
        return "\n".join(lines)

    __repr__ = __str__


def explain(fun: Callable, *args: Any, **kwargs: Any) -> Report:
    """Plan `fun` for these arguments and return a printable report (nothing runs)."""
    from nimblejax.api import NimbleFunction, jit

    nf = fun if isinstance(fun, NimbleFunction) else jit(fun, backend="interpret")
    return Report(nf.plan(*args, **kwargs))

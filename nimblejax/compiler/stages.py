"""The program after each compiler pass, as objects a user or a test can hold.

`nimble.jit(f).stages(*args)` returns `Stages`: pass name → `Stage`, in pass order
(trace, canonicalize, fuse, lower, buffers, streams, memory). A stage holds the record
its pass made (`value`: the graph, the groups, the tasks, the buffer analysis, the
schedule, the plan) and prints as NIMBLE_DEBUG=2 prints that pass, which prints from
these same objects (compiler/pipeline.py). The text is made when first asked for, so
holding the stages costs nothing until they are printed.
"""
from __future__ import annotations

import functools
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Callable, Iterator, Mapping, Sequence

from nimblejax.compiler import printing

if TYPE_CHECKING:
    from nimblejax.compiler.plan import Plan


@dataclass(frozen=True, eq=False)
class Stage:
    name: str  # the pass that made it
    value: Any  # its record: Graph, groups, tasks, Buffers, Schedule or Plan
    render: Callable[[], str] = field(repr=False)

    @functools.cached_property
    def text(self) -> str:
        """The pass's program as text (without its header)."""
        return printing.clean(self.render())

    def __str__(self) -> str:
        return printing.section(self.name, self.text)


class Stages(Mapping[str, Stage]):
    """Pass name → Stage, in pass order. `str()` is NIMBLE_DEBUG=2's whole output for
    one plan; `.plan` is the launch plan the last stage made."""

    def __init__(self, stages: Sequence[Stage]) -> None:
        self._stages = {s.name: s for s in stages}
        assert len(self._stages) == len(stages), [s.name for s in stages]

    def __getitem__(self, name: str) -> Stage:
        try:
            return self._stages[name]
        except KeyError:
            raise KeyError(f"no stage {name!r}; the stages are {', '.join(self._stages)}") from None

    def __iter__(self) -> Iterator[str]:
        return iter(self._stages)

    def __len__(self) -> int:
        return len(self._stages)

    def __str__(self) -> str:
        return "".join(map(str, self._stages.values()))

    def __repr__(self) -> str:
        return f"Stages({', '.join(self._stages)})"

    @property
    def plan(self) -> Plan:
        return self._stages["memory"].value

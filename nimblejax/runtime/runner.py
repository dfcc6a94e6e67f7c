"""The one runner model: a call spec's plan and the runners that run it.

A runner runs one plan one way; every way is a strategy of `Runner`:

| runner | backend | how a call runs |
|---|---|---|
| runtime/direct_runner.py `DirectRunner` | cuda | `runner(leaves)` from Python: inputs copied into the arena, the DeviceGraph launched, outputs handed back |
| runtime/ffi_runner.py `FfiRunner` | cuda | as a JAX operation: `lower` emits an XLA custom call that launches the DeviceGraph on XLA's stream |
| runtime/interpret_runner.py `InterpretRunner` | interpret | both: `runner(leaves)`, or `lower` as a host callback |

GPU runners share one graph build (runtime/graph.py's DeviceGraph: arena, streams,
launchers, capture). A function's calls are cached under one call-spec key,
`(body key, operand signatures)`, in one dict of `Compiled` entries: the plan, the
output tree, and its runners by arena name (api.py's `_specs`; runtime/xla_op.py's
`Body` fills the same dict for the XLA operation). runtime/choose.py picks the
runner.
"""
from __future__ import annotations

import functools
from dataclasses import dataclass, field
from typing import Any, Callable, Sequence

from jax.interpreters import mlir

from nimblejax.compiler.kinds import OutputKind
from nimblejax.compiler.plan import Plan

PASSED, HELD = -1, -2  # a resident call's operand sources; j >= 0: the previous call's output j

# The arenas a plan's runners are kept under (runtime/xla_op.py's Body.arena): the XLA
# operation's, the resident path's (it holds operands between calls, so nothing else may
# write it) and the direct Python path's.
OPERATION, RESIDENT, DIRECT = "", "resident", "direct"


class Runner:
    """Runs `plan`: called directly (`runner(leaves)`), or lowered inside a JAX
    computation (`place`, then `lower`). A runner that does not run one way says so."""

    plan: Plan

    def __call__(self, leaves: list) -> list:
        raise NotImplementedError(f"{type(self).__name__} runs only as a JAX operation")

    def place(self, devices) -> None:
        """Make the plan runnable on these (local) devices."""

    def lower(self, ctx, *args, sources: "tuple | None" = None):
        """The MLIR of one call: the lowering of `emit`, or of `emit_resident` for a
        resident call's operand `sources`."""
        emit = self.emit if sources is None else functools.partial(self.emit_resident, sources)
        return mlir.lower_fun(emit, multiple_results=True)(ctx, *args)

    def emit(self, *xs):
        raise NotImplementedError(f"{type(self).__name__} runs only from Python")

    def emit_resident(self, sources: tuple, *xs):
        """`emit` with only the operands whose source is PASSED (Residency)."""
        raise NotImplementedError(f"{type(self).__name__} takes no resident operands")

    def graphs(self) -> list:
        """The DeviceGraphs this runner launches (one per GPU it was placed on)."""
        return []


@dataclass
class Compiled:
    """One call spec: its plan, the function's output tree (once known) and the plan's
    runners by arena name."""

    plan: Plan
    out_tree: Any = None
    runners: dict = field(default_factory=dict)
    call: Any = None  # the direct path's call: its runner, keys crossing as key data
    out_shapes: Any = None  # the flat results' ShapeDtypeStructs, from the plan's trace


def assemble(plan: Plan, made: Sequence, input_at: Callable[[int], Any], value: Callable) -> list:
    """A call's flat outputs, as `plan.output_slots` says: `made[i]` for output buffer i,
    `input_at(k)` for plan input k passed through, `value(v)` for a literal or constant.
    Every runner hands back its results through this."""
    return [made[s.index] if s.kind is OutputKind.BUFFER else input_at(s.index) if s.kind is OutputKind.INPUT
            else value(s.value) for s in plan.output_slots]


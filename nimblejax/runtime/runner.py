"""What a lowered nimble operation emits: the runner interface every backend implements
(runtime/xla_op.py's InterpretRunner, runtime/ffi_runner.py's FfiRunner), and the
operand sources of a resident call."""
from __future__ import annotations

import functools
from typing import Any, Callable, Sequence

from jax.interpreters import mlir

from nimblejax.compiler.plan import Plan

PASSED, HELD = -1, -2  # a resident call's operand sources; j >= 0: the previous call's output j


class Runner:
    """Emits the traced computation that runs `plan` (inside lowering)."""

    plan: Plan

    def place(self, devices) -> None:
        """Make the plan runnable on these (local) devices."""

    def lower(self, ctx, *args, sources: "tuple | None" = None):
        """The MLIR of one call: the lowering of `emit`, or of `emit_resident` for a
        resident call's operand `sources`."""
        emit = self.emit if sources is None else functools.partial(self.emit_resident, sources)
        return mlir.lower_fun(emit, multiple_results=True)(ctx, *args)

    def emit(self, *xs):
        raise NotImplementedError

    def emit_resident(self, sources: tuple, *xs):
        """`emit` with only the operands whose source is PASSED (Residency)."""
        raise NotImplementedError


def assemble(plan: Plan, made: Sequence, input_at: Callable[[int], Any], value: Callable) -> list:
    """A call's flat outputs, as `plan.output_slots` says: `made[i]` for output buffer i,
    `input_at(k)` for plan input k passed through, `value(v)` for a literal or constant.
    Every runner hands back its results through this."""
    return [made[s.index] if s.kind == "buffer" else input_at(s.index) if s.kind == "input" else value(s.value)
            for s in plan.output_slots]

"""The kinds of rules, groups and tasks. `str` enums (StrEnum): a kind prints as its
name ("kernel") and equals that string, so reports, JSON and the runtime's comparisons
read the same as before; a misspelt kind is an error where it is made."""
from __future__ import annotations

from enum import StrEnum


class RuleKind(StrEnum):
    """How a primitive is lowered (lowering/registry.py gives each kind's signature)."""

    ELEMENTWISE = "elementwise"  # a C expression at one index: fusible into any kernel
    REDUCTION = "reduction"      # a reducer; producers fuse into its loop
    KERNEL = "kernel"            # a standalone generated kernel
    GEMM = "gemm"                # a GemmCall (or a generated kernel: integers, small M)
    CUDNN = "cudnn"              # a ConvCall


class GroupKind(StrEnum):
    """What one fusion group (fusion.py) becomes."""

    FUSED = "fused"          # elementwise nodes rooted at an elementwise node
    REDUCTION = "reduction"  # a reduction with its producers inlined
    ROW = "row"              # row normalizations: reductions over rows and their consumers
    KERNEL = "kernel"
    GEMM = "gemm"
    CUDNN = "cudnn"
    VIEW = "view"            # reshapes of a row-major buffer: the same bytes
    HORIZONTAL = "horizontal"  # independent FUSED groups in one launch (fusion_horizontal.py)


class TaskKind(StrEnum):
    """How a task (lowering/task.py) runs."""

    KERNEL = "kernel"  # a generated CUDA C kernel
    GEMM = "gemm"      # a cuBLASLt / cuBLAS call
    CUDNN = "cudnn"    # a cuDNN convolution
    VIEW = "view"      # no work: its output shares its input's bytes
    WHILE = "while"    # a loop: its step is a plan of its own (compiler/loops.py)
    SWITCH = "switch"  # a cond/switch: one plan per branch (compiler/loops.py)


class OutputKind(StrEnum):
    """Where one flat output of a plan comes from (Plan.output_kind); an OutputSlot's
    kind is BUFFER, INPUT or VALUE (a literal or a constant, handed back as its value)."""

    BUFFER = "buffer"    # computed by the tasks: one of Plan.output_buffers
    INPUT = "input"      # a plan input passed through
    LITERAL = "literal"
    CONST = "const"
    VALUE = "value"      # a LITERAL or CONST output's slot


# The primitives of a loop or branch kept as one task (compiler/loops.py makes them,
# lowering/__init__.py turns their group into a WHILE or SWITCH task).
CONTROL_PRIMITIVES = {"nimble_while": TaskKind.WHILE, "nimble_switch": TaskKind.SWITCH}

"""Graph IR: immutable records for values, nodes and graphs.

A `Graph` is a flat, inlined, dead-code-free copy of a jaxpr. Nodes keep the JAX
primitive and its params, so any node can still be evaluated by JAX itself (the CPU
plan interpreter relies on that).
"""
from __future__ import annotations

import contextlib
import contextvars
import itertools
import math
from dataclasses import dataclass, field
from typing import Any, Mapping, Protocol, Union

import numpy as np

# Value ids: numbered per plan inside `fresh_ids()` (so printing one function twice
# gives the same text), from a process-wide counter elsewhere (tests building IR by hand).
_global_ids = itertools.count()
_plan_ids: contextvars.ContextVar = contextvars.ContextVar("nimble_plan_ids", default=None)


def _next_id() -> int:
    counter = _plan_ids.get()
    return next(counter if counter is not None else _global_ids)


@contextlib.contextmanager
def fresh_ids():
    """Number the values created inside from 0 (one plan's values are made in one)."""
    token = _plan_ids.set(itertools.count())
    try:
        yield
    finally:
        _plan_ids.reset(token)


@dataclass(frozen=True, eq=False)
class Var:
    """A value produced by one node (or a graph input / constant). Hashed by identity."""

    shape: tuple[int, ...]
    dtype: np.dtype
    weak_type: bool = False
    id: int = field(default_factory=_next_id)

    @property
    def ndim(self) -> int:
        return len(self.shape)

    @property
    def size(self) -> int:
        return math.prod(self.shape)

    @property
    def nbytes(self) -> int:
        return self.size * np.dtype(self.dtype).itemsize

    def __repr__(self) -> str:
        return f"%{self.id}:{short_dtype(self.dtype)}{list(self.shape)}"


@dataclass(frozen=True, eq=False)
class Literal:
    """A scalar constant written into the program text (jaxpr literals)."""

    value: np.ndarray  # 0-d array with the literal's dtype

    @property
    def shape(self) -> tuple[int, ...]:
        return ()

    @property
    def dtype(self) -> np.dtype:
        return self.value.dtype

    # A 0-d operand to rules that read sizes (`x.at[i].add(1.0)`: a scatter's updates).
    ndim = 0
    size = 1

    def __repr__(self) -> str:
        return f"{self.value.item()!r}:{short_dtype(self.dtype)}"


Atom = Union[Var, Literal]


@dataclass(frozen=True, eq=False)
class Node:
    """One primitive application. `source` is the user's file:line that produced it."""

    primitive: Any  # jax.extend.core.Primitive
    inputs: tuple[Atom, ...]
    outputs: tuple[Var, ...]
    params: Mapping[str, Any]
    source: str = "<unknown>"
    effectful: bool = False

    @property
    def name(self) -> str:
        return self.primitive.name

    def __repr__(self) -> str:
        outs = " ".join(map(repr, self.outputs))
        ins = " ".join(map(repr, self.inputs))
        shown = {k: v for k, v in self.params.items() if k not in HIDDEN_PARAMS}
        ps = f"[{', '.join(f'{k}={v}' for k, v in shown.items())}]" if shown else ""
        return f"{outs} = {self.name}{ps} {ins}"


HIDDEN_PARAMS = frozenset({"sharding", "out_sharding", "accuracy"})


@dataclass(frozen=True, eq=False)
class Graph:
    inputs: tuple[Var, ...]
    outputs: tuple[Atom, ...]
    nodes: tuple[Node, ...]
    consts: Mapping[Var, np.ndarray]
    control: tuple = ()  # compiler/control.py: what became of each loop and cond

    def consumers(self) -> dict[Var, list[Node]]:
        uses: dict[Var, list[Node]] = {}
        for node in self.nodes:
            for a in node.inputs:
                if isinstance(a, Var):
                    uses.setdefault(a, []).append(node)
        return uses

    def pretty(self) -> str:
        lines = [f"graph ({', '.join(map(repr, self.inputs))}) consts ({len(self.consts)})"]
        lines += [f"  {n!r}    # {n.source}" for n in self.nodes]
        lines.append(f"  return {', '.join(map(repr, self.outputs))}")
        return "\n".join(lines)

    __str__ = pretty


def short_dtype(dtype: Any) -> str:
    name = np.dtype(dtype).name
    return {"float32": "f32", "float16": "f16", "bfloat16": "bf16", "int32": "i32",
            "uint32": "u32", "bool": "bool", "int8": "i8", "uint8": "u8",
            "int64": "i64", "float64": "f64"}.get(name, name)


class Inliner(Protocol):
    """What control-flow inlining (control.py) needs of the graph builder that calls it
    (trace.GraphBuilder): named here so that control.py need not import trace.py, which
    imports it."""

    nodes: list[Node]
    consts: dict[Var, np.ndarray]
    control: list  # control.ControlDecision, one per loop or cond

    def const(self, value: Any) -> Atom: ...

    def new_var(self, aval: Any) -> "Var": ...

    def inline(self, jaxpr: Any, args: list[Atom], outer: str = "<unknown>") -> list[Atom]: ...

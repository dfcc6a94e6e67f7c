"""jax.nn.gelu(approximate=True)'s equations recognized after a GEMM, in any order of
their factors, so that cuBLASLt's GELU epilogue computes them (compiler/epilogue.py)."""
from __future__ import annotations

import math

from typing import Mapping, Optional

import numpy as np

from nimblejax.compiler.ir import Atom, Literal, Node, Var

SQRT_2_OVER_PI = math.sqrt(2.0 / math.pi)
GELU_CUBIC = 0.044715


def gelu_tanh(x: Var, ctx) -> Optional[tuple[Node, ...]]:
    """The nodes of x * 0.5 * (1 + tanh(sqrt(2/pi) * (x + 0.044715 * x**3))) when they are
    x's only uses (jax.nn.gelu(approximate=True); factors in any order), in graph order."""
    if x in ctx.outputs:
        return None
    uses = ctx.consumers.get(x, [])
    for final in _reachable(x, ctx, limit=12):
        nodes = _tree(final, x, ctx)
        if nodes is not None and all(u in nodes for u in uses) \
                and _gelu_form(_expr(final.outputs[0], x, ctx.producer)):
            return nodes
    return None


def _reachable(x: Var, ctx, limit: int) -> list[Node]:
    """Nodes downstream of x (breadth first, at most `limit`), farthest first."""
    seen: list[Node] = []
    frontier = [x]
    while frontier and len(seen) < limit:
        nxt = []
        for v in frontier:
            for u in ctx.consumers.get(v, []):
                if u not in seen and len(seen) < limit:
                    seen.append(u)
                    nxt.extend(u.outputs)
        frontier = nxt
    return seen[::-1]


_GELU_PRIMS = frozenset({"mul", "add", "tanh", "integer_pow"})


def _tree(final: Node, x: Var, ctx) -> Optional[tuple[Node, ...]]:
    """The nodes computing `final` from x and literals, every value inside used once by
    the node above it (a tree), or None."""
    nodes: list[Node] = []

    def visit(node: Node) -> bool:
        if node.name not in _GELU_PRIMS or not ctx.free(node) or node in nodes:
            return False
        for a in node.inputs:
            if isinstance(a, Literal) or a is x:
                continue
            p = ctx.producer.get(a)
            if p is None or not ctx.only_use(a, node) or not visit(p):
                return False
        nodes.append(node)
        return True

    return tuple(nodes) if visit(final) else None


def _expr(a: Atom, x: Var, producer: Mapping[Var, Node]):
    """An expression tree: 'x', a Literal, or (primitive, params, children...)."""
    if a is x or isinstance(a, Literal):
        return "x" if a is x else a
    node = producer[a]
    return (node.name, node.params.get("y"), *(_expr(b, x, producer) for b in node.inputs))


def _flat(e, op: str) -> list:
    """The operands of nested `op`s (mul or add); x**3 is three factors."""
    if isinstance(e, tuple) and e[0] == op:
        return [f for child in e[2:] for f in _flat(child, op)]
    if op == "mul" and isinstance(e, tuple) and e[0] == "integer_pow" and e[1] == 3:
        return _flat(e[2], op) * 3
    return [e]


def _is_const(e, value: float) -> bool:
    """A literal equal to `value` rounded to the literal's dtype."""
    return isinstance(e, Literal) and bool(np.asarray(value, e.dtype) == e.value)


def _take(items: list, value: float) -> Optional[list]:
    """items without one literal equal to value, or None if there is none."""
    for i, e in enumerate(items):
        if _is_const(e, value):
            return items[:i] + items[i + 1:]
    return None


def _gelu_form(e) -> bool:
    """x * 0.5 * (1 + tanh(c1 * (x + c2 * x^3)))."""
    rest = _take(_flat(e, "mul"), 0.5)
    if rest is None or len(rest) != 2 or "x" not in rest:
        return False
    one_plus = rest[1 - rest.index("x")]
    terms = _take(_flat(one_plus, "add"), 1.0)
    if terms is None or len(terms) != 1 or not (isinstance(terms[0], tuple) and terms[0][0] == "tanh"):
        return False
    inner = _take(_flat(terms[0][2], "mul"), SQRT_2_OVER_PI)
    if inner is None or len(inner) != 1:
        return False
    poly = _flat(inner[0], "add")
    if len(poly) != 2 or "x" not in poly:
        return False
    cubic = _take(_flat(poly[1 - poly.index("x")], "mul"), GELU_CUBIC)
    return cubic == ["x", "x", "x"]

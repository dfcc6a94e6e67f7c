"""The one way a rewrite replaces a node by a traced JAX function (a module of its own:
it reaches the tracer, which registry.py, imported by the lowering rules, must not)."""
from __future__ import annotations

from typing import Callable

import jax

from nimblejax.compiler.ir import Node


def replace_with(node: Node, fn: Callable) -> list[Node]:
    """The nodes of `fn` traced on the node's inputs, the last one writing the node's own
    output (so its readers need no change), each keeping the node's source line; [node]
    where the trace does not end in a value of that output's type."""
    from nimblejax.compiler.trace import GraphBuilder

    out = node.outputs[0]
    closed = jax.make_jaxpr(fn)(*(jax.ShapeDtypeStruct(v.shape, v.dtype) for v in node.inputs))
    builder = GraphBuilder()
    (result,) = builder.inline(closed.jaxpr, list(node.inputs), outer=node.source)
    nodes = builder.nodes
    if not nodes or nodes[-1].outputs[0] is not result or result.shape != out.shape or result.dtype != out.dtype:
        return [node]
    last = nodes[-1]
    nodes[-1] = Node(last.primitive, last.inputs, (out,), last.params, node.source)
    return [Node(n.primitive, n.inputs, n.outputs, n.params, node.source) for n in nodes]

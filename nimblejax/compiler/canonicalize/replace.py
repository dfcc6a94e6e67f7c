"""The one way a rewrite replaces a node by a traced JAX function (a module of its own:
it reaches the tracer, which registry.py, imported by the lowering rules, must not)."""
from __future__ import annotations

from typing import Callable, Hashable, Optional

import jax

from nimblejax.compiler.ir import Node


# Traces of replacements by key: a model repeats its convolutions (NASNet's cells: 197
# traces, a third of its planning time), and a key says all a trace depends on.
_TRACES: dict = {}
_MAX_TRACES = 4096


def replace_with(node: Node, fn: Callable, key: Optional[Hashable] = None) -> list[Node]:
    """The nodes of `fn` traced on the node's inputs, the last one writing the node's own
    output (so its readers need no change), each keeping the node's source line; [node]
    where the trace does not end in a value of that output's type. `key` (with the
    inputs' and output's types added here) names everything else `fn`'s trace depends
    on; a trace made under an equal key is reused."""
    from nimblejax.compiler.trace import GraphBuilder

    out = node.outputs[0]
    closed = None
    if key is not None:
        # jax's settings a trace may read: the dtypes, and the matmul precision that
        # picks TF32 or float32 for cuDNN (dot.compute_mode)
        key = (key, tuple((v.shape, str(v.dtype)) for v in node.inputs), out.shape, str(out.dtype),
               jax.config.jax_enable_x64, str(jax.config.jax_default_matmul_precision))
        try:
            closed = _TRACES.get(key)
        except TypeError:  # an unhashable parameter: trace every time
            key = None
    if closed is None:
        closed = jax.make_jaxpr(fn)(*(jax.ShapeDtypeStruct(v.shape, v.dtype) for v in node.inputs))
        if key is not None:
            if len(_TRACES) >= _MAX_TRACES:
                _TRACES.clear()
            _TRACES[key] = closed
    builder = GraphBuilder()
    (result,) = builder.inline(closed.jaxpr, list(node.inputs), outer=node.source)
    nodes = builder.nodes
    if not nodes or nodes[-1].outputs[0] is not result or result.shape != out.shape or result.dtype != out.dtype:
        return [node]
    last = nodes[-1]
    nodes[-1] = Node(last.primitive, last.inputs, (out,), last.params, node.source)
    return [Node(n.primitive, n.inputs, n.outputs, n.params, node.source) for n in nodes]

"""Trace a function to nimblejax's graph IR and evaluate a graph node by node with
JAX (each node's primitive bound to its inputs): a compiler stage's output checked
against jax.jit without planning or interpreting a plan."""
from __future__ import annotations

import jax

from nimblejax.compiler.ir import Graph, Literal, fresh_ids
from nimblejax.compiler.trace import make_graph


def trace(fn, *args) -> Graph:
    """fn's graph at the shapes and dtypes of `args` (flat arrays), values numbered from 0."""
    with fresh_ids():
        graph, _ = make_graph(fn, [jax.ShapeDtypeStruct(a.shape, a.dtype) for a in args])
    return graph


def evaluate(graph: Graph, args) -> list:
    """The graph's outputs for `args`, each node run by its JAX primitive."""
    env = dict(zip(graph.inputs, args))
    env.update(graph.consts)
    read = lambda a: a.value if isinstance(a, Literal) else env[a]  # noqa: E731
    for node in graph.nodes:
        outs = node.primitive.bind(*map(read, node.inputs), **node.params)
        env.update(zip(node.outputs, outs if node.primitive.multiple_results else [outs]))
    return [read(a) for a in graph.outputs]


def names(graph: Graph) -> list[str]:
    return [n.name for n in graph.nodes]


def missing_dependencies(schedule, dag) -> list[tuple]:
    """Edges of `dag` that `schedule` does not enforce (empty when sound)."""
    return [(u, v) for u, v in dag.edges if not schedule.happens_before(u, v)]

"""Small vector products as a multiply and a sum (XLA's dot strength reduction): a
`dot_general` one of whose sides is a vector (its free axes hold one element) and that
does at most MAX_MACS multiply-adds becomes `sum(a * b)` over the contracted axes, which
fusion then runs in one reduction kernel with its neighbours inlined.

Why: such a dot is a library GEMM call of a few hundred multiply-adds, and a call costs
a few microseconds however small (a cuBLASLt launch and its kernel). diffrax's Tsit5 step
has two per stage (the stage combination, 1x16x7, and the vector field's 16x16 matrix
times a vector), inside a loop of seven stages inside the loop of steps. The sum is in
the dot's float32 accumulation type, with no TF32 rounding of the operands: at least as
accurate as the GEMM it replaces. MAX_MACS is set low, not measured yet: diffrax's stage
products (256 and 112) are below it, every GEMM of the suite's models past it (the
LSTM's 1x2048x512 step keeps the small-M kernel, lowering/gemm_small.py, and the branchy
MLP's 1x256x256 layers their cuBLASLt bias epilogues).
"""
from __future__ import annotations

import jax.numpy as jnp
from jax import lax

from nimblejax.compiler import dtypes
from nimblejax.compiler.canonicalize.dot import dot_dims, dot_sizes
from nimblejax.compiler.canonicalize.replace import replace_with
from nimblejax.compiler.ir import Graph, Node

MAX_MACS = 1024


def strength_reduce_small_dots(graph: Graph) -> Graph:
    """Every small vector product of `graph` as a multiply and a sum (a pass over the graph,
    run after merge_dots: the dot rewrite in dot.py is imported by the lowering rules,
    which replace.py's tracer reaches, so it cannot trace a replacement itself)."""
    nodes: list[Node] = []
    for node in graph.nodes:
        small = node.name == "dot_general" and is_small_vector_product(node)
        nodes.extend(strength_reduce(node) if small else [node])
    return Graph(graph.inputs, graph.outputs, tuple(nodes), graph.consts)


def is_small_vector_product(node: Node) -> bool:
    a, b = node.inputs
    out = node.outputs[0]
    if not all(dtypes.is_float(v.dtype) for v in (a, b, out)):
        return False
    batch, m, n, k = dot_sizes(node)
    return min(m, n) == 1 and batch * m * n * k <= MAX_MACS


def strength_reduce(node: Node) -> list[Node]:
    """The dot as a broadcast multiply and a sum over the contracted axes, in float32 for
    half outputs (else the output's dtype), reshaped to the dot's output."""
    out = node.outputs[0]
    lc, rc, lb, rb, lf, rf = dot_dims(node)
    batch = tuple(node.inputs[0].shape[i] for i in lb)
    _, m, n, k = dot_sizes(node)
    acc = jnp.promote_types(out.dtype, jnp.float32)  # halves accumulate in float32, as XLA's

    def reduced(x, y):
        x = lax.transpose(x, lb + lf + lc).reshape(batch + (m, 1, k)).astype(acc)
        y = lax.transpose(y, rb + rf + rc).reshape(batch + (1, n, k)).astype(acc)
        return jnp.sum(x * y, axis=-1).reshape(out.shape).astype(out.dtype)

    return replace_with(node, reduced, key=("small_vector_product", node.params["dimension_numbers"]))

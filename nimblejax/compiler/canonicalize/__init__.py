"""Canonicalization: the stage between tracing and fusion. It rewrites nodes into the
forms lowering expects:

- convolutions → im2col + GEMM, a cuDNN call, or kept for the direct kernel (conv.py:
  the one place a convolution's path is decided);
- long reductions with few outputs → two reductions (split.py);
- split → one slice per output (slices.py);
- stack, unstack, tile → reshapes, slices, broadcasts and a concatenate (stacking.py);
- independent dots sharing an operand → one dot and free slices of its result
  (merge_dots.py), once the rewrites above have made their dots and slices;
- dot_general → operands transposed into a GEMM-ready layout (dot.py), last, so that
  merged dots get their layout too and merge_dots sees the dots as the user wrote them.

(Random-number primitives and PRNG key arrays are expanded earlier, while tracing:
compiler/prng.py.)

Every rewrite emits ordinary JAX primitives (or ours with JAX reference semantics), so
the CPU interpreter runs a canonicalized graph like any other. Values a rewrite makes
that nothing reads (the unused outputs of an unstack or a split) are dropped at the end.
"""
from __future__ import annotations

from nimblejax.compiler.canonicalize.conv import rewrite_conv
from nimblejax.compiler.canonicalize.dot import canonicalize_dot
from nimblejax.compiler.canonicalize.merge_dots import merge_dots
from nimblejax.compiler.canonicalize.slices import rewrite_split
from nimblejax.compiler.canonicalize.split import split_reduction
from nimblejax.compiler.canonicalize.stacking import REWRITES as STACKING, rewrite_stacking
from nimblejax.compiler.ir import Graph, Node
from nimblejax.options import Options


# Primitives this stage replaces entirely (they need no lowering rule).
REWRITTEN = frozenset({"split"}) | STACKING


def canonicalize(graph: Graph, options: Options) -> Graph:
    nodes: list[Node] = []
    for node in graph.nodes:
        if node.name == "conv_general_dilated":
            parts = rewrite_conv(node, options)
        elif node.name.startswith("reduce_"):
            parts = split_reduction(node)
        elif node.name == "split":
            parts = rewrite_split(node)
        elif node.name in STACKING:
            parts = rewrite_stacking(node)
        else:
            parts = [node]
        nodes.extend(parts)
    merged = merge_dots(Graph(graph.inputs, graph.outputs, tuple(nodes), graph.consts))
    nodes = [part for node in merged.nodes
             for part in (canonicalize_dot(node) if node.name == "dot_general" else [node])]
    from nimblejax.compiler.trace import drop_dead_code

    return drop_dead_code(Graph(graph.inputs, graph.outputs, tuple(nodes), merged.consts))

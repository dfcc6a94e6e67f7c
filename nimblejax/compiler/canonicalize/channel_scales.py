"""A per-channel scale after a GEMM or a cuDNN convolution folded into its weights, so
that the library call's epilogue computes the rest: an inference batch norm after a convolution, `conv(x, w) * scale +
shift`, then relu and a residual add, becomes `conv(x, w * scale)` with the shift, the
residual and the relu in the GEMM's epilogue (compiler/epilogue.py), and no kernel reads
and writes the convolution's whole output again.

    dot_general(x, w) → views → × v (v: n values along the last axis, n = the GEMM's
    columns)   becomes   dot_general(x, w × broadcast(v along w's column axis)) → views

and the same for `nimble_cudnn_conv(x, w)` (NHWC × KRSC: v along w's first axis, K),
whose epilogue is cuDNN's fused bias, residual and relu.

The scale is exact in real arithmetic (each column of the product is the same dot with
that column of w scaled); in float32 it rounds w × v once instead of the product × v,
which differs by about an ulp of each, far below the TF32 rounding the GEMM applies to
its operands anyway. Half types are left alone: there w × v rounds each weight to 8 or
11 bits, an error the unfused program does not make (a bfloat16 test differed from
jax.jit by 0.023 where the output was 0.13).

A fold is kept only where it pays (measured on ResNet-50 at batch 32: the batch norms
after its 1×1 convolutions were a third of its GPU time):
- the dot is a float32 library GEMM (cuBLASLt: an epilogue takes a bias, a residual and
  relu), and not the tensor-core kernel, whose epilogue computes any elementwise reader,
  scale included (compiler/fusion_gemm_post.py); or a float32 cuDNN convolution of one
  group;
- w has at most as many elements as the product: the fold reads and writes w (off the
  critical path: it depends on the parameters only), where the kernel it saves reads
  and writes the product;
- after the fold the GEMM's epilogue takes the shift as its bias, and every elementwise
  reader of what the epilogue writes is itself taken by another GEMM's epilogue (as a
  residual): so the whole elementwise chain after the GEMM is gone, not split into an
  epilogue and a kernel for what is left (a clipped relu6 or a swish, which cuBLASLt
  cannot compute, keeps its scale where it was).
"""
from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Optional

import jax
import numpy as np
from jax import lax

from nimblejax.compiler.canonicalize.dot import dot_sizes
from nimblejax.compiler.ir import Graph, Node, Var
from nimblejax.compiler.jaxprs import open_jaxpr
from nimblejax.options import Options

MAX_WEIGHT_RATIO = 1.0  # fold when w has at most this many elements per product element


@dataclass(frozen=True, eq=False)
class Fold:
    dot: Node
    scale: Node  # the multiply by the per-channel vector
    product: Var  # what it multiplies: the dot's result, or a view of it
    vector: Var  # its n values, in row-major order, of any shape
    axis: int  # the column axis of the dot's rhs (its one free axis)


def fold_channel_scales(graph: Graph, options: Options) -> Graph:
    """`graph` with each per-channel scale that pays (module docstring) folded into its
    GEMM's weights."""
    if options.gemm == "cublas":  # plain cuBLAS has no epilogues to take the rest
        return graph
    consumers = graph.consumers()
    producer = {v: n for n in graph.nodes for v in n.outputs}
    folds = [f for n in graph.nodes if (f := _candidate(n, graph, consumers, producer, options))]
    # Whether a fold pays depends on the others (a residual add another GEMM's epilogue
    # takes): drop those that do not until every fold left pays.
    while folds:
        trial, dots = _apply(graph, folds)
        consumers, found = _epilogues(trial, options)
        kept = [f for f in folds if _pays(dots[f], consumers, found)]
        if len(kept) == len(folds):
            return trial
        folds = kept
    return graph


def _candidate(node: Node, graph: Graph, consumers, producer, options: Options) -> Optional[Fold]:
    from nimblejax.compiler.epilogue import VIEWS, row_vector

    if node.name == "dot_general" and _library_gemm(node, options):
        n, axis = dot_sizes(node)[2], _column_axis(node)
    elif _cudnn_conv(node):  # y (N, P, Q, K) from w (K, R, S, C)
        n, axis = node.outputs[0].shape[-1], 0
    else:
        return None
    cur = node.outputs[0]
    if axis is None or cur.shape[-1] != n or node.inputs[1].size > MAX_WEIGHT_RATIO * cur.size:
        return None
    while True:
        users = consumers.get(cur, [])
        if cur in graph.outputs or len(users) != 1 or sum(a is cur for a in users[0].inputs) != 1:
            return None
        user = users[0]
        if user.name in VIEWS and user.params.get("dimensions") is None:
            cur = user.outputs[0]
            continue
        out = user.outputs[0]
        if user.name != "mul" or len(user.inputs) != 2 or out.shape != cur.shape or out.dtype != cur.dtype:
            return None
        other = user.inputs[1] if user.inputs[0] is cur else user.inputs[0]
        vector = row_vector(other, cur, n, producer) if other.dtype == cur.dtype else None
        return Fold(node, user, cur, vector, axis) if vector is not None else None


def _cudnn_conv(node: Node) -> bool:
    """A cuDNN convolution whose fused call takes a bias and relu (compiler/epilogue.py)."""
    from nimblejax.compiler.epilogue import takes_conv_epilogue

    return takes_conv_epilogue(node) and node.inputs[1] is not node.inputs[0]


def _library_gemm(node: Node, options: Options) -> bool:
    """A cuBLASLt GEMM (not the small-M or the tensor-core kernel: lowering/gemm.py)."""
    from nimblejax.compiler.lowering.gemm import is_library_gemm, library_gemm
    from nimblejax.compiler.lowering.gemm_tc import takes_tc

    if not is_library_gemm(node, options.small_gemm):
        return False
    if any(np.dtype(a.dtype) != np.float32 for a in (*node.inputs, *node.outputs)):
        return False
    return not (options.tc_gemm and takes_tc(library_gemm(node)))


def _column_axis(dot: Node) -> Optional[int]:
    """The rhs axis that makes the product's last axis: its one free axis."""
    (_, rc), (_, rb) = dot.params["dimension_numbers"]
    lhs, rhs = dot.inputs
    if not isinstance(rhs, Var) or rhs is lhs:
        return None
    free = [a for a in range(rhs.ndim) if a not in tuple(rc) and a not in tuple(rb)]
    return free[0] if len(free) == 1 else None


def _pays(dot: Node, consumers, found) -> bool:
    """After the fold, the dot's epilogue takes a bias, and every elementwise reader of
    what it writes (through views) is taken by another GEMM's epilogue (`found`: every
    epilogue of the folded graph)."""
    from nimblejax.compiler.epilogue import VIEWS
    from nimblejax.compiler.kinds import RuleKind
    from nimblejax.compiler.lowering.registry import rule_for

    match = found.get(dot)
    if match is None or match.bias is None:
        return False
    claimed = {n for m in found.values() for n in m.chain}
    frontier = [match.output]
    while frontier:
        for u in consumers.get(frontier.pop(), []):
            if u.name in VIEWS:
                frontier.extend(u.outputs)
            elif rule_for(u).kind is RuleKind.ELEMENTWISE and u not in claimed:
                return False
    return True


def _epilogues(graph: Graph, options: Options) -> tuple[dict, dict]:
    """(consumers, every GEMM's and convolution's epilogue) of a graph."""
    from nimblejax.compiler.epilogue import find_epilogues

    consumers = graph.consumers()
    outputs = [v for v in graph.outputs if isinstance(v, Var)]
    return consumers, find_epilogues(graph, consumers, outputs, options.small_gemm)


def _apply(graph: Graph, folds: list[Fold]) -> tuple[Graph, dict[Fold, Node]]:
    """The graph with each fold made, and each fold's new dot."""
    from nimblejax.compiler.canonicalize.merge_rewrite import topological

    by_dot = {f.dot: f for f in folds}
    dropped = {f.scale for f in folds}
    subst = {f.scale.outputs[0]: f.product for f in folds}
    new_dots: dict[Fold, Node] = {}
    nodes: list[Node] = []
    for node in graph.nodes:
        if node in dropped:
            continue
        if node in by_dot:
            f = by_dot[node]
            made = _scaled_weight(node.inputs[1], f.vector, f.axis, node.source)
            nodes += made
            node = Node(node.primitive, (node.inputs[0], made[-1].outputs[0]), node.outputs,
                        node.params, node.source, node.effectful)
            new_dots[f] = node
        elif any(a in subst for a in node.inputs if isinstance(a, Var)):
            node = Node(node.primitive, tuple(subst.get(a, a) if isinstance(a, Var) else a for a in node.inputs),
                        node.outputs, node.params, node.source, node.effectful)
        nodes.append(node)
    outputs = tuple(subst.get(a, a) if isinstance(a, Var) else a for a in graph.outputs)
    return Graph(graph.inputs, outputs, topological(nodes), graph.consts, graph.control), new_dots


def _scaled_weight(w: Var, vector: Var, axis: int, source: str) -> list[Node]:
    """Nodes computing w × (vector along `axis`), traced with this JAX's lax."""
    from nimblejax.compiler.trace import GraphBuilder

    jaxpr, consts = open_jaxpr(_scale_jaxpr(tuple(w.shape), np.dtype(w.dtype), tuple(vector.shape), axis))
    assert not consts
    part = GraphBuilder()
    (out,) = part.inline(jaxpr, [w, vector], source)
    assert part.nodes and part.nodes[-1].outputs[0] is out
    return part.nodes


@functools.lru_cache(maxsize=1024)
def _scale_jaxpr(w_shape: tuple, dtype: np.dtype, v_shape: tuple, axis: int):
    def fn(w, v):
        return w * lax.broadcast_in_dim(v.reshape(-1), w_shape, (axis,))

    return jax.make_jaxpr(fn)(jax.ShapeDtypeStruct(w_shape, dtype), jax.ShapeDtypeStruct(v_shape, dtype))

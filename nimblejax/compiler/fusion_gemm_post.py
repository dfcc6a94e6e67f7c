"""A GEMM and the elementwise kernel after it as one kernel: the TF32 tensor-core GEMM
(lowering/gemm_tc.py) computes any elementwise group that reads its result, at the
same element, from its accumulators, where cuBLASLt's epilogues take only a scale, a
bias, a residual and relu or GELU (compiler/epilogue.py).

An MLP's training step at batch 32 is a chain of small GEMMs with elementwise work
between them: `tanh(x @ w)`, the loss gradient `(h @ v - y) * 2 / n`, the tanh backward
`(d @ vᵀ) * (1 - h²)`. Each of those was a kernel of its own on the step's critical path
(an SGD step of two layers: 7 tasks in a row); as the GEMM's epilogue it costs no launch.

A GEMM group takes the group after it (`post`) when
- the GEMM is the tensor-core kernel's (`takes_tc` on its call, epilogue included:
  Options.tc_gemm, batch 1, the rule's shapes) and writes a contiguous row-major C of
  its result's shape (M, N), leading axes of size 1 aside;
- its result is read by that one group only and is not a graph output;
- that group is elementwise (FUSED, one output, nothing else written) over the GEMM
  result's shape, float32, and reads the result only at the element it writes (no
  broadcast, transpose, slice or reshape of it).
The merged group writes the post group's output; the GEMM's result is never written.
Its other operands are read as the fused kernel read them (buffers written earlier,
literals, their own inlined producers), and the merged group stands where the post group
stood, after everything it reads.
"""
from __future__ import annotations

import dataclasses
from typing import Callable, Optional

from nimblejax.compiler import dtypes
from nimblejax.compiler.fusion import Group
from nimblejax.compiler.ir import Graph, Var
from nimblejax.compiler.kinds import GroupKind, RuleKind
from nimblejax.compiler.lowering import gemm_of
from nimblejax.compiler.lowering.codegen import INDEX_ONLY
from nimblejax.compiler.lowering.gemm_tc import takes_tc
from nimblejax.compiler.lowering.registry import rule_for
from nimblejax.compiler.lowering.task import GemmCall


def fuse_gemm_posts(groups: list[Group], graph: Graph, small_gemm: bool = True) -> list[Group]:
    """`groups` with each qualifying (GEMM group, elementwise reader) pair as one group."""
    return merge_posts(groups, graph, lambda g: g.kind is GroupKind.GEMM and tc_group(g, small_gemm))


FLOAT32 = frozenset({"float32"})  # the post dtypes of the tensor-core kernel


def merge_posts(groups: list[Group], graph: Graph, takes_post: Callable[[Group], bool],
                reshaped: bool = False, dtypes_ok: frozenset = FLOAT32) -> list[Group]:
    """`groups` with each group that `takes_post` merged with its elementwise reader, where
    that reader qualifies (module docstring; its output of a dtype in `dtypes_ok`); also
    fusion_conv_post.py's, whose reader may end in a reshape of the result's shape
    (`reshaped`)."""
    readers: dict[Var, list[int]] = {}
    for i, g in enumerate(groups):
        for v in set(g.inputs):
            readers.setdefault(v, []).append(i)
    results = {v for v in graph.outputs if isinstance(v, Var)}
    merged: dict[int, Group] = {}  # index of the post group → the merged group
    dropped: set[int] = set()
    for i, g in enumerate(groups):
        j = _post_of(g, readers, groups, results, reshaped, dtypes_ok) if takes_post(g) else None
        if j is not None and j not in merged:  # a group reading two GEMMs takes the first
            merged[j] = _merge(g, groups[j])
            dropped.add(i)
    return [merged.get(i, g) for i, g in enumerate(groups) if i not in dropped]


def _post_of(g: Group, readers, groups, results, reshaped: bool, dtypes_ok: frozenset) -> Optional[int]:
    out = g.output
    if out in results or len(readers.get(out, ())) != 1:
        return None
    j = readers[out][0]
    e = groups[j]
    shape = e.output.shape
    if reshaped and e.root.name == "reshape" and e.root.params.get("dimensions") is None:
        shape = e.root.inputs[0].shape
    if (e.kind is not GroupKind.FUSED or e.extra_outputs or len(e.outputs) != 1
            or shape != out.shape or dtypes.name(e.output.dtype) not in dtypes_ok):
        return None
    if not all(_reads_at_its_element(n, out) for n in e.nodes if out in n.inputs):
        return None
    return j


def _reads_at_its_element(node, value: Var) -> bool:
    """Whether `node` reads `value` at the index it computes: an elementwise op that
    moves no index, whose output has `value`'s shape (so `value` is not broadcast)."""
    if node.name in INDEX_ONLY or node.name == "gather" or rule_for(node).kind is not RuleKind.ELEMENTWISE:
        return False
    return node.outputs[0].shape == value.shape


def tc_group(g: Group, small_gemm: bool) -> bool:
    """Whether lowering makes this GEMM group the tensor-core kernel (lower_group's test,
    on the call it builds), writing its (M, N) result contiguously."""
    return tc_call(g, small_gemm) is not None


def tc_call(g: Group, small_gemm: bool) -> Optional[GemmCall]:
    """The call of tc_group's GEMM, or None where it is not the tensor-core kernel's."""
    made = gemm_of(g, small_gemm)
    if not isinstance(made, GemmCall):
        return None
    ldc, _ = made.layout("c")
    ok = (takes_tc(made) and made.batch == 1 and ldc == made.n and made.c is g.output
          and matrix_shape(g.output.shape) == (made.m, made.n))
    return made if ok else None


def matrix_shape(shape) -> tuple:
    """`shape` without leading axes of size 1 (the post group's index is (0.., row, col))."""
    shape = tuple(shape)
    while len(shape) > 2 and shape[0] == 1:
        shape = shape[1:]
    return shape


def _merge(g: Group, e: Group) -> Group:
    inputs = tuple(dict.fromkeys(v for v in g.inputs + e.inputs if v is not g.output))
    return dataclasses.replace(g, nodes=g.nodes + e.nodes, inputs=inputs, post=e)

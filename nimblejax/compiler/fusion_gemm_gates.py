"""A GEMM and the cell that reads its result through gate slices as one kernel: an LSTM
step's `z = xproj_t + h @ w_hh + b`, its gates `i, f, g, o = z[:, k·H:(k+1)·H]`,
`c = σ(f)·c + σ(i)·tanh(g)` and `h = σ(o)·tanh(c)` in the TF32 tensor-core GEMM kernel
(lowering/gemm_gates.py), where they were two kernels on the recurrence's critical path
(32 x 2048 x 512 at batch 32: the GEMM, then a 5.6 µs cell kernel). fusion_gemm_post.py
takes a reader at the GEMM's own element only; this one reads G columns apart.
Measured on an H100 (examples/gpu/profile_models.py --models lstm, GPU time of the graph,
against 2ab0d95, the commit before it): batch 32 263 → 213 µs, batch 16 248 → 198;
a step's kernel alone 9.1 µs against 7.9 + 5.5 (with the cell's loads issued after the
product rather than before it: 11.0 µs alone, and 268 µs at batch 32).

A GEMM group g takes the groups that read its result z (`post`: the first of them,
which becomes the one reader) when
- g is the tensor-core kernel's, writing a contiguous row-major (M, N) result z
  (fusion_gemm_post.tc_group), or the small-M kernel's in float32 (lowering/gemm_small.py:
  an LSTM at batch 1 to 8, whose step was a 2.2 µs GEMM and a 2.8 µs cell kernel on an
  H100), not a graph output, and not merged already;
- every group reading z is elementwise (FUSED), and each later one either reads back
  what it shares with post or is absorbed by post (below), so that z has one reader;
- post's outputs are float32 of shape (M, H), with N = G·H, G ≥ 2, and post reads z only
  so (`gate_width`): nodes of z's shape that read it, and what they make, at their own
  element (same-index, fusion_rows.SAME_INDEX, of z's shape: no broadcast); slices of
  those of all rows and exactly the columns [k·H, (k+1)·H); and same-index nodes of
  (M, H) after them. So z is read at (row, k·H + unit) for an output element (row,
  unit), and every value of (M, H) that depends on z is computed at that element;
- the kernel's tile splits into whole runs of U = BN / G units that divide H (a block
  holds the same units of every gate: gemm_gates.units).
The merged group writes post's outputs and stands where post stood (after everything it
reads); the readers that read values back came after post, so they still come after it.

Read back: fusion recomputes an LSTM's cell state c_t in the next step's kernel on
alternate steps (fusion._compounds), so that kernel reads z_t too. In a later reader q,
the nodes that depend on z and are post's own too (the same Node objects) must include
every node of q reading z and none of q's outputs, and the values q reads from them (the
frontier: c_t) must have post's output shape. q then keeps only the nodes its outputs
still need once the frontier is read from buffers, and post writes the frontier too.
Absorbed: otherwise a later reader q none of whose inputs is written after post's place
(the last step's h beside a returned c: c's group, then h's reading c and z) is computed
by post, which writes q's outputs too (the nodes of both, in the graph's order).
Refused where post would write more than fusion.MAX_FUSED_OUTPUTS values besides its
root's; nothing changes where the gate check then fails.
"""
from __future__ import annotations

import dataclasses
from typing import Optional

from nimblejax.compiler import dtypes
from nimblejax.compiler.fusion import MAX_FUSED_OUTPUTS, Group
from nimblejax.compiler.fusion_gemm_post import matrix_shape, tc_call
from nimblejax.compiler.fusion_rows import SAME_INDEX
from nimblejax.compiler.ir import Graph, Node, Var
from nimblejax.compiler.kinds import GroupKind
from nimblejax.compiler.lowering.gemm import gemm_sizes, is_small_m_gemm
from nimblejax.compiler.lowering.gemm_gates import units
from nimblejax.compiler.lowering.gemm_small import small_tile
from nimblejax.compiler.lowering.gemm_tc import choose_tile


def fuse_gemm_gates(groups: list[Group], graph: Graph, small_gemm: bool = True) -> list[Group]:
    """`groups` with each qualifying GEMM group and its gate-sliced readers as one group."""
    groups: list[Optional[Group]] = list(groups)
    results = {v for v in graph.outputs if isinstance(v, Var)}
    order = {n: k for k, n in enumerate(graph.nodes)}
    for i, g in enumerate(groups):
        if g is None or g.kind is not GroupKind.GEMM or g.post is not None or g.output in results:
            continue
        out = g.output  # (a property: computed once here, not once a group)
        readers = [j for j, e in enumerate(groups) if e is not None and out in e.inputs]
        tile = gate_tile(g, small_gemm) if readers else None
        if tile is None:
            continue
        made = _one_reader(g.output, readers, groups, order)
        if made is None:
            continue
        post, changed = made
        width = gate_width(post, g.output)
        if width is None or units(tile, g.output.shape[-1] // width, width) is None:
            continue
        groups[i], groups[readers[0]] = None, _merge(g, post, g.output.shape[-1] // width)
        for j, e in changed.items():
            groups[j] = e
    return [g for g in groups if g is not None]


def gate_tile(g: Group, small_gemm: bool):
    """The tile whose columns a gate post splits (gemm_gates.units): the tensor-core
    kernel's, or the small-M kernel's block (float32, C (M, N) contiguous); None for the
    GEMMs that take no post group."""
    call = tc_call(g, small_gemm)
    if call is not None:
        return choose_tile(call)
    if not (small_gemm and is_small_m_gemm(g.root)) or dtypes.name(g.output.dtype) != "float32":
        return None
    if any(dtypes.name(v.dtype) != "float32" for v in g.root.inputs):
        return None
    _, m, n, _ = gemm_sizes(g.root)
    return small_tile(m, n) if matrix_shape(g.output.shape) == (m, n) else None


def _one_reader(z: Var, readers: list[int], groups: list, order) -> Optional[tuple[Group, dict]]:
    """The first reader of z, computing what the others compute from z: each later one
    reads those values back, or is absorbed; and the later ones changed (None: absorbed)."""
    if any(groups[j].kind is not GroupKind.FUSED for j in readers):
        return None
    first = readers[0]
    post, changed, frontier = groups[first], {}, []
    later = {v for e in groups[first + 1:] if e is not None for v in e.outputs}
    for j in readers[1:]:
        e = groups[j]
        made = _read_back(post, e, z)
        if made is not None:
            needed, changed[j] = made
            frontier += [v for v in needed if v not in frontier and v not in post.outputs]
        elif not (set(e.inputs) & later):
            post, changed[j] = _absorb(post, e, order), None
        else:
            return None
    if len(post.extra_outputs) + len(frontier) > MAX_FUSED_OUTPUTS:
        return None
    return dataclasses.replace(post, extra_outputs=post.extra_outputs + tuple(frontier)), changed


def _read_back(post: Group, e: Group, z: Var) -> Optional[tuple[list[Var], Group]]:
    """The values e reads from nodes that depend on z and that post computes too, and e
    reading them as buffers; None where e has another node that reads z, would lose an
    output, or would read a value not of post's output shape (a sum of z's columns:
    post writes (M, H) values only)."""
    common = _depending(e.nodes, z) & set(post.nodes)
    values = {v for n in common for v in n.outputs}
    if any(z in n.inputs and n not in common for n in e.nodes) or values & set(e.outputs):
        return None
    needed = list(dict.fromkeys(v for n in e.nodes if n not in common for v in n.inputs
                                if isinstance(v, Var) and v in values))
    if any(v.shape != post.output.shape for v in needed):
        return None
    return needed, _without(e, set(needed))


def _absorb(post: Group, e: Group, order) -> Group:
    """post also computing e (whose inputs are all written before post) and writing its
    outputs: their nodes in the graph's order."""
    nodes = tuple(sorted(set(post.nodes) | set(e.nodes), key=order.__getitem__))
    return _with_nodes(post, nodes, post.extra_outputs + e.outputs)


def _depending(nodes, z: Var) -> set[Node]:
    """The nodes of `nodes` (in topological order) whose value depends on z."""
    found: set[Node] = set()
    made = {z}
    for n in nodes:
        if any(isinstance(a, Var) and a in made for a in n.inputs):
            found.add(n)
            made.update(n.outputs)
    return found


def _without(e: Group, buffers: set[Var]) -> Group:
    """`e` reading `buffers` rather than computing them: the nodes its outputs need."""
    producer = {v: n for n in e.nodes for v in n.outputs}
    keep: set[Node] = set()
    todo = list(e.outputs)
    while todo:
        n = producer.get(todo.pop())
        if n is not None and n not in keep and not (set(n.outputs) & buffers):
            keep.add(n)
            todo += [a for a in n.inputs if isinstance(a, Var)]
    return _with_nodes(e, tuple(n for n in e.nodes if n in keep), e.extra_outputs)


def _with_nodes(e: Group, nodes: tuple, extra_outputs: tuple) -> Group:
    """`e` computing `nodes` and writing `extra_outputs` besides its root's, reading what
    they read and do not make (fusion._make_group's order)."""
    made = {v for n in nodes for v in n.outputs}
    inputs = tuple(dict.fromkeys(a for n in nodes for a in n.inputs if isinstance(a, Var) and a not in made))
    return dataclasses.replace(e, nodes=nodes, inputs=inputs, extra_outputs=extra_outputs)


def gate_width(post: Group, z: Var) -> Optional[int]:
    """H, where `post` reads z (M, G·H) only through G slices of H columns and computes
    values of shape (M, H) from them at their own element (module docstring), or None."""
    if z.ndim != 2 or post.output.ndim != 2 or post.members or post.siblings:
        return None
    m, n = z.shape
    width = post.output.shape[-1]
    if (width >= n or n % width or any(tuple(v.shape) != (m, width) or dtypes.name(v.dtype) != "float32"
                                       for v in post.outputs)):
        return None
    wide, narrow = {z}, set()
    for node in post.nodes:
        read = [a for a in node.inputs if isinstance(a, Var) and (a in wide or a in narrow)]
        if not read:
            continue
        out = node.outputs[0]
        if node.name == "slice" and node.inputs[0] in wide and _gate_slice(node, m, width):
            narrow.add(out)
        elif _same_index(node, read, wide, (m, n)):
            wide.add(out)
        elif _same_index(node, read, narrow, (m, width)):
            narrow.add(out)
        else:
            return None
    return width if narrow else None


def _gate_slice(node: Node, m: int, width: int) -> bool:
    """A slice of a (M, G·H) value: all rows, the columns of one gate."""
    start, limit = tuple(node.params["start_indices"]), tuple(node.params["limit_indices"])
    strides = node.params.get("strides") or (1, 1)
    return (node.inputs[0].ndim == 2 and tuple(strides) == (1, 1) and start[0] == 0 and limit[0] == m
            and start[1] % width == 0 and limit[1] - start[1] == width)


def _same_index(node: Node, read: list[Var], values: set[Var], shape: tuple) -> bool:
    """A same-index node of `shape` whose operands among z's values are `values` of it."""
    return (node.name in SAME_INDEX and len(node.outputs) == 1 and tuple(node.outputs[0].shape) == shape
            and all(a in values and tuple(a.shape) == shape for a in read))


def _merge(g: Group, post: Group, gates: int) -> Group:
    inputs = tuple(dict.fromkeys(v for v in g.inputs + post.inputs if v is not g.output))
    return dataclasses.replace(g, nodes=g.nodes + post.nodes, inputs=inputs, post=post, gates=gates)

"""Merged dots (XLA's DotMerger): independent dot_generals that share an operand become
one GEMM.

Two kinds of sharing are merged:
- tiled: the dots share one operand S and their other operands are slices of one array
  X along one free axis that together tile it, each possibly reshaped to drop a one-wide
  axis (the input projections `x[:, t] @ W_ih` of an unrolled LSTM; a scan's
  per-iteration slices). The merged dot reads X itself: nothing is copied.
- concatenated: the dots share S and their other operands O_1..O_k have one shape except
  along the merge axis (Q/K/V projections `x @ Wq, x @ Wk, x @ Wv`; four gates `h @ U_g`).
  The merged dot reads concatenate(O_1..O_k). It is made once per tuple of operands and
  reused by every later merge of that tuple (the steps of an unrolled loop share it), and
  folded at plan time when the operands are all constants.

Each dot's result becomes a slice of the merged result (plus a reshape dropping the axis
of a one-wide slice). Both are elementwise, so fusion inlines them as index arithmetic
into their consumers' kernels. A dot is merged only where that happens: every consumer
of its result is elementwise, a reduction reading it as its operand, or a dot that
canonicalize_dot (which runs after this pass, on the merged graph) gives a transpose of it
keeping its innermost axis (the slice is inlined into that transpose; one that moves the
innermost axis would lose its tiled kernel, so such transposes do not count). A reshape
counts when its own consumers do (alone it is a view, with a slice it would be a copy).
Readers that are all slices (a previous merge's) count too: they become slices of the
merged result themselves.
A result feeding a GEMM directly or leaving the graph would cost a copy kernel of its
own: that dot is left alone.

Safety: members are dot_generals without batch dims whose params (precision, preferred
element type) and dtypes agree, read S on the same side with the same contracting dims,
and none depends on another (merging would make a cycle). Merges are made in rounds: a
round keeps merges with disjoint members that close no cycle together (a1 feeding b1 and
b2 feeding a2 forbid merging both {a1, a2} and {b1, b2}), then the dependences are
recomputed for the next round.

Cost, measure-free. A tiled merge is always taken: it saves k-1 launches and k-1 reads
of S and adds nothing. A concatenated one is taken when what it saves over every merge of
the same operand tuple (the steps of a loop) is at least what the concatenate costs per
call, one launch plus reading and writing the O_i. What a merge saves depends on how
large the member GEMMs are (`_saving`):
- one launch's latency on the path (the fork and join: the k dots are independent, so
  the multi-stream schedule runs them side by side anyway), unless each member fills the
  GPU alone (batch * ceil(m/128) * ceil(n/128) tiles >= GPU_SMS): a GEMM that occupies
  every SM hides the next launch behind its own run;
- k-1 reads of S, where a member is memory bound (2mnk flops per byte moved below the
  ridge, RIDGE_FLOP_PER_BYTE): a compute-bound GEMM pays for its flops, not for reading S.
Launches count as LAUNCH_BYTES of traffic. Measured on an H100 (BERT-base at batch 32,
BENCHMARKS.md 2026-11-25): each Q/K/V GEMM is 4096x768x768 (192 tiles, 176 flop/byte),
and the 12 per-call weight concatenates took 176 µs of 4772: there merging saves nothing
and the rule keeps three GEMMs. At batch 1 (128x768x768: 6 tiles, 48 flop/byte) a merge
saves a launch and two reads of x (about 5 MB) against 18 MB for concatenating the 7 MB
of weights each call: three GEMMs, side by side, again. A branchy MLP's first layers (one
x, eight 256x256 weights) stay parallel GEMMs at any batch, and an LSTM's four gate
weights merge because all of its steps share the one concatenate.

Order: a round takes the concatenated merges worth it (those over a concatenate made
already first), or, when there is none, the tiled ones; an operand that is a tile (a
slice of one array along one axis) is never concatenated, since a later round may
complete its tiling. In flax's LSTMCell (four dots on x_t and four on h each step) the
four input gates of each step merge over concatenate(W_i, W_f, W_g, W_o), made once,
then the steps' merged dots over x's tiles: one GEMM for every input projection.
"""
from __future__ import annotations

from collections import Counter
from typing import Callable, Optional

import numpy as np

from nimblejax.compiler.canonicalize.dot import dot_dims, operand_transposes
from nimblejax.compiler.canonicalize.merge_rewrite import (Member, Merge, apply_merge,
                                                           free_axes, operands, plain_slice)
from nimblejax.compiler.ir import Graph, Literal, Node, Var

# A kernel launch, counted as memory traffic: on the H100 a launch inside a CUDA graph and
# the ramp of a small kernel cost about 1.3 µs, the time to move 4 MiB at ~3.3 TB/s.
LAUNCH_BYTES = 4 << 20
# A GEMM tile (cuBLASLt's usual 128x128 output tile) and the SMs of an H100 (and H200):
# a GEMM with at least one tile per SM keeps the whole GPU busy.
GEMM_TILE = 128
GPU_SMS = 132
# H100 SXM: about 495 TFLOP/s dense TF32 (JAX's float32 default) over 3.35 TB/s of HBM3.
# A GEMM doing fewer flops per byte it moves is bound by memory.
RIDGE_FLOP_PER_BYTE = 148
# As fusion.MAX_DUPLICATION: a value with more consumers may be written, not inlined.
MAX_CONSUMERS = 4
# As fusion.VIEW_PRIMS: alone (and without `dimensions`), views of a buffer, not kernels.
VIEW_PRIMS = frozenset({"reshape", "squeeze"})


def merge_dots(graph: Graph) -> Graph:
    """The graph with every profitable merge made, a round at a time until none is left."""
    concats: dict[tuple, Var] = {}  # (operands, axis) → their concatenate, made once
    while merges := find_merges(graph, concats):
        for merge in merges:
            graph = apply_merge(graph, merge, concats)
    return graph


# ---- finding merges -------------------------------------------------------------------


def find_merges(graph: Graph, concats: dict) -> list[Merge]:
    """One round: the concatenated merges worth their concatenate, or else the tiled
    ones, in order, each kept if it shares no dot with those kept before and they make
    no cycle together (so they can be made one after another in any order)."""
    deps = _dot_ancestors(graph)
    bit = {d: 1 << i for i, d in enumerate(n for n in graph.nodes if n.name == "dot_general")}
    kept: list[Merge] = []
    groups: list[tuple[int, int]] = []  # per kept merge: its dots, the dots they depend on
    for merge in _candidates(graph, concats, deps, bit):
        mask, above = 0, 0
        for m in merge.members:
            mask |= bit[m.dot]
            above |= deps[m.dot]
        if all(mask & g == 0 for g, _ in groups) and _acyclic(groups + [(mask, above)]):
            kept.append(merge)
            groups.append((mask, above))
    return kept


def _acyclic(groups: list[tuple[int, int]]) -> bool:
    """Whether merging each group into one node leaves the dots' dependences acyclic:
    group j follows group i when a dot of j depends on one of i (the dependences are
    transitive, so paths through other nodes are edges here too)."""
    after = [[j for j, (_, above) in enumerate(groups) if above & mask and j != i]
             for i, (mask, _) in enumerate(groups)]
    state = [0] * len(groups)  # 0 unseen, 1 on the path, 2 done
    for root in range(len(groups)):
        stack = [(root, iter(after[root]))] if state[root] == 0 else []
        if stack:
            state[root] = 1
        while stack:
            i, nxt = stack[-1]
            j = next(nxt, None)
            if j is None:
                state[i] = 2
                stack.pop()
            elif state[j] == 1:
                return False
            elif state[j] == 0:
                state[j] = 1
                stack.append((j, iter(after[j])))
    return True


def _candidates(graph: Graph, concats: dict, deps, bit) -> list[Merge]:
    """Concatenated merges worth their concatenate (those over one made already first),
    or, when there is none, the tiled merges."""
    producer = {v: n for n in graph.nodes for v in n.outputs}
    consumers = graph.consumers()
    outputs = {a for a in graph.outputs if isinstance(a, Var)}
    dots = [n for n in graph.nodes if n.name == "dot_general"
            and _mergeable(n) and _free_result(n, consumers, outputs)]
    if len(dots) < 2:
        return []
    tiled: dict[tuple, list[Member]] = {}
    for d in dots:
        for side in (0, 1):
            m = _tiled_member(d, side, producer)
            if m is not None:
                key = _base_key(d, side) + (m.source, m.axis, m.contracting)
                tiled.setdefault(key, []).append(m)
    tilings = [Merge(key[1], tuple(ms), concatenated=False) for key, ms in tiled.items()
               if len(ms) > 1 and _tiles(ms) and len(_independent_sets(ms, deps, bit)) == 1]
    # A tile is never concatenated: reading the whole array beats copying its tiles, and
    # a tiling left incomplete now may be completed by later merges.
    tile_sides = {(m.dot, side) for key, ms in tiled.items() for m in ms for side in [key[1]]}
    stacked: dict[tuple, list[Member]] = {}
    for d in dots:
        for side in (0, 1):
            m = _concat_member(d, side)
            if m is not None and (d, side) not in tile_sides:
                shape = tuple(s for a, s in enumerate(m.source.shape) if a != m.axis)
                key = _base_key(d, side) + (shape, m.axis, m.contracting)
                stacked.setdefault(key, []).append(m)
    candidates = [(key[1], tuple(s)) for key, ms in stacked.items()
                  for s in _independent_sets(ms, deps, bit) if len(s) > 1]
    # Merges over a concatenate made already go first: the steps of a loop all merge
    # before their merged dots are looked at together.
    candidates.sort(key=lambda c: operands(c[1]) not in concats)
    sites = Counter(operands(ms) for _, ms in candidates)
    worth = [Merge(side, ms, concatenated=True) for side, ms in candidates
             if _worth_concatenating(side, ms, sites[operands(ms)], concats, graph.consts)]
    return worth or tilings


def _mergeable(dot: Node) -> bool:
    (_, _), (lb, rb) = dot.params["dimension_numbers"]
    lhs, rhs = dot.inputs
    return (not lb and not rb and isinstance(lhs, Var) and isinstance(rhs, Var)
            and lhs is not rhs)


def _free_result(dot: Node, consumers, outputs) -> bool:
    """Whether merging copies nothing for this dot's result: every reader is a slice
    (each then slices the merged result itself: `_compose`), or a slice of the merged
    result would be inlined into every reader (see the module docstring)."""
    y = dot.outputs[0]
    users = consumers.get(y, [])
    if y not in outputs and users and all(plain_slice(u) for u in users):
        return True
    return _inlined_everywhere(y, consumers, outputs)


def _inlined_everywhere(y: Var, consumers, outputs) -> bool:
    from nimblejax.compiler.kinds import RuleKind
    from nimblejax.compiler.lowering.registry import rule_for

    users = consumers.get(y, [])
    if y in outputs or not users or len(users) > MAX_CONSUMERS:
        return False
    for u in users:
        kind = rule_for(u).kind
        if u.name in VIEW_PRIMS and u.params.get("dimensions") is None:
            # A view of y now, a copy of the slice then, unless it is inlined further.
            if not _inlined_everywhere(u.outputs[0], consumers, outputs):
                return False
            continue
        if u.name == "transpose" and _moves_innermost(tuple(u.params["permutation"])):
            return False  # it would lose its tiled kernel (lowering/transpose.py)
        if kind is RuleKind.ELEMENTWISE:
            continue
        if kind is RuleKind.REDUCTION and all(a is not y for a in u.inputs[1:]):
            continue
        if u.name == "dot_general" and _transposed_in_place(u, y):
            continue
        return False
    return True


def _transposed_in_place(dot: Node, y: Var) -> bool:
    """canonicalize_dot will transpose every operand of `dot` that is y, keeping its
    innermost axis (so the transpose is an elementwise kernel that can read a slice); an
    operand it reads in place (contiguous or strided) is read from memory."""
    for a, perm in zip(dot.inputs, operand_transposes(dot)):
        if a is y and (perm is None or _moves_innermost(perm)):
            return False
    return True


def _moves_innermost(perm: tuple[int, ...]) -> bool:
    return bool(perm) and perm[-1] != len(perm) - 1


def _base_key(dot: Node, side: int) -> tuple:
    """What members sharing operand `side` must agree on, apart from the other operand."""
    (lc, rc), _ = dot.params["dimension_numbers"]
    shared_contracting = tuple(int(d) for d in (lc, rc)[side])
    params = tuple(sorted((k, repr(v)) for k, v in dot.params.items()
                          if k != "dimension_numbers"))
    other = dot.inputs[1 - side]
    return (dot.inputs[side], side, shared_contracting, params, np.dtype(other.dtype),
            np.dtype(dot.outputs[0].dtype))


def _other_contracting(dot: Node, side: int) -> tuple[int, ...]:
    (lc, rc), _ = dot.params["dimension_numbers"]
    return tuple(int(d) for d in (lc, rc)[1 - side])


def _tiled_member(dot: Node, side: int, producer) -> Optional[Member]:
    """The dot as a member reading a slice of a larger array, if its other operand is
    one: slice(X) along one free axis, or that slice one wide with the axis dropped."""
    view = _slice_of(dot.inputs[1 - side], producer)
    if view is None:
        return None
    x, axis, start, stop, squeezed = view
    cont = tuple(c + 1 if squeezed and c >= axis else c for c in _other_contracting(dot, side))
    if axis in cont:
        return None
    return Member(dot, x, axis, start, stop, squeezed, cont)


def _slice_of(v: Var, producer) -> Optional[tuple[Var, int, int, int, bool]]:
    """(X, axis, start, stop, squeezed) when v is X sliced along one axis alone."""
    node = producer.get(v)
    squeezed = node is not None and node.name in ("squeeze", "reshape")
    if squeezed:
        if node.name == "reshape" and node.params.get("dimensions") is not None:
            return None
        node = producer.get(node.inputs[0])
    box = _static_box(node, producer)
    if box is None:
        return None
    x, starts, limits = box
    cut = [a for a in range(x.ndim) if int(starts[a]) != 0 or int(limits[a]) != x.shape[a]]
    if len(cut) != 1:
        return None
    axis = cut[0]
    start, stop = int(starts[axis]), int(limits[axis])
    if squeezed and (stop - start != 1 or tuple(v.shape) != x.shape[:axis] + x.shape[axis + 1:]):
        return None
    return x, axis, start, stop, squeezed


def _static_box(node: Optional[Node], producer) -> Optional[tuple[Var, list[int], list[int]]]:
    """(X, starts, limits) of a unit-stride slice of X, or of a dynamic_slice whose start
    indices are constants (clamped into X as XLA does)."""
    if node is None or not node.inputs or not isinstance(node.inputs[0], Var):
        return None
    x = node.inputs[0]
    if node.name == "slice":
        strides = node.params.get("strides")
        if strides is not None and any(int(s) != 1 for s in strides):
            return None
        return x, [int(a) for a in node.params["start_indices"]], \
            [int(a) for a in node.params["limit_indices"]]
    if node.name != "dynamic_slice":
        return None
    given = [_constant(a, producer) for a in node.inputs[1:]]
    if any(a is None for a in given):
        return None
    sizes = [int(a) for a in node.params["slice_sizes"]]
    starts = [min(max(a, 0), d - n) for a, d, n in zip(given, x.shape, sizes)]
    return x, starts, [a + n for a, n in zip(starts, sizes)]


# Scalar integer arithmetic that jnp's indexing wraps around a static index (negative
# index normalization: `select_n(i < 0, i, i + n)`), evaluated at plan time.
_SCALAR_OPS: dict[str, Callable] = {
    "add": lambda a, b: a + b, "sub": lambda a, b: a - b, "mul": lambda a, b: a * b,
    "lt": lambda a, b: a < b, "le": lambda a, b: a <= b, "gt": lambda a, b: a > b,
    "ge": lambda a, b: a >= b, "eq": lambda a, b: a == b, "ne": lambda a, b: a != b,
    "max": max, "min": min, "convert_element_type": lambda a: a,
    "select_n": lambda p, *cases: cases[int(p)],
    "clamp": lambda lo, a, hi: min(max(a, lo), hi),
}


def _constant(a, producer, depth: int = 8) -> Optional[int]:
    """The value of an integer scalar computed from literals alone, else None."""
    if isinstance(a, Literal):
        return int(a.value) if np.issubdtype(a.dtype, np.integer) or a.dtype == bool else None
    node = producer.get(a)
    if node is None or depth == 0 or node.name not in _SCALAR_OPS or a.shape:
        return None
    if node.name == "convert_element_type" and not np.issubdtype(a.dtype, np.integer):
        return None
    args = [_constant(b, producer, depth - 1) for b in node.inputs]
    return None if any(v is None for v in args) else int(_SCALAR_OPS[node.name](*args))


def _concat_member(dot: Node, side: int) -> Optional[Member]:
    """The dot as a member whose own operand is concatenated with the others': along
    the rows of an lhs (its first free axis), the columns of an rhs (its last). None
    when that operand has no free axis (a matrix-vector product's vector)."""
    other = dot.inputs[1 - side]
    cont = _other_contracting(dot, side)
    free = free_axes(other.ndim, cont)
    if not free:
        return None
    axis = free[-1] if side == 0 else free[0]
    return Member(dot, other, axis, 0, other.shape[axis], False, cont)


def _tiles(ms: list[Member]) -> bool:
    """The members' slices cover their source along the axis exactly once."""
    at = 0
    for m in sorted(ms, key=lambda m: m.start):
        if m.start != at:
            return False
        at = m.stop
    return at == ms[0].source.shape[ms[0].axis]


def _dot_ancestors(graph: Graph) -> dict[Node, int]:
    """dot → the set (a bit per dot, graph order) of dots it depends on."""
    index = {d: i for i, d in enumerate(n for n in graph.nodes if n.name == "dot_general")}
    above: dict[Var, int] = {}
    deps: dict[Node, int] = {}
    for n in graph.nodes:
        mask = 0
        for a in n.inputs:
            if isinstance(a, Var):
                mask |= above.get(a, 0)
        if n in index:
            deps[n] = mask
            mask |= 1 << index[n]
        for o in n.outputs:
            above[o] = mask
    return deps


def _independent_sets(ms: list[Member], deps, bit) -> list[list[Member]]:
    """Members split first-fit (in graph order) into sets in which none depends on
    another: a later member may join a set when no member of it is among its ancestors."""
    sets: list[tuple[int, list[Member]]] = []
    for m in ms:
        for i, (mask, s) in enumerate(sets):
            if deps[m.dot] & mask == 0:
                sets[i] = (mask | bit[m.dot], s + [m])
                break
        else:
            sets.append((bit[m.dot], [m]))
    return [s for _, s in sets]


def _worth_concatenating(side: int, ms, sites: int, concats: dict, consts) -> bool:
    """The measure-free rule of the module docstring; free when the concatenate exists
    already or folds at plan time."""
    if operands(ms) in concats or all(m.source in consts for m in ms):
        return True
    cost = LAUNCH_BYTES + 2 * sum(m.source.nbytes for m in ms)
    return sites * _saving(side, ms) >= cost


def _saving(side: int, ms) -> int:
    """What one merge of the members saves, in bytes of traffic (module docstring): a
    launch unless every member fills the GPU, k-1 reads of the shared operand S where
    the members are memory bound."""
    shared = ms[0].dot.inputs[side]
    sizes = [_gemm_sizes(m.dot) for m in ms]
    launch = 0 if all(fills_gpu(b, m, n) for b, m, n, _ in sizes) else LAUNCH_BYTES
    reads = sum(shared.nbytes for m, s in zip(ms[1:], sizes[1:])
                if not compute_bound(*s, m.dot))
    return launch + reads


def fills_gpu(batch: int, m: int, n: int) -> bool:
    """Whether a GEMM has an output tile for every SM."""
    return batch * -(-m // GEMM_TILE) * -(-n // GEMM_TILE) >= GPU_SMS


def compute_bound(batch: int, m: int, n: int, k: int, dot: Node) -> bool:
    """Whether a GEMM does at least RIDGE_FLOP_PER_BYTE flops per byte it reads and
    writes (each operand once)."""
    moved = sum(v.nbytes for v in (*dot.inputs, *dot.outputs))
    return 2 * batch * m * n * k >= RIDGE_FLOP_PER_BYTE * moved


def _gemm_sizes(dot: Node) -> tuple[int, int, int, int]:
    """(batch, m, n, k) of a dot_general in any layout."""
    lc, rc, lb, rb, lf, rf = dot_dims(dot)
    lhs, rhs = dot.inputs
    size = lambda x, axes: int(np.prod([x.shape[a] for a in axes], dtype=np.int64))  # noqa: E731
    return size(lhs, lb), size(lhs, lf), size(rhs, rf), size(lhs, lc)

"""Horizontal fusion: independent small elementwise kernels packed into one launch.

An optimizer step over many parameter leaves makes many small elementwise kernels that read and write different buffers and depend on
nothing of each other. Each is one graph node, and a CUDA graph's launch costs host
time per node (H100: a 98-kernel update step spends 35.8 µs in the FFI handler, a
one-kernel call 6.0 µs, most of the difference in `cuGraphLaunch`), and each launch
costs GPU time too. XLA's horizontal loop fusion and PyTorch's multi-tensor apply pack
such kernels into one; this pass does the same over fusion's groups:

- candidates are elementwise groups (`GroupKind.FUSED`) of one output smaller than
  `HORIZONTAL_BELOW` elements (larger ones are bound by their bytes, not their launch),
  that are not a tiled transpose (those want their own block shape);
- candidates that read the same groups' outputs (or only the plan's inputs and
  constants: an update step's leaves, the converts of a model's parameters) are packed
  together: they wait for the same work anyway, so packing them delays none of them.
  Candidates reading different groups are not: the branches of a wide model would
  then meet at every layer (one pack waiting for every branch's GEMM), trading their
  overlap on separate streams for a launch each;
- a candidate nothing reads (its outputs are the plan's results only, as an optimizer's
  updates are) may wait: all of them are packed together at the end of the plan. That
  delays each one to the end, so such a pack is capped at `TERMINAL_ELEMENTS` elements
  (4M float32 values read and written, 32 MB: about 13 µs at an H100's 2.5 TB/s) so
  that it adds little after the work it used to overlap;
- a pack holds at most `MAX_MEMBERS` groups and `MAX_PARAMS` buffer pointers (a kernel's
  parameters must fit in the 4 KB a launch may pass on every CUDA 12 driver).

The pack is one group of kind `HORIZONTAL` whose `members` keep their own nodes; its
kernel (lowering/horizontal.py) gives each member its own range of blocks.
"""
from __future__ import annotations

from nimblejax.compiler.fusion import Group, moves_innermost_axis
from nimblejax.compiler.ir import Var
from nimblejax.compiler.kinds import GroupKind

# At or above this many elements an elementwise kernel is bound by its bytes (see
# fusion_costs.RECOMPUTE_ANY_BELOW, the same measure): packing it saves one launch of many.
HORIZONTAL_BELOW = 1 << 20
MAX_MEMBERS = 64
MAX_PARAMS = 400  # 8-byte pointers: 3.2 KB of the 4 KB kernel parameter space
TERMINAL_ELEMENTS = 1 << 22


def pack_horizontal(groups: list) -> list:
    """Groups (fusion.fuse's, topological) with the small elementwise groups that read
    the same groups packed into one launch each, placed where the first of them was,
    and those nothing reads into another, placed where the last of them was (both
    orders stay topological); every other group keeps its place."""
    producers, terminal = _producers(groups)
    alike: dict[frozenset, list] = {}
    last: list = []
    for g in groups:
        if _candidate(g):
            if id(g) in terminal:
                last.append(g)
            else:
                alike.setdefault(producers[id(g)], []).append(g)
    at: dict[int, object] = {}  # id(the member whose place a pack takes) -> the pack
    dropped: set[int] = set()
    runs = [(members, None, 0) for members in alike.values()] + [(last, TERMINAL_ELEMENTS, -1)]
    for members, cap, anchor in runs:
        for pack in _chunks(members, cap):
            if len(pack) > 1:
                at[id(pack[anchor])] = _make_pack(pack)
                dropped.update(id(g) for g in pack)
    return [at.get(id(g), g) for g in groups if id(g) in at or id(g) not in dropped]


def _candidate(g) -> bool:
    if g.kind is not GroupKind.FUSED or len(g.outputs) != 1 or g.in_place:
        return False
    out = g.outputs[0]
    return out.size < HORIZONTAL_BELOW and not any(map(moves_innermost_axis, g.nodes))


def _producers(groups: list) -> tuple[dict[int, frozenset], set[int]]:
    """(id(group) -> the ids of the groups it reads, the ids of the groups no other
    group reads)."""
    maker: dict[Var, object] = {}
    producers: dict[int, frozenset] = {}
    for g in groups:
        producers[id(g)] = frozenset(id(maker[v]) for v in g.inputs if v in maker)
        for v in g.outputs:
            maker[v] = g
    read = set().union(*producers.values()) if producers else set()
    return producers, {id(g) for g in groups} - read


def _chunks(members: list, max_elements: int | None = None) -> list[list]:
    """Consecutive runs of `members` within MAX_MEMBERS, MAX_PARAMS and `max_elements`."""
    chunks: list[list] = [[]]
    params = elements = 0
    for g in members:
        n, size = len(g.inputs) + len(g.outputs), g.outputs[0].size
        full = (len(chunks[-1]) >= MAX_MEMBERS or params + n > MAX_PARAMS
                or (max_elements is not None and elements + size > max_elements))
        if chunks[-1] and full:
            chunks.append([])
            params = elements = 0
        chunks[-1].append(g)
        params, elements = params + n, elements + size
    return chunks


def _make_pack(members: list) -> Group:
    nodes, seen = [], set()
    for g in members:
        for n in g.nodes:
            if id(n) not in seen:
                seen.add(id(n))
                nodes.append(n)
    made = {v for g in members for v in g.outputs}
    inputs: list[Var] = []
    for g in members:
        inputs.extend(v for v in g.inputs if v not in made and v not in inputs)
    return Group(GroupKind.HORIZONTAL, members[-1].root, tuple(nodes), tuple(inputs),
                 members=tuple(members))

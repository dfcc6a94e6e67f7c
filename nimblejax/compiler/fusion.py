"""Fusion: partition the graph's nodes into groups, one group per kernel.

Walking the nodes backwards, an elementwise node is *inlined* (recomputed inside its
consumers' kernels) when all of its consumers are elementwise nodes, reductions or kernels
that fuse that operand (a rule registered with `fuses`, the scatter family), its value
is not a graph output, and recomputing it in several kernels reads no more than
reading it would (fusion_costs.py); otherwise it roots a kernel of its own and its
value is materialized in a buffer. A reduction roots a kernel into whose loop its operand's
producers are inlined. A scatter roots a kernel that computes its operand straight into
its output (`zeros(...).at[ids].add(g)` writes the table once) and its indices and
updates where it reads them; a scatter that is the only reader of an operand buffer the
plan writes updates that buffer in place (`_in_place`). A library GEMM's group also
takes the bias add, residual add, scale and activation after it that cuBLASLt computes in
its epilogue (compiler/epilogue.py); other groups treat those nodes as opaque readers.
A reduction over the trailing axes whose readers are all in one group joins that group
instead, which then becomes one row kernel (fusion_rows.py: softmax, LayerNorm); an
elementwise value that group reads and that would root a kernel of its own (read outside
too: pre-LN's residual stream) is written by the row kernel as another output. This is
XLA's loop/input fusion with producer duplication, kept deliberately simple.
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from nimblejax.compiler.epilogue import EpilogueMatch, find_epilogues
from nimblejax.compiler.fusion_rows import (MAX_REACH, SAME_INDEX, comes_back, in_dependency_order, row_exits,
                                            row_output_target, row_target)
from nimblejax.compiler.ir import Graph, Node, Var
from nimblejax.compiler.kinds import GroupKind, RuleKind
from nimblejax.compiler.fusion_costs import (MAX_INLINE_DEPTH, costly_to_fuse, free,
                                             worth_writing)
from nimblejax.compiler.lowering.registry import rule_for

# A node feeding more than this many kernels is materialized rather than recomputed.
MAX_DUPLICATION = 4
# A fused kernel writes at most this many values besides its root's (_fused_output_target).
MAX_FUSED_OUTPUTS = 4
VIEW_PRIMS = frozenset({"reshape", "squeeze"})


@dataclass(frozen=True, eq=False)
class Group:
    kind: GroupKind
    root: Node
    nodes: tuple[Node, ...]  # topological order, root last (an epilogue's nodes follow a dot)
    inputs: tuple[Var, ...]  # materialized values read
    in_place: bool = False  # the root's rule updates its `in_place` operand's buffer
    # A GEMM group's epilogue: its nodes follow the root (the dot), and it writes the
    # epilogue's last value instead of the root's.
    epilogue: EpilogueMatch | None = None
    # Values written besides the root's: a row group's prologue values read outside the
    # group (fusion_rows.row_output_target, _late_row_outputs), a fused group's values
    # others read back instead of recomputing them (_fused_output_target).
    extra_outputs: tuple[Var, ...] = ()
    # A HORIZONTAL group's member groups (fusion_horizontal.py), each with its outputs.
    members: tuple["Group", ...] = ()
    # A REDUCTION group's other roots (fusion_siblings.py): reductions of the same shape
    # computed in the root's loop, each writing its own output (before the root's).
    siblings: tuple[Node, ...] = ()
    # A GEMM group's elementwise reader, computed by the tensor-core GEMM kernel from its
    # accumulators (fusion_gemm_post.py): its nodes follow the GEMM's, and the group
    # writes its output instead of the GEMM's result.
    post: "Group | None" = None
    # The gates a GEMM group's post group reads its result through (column slices of equal
    # width, fusion_gemm_gates.py: an LSTM cell); 0: it reads it at its own element.
    gates: int = 0

    def __post_init__(self) -> None:
        object.__setattr__(self, "kind", GroupKind(self.kind))  # a string is checked

    @property
    def output(self) -> Var:
        return self.outputs[0]

    @property
    def outputs(self) -> tuple[Var, ...]:
        if self.members:
            return tuple(v for g in self.members for v in g.outputs)
        if self.post is not None:
            return self.post.outputs
        if self.epilogue is not None:
            return (self.epilogue.output,)
        return tuple(n.outputs[0] for n in self.siblings) + self.root.outputs + self.extra_outputs


def fuse(graph: Graph, gemm_epilogues: bool = True, small_gemm: bool = True) -> list[Group]:
    """Groups of a canonicalized graph (compiler/canonicalize), in topological order.
    `gemm_epilogues`: whether GEMMs take their epilogues (cuBLASLt; plain cuBLAS has none).
    `small_gemm`: whether small-M GEMMs are the generated kernel (lowering/gemm_small.py),
    which has no epilogue: their bias and activation stay elementwise kernels."""
    consumers = graph.consumers()
    outputs = {a for a in graph.outputs if isinstance(a, Var)}
    owner: dict[Node, frozenset[int]] = {}
    roots: dict[int, Node] = {}
    written, broadcast = worth_writing(graph, consumers)
    depth: dict[Node, int] = {}  # inlined nodes between a node and its kernel's root
    rows: dict[int, int] = {}  # row groups (fusion_rows.py) → their row count
    extra: dict[int, list[Node]] = {}  # row or fused group → nodes it also writes
    order = {n: i for i, n in enumerate(graph.nodes)}
    exits = row_exits(graph.nodes, consumers, outputs)  # they root their row group

    def new_group(node: Node) -> None:
        gid = len(roots)
        roots[gid] = node
        owner[node] = frozenset([gid])
        depth[node] = 0

    ep = _Epilogues(find_epilogues(graph, consumers, outputs, small_gemm) if gemm_epilogues else {})
    # users that read operands from memory
    from_memory = ep.opaque | costly_to_fuse(graph) | _gemm_operand_views(graph, consumers)
    for dot, match in ep.matches.items():  # decided first: the walk below skips them
        new_group(dot)
        for n in match.chain:
            owner[n] = owner[dot]

    for node in reversed(graph.nodes):
        if node in ep.opaque:
            continue
        users = ep.live_users(node, consumers, owner)
        read = node.outputs[0] in ep.vectors  # a GEMM reads it from memory
        if node in ep.copies and not users and not read and node.outputs[0] not in outputs:
            continue  # only GEMM epilogues' equations compute it
        if rule_for(node).kind is RuleKind.ELEMENTWISE and node not in exits:
            groups = None if read or node in broadcast else _inline_target(node, users, outputs, owner,
                                                                            from_memory)
            if groups is not None and _strided_into_kernel(node, groups, roots):
                groups = None
            worth = node in written and len(groups or ()) > 1
            if groups is not None and not free(node) and (worth or _compounds(users, groups, owner)):
                gid = _fused_output_target(node, groups, consumers, owner, roots, rows, extra,
                                           order, ep, worth_writing=worth)
                if gid is not None:  # one reader writes it, the others read it back
                    d = 1 + max(depth[u] for u in users if gid in owner.get(u, ()))
                    if d <= MAX_INLINE_DEPTH:
                        owner[node], depth[node] = frozenset([gid]), d
                        extra.setdefault(gid, []).append(node)
                        continue
            if groups is not None and (len(groups) == 1 or node not in written):
                d = 1 + max(depth[u] for u in users)
                if d <= MAX_INLINE_DEPTH:
                    owner[node] = groups
                    depth[node] = d
                    continue
            gid = None if read or node in ep.copies else row_output_target(
                node, users, consumers, owner, roots, rows, extra, order)
            if gid is not None:  # its row kernel writes it too
                d = 1 + max(depth[u] for u in users if gid in owner.get(u, ()))
                if d <= MAX_INLINE_DEPTH:
                    owner[node], depth[node] = frozenset([gid]), d
                    extra.setdefault(gid, []).append(node)
                    continue
        elif rule_for(node).kind is RuleKind.REDUCTION:
            gid = row_target(node, consumers, outputs, owner, roots, rows, extra)
            if gid is not None:  # one reduction of its consumers' row kernel
                owner[node], depth[node], rows[gid] = frozenset([gid]), 0, node.outputs[0].size
                if node.outputs[0] in outputs:  # which writes it too
                    extra.setdefault(gid, []).append(node)
                continue
        new_group(node)

    _late_row_outputs(consumers, owner, roots, rows, extra, order)
    members: dict[int, list[Node]] = {gid: [] for gid in roots}
    for node in graph.nodes:
        copied = frozenset(g for dot in ep.copies.get(node, ()) for g in owner[dot])
        for gid in owner.get(node, frozenset()) | copied:
            members[gid].append(node)
    groups = [_make_group(roots[gid], members[gid], ep.matches.get(roots[gid]), gid in rows,
                          tuple(n.outputs[0] for n in reversed(extra.get(gid, ()))))
              for gid in sorted(roots, reverse=True)]
    groups = _in_place(groups, consumers, outputs)
    # By the node that writes each group's output (its last): the root, or an epilogue's
    # last node, after every value the epilogue reads.
    groups = sorted(groups, key=lambda g: order[g.nodes[-1]])
    # A row group writing a prologue value may come after a reader of that value.
    return in_dependency_order(groups) if extra else groups


class _Epilogues:
    """The GEMM epilogues fusion was given (compiler/epilogue.py), as the walk reads them.

    `opaque`: each dot and its chain, fixed in the dot's group; producers that feed
    them are written, since a library call reads its operands from memory. `copies`:
    bias-path node → the dots whose group recomputes it in its equations (the GEMM reads
    the vector before it); the edges along such a path do not count as uses, and the
    `vectors` at their start are written whoever else reads them."""

    def __init__(self, matches: dict[Node, EpilogueMatch]) -> None:
        self.matches = matches
        self.opaque = {n for dot, m in matches.items() for n in (dot, *m.chain)}
        self.copies: dict[Node, list[Node]] = {}
        self.copy_edges: set[tuple[Var, Node]] = set()
        self.vectors = {m.bias for m in matches.values() if m.bias is not None}
        for dot, m in matches.items():
            for p in m.bias_path:
                self.copies.setdefault(p, []).append(dot)
            self.copy_edges.update(m.path_edges)

    def live_users(self, node: Node, consumers, owner) -> list[Node]:
        """node's consumers, less the bias paths' copies of it (a copy with no group of
        its own, or the epilogue's add)."""
        out = node.outputs[0]
        return [u for u in consumers.get(out, [])
                if not ((out, u) in self.copy_edges and (u in self.opaque or u not in owner))]


def _in_place(groups: list[Group], consumers, outputs) -> list[Group]:
    """Mark the groups whose rule may update an operand in place (rule `in_place`: a
    scatter) where that is safe: the operand is a buffer a task of the plan writes (not
    an argument, a constant or a view, which share bytes with others), no graph output,
    and the root is its only reader (reading it once), so that nothing reads its old
    value after the update starts. The scatter then skips its copy."""
    made = {v: g for g in groups for v in g.outputs}
    marked = []
    for g in groups:
        k = rule_for(g.root).in_place
        if k is not None and g.kind is GroupKind.KERNEL:
            x = g.root.inputs[k]
            if (isinstance(x, Var) and x in made and made[x].kind is not GroupKind.VIEW
                    and x not in outputs
                    and consumers.get(x) == [g.root]
                    and sum(a is x for a in g.root.inputs) == 1):
                g = dataclasses.replace(g, in_place=True)
        marked.append(g)
    return marked


def _gemm_operand_views(graph: Graph, consumers) -> set[Node]:
    """Reshapes read only by dots (canonicalize/split_k.py's slices of K): views of their
    input's buffer, into which no producer is inlined, so that the value is written once
    in its own shape for its other readers (a LayerNorm's output, the next residual)."""
    return {n for n in graph.nodes
            if n.name == "reshape" and n.params.get("dimensions") is None
            and (users := consumers.get(n.outputs[0])) and all(u.name == "dot_general" for u in users)}


def _inline_target(node: Node, users: list[Node], outputs, owner,
                   opaque=frozenset()) -> frozenset[int] | None:
    """The groups that recompute `node` (read by `users`), or None if it is written.
    `opaque`: GEMMs with epilogues, which read their operands from memory, as does a
    bias-path copy with no group of its own."""
    out = node.outputs[0]
    if not users or out in outputs:
        return None
    groups: set[int] = set()
    for user in users:
        rule = rule_for(user)
        if user in opaque or user not in owner:
            return None
        if rule.kind is RuleKind.ELEMENTWISE:
            groups |= owner[user]
        elif rule.kind is RuleKind.REDUCTION and user.inputs[0] is out:
            groups |= owner[user]
        elif rule.fuses and all(k in rule.fuses for k, a in enumerate(user.inputs) if a is out):
            groups |= owner[user]
        else:
            return None
    return frozenset(groups) if len(groups) <= MAX_DUPLICATION or free(node) else None


def _late_row_outputs(consumers, owner, roots, rows, extra, order) -> None:
    """A second look once every row group is known. The walk meets a node before the
    reduction below it joins its readers' group, so a value one per row that a row group
    reads and that is written anyway (a loop's counter `k + 1`, the next carry, read by
    the condition next to the step's reduction) got a kernel of its own. Such a group,
    its nodes in no other group, becomes the row group's another output (fusion_rows.
    row_output_target, which refuses a cycle of groups): Newton's step is one kernel."""
    for gid, root in list(roots.items()):
        if gid in rows or rule_for(root).kind is not RuleKind.ELEMENTWISE or len(root.outputs) != 1:
            continue
        users = consumers.get(root.outputs[0], [])
        target = row_output_target(root, users, consumers, owner, roots, rows, extra, order)
        if target is None or root.outputs[0].size != rows[target]:
            continue
        nodes = [n for n, g in owner.items() if gid in g]
        if any(len(owner[n]) > 1 for n in nodes):
            continue
        for n in nodes:
            owner[n] = frozenset([target])
        extra.setdefault(target, []).append(root)
        del roots[gid]


def _compounds(users: list[Node], groups: frozenset[int], owner) -> bool:
    """Whether recomputing a node in `groups` would duplicate what is duplicated already:
    a reader of it is recomputed in several kernels, and the node would be in more. An
    unrolled recurrence (an LSTM's cell state: c_t feeds h_t and c_t+1, which feeds h_t+1
    and c_t+2, ...) then recomputes a chain of steps in every kernel, up to
    MAX_DUPLICATION steps each: the step kernel grew from 1.4 to 3.4 µs (H100, LSTM at
    batch 1, `examples/gpu/trace_kernels.py`)."""
    spans = [len(owner[u]) for u in users if u in owner]
    return len(groups) > 1 and max(spans, default=1) > 1 and len(groups) > max(spans)


def _fused_output_target(node: Node, groups: frozenset[int], consumers, owner, roots, rows,
                         written, order, ep: "_Epilogues", worth_writing: bool = False) -> int | None:
    """One of `groups` (the fused groups that would recompute `node`) that can write its
    value as another output (XLA's multi-output loop fusion), or None. The node is
    elementwise and same-index, and every path from it to the group's root runs through
    same-index nodes of the root's shape (the kernel computes it at the root's own index,
    once per element). Every other group of `groups` comes after the writer already (a
    path of the graph leads from the writer's root to its root, as the GEMM between two
    steps of an RNN does): reading the value back adds no wait, so independent kernels
    stay free to run side by side or share one launch (fusion_horizontal.py). The group
    rooted earliest is taken, and none whose kernel another reader of the value leads
    back to (fusion_rows.comes_back).

    `worth_writing`: a value written anyway (fusion_costs.worth_writing), whose kernel of its own every
    reader waited for: the earliest elementwise reader that can write it does, and the
    others (reductions too) read it back, waiting for that kernel instead. A train step's
    residual sum `bn(conv) + shortcut` is written by the relu kernel, and a relu mask
    `dy * (y > 0)` by the kernel scaling it for the next convolution's gradients, beside
    the batch norm's gradient sums that read it."""
    out = node.outputs[0]
    if node.name not in SAME_INDEX or len(node.outputs) != 1 or out.size == 0:
        return None

    def fused(g: int) -> bool:
        return not (g in rows or roots[g] in ep.matches or rule_for(roots[g]).kind is not RuleKind.ELEMENTWISE)

    if worth_writing:
        candidates = sorted((g for g in groups if fused(g)), reverse=True)
    elif all(fused(g) for g in groups):
        candidates = [max(groups)]  # rooted earliest in the graph (numbered walking backwards)
    else:
        return None
    for gid in candidates:
        root = roots[gid]
        if (root.name not in SAME_INDEX or tuple(root.outputs[0].shape) != tuple(out.shape)
                or len(written.get(gid, ())) >= MAX_FUSED_OUTPUTS):
            continue
        if not worth_writing and not all(_reaches(root, roots[g], consumers, order) for g in groups if g != gid):
            continue
        if _same_index_to_root(out, gid, consumers, owner, root) and not comes_back(
                out, gid, consumers, owner, order, order[root]):
            return gid
    return None


def _reaches(src: Node, dst: Node, consumers, order) -> bool:
    """Whether a path of the graph leads from node `src` to node `dst` (False past
    fusion_rows.MAX_REACH steps: refusing is always safe)."""
    last, seen = order[dst], set()
    todo = [u for v in src.outputs for u in consumers.get(v, ()) if order[u] <= last]
    while todo:
        n = todo.pop()
        if n is dst:
            return True
        if n in seen:
            continue
        seen.add(n)
        if len(seen) > MAX_REACH:
            return False
        todo += [u for v in n.outputs for u in consumers.get(v, ()) if order[u] <= last]
    return False


def _same_index_to_root(value: Var, gid: int, consumers, owner, root: Node) -> bool:
    """Whether every reader of `value` inside group `gid`, and so on up to its root, is a
    same-index node of the root's shape."""
    shape, todo, seen = tuple(root.outputs[0].shape), [value], set()
    while todo:
        v = todo.pop()
        for u in consumers.get(v, ()):
            if gid not in owner.get(u, ()) or u in seen:
                continue
            if u.name not in SAME_INDEX or tuple(u.outputs[0].shape) != shape:
                return False
            seen.add(u)
            if u is not root:
                todo.extend(u.outputs)
    return root in seen


def _strided_into_kernel(node: Node, groups, roots) -> bool:
    """A transpose that moves its input's innermost axis stays out of a kernel rule's
    group (a scatter's loops read its operands one element per thread, so it would read
    a row apart per thread): it gets the tiled transpose kernel of its own."""
    return moves_innermost_axis(node) and any(rule_for(roots[g]).fuses for g in groups)


def moves_innermost_axis(node: Node) -> bool:
    """A transpose that moves its input's innermost axis: lowering/transpose.py gives it
    a tiled kernel (a block shape of its own)."""
    perm = tuple(node.params["permutation"]) if node.name == "transpose" else ()
    return bool(perm) and perm[-1] != len(perm) - 1


def _make_group(root: Node, nodes: list[Node], epilogue: EpilogueMatch | None = None,
                row: bool = False, extra_outputs: tuple[Var, ...] = ()) -> Group:
    produced = {v for n in nodes for v in n.outputs}
    inputs: list[Var] = []
    for n in nodes:
        for a in n.inputs:
            if isinstance(a, Var) and a not in produced and a not in inputs:
                inputs.append(a)
    rule_kind = rule_for(root).kind
    kind = GroupKind.FUSED if rule_kind is RuleKind.ELEMENTWISE else GroupKind(rule_kind.value)
    if row:  # reductions joined their consumers' group (fusion_rows.py)
        kind = GroupKind.ROW
    # A reshape of a row-major buffer is a view of the same bytes (outputs are copied
    # out of the arena on every call, so a view may even be an output).
    if kind is GroupKind.FUSED and all(n.name in VIEW_PRIMS and n.params.get("dimensions") is None
                               for n in nodes):
        kind = GroupKind.VIEW
    return Group(kind, root, tuple(nodes), tuple(inputs), epilogue=epilogue, extra_outputs=extra_outputs)

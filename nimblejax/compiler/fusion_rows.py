"""Row groups: softmax, log_softmax, LayerNorm, RMSNorm and logsumexp as one kernel.

A row normalization reduces each row of x (its trailing axes) and then computes, for
every element of the row, a value from the row's own reductions and the row itself:
softmax is max, exp(x - max), sum, divide. Plain fusion puts each reduction in a kernel
of its own, because the reduction's elementwise consumers also read the un-reduced row.
Here a reduction over trailing axes instead *joins* the group of its consumers (fusion.py
walks the graph backwards, so that group is known), and the group becomes a row kernel
(lowering/rows.py): one warp or block per row, one pass over the row per reduction, then
the outputs. A reduction's value is then only a register of the threads of its row, so it
may join only where every reader of it, through elementwise steps, reads it at its own
row: `row_target` checks that, operation by operation (`keeps_rows`).

"Row" of an element: its row-major offset divided by the value's size per row (a value of
R rows has size R * m). Reshapes keep offsets; an elementwise step keeps rows where its
operand's leading axes equal its output's and number R in all; a broadcast where it maps
those leading axes in place.

The elementwise producers of a row kernel's input (`LN(x + attn)`'s residual add, the
scale and mask add before a softmax) are inlined into it by fusion.py's ordinary rule,
which needs no rows: the kernel computes them from their inputs at any index. Where
such a value is also read outside the group (pre-LN transformers keep the residual
stream `h = x + attn` for the next block), it would root an elementwise kernel of its
own, which writes it for the row kernel to read back. Instead the row kernel writes it
too, as another output (`row_output_target`): one kernel and one write where there were
two and a write and read. Such a value depends on none of its group's reductions (the
kernel writes it in the first pass over the row).
"""
from __future__ import annotations

import heapq
import math
from typing import Mapping

from nimblejax.compiler.ir import Node, Var
from nimblejax.compiler.kinds import RuleKind
from nimblejax.compiler.lowering.elementwise import BINARY_NAMES, UNARY_NAMES
from nimblejax.compiler.lowering.registry import rule_for
from nimblejax.compiler.lowering.rules_special import BLOCKS

# Elementwise steps that read every operand at their output's own index.
SAME_INDEX = (UNARY_NAMES | BINARY_NAMES | frozenset(BLOCKS)
              | {"integer_pow", "convert_element_type", "reduce_precision", "select_n", "clamp",
                 "bitcast_convert_type", "mulhi"})
# Reshapes keep each element's row-major offset, hence its row.
RESHAPES = frozenset({"reshape", "squeeze"})

# A row kernel runs one warp or block per row. With few long rows that is a few busy SMs
# where separate kernels would spread the elementwise work over the whole GPU, so a
# reduction joins only where there are enough rows to fill an H100's 132 SMs, or so
# little work that the launches saved are what counts.
MIN_ROWS = 128
SMALL_WORK = 1 << 18  # elements of the longest pass, all rows together
# Values a row kernel writes besides its result (row_output_target).
MAX_ROW_OUTPUTS = 4
# Steps the cycle check (_comes_back) takes before it gives up and refuses.
MAX_REACH = 1 << 14


def is_row_reduction(node: Node) -> bool:
    """A reduction over the trailing axes of its operand (and at least one axis)."""
    if rule_for(node).kind is not RuleKind.REDUCTION:
        return False
    x = node.inputs[0]
    axes = tuple(sorted(int(a) for a in node.params["axes"]))
    return bool(axes) and axes == tuple(range(x.ndim - len(axes), x.ndim)) and x.size > 0


def row_target(node: Node, consumers: Mapping[Var, list[Node]], outputs, owner,
               roots: Mapping[int, Node], rows: Mapping[int, int],
               written: Mapping[int, list[Node]] | None = None) -> int | None:
    """The group that reduction `node` joins as one of a row kernel's reductions, or None.
    A reduction that is a graph output joins too: the kernel then writes it, one value
    per row (a while loop's step that returns its convergence measure beside the test).

    `owner` maps each node already placed (all of node's consumers are: the walk is
    backwards) to its groups, `roots` each group to its root, `rows` each row group so far
    to its row count, `written` each row group to the nodes whose values it also writes
    (row_output_target)."""
    if not is_row_reduction(node):
        return None
    out = node.outputs[0]
    users = consumers.get(out, [])
    if not users:
        return None
    gids = {g for u in users for g in owner[u]}
    if len(gids) != 1 or any(len(owner[u]) != 1 for u in users):
        return None  # read by several kernels: it must be written, once
    (gid,) = gids
    if out in outputs and len((written or {}).get(gid, ())) >= MAX_ROW_OUTPUTS:
        return None  # a graph output: the row kernel writes it too (fusion.py), up to the cap
    root, n_rows = roots[gid], out.size
    if rows.get(gid, n_rows) != n_rows or not _root_takes_rows(root, n_rows):
        return None
    below = _below(out, consumers, root, n_rows)
    if below is None or root not in below or all(n.name in RESHAPES for n in below):
        return None  # (a reduction read only through reshapes: its reader is a view)
    if written and any(n in below for n in written.get(gid, ())):
        return None  # a value the kernel writes in its first pass may not depend on it
    if _too_few_rows(n_rows, max(node.inputs[0].size, root.outputs[0].size) // n_rows):
        return None
    return gid


def _too_few_rows(n_rows: int, longest: int) -> bool:
    """Whether one warp or block per row would leave most of the GPU idle."""
    return n_rows < MIN_ROWS and n_rows * longest > SMALL_WORK


def row_exits(nodes, consumers: Mapping[Var, list[Node]], outputs) -> frozenset[Node]:
    """Elementwise nodes that must root a kernel of their own for a row group to form:
    the one node through which a row normalization's result leaves it, where a reader
    across rows (the transpose that puts attention probabilities in a GEMM's layout)
    would otherwise inline it, and with it every reduction's readers. Writing that value
    and transposing it is two kernels where the reductions and the transpose were three."""
    exits: set[Node] = set()
    for node in nodes:
        if not is_row_reduction(node) or node.outputs[0] in outputs:
            continue
        n_rows = node.outputs[0].size
        leaving = _leaving(node, consumers, outputs, n_rows)
        if len(leaving) != 1:
            continue
        (last,) = leaving
        per_row = last.outputs[0].size // n_rows  # (1: a value per row, cheap to inline)
        if (rule_for(last).kind is RuleKind.ELEMENTWISE and per_row > 1
                and not _too_few_rows(n_rows, max(per_row, node.inputs[0].size // n_rows))
                and any(rule_for(u).kind is RuleKind.ELEMENTWISE
                        for u in consumers.get(last.outputs[0], []))):
            exits.add(last)
    return frozenset(exits)


def _leaving(node: Node, consumers, outputs, n_rows: int) -> set[Node]:
    """The nodes of the region that reads `node`'s rows in place (elementwise steps and
    reductions that keep rows) whose values are read outside it or are graph outputs."""
    found: set[Node] = set()
    seen, todo = {node}, [node]
    while todo:
        p = todo.pop()
        v = p.outputs[0]
        leaves = v in outputs
        for u in consumers.get(v, []):
            if rule_for(u).kind in (RuleKind.ELEMENTWISE, RuleKind.REDUCTION) and keeps_rows(u, v, n_rows):
                if u not in seen:
                    seen.add(u)
                    todo.append(u)
            else:
                leaves = True
        if leaves:
            found.add(p)
    return found


def _root_takes_rows(root: Node, n_rows: int) -> bool:
    kind = rule_for(root).kind
    if kind is RuleKind.REDUCTION:
        return is_row_reduction(root) and root.outputs[0].size == n_rows
    return kind is RuleKind.ELEMENTWISE and root.outputs[0].size % n_rows == 0


def _below(value: Var, consumers, root: Node, n_rows: int) -> set[Node] | None:
    """Every node that reads `value` through the group, up to its root, if each keeps
    rows; else None. (Every reader is in the group: the caller checked the first ones,
    and an inlined node's readers are in its groups.)"""
    seen: set[Node] = set()
    todo = [value]
    while todo:
        v = todo.pop()
        for u in consumers.get(v, []):
            if not keeps_rows(u, v, n_rows):
                return None
            if u not in seen:
                seen.add(u)
                if u is not root:
                    todo.append(u.outputs[0])
    return seen


def keeps_rows(node: Node, value: Var, n_rows: int) -> bool:
    """Whether every element of `node`'s output reads `value` only in its own row."""
    out = node.outputs[0]
    if out.size % n_rows or value.size % n_rows:
        return False
    if n_rows == 1:
        return True
    if rule_for(node).kind is RuleKind.REDUCTION:
        return is_row_reduction(node) and out.size == n_rows
    if node.name in RESHAPES:
        return node.params.get("dimensions") is None
    if node.name == "broadcast_in_dim":
        dims = tuple(node.params["broadcast_dimensions"])
        q = _row_axes(value.shape, n_rows)
        return (q is not None and dims[:q] == tuple(range(q))
                and tuple(out.shape[:q]) == tuple(value.shape[:q]))
    if node.name in SAME_INDEX:
        return (value.shape == out.shape
                or (len(value.shape) == len(out.shape)
                    and (q := _row_axes(out.shape, n_rows)) is not None
                    and tuple(value.shape[:q]) == tuple(out.shape[:q])))
    return False


def _row_axes(shape: tuple[int, ...], n_rows: int) -> int | None:
    """The number of leading axes that index the rows (their sizes multiply to n_rows)."""
    for q in range(len(shape) + 1):
        if math.prod(shape[:q]) == n_rows:
            return q
    return None


def row_output_target(node: Node, users: list[Node], consumers: Mapping[Var, list[Node]], owner,
                      roots: Mapping[int, Node], rows: Mapping[int, int],
                      written: Mapping[int, list[Node]], order: Mapping[Node, int]) -> int | None:
    """The row group that writes elementwise `node`'s value as another output, where the
    node would otherwise root a kernel of its own (its value is read outside the group,
    or is a graph output), or None. `users`: its readers, all placed; `order`: each
    node's position in the graph.

    The group must read the value itself, and no other kernel that reads it may be a
    step on the way to the group: the group would wait for a kernel that waits for it
    (pre-LN's `h` feeds the next block's LayerNorm through this block's attention: only
    this block's LayerNorm, the first reader, may write it)."""
    out = node.outputs[0]
    if node.name not in SAME_INDEX or len(node.outputs) != 1 or out.size == 0:
        return None
    candidates = {g for u in users for g in owner.get(u, ()) if g in rows}
    for gid in sorted(candidates, reverse=True):  # the one rooted earliest first
        if out.size % rows[gid] or len(written.get(gid, ())) >= MAX_ROW_OUTPUTS:
            continue
        if not comes_back(out, gid, consumers, owner, order, order[roots[gid]]):
            return gid
    return None


def comes_back(value: Var, gid: int, consumers, owner, order: Mapping[Node, int],
                last: int) -> bool:
    """Whether a path of readers from `value` leaves group `gid` (a node of another
    group: that kernel reads `value`, or computes from what does) and then reaches the
    group again. Only nodes up to position `last` (the group's root) can be the group's;
    past MAX_REACH steps the answer is yes (refusing is always safe)."""
    seen: set[tuple[Node, bool]] = set()
    todo = [(u, False) for u in consumers.get(value, [])]
    while todo:
        n, left = todo.pop()
        inside = gid in owner.get(n, ())
        if left and inside:
            return True
        if (n, left or not inside) in seen:
            continue
        seen.add((n, left or not inside))
        if len(seen) > MAX_REACH:
            return True
        todo += [(u, left or not inside) for v in n.outputs for u in consumers.get(v, [])
                 if order[u] <= last]
    return False


def in_dependency_order(groups: list) -> list:
    """`groups` (sorted by their last node) reordered so that each comes after the groups
    whose outputs it reads, otherwise in the same order. A row group that writes a value
    of its prologue (row_output_target) may have a reader whose last node comes before
    the row group's root; every other group already is in order, and stays so."""
    made = {v: i for i, g in enumerate(groups) for v in g.outputs}
    needs = [{made[v] for v in g.inputs if v in made and made[v] != i} for i, g in enumerate(groups)]
    readers: dict[int, list[int]] = {}
    for i, deps in enumerate(needs):
        for d in deps:
            readers.setdefault(d, []).append(i)
    waiting = [len(d) for d in needs]
    ready = [i for i, w in enumerate(waiting) if w == 0]
    heapq.heapify(ready)
    ordered = []
    while ready:
        i = heapq.heappop(ready)
        ordered.append(groups[i])
        for r in readers.get(i, ()):
            waiting[r] -= 1
            if waiting[r] == 0:
                heapq.heappush(ready, r)
    assert len(ordered) == len(groups), "fusion made a cycle of groups"
    return ordered

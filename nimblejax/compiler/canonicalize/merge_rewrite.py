"""Merged dots, the rewrite (merge_dots.py decides what to merge): the members' dots
replaced by one dot over the shared operand and the whole array the members' operands
are tiles of, or their concatenate, and each member's result by a slice of the merged
one (plus a reshape dropping a one-wide axis). Slices that read a member's result are
composed into slices of the merged result instead. The new nodes are traced with this
JAX's lax, so each carries the params its JAX expects (the interpreter binds them).
"""
from __future__ import annotations

import functools
from dataclasses import dataclass

import jax
import numpy as np
from jax import lax

from nimblejax.compiler.ir import Graph, Node, Var
from nimblejax.compiler.jaxprs import open_jaxpr


@dataclass(frozen=True, eq=False)
class Member:
    """One dot of a merge. `source` is the array the merged dot reads on the non-shared
    side (the sliced X, or the dot's own operand, to be concatenated); the dot's operand
    is source[start:stop] along `axis`, without that axis when `squeezed`."""

    dot: Node
    source: Var
    axis: int
    start: int
    stop: int
    squeezed: bool
    contracting: tuple[int, ...]  # the non-shared side's, in source's axes


@dataclass(frozen=True, eq=False)
class Merge:
    side: int  # the shared operand's position: 0 lhs, 1 rhs
    members: tuple[Member, ...]  # graph order
    concatenated: bool


def free_axes(ndim: int, contracting: tuple[int, ...]) -> list[int]:
    """An operand's axes that are not contracted (no batch axes: members have none)."""
    return [a for a in range(ndim) if a not in contracting]


def operands(ms) -> tuple:
    """What identifies a concatenate: its operands and axis (one per tuple, reused)."""
    return tuple(m.source for m in ms) + (ms[0].axis,)


def plain_slice(node: Node) -> bool:
    strides = node.params.get("strides") if node.name == "slice" else None
    return node.name == "slice" and (strides is None or all(int(s) == 1 for s in strides))


def apply_merge(graph: Graph, merge: Merge, concats: dict) -> Graph:
    """The graph with the members replaced by one dot and a slice of it each."""
    first = merge.members[0].dot
    consts = dict(graph.consts)
    made: list[Node] = []
    if merge.concatenated:
        source, ranges = _concatenated(merge, concats, consts, made)
    else:
        source = merge.members[0].source
        ranges = [(m.start, m.stop) for m in merge.members]
    merged, position = _merged_dot(merge, source, made)
    consumers = graph.consumers()
    dropped = {m.dot for m in merge.members}
    for m, (start, stop) in zip(merge.members, ranges):
        users = consumers[m.dot.outputs[0]]
        if all(plain_slice(u) for u in users):
            made += [n for u in users for n in _compose(u, merged, position, start, m.squeezed)]
            dropped.update(users)
        else:
            made += _slice_back(merged, position, start, stop, m, first.source)
    nodes: list[Node] = []
    for n in graph.nodes:
        if n is first:
            nodes += made
        elif n not in dropped:
            nodes.append(n)
    return Graph(graph.inputs, graph.outputs, topological(nodes), consts, graph.control)


def _concatenated(merge: Merge, concats: dict, consts: dict, made: list) -> tuple[Var, list]:
    ms = merge.members
    axis = ms[0].axis
    bounds = np.cumsum([0] + [m.source.shape[axis] for m in ms])
    ranges = [(int(a), int(b)) for a, b in zip(bounds[:-1], bounds[1:])]
    key = operands(ms)
    if key not in concats:
        parts = [m.source for m in ms]
        if all(p in consts for p in parts):
            value = np.concatenate([np.asarray(consts[p]) for p in parts], axis)
            concats[key] = Var(value.shape, value.dtype)
            consts[concats[key]] = value
        else:
            made += _traced("concatenate", axis, parts, ms[0].dot.source)
            concats[key] = made[-1].outputs[0]
    return concats[key], ranges


def _merged_dot(merge: Merge, source: Var, made: list) -> tuple[Var, int]:
    """The one dot (appended to `made`) and the position of the merge axis in its result."""
    first = merge.members[0].dot
    side, m = merge.side, merge.members[0]
    (lc, rc), _ = first.params["dimension_numbers"]
    shared = first.inputs[side]
    contracting = [tuple(int(d) for d in (lc, rc)[side]), m.contracting]
    if side == 1:
        contracting.reverse()
    lhs, rhs = (shared, source) if side == 0 else (source, shared)
    lfree = free_axes(lhs.ndim, contracting[0])
    rfree = free_axes(rhs.ndim, contracting[1])
    out_shape = tuple(lhs.shape[a] for a in lfree) + tuple(rhs.shape[a] for a in rfree)
    y = first.outputs[0]
    out = Var(out_shape, y.dtype, y.weak_type)
    dn = ((tuple(contracting[0]), tuple(contracting[1])), ((), ()))
    made.append(Node(first.primitive, (lhs, rhs), (out,), dict(first.params, dimension_numbers=dn),
                     first.source))
    position = lfree.index(m.axis) if side == 1 else len(lfree) + rfree.index(m.axis)
    return out, position


def _slice_back(merged: Var, position: int, start: int, stop: int, m: Member,
                source: str) -> list[Node]:
    """Nodes computing the member's own result from the merged one."""
    y = m.dot.outputs[0]
    starts, limits = [0] * merged.ndim, list(merged.shape)
    starts[position], limits[position] = start, stop
    return _sliced(merged, starts, limits, m.squeezed, y, source)


def _compose(u: Node, merged: Var, position: int, start: int, squeezed: bool) -> list[Node]:
    """A slice `u` of a member's result as a slice of the merged result (and a reshape
    dropping the member's axis when its operand was squeezed)."""
    starts = [int(a) for a in u.params["start_indices"]]
    limits = [int(a) for a in u.params["limit_indices"]]
    if squeezed:
        starts.insert(position, start)
        limits.insert(position, start + 1)
    else:
        starts[position] += start
        limits[position] += start
    return _sliced(merged, starts, limits, squeezed, u.outputs[0], u.source)


def _sliced(x: Var, starts: list, limits: list, reshape: bool, out: Var,
            source: str) -> list[Node]:
    """Nodes computing `out` as x[starts:limits], reshaped to out's shape if `reshape`."""
    params = (tuple(starts), tuple(limits), tuple(out.shape) if reshape else None)
    nodes = _traced("slice", params, [x], source)
    last = nodes[-1]
    assert last.outputs[0].shape == out.shape, (last, out)
    # Renamed to `out`, so that its readers need no change.
    return nodes[:-1] + [Node(last.primitive, last.inputs, (out,), last.params, last.source,
                              last.effectful)]


def _traced(op: str, params: tuple, args: list[Var], source: str) -> list[Node]:
    """The equations of `op` (see _jaxpr), traced with this JAX's lax, on `args`."""
    from nimblejax.compiler.trace import GraphBuilder

    specs = tuple((tuple(a.shape), np.dtype(a.dtype), bool(a.weak_type)) for a in args)
    jaxpr, consts = open_jaxpr(_jaxpr(op, params, specs))
    assert not consts
    part = GraphBuilder()
    outs = part.inline(jaxpr, list(args), source)
    assert len(outs) == 1 and part.nodes and part.nodes[-1].outputs[0] is outs[0], outs
    return part.nodes


@functools.lru_cache(maxsize=4096)
def _jaxpr(op: str, params: tuple, specs: tuple):
    """Traced once per op, params and operand types (an unrolled loop repeats them):
    "slice": params (starts, limits, shape to reshape to or None); "concatenate": axis."""
    def fn(*xs):
        if op == "concatenate":
            return lax.concatenate(xs, params)
        starts, limits, shape = params
        s = lax.slice(xs[0], starts, limits)
        return lax.reshape(s, shape) if shape is not None else s

    return jax.make_jaxpr(fn)(*(jax.ShapeDtypeStruct(s, d, weak_type=w) for s, d, w in specs))


def topological(nodes: list[Node]) -> tuple[Node, ...]:
    """The nodes in an order where each follows its producers, staying close to the
    given order (a merged dot sits where its first member was; its later members'
    operands are pulled up before it)."""
    producer = {v: n for n in nodes for v in n.outputs}
    done: set[Node] = set()
    order: list[Node] = []
    for root in nodes:
        if root in done:
            continue
        stack, open_ = [(root, iter(root.inputs))], {root}
        while stack:
            node, ins = stack[-1]
            nxt = next((producer[a] for a in ins if isinstance(a, Var) and a in producer
                        and producer[a] not in done), None)
            if nxt is None:
                done.add(node)
                open_.discard(node)
                order.append(node)
                stack.pop()
            elif nxt in open_:
                raise AssertionError(f"merge_dots made a cycle through {nxt!r}")
            else:
                open_.add(nxt)
                stack.append((nxt, iter(nxt.inputs)))
    return tuple(order)

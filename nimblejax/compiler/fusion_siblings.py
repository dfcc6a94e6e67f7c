"""Sibling reductions in one kernel: column reductions of one shape that read a common
buffer share one loop over it (XLA's multi-output reduction fusion).

`jax.grad` through a batch norm (or any per-channel scale and shift) sums the same
output gradient twice over (N, H, W): once alone (the shift's gradient) and once times
the normalized input (the scale's). Each was a kernel of its own that read the whole
gradient; one kernel now reads it once and writes both sums. A pass over the groups
fusion made, before horizontal packing.

Two REDUCTION groups merge when their roots are the same reducer over the same axes of
inputs of one shape and dtype, keep the innermost axis (the column kernel, the one that
takes several roots), read at least one buffer in common (views resolved), and the
later one can move up to the earlier one's place: no group from the earlier one on
writes what it reads.
"""
from __future__ import annotations

import dataclasses

from nimblejax.compiler.fusion import Group
from nimblejax.compiler.kinds import GroupKind

# Roots of one kernel at most: each adds an accumulator and a shared-memory tile.
MAX_ROOTS = 4


def merge_sibling_reductions(groups: list[Group]) -> list[Group]:
    """`groups` (topological order) with sibling column reductions merged, each merged
    group at the earlier member's place."""
    groups = list(groups)
    # A view (a reshape: split.py reshapes each long reduction's input) reads the bytes
    # of its source: two reductions of views of one buffer read the same buffer.
    source = {g.outputs[0]: g.inputs[0] for g in groups if g.kind is GroupKind.VIEW and len(g.inputs) == 1}
    i = 0
    while i < len(groups):
        j = _partner(groups, i, source)
        if j is None:
            i += 1
            continue
        groups[i] = _merged(groups[i], groups[j])
        del groups[j]  # group i may take another sibling
    return groups


def _partner(groups: list[Group], i: int, source: dict):
    """The first later group that can move up to group i's place and merge with it:
    a sibling none of whose inputs a group from i on writes; or None."""
    a = groups[i]
    if not _column(a):
        return None
    reads = _read(a, source)
    written: set = set()
    for j in range(i, len(groups)):
        b = groups[j]
        if (j > i and _column(b) and _alike(a.root, b.root) and not set(b.inputs) & written
                and reads & _read(b, source)
                and 2 + len(a.siblings) + len(b.siblings) <= MAX_ROOTS):
            return j
        written.update(b.outputs)
    return None


def _read(g: Group, source: dict) -> set:
    """The buffers group g reads, views resolved to their sources."""
    found = set()
    for v in g.inputs:
        while v in source:
            v = source[v]
        found.add(v)
    return found


def _column(g: Group) -> bool:
    """A plain reduction group whose root keeps its input's innermost axis."""
    if g.kind is not GroupKind.REDUCTION or g.in_place or g.extra_outputs:
        return False
    x = g.root.inputs[0]
    return x.ndim > 0 and (x.ndim - 1) not in tuple(g.root.params["axes"])


def _alike(r, s) -> bool:
    x, y = r.inputs[0], s.inputs[0]
    return (r.name == s.name and x.shape == y.shape and x.dtype == y.dtype
            and tuple(sorted(r.params["axes"])) == tuple(sorted(s.params["axes"]))
            and r.outputs[0].shape == s.outputs[0].shape and r.outputs[0].dtype == s.outputs[0].dtype)


def _merged(a: Group, b: Group) -> Group:
    """b's root is the root; a's roots join its siblings. Nodes: every inlined node
    once (a producer both recompute is one node), in an order each list had, then the
    roots."""
    roots = (*a.siblings, a.root, *b.siblings, b.root)
    inlined = list(dict.fromkeys(n for g in (a, b) for n in g.nodes if n not in roots))
    inputs = tuple(dict.fromkeys(a.inputs + b.inputs))
    return dataclasses.replace(b, nodes=tuple(inlined) + roots, inputs=inputs, siblings=roots[:-1])

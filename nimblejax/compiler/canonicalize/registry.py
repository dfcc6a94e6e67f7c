"""One table: primitive name → its canonicalization rewrite, registered next to the
rewrite (`@rewrites(...)`, as lowering/registry.py registers lowering rules).

A rewrite is `fn(node, options) -> list[Node]`: the nodes that replace `node` (`[node]`
keeps it). One signature for every rewrite, though only a convolution's path depends
on the options today.

- `replaces=True`: every node of the primitive is rewritten away, so the primitive
  needs no lowering rule (`REWRITTEN` in canonicalize/__init__.py; check_supported
  skips it).
- `after_merge=True`: the rewrite runs in the second sweep, after merge_dots.py
  (dot.py's GEMM layout: merged dots get their layout too, and merge_dots sees the
  dots as the user wrote them). Every other rewrite runs in the first sweep, before.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Iterable

from nimblejax.compiler.ir import Node
from nimblejax.options import Options


@dataclass(frozen=True)
class Rewrite:
    fn: Callable[[Node, Options], list[Node]]
    replaces: bool = False  # no node of the primitive is left: it needs no lowering rule
    after_merge: bool = False  # the second sweep (after merge_dots), else the first


REWRITES: dict[str, Rewrite] = {}


def rewrites(*names: str, replaces: bool = False, after_merge: bool = False) -> Callable:
    def deco(fn: Callable[[Node, Options], list[Node]]) -> Callable:
        for n in names:
            if n in REWRITES:  # one rewrite per primitive: a second would be silently lost
                raise ValueError(f"two canonicalization rewrites registered for {n!r}")
            REWRITES[n] = Rewrite(fn, replaces, after_merge)
        return fn

    return deco


def sweep(nodes: Iterable[Node], options: Options, after_merge: bool) -> list[Node]:
    """Each node replaced by its rewrite of this sweep (kept where it has none)."""
    out: list[Node] = []
    for node in nodes:
        rule = REWRITES.get(node.name)
        out.extend(rule.fn(node, options) if rule is not None and rule.after_merge == after_merge
                   else [node])
    return out


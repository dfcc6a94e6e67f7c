"""Emitting a small JAX function into a graph being built: control-flow flattening
(control.py) and the loop plans (loops.py) build their stacking, slicing and copying
this way, each equation carrying the user's line of the loop it came from."""
from __future__ import annotations

import functools
from typing import Any, Callable

import jax
import numpy as np

from nimblejax.compiler.ir import Atom, Inliner, Node
from nimblejax.compiler.jaxprs import open_jaxpr


def emit(builder: Inliner, fn: Callable, args: list[Atom], src: str) -> list[Atom]:
    """Inline `fn` traced at `args`' shapes; its equations carry the loop's user line."""
    specs = [jax.ShapeDtypeStruct(a.shape, a.dtype, weak_type=getattr(a, "weak_type", False))
             for a in args]
    closed = _traced(fn, tuple((s.shape, str(s.dtype), s.weak_type) for s in specs))
    jaxpr, consts = open_jaxpr(closed)
    start = len(builder.nodes)
    outs = builder.inline(jaxpr, [builder.const(c) for c in consts] + list(args), src)
    builder.nodes[start:] = [_at(n, src) for n in builder.nodes[start:]]
    return outs


@functools.lru_cache(maxsize=4096)
def _traced(fn: Callable, key: tuple) -> Any:
    specs = [jax.ShapeDtypeStruct(s, np.dtype(d), weak_type=w) for s, d, w in key]
    return jax.make_jaxpr(fn)(*specs)


def _at(node: Node, src: str) -> Node:
    return Node(node.primitive, node.inputs, node.outputs, node.params, src, node.effectful)

"""`stack`, `unstack` and `tile` → the primitives lowering already takes, as JAX's own
lowering of each spells them out:

- stack (every jnp.stack since JAX 0.10; jax.random.split's key arithmetic): each operand
  reshaped with the new axis of size 1 (a view of its buffer), then one concatenate;
- unstack (jnp.unstack; inside jax.random on JAX 0.11): per output, a slice one wide
  along the axis, then a reshape dropping that axis (both index-only: each output
  fuses into its consumers' kernels);
- tile (jnp.tile): a broadcast_in_dim to (r0, d0, r1, d1, ...), then a reshape
  (index-only too).

The replacement is traced with this JAX version's lax functions, so every primitive
carries the params its JAX expects (the interpreter binds them), and the traced
results are renamed to the node's own outputs.
"""
from __future__ import annotations

import functools
import math
from typing import Callable

import jax
import numpy as np
from jax import lax

from nimblejax.compiler.canonicalize.registry import rewrites
from nimblejax.compiler.ir import Literal, Node, Var
from nimblejax.compiler.jaxprs import open_jaxpr
from nimblejax.options import Options


@rewrites("stack", "unstack", "tile", replaces=True)
def rewrite_stacking(node: Node, options: Options) -> list[Node]:
    from nimblejax.compiler.trace import GraphBuilder

    param = tuple(node.params["reps"]) if node.name == "tile" else int(node.params["axis"])
    specs = tuple((tuple(a.shape), np.dtype(a.dtype), bool(getattr(a, "weak_type", False)),
                   isinstance(a, Literal)) for a in node.inputs)
    jaxpr, consts = open_jaxpr(_traced(node.name, param, specs))
    assert not consts, node
    part = GraphBuilder()
    outs = part.inline(jaxpr, list(node.inputs), node.source)
    rename = dict(zip(outs, node.outputs))
    produced = {v for n in part.nodes for v in n.outputs}
    assert len(outs) == len(node.outputs) and all(o in produced for o in outs), node

    def swap(atoms):
        return tuple(rename.get(a, a) if isinstance(a, Var) else a for a in atoms)

    return [Node(n.primitive, swap(n.inputs), swap(n.outputs), n.params, node.source,
                 n.effectful) for n in part.nodes]


@functools.lru_cache(maxsize=1024)
def _traced(name: str, param, specs: tuple):
    args = [jax.ShapeDtypeStruct(shape, dtype, weak_type=weak)
            for shape, dtype, weak, _ in specs]
    literal = [lit for *_, lit in specs]
    fn = {"stack": _stack, "unstack": _unstack, "tile": _tile}[name](param, literal)
    return jax.make_jaxpr(_never_an_input(fn))(*args)


def _stack(axis: int, literal: list[bool]) -> Callable:
    def fn(*xs):
        shape = lambda x: (*x.shape[:axis], 1, *x.shape[axis:])  # noqa: E731
        # A reshape of a buffer is a view (no kernel); a literal operand has no buffer
        # to view, so it is broadcast instead.
        rows = [lax.broadcast_in_dim(x, shape(x), ()) if lit else lax.reshape(x, shape(x))
                for x, lit in zip(xs, literal)]
        return [lax.concatenate(rows, axis)]
    return fn


def _unstack(axis: int, literal: list[bool]) -> Callable:
    def fn(x):
        shape = x.shape[:axis] + x.shape[axis + 1:]
        return [lax.reshape(lax.slice_in_dim(x, i, i + 1, axis=axis), shape)
                for i in range(x.shape[axis])]
    return fn


def _tile(reps: tuple, literal: list[bool]) -> Callable:
    def fn(x):
        wide = tuple(k for pair in zip(reps, x.shape) for k in pair)
        out = tuple(r * d for r, d in zip(reps, x.shape))
        assert math.prod(out) == math.prod(wide)
        spread = lax.broadcast_in_dim(x, wide, tuple(range(1, 2 * x.ndim, 2)))
        return [lax.reshape(spread, out)]
    return fn


def _never_an_input(fn: Callable) -> Callable:
    """A result that is an operand unchanged (a tile of a scalar) becomes a copy, so that
    every result of the node is produced by a node of the replacement."""
    def wrapped(*xs):
        return [lax.copy_p.bind(y) if any(y is x for x in xs) else y for y in fn(*xs)]
    return wrapped

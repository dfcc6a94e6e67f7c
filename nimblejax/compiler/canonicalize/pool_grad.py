"""The max-pool gradient (`select_and_scatter_add`, what jax.grad makes of a max or min
pool) → two passes, primitives of ours with NumPy reference semantics (the CPU
interpreter evaluates them like any other node; lowering/rules_window.py has their
kernels):

1. `nimble_pool_select`: one value per window (the source's shape), the row-major
   offset inside the window of the element it selects, the first maximum (XLA's `ge`
   select keeps the earliest; `le`: the first minimum), -1 where every element of the
   window is padding;
2. `nimble_pool_scatter`: each operand element sums, window by window in row-major
   order, the source values of the windows that selected it, each step rounded to the
   operand's type.

One kernel that found each covering window's selection again for every operand element
read a 3×3 window once per covering window (four at stride 2): ResNet-50's at batch 32
took 399 µs of its train step on an H200, in one launch.
"""
from __future__ import annotations

import numpy as np
import jax
from jax.extend.core import Primitive

from nimblejax.compiler.canonicalize.registry import rewrites
from nimblejax.compiler.ir import Node, Var
from nimblejax.options import Options

select_p = Primitive("nimble_pool_select")
scatter_p = Primitive("nimble_pool_scatter")


def windows(shape, dims, strides, padding) -> tuple[int, ...]:
    """How many windows fit along each axis (the source's shape)."""
    return tuple((n + lo + hi - k) // s + 1 for n, k, s, (lo, hi) in zip(shape, dims, strides, padding))


def _at_offset(shape, count, strides, padding, offsets) -> tuple[tuple, np.ndarray]:
    """Where window offset `offsets` of every window falls in an operand of `shape`: its
    open-mesh index (np.ix_, clipped into range) and whether that is inside (not padding)."""
    idx, inside = [], np.ones(count, bool)
    for d, (n, c, s, (lo, _), o) in enumerate(zip(shape, count, strides, padding, offsets)):
        pos = np.arange(c) * s + o - lo
        idx.append(np.clip(pos, 0, n - 1))
        inside &= ((pos >= 0) & (pos < n)).reshape([-1 if e == d else 1 for e in range(len(count))])
    return np.ix_(*idx), inside


@select_p.def_abstract_eval
def _select_abstract(x, *, window_dimensions, window_strides, padding, select):
    return jax.core.ShapedArray(windows(x.shape, window_dimensions, window_strides, padding), np.int32)


@select_p.def_impl
def _select_impl(x, *, window_dimensions, window_strides, padding, select):
    x = np.asarray(x)
    count = windows(x.shape, window_dimensions, window_strides, padding)
    best = np.zeros(count, x.dtype)
    at = np.full(count, -1, np.int32)
    for k, offsets in enumerate(np.ndindex(*window_dimensions)):
        where, inside = _at_offset(x.shape, count, window_strides, padding, offsets)
        v = x[where]
        better = v > best if select == "ge" else v < best
        take = inside & ((at < 0) | better)
        best, at = np.where(take, v, best), np.where(take, np.int32(k), at)
    return at


@scatter_p.def_abstract_eval
def _scatter_abstract(source, selected, *, operand_shape, window_dimensions, window_strides, padding):
    return jax.core.ShapedArray(tuple(operand_shape), source.dtype)


@scatter_p.def_impl
def _scatter_impl(source, selected, *, operand_shape, window_dimensions, window_strides, padding):
    """Windows in row-major order reach an element through offsets in reverse row-major
    order: adding offset by offset from the last keeps the kernel's order of sums."""
    source, selected = np.asarray(source), np.asarray(selected)
    out = np.zeros(operand_shape, source.dtype)
    count = source.shape
    all_offsets = list(np.ndindex(*window_dimensions))
    wide = np.promote_types(out.dtype, np.float32)  # the kernel's compute type
    for k in reversed(range(len(all_offsets))):
        where, inside = _at_offset(operand_shape, count, window_strides, padding, all_offsets[k])
        take = inside & (selected == k)
        # distinct windows reach distinct elements at one offset (strides are ≥ 1)
        summed = (out[where].astype(wide) + source.astype(wide)).astype(out.dtype)
        out[tuple(i[take] for i in np.broadcast_arrays(*where))] = summed[take]
    return out


@rewrites("select_and_scatter_add", replaces=True)
def split_pool_grad(node: Node, options: Options) -> list[Node]:
    source, operand = node.inputs
    p = node.params
    select = p["select_prim"].name
    if select not in ("ge", "le"):  # jax's max and min pools' gradients use these two
        raise NotImplementedError(f"select_and_scatter_add with select_prim={select} (from {node.source})")
    window = dict(window_dimensions=tuple(p["window_dimensions"]), window_strides=tuple(p["window_strides"]),
                  padding=tuple(tuple(pad) for pad in p["padding"]))
    selected = Var(tuple(source.shape), np.dtype(np.int32))
    return [Node(select_p, (operand,), (selected,), dict(window, select=select), node.source),
            Node(scatter_p, (source, selected), node.outputs, dict(window, operand_shape=tuple(operand.shape)),
                 node.source)]

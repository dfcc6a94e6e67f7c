"""Windowed reductions (pooling) and the max-pool gradient."""
from __future__ import annotations

import itertools

from nimblejax.compiler.ir import Node
from nimblejax.compiler import dtypes
from nimblejax.compiler.kinds import RuleKind
from nimblejax.compiler.lowering.codegen import (Index, KernelBuilder, dilated_source, loop_kernel,
                                                 loop_kernel_with_post, post_value, unroll_for)
from nimblejax.compiler.lowering.elementwise import _FMAX, _FMIN
from nimblejax.compiler.lowering.registry import register
from nimblejax.compiler.lowering.task import Kernel

WINDOW_REDUCERS = {
    "reduce_window_sum": ("({a} + {b})", lambda d: dtypes.literal(0, d)),
    "reduce_window_max": (_FMAX, dtypes.lowest),
    "reduce_window_min": (_FMIN, dtypes.highest),
}


def _window_positions(b: KernelBuilder, idx: Index, x_shape, p, offsets) -> tuple[list[str], list[str]]:
    """Operand index and in-bounds conditions of window element `offsets` of output `idx`."""
    conds, src = [], []
    base_dil = p.get("base_dilation") or (1,) * len(x_shape)
    win_dil = p.get("window_dilation") or (1,) * len(x_shape)
    for d, (i, off) in enumerate(zip(idx, offsets)):
        st, (lo, hi), bd, wd = p["window_strides"][d], p["padding"][d], base_dil[d], win_dil[d]
        # The output index is the operand index only without padding: high padding
        # adds outputs past the operand's end, which hold the identity.
        if (st, lo, hi, bd, wd, p["window_dimensions"][d]) == (1, 0, 0, 1, 1, 1):
            src.append(i)
            continue
        pos, ok = dilated_source(f"({i} * {st} + {off * wd} - ({lo}))", bd, x_shape[d])
        conds += ok
        src.append(pos)
    return src, conds


@register(*WINDOW_REDUCERS, kind=RuleKind.KERNEL)
def reduce_window(node: Node, post=None) -> Kernel:
    """One thread per output; the window is unrolled (pooling windows are small).
    Padding contributes the identity, as in XLA. With `post` (the elementwise group that
    alone reads the result at its own element: fusion_conv_post.py, an average pool's
    division by the window's count) the kernel writes that group's output instead."""
    x, out = node.inputs[0], node.outputs[0]
    p = node.params
    combine, init = WINDOW_REDUCERS[node.name]
    if not dtypes.is_float(out.dtype) and node.name != "reduce_window_sum":
        combine = "max({a}, {b})" if node.name.endswith("max") else "min({a}, {b})"
    ctype = dtypes.compute_type(out.dtype)

    def body(b: KernelBuilder, idx: Index) -> str:
        acc = b.tmp(ctype, init(out.dtype))
        for offsets in itertools.product(*(range(k) for k in p["window_dimensions"])):
            src, conds = _window_positions(b, idx, x.shape, p, offsets)
            step = f"{acc} = {dtypes.round_to(out.dtype, combine.format(a=acc, b=b.load(x, tuple(src))))};"
            b.emit(f"if ({' && '.join(conds)}) {{ {step} }}" if conds else step)
        return acc if post is None else post_value(b, post, out, idx, acc)

    return loop_kernel_with_post("pool", out, [node.name], body, post=post, unroll=unroll_for(out))


def _covering_windows(b: KernelBuilder, idx: Index, p, count) -> list[tuple[tuple, str, str]]:
    """The windows whose span covers operand element `idx` (w·stride − lo ≤ idx <
    w·stride − lo + k along each axis), as straight-line candidates in row-major window
    order (at most ceil(k / stride) an axis): each one's index, the condition that it
    exists and idx's row-major offset inside it."""
    dims, strides, pads = p["window_dimensions"], p["window_strides"], p["padding"]
    axes = []
    for d in range(len(dims)):
        k, st, lo = dims[d], strides[d], pads[d][0]
        if (k, st, lo) == (1, 1, 0):  # the window is idx itself along d
            axes.append([(idx[d], None, None)])
            continue
        first = b.tmp("int", f"max(0, ({idx[d]} + {lo} - {k} + {st}) / {st})")
        last = b.tmp("int", f"min({count[d] - 1}, ({idx[d]} + {lo}) / {st})")
        axes.append([(f"({first} + {j})", f"{first} + {j} <= {last}",
                      f"({idx[d]} + {lo} - ({first} + {j}) * {st})") for j in range(-(-k // st))])
    found = []
    for combo in itertools.product(*axes):
        offset = "0"
        for d, (_, _, off) in enumerate(combo):
            offset = f"({offset}) * {dims[d]} + {off}" if off is not None else offset
        conds = [c for _, c, _ in combo if c is not None]
        found.append((tuple(w for w, _, _ in combo), " && ".join(conds) or "true", offset))
    return found


@register("nimble_pool_select", kind=RuleKind.KERNEL)
def pool_select(node: Node) -> Kernel:
    """One thread per window: the row-major offset of the element it selects, the first
    best (canonicalize/pool_grad.py), -1 where the whole window is padding."""
    operand, out = node.inputs[0], node.outputs[0]
    p = node.params
    better = ">" if p["select"] == "ge" else "<"
    ctype = dtypes.compute_type(operand.dtype)
    params = dict(p, base_dilation=None, window_dilation=None)

    def body(b: KernelBuilder, idx: Index) -> str:
        best, at = b.tmp(ctype, "0"), b.tmp("int", "-1")
        for k, offsets in enumerate(itertools.product(*(range(n) for n in p["window_dimensions"]))):
            src, conds = _window_positions(b, idx, operand.shape, params, offsets)
            v = b.load(operand, tuple(src))
            b.emit(f"if ({' && '.join(conds) or 'true'}) {{ {ctype} v = {v}; "
                   f"if ({at} < 0 || v {better} {best}) {{ {best} = v; {at} = {k}; }} }}")
        return at

    return loop_kernel("poolselect", out, ["select_and_scatter_add"], body, unroll=unroll_for(out))


@register("nimble_pool_scatter", kind=RuleKind.KERNEL)
def pool_scatter(node: Node) -> Kernel:
    """Max-pool gradient as a gather: one thread per operand element sums, window by
    window, the source values of the covering windows that selected it."""
    source, selected = node.inputs
    out = node.outputs[0]
    ctype = dtypes.compute_type(out.dtype)

    def body(b: KernelBuilder, idx: Index) -> str:
        total = b.tmp(ctype, "0")
        for w, exists, offset in _covering_windows(b, idx, node.params, source.shape):
            b.emit(f"if ({exists} && {b.load(selected, w)} == {offset}) "
                   f"{total} = {dtypes.round_to(out.dtype, f'{total} + ' + b.load(source, w))};")
        return total

    return loop_kernel("poolgrad", out, ["select_and_scatter_add"], body, unroll=unroll_for(out))

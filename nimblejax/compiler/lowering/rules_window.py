"""Windowed reductions (pooling) and the max-pool gradient."""
from __future__ import annotations

import itertools

from nimblejax.compiler.ir import Node
from nimblejax.compiler import dtypes
from nimblejax.compiler.kinds import RuleKind
from nimblejax.compiler.lowering.codegen import (Index, KernelBuilder, dilated_source, loop_kernel,
                                                 loop_kernel_with_post, post_value)
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
        b.emit(f"{ctype} acc = {init(out.dtype)};")
        for offsets in itertools.product(*(range(k) for k in p["window_dimensions"])):
            src, conds = _window_positions(b, idx, x.shape, p, offsets)
            step = f"acc = {dtypes.round_to(out.dtype, combine.format(a='acc', b=b.load(x, tuple(src))))};"
            b.emit(f"if ({' && '.join(conds)}) {{ {step} }}" if conds else step)
        return "acc" if post is None else post_value(b, post, out, idx, "acc")

    return loop_kernel_with_post("pool", out, [node.name], body, post=post)


@register("select_and_scatter_add", kind=RuleKind.KERNEL)
def select_and_scatter_add(node: Node) -> Kernel:
    """Max-pool gradient as a gather: each operand element sums the source values of
    the windows that selected it (the first maximum of the window, as XLA's `ge`
    select keeps the earliest)."""
    source, operand = node.inputs
    out = node.outputs[0]
    p = dict(node.params)
    if p["select_prim"].name not in ("ge", "le"):
        raise NotImplementedError(f"select_and_scatter_add with select_prim={p['select_prim']} "
                                  f"(from {node.source})")
    better = ">" if p["select_prim"].name == "ge" else "<"
    dims, strides, pads = p["window_dimensions"], p["window_strides"], p["padding"]
    ctype = dtypes.compute_type(out.dtype)
    nd = operand.ndim

    def body(b: KernelBuilder, idx: Index) -> str:
        b.emit(f"{ctype} total = 0;")
        # Windows w whose span covers idx: w*stride - lo <= idx < w*stride - lo + k.
        loops = []
        for d in range(nd):
            lo = pads[d][0]
            first = f"max(0, ({idx[d]} + {lo} - {dims[d]} + {strides[d]}) / {strides[d]})"
            last = f"min({source.shape[d] - 1}, ({idx[d]} + {lo}) / {strides[d]})"
            if (dims[d], strides[d], lo) == (1, 1, 0):
                loops.append(None)
                continue
            b.open(f"for (int w{d} = {first}; w{d} <= {last}; ++w{d})")
            loops.append(d)
        w = tuple(f"w{d}" if loops[d] is not None else idx[d] for d in range(nd))
        # Find the window's selected element (first best in row-major window order).
        b.emit(f"{ctype} best = 0; long long best_at = -1;")
        for offsets in itertools.product(*(range(k) for k in dims)):
            src, conds = [], []
            for d in range(nd):
                if loops[d] is None:
                    src.append(idx[d])
                    continue
                pos = f"({w[d]} * {strides[d]} + {offsets[d]} - ({pads[d][0]}))"
                conds.append(f"{pos} >= 0 && {pos} < {operand.shape[d]}")
                src.append(pos)
            from nimblejax.compiler.lowering.codegen import linear

            at = linear(tuple(src), operand.shape)
            v = b.load(operand, tuple(src))
            cond = " && ".join(conds) or "true"
            b.emit(f"if ({cond}) {{ {ctype} v = {v}; if (best_at < 0 || v {better} best) "
                   f"{{ best = v; best_at = {at}; }} }}")
        me = linear(idx, operand.shape)
        b.emit(f"if (best_at == {me}) total = {dtypes.round_to(out.dtype, 'total + ' + b.load(source, w))};")
        for d in loops:
            if d is not None:
                b.close()
        return "total"

    return loop_kernel("poolgrad", out, ["select_and_scatter_add"], body)

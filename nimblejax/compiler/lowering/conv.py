"""Convolution lowering rules: the im2col gather kernel, the cuDNN call records (forward
and filter gradient), and a direct generated kernel for depthwise-like convolutions.
Which path a convolution takes is decided before fusion, in
compiler/canonicalize/conv_path.py.
"""
from __future__ import annotations

from typing import Mapping

from nimblejax.compiler.canonicalize.conv_path import im2col_shape, conv_specs
from nimblejax.compiler.ir import Node, Var
from nimblejax.compiler import dtypes
from nimblejax.compiler.kinds import RuleKind
from nimblejax.compiler.lowering.codegen import (Index, KernelBuilder, dilated_source, loop_kernel,
                                                 loop_kernel_with_post, post_value, unroll_for)
from nimblejax.compiler.lowering.conv_tiled import tiled_depthwise, tiles
from nimblejax.compiler.lowering.registry import register
from nimblejax.compiler.lowering.task import ConvCall, Kernel


@register("nimble_im2col", kind=RuleKind.KERNEL)
def im2col_kernel(node: Node) -> Kernel:
    """One thread per patch element; zeros where the window falls on padding or on the
    holes of lhs dilation. Transposed (each group's matrix stored patch size × patches),
    consecutive threads take consecutive patches of one window offset."""
    x, out = node.inputs[0], node.outputs[0]
    p = node.params
    n, *spatial, c = x.shape
    groups, mode = p["groups"], p["mode"]
    _, out_sp = im2col_shape(x.shape, p["kernel"], p["strides"], p["padding"], p["lhs_dilation"],
                             p["rhs_dilation"], groups, mode)
    nb = n // groups if mode == "batch" else n
    cg = c // groups if mode == "feature" else c
    
    def body(b: KernelBuilder, idx: Index) -> str:
        g, m, k = (idx[0], idx[2], idx[1]) if p.get("transposed") else idx
        mi = b.index_vars(m, [nb] + list(out_sp))
        ki = b.index_vars(k, list(p["kernel"]) + [cg])
        batch = mi[0] if mode == "feature" else f"({g} * {nb} + {mi[0]})"
        chan = f"({g} * {cg} + {ki[-1]})" if mode == "feature" else ki[-1]
        conds, src = [], [batch]
        for j, size in enumerate(spatial):
            st, (lo, _hi), ld, rd = p["strides"][j], p["padding"][j], p["lhs_dilation"][j], p["rhs_dilation"][j]
            pos, ok = dilated_source(b.tmp("int", f"{mi[1 + j]} * {st} + {ki[j]} * {rd} - ({lo})"), ld, size)
            conds += ok
            src.append(pos)
        src.append(chan)
        zero = dtypes.literal(0, x.dtype)
        return b.tmp(dtypes.compute_type(x.dtype),
                     f"({' && '.join(conds) or 'true'}) ? {b.load(x, tuple(src))} : {zero}")

    return loop_kernel("im2col", out, ["im2col"], body, unroll=unroll_for(out))


# ---- the cuDNN calls --------------------------------------------------------------
def _conv_call(node: Node, mode: str, x, w, y, groups: int) -> ConvCall:
    """The ConvCall of a cuDNN node: x (N,H,W,C), w (K,R,S,C/G), y (N,P,Q,K), in the
    first input's dtype and the output's."""
    p = node.params
    return ConvCall(tuple(x.shape), tuple(w.shape), tuple(y.shape), tuple(p["padding"]),
                    tuple(p["strides"]), tuple(p["dilation"]), groups, dtypes.name(node.inputs[0].dtype),
                    dtypes.name(node.outputs[0].dtype), p["math"], mode=mode, x=x, w=w, y=y)


@register("nimble_cudnn_conv", kind=RuleKind.CUDNN)
def cudnn_conv(node: Node):
    (x, w), y = node.inputs, node.outputs[0]
    return _conv_call(node, "forward", x, w, y, node.params["groups"])


@register("nimble_cudnn_conv_filter_grad", kind=RuleKind.CUDNN)
def cudnn_conv_filter_grad(node: Node):
    """dW of a forward convolution from x and dy (canonicalize/conv_filter_grad.py)."""
    (x, dy), dw = node.inputs, node.outputs[0]
    return _conv_call(node, "filter_grad", x, dw, dy, node.params["groups"])


@register("nimble_cudnn_conv_data_grad", kind=RuleKind.CUDNN)
def cudnn_conv_data_grad(node: Node):
    """dx of a forward convolution from dy and w (canonicalize/conv_data_grad.py)."""
    (dy, w), dx = node.inputs, node.outputs[0]
    return _conv_call(node, "data_grad", dx, w, dy, 1)


# ---- the direct kernel (depthwise) -----------------------------------------------------
@register("conv_general_dilated", kind=RuleKind.KERNEL, fuses=(0,),
          cheap_fuses=lambda node: tiles(node) is None)
def direct_conv(node: Node, inlined: Mapping[Var, Node] = {}, post=None) -> Kernel:
    """A depthwise convolution in NHWC: tiles in shared memory (conv_tiled.py), which
    compute the input's fused producers once per element. Any other: one thread per
    output element, a loop over the window and the group's channels, the input's
    elementwise producers computed where it is read (`inlined`): a depthwise convolution
    after a batch norm and relu6 (MobileNetV2's block) reads the expansion GEMM's product,
    and no kernel writes the activated value first. There each input element is read once
    per window position (9 or 25 times), so only cheap producers are taken
    (`cheap_fuses`: fusion_costs.py): EfficientNet's swish, a sigmoid recomputed 25 times, made
    its batch-32 step 0.81x → 0.66x jax.jit on an H100. The zero padding stays zero: a
    position outside the input is skipped before anything is read there. With `post` (a
    fusion.Group reading the result at its own element: fusion_conv_post.py) the kernel
    writes that group's output, computed from the convolution's value at the element,
    and not the result."""
    t = tiles(node)
    if t is not None:
        return tiled_depthwise(node, t, inlined, post)
    x, w = node.inputs
    out = node.outputs[0]
    p = node.params
    lhs_spec, rhs_spec, out_spec = conv_specs(node)
    k = len(lhs_spec) - 2
    fg, bg = p["feature_group_count"], p["batch_group_count"]
    cg = w.shape[rhs_spec[1]]
    o_total = out.shape[out_spec[1]]
    og_f = o_total // fg
    og_b = o_total // bg
    kernel = [w.shape[d] for d in rhs_spec[2:]]
    acc_t = "float" if dtypes.is_float(out.dtype) else dtypes.compute_type(out.dtype)
    
    def body(b: KernelBuilder, idx: Index) -> str:
        nb_, of = idx[out_spec[0]], idx[out_spec[1]]
        osp = [idx[d] for d in out_spec[2:]]
        g = b.tmp("int", f"{of} / {og_f}") if fg > 1 else "0"
        bgi = b.tmp("int", f"{of} / {og_b}") if bg > 1 else "0"
        nbatch = out.shape[out_spec[0]]
        b.emit(f"{acc_t} acc = 0;")
        loops = [("ci", cg)] + [(f"k{j}", kernel[j]) for j in range(k)]
        for var, size in loops:
            b.open(f"for (int {var} = 0; {var} < {size}; ++{var})")
        conds, xs = [], [""] * (k + 2)
        xs[lhs_spec[0]] = f"({bgi} * {nbatch} + {nb_})" if bg > 1 else nb_
        xs[lhs_spec[1]] = f"({g} * {cg} + ci)" if fg > 1 else "ci"
        for j in range(k):
            st, (lo, _), ld, rd = p["window_strides"][j], p["padding"][j], p["lhs_dilation"][j], p["rhs_dilation"][j]
            pos, ok = dilated_source(f"({osp[j]} * {st} + k{j} * {rd} - ({lo}))", ld, x.shape[lhs_spec[2 + j]])
            conds += ok
            xs[lhs_spec[2 + j]] = pos
        ws = [""] * (k + 2)
        ws[rhs_spec[0]] = of
        ws[rhs_spec[1]] = "ci"
        for j in range(k):
            ws[rhs_spec[2 + j]] = f"k{j}"
        b.emit(f"if (!({' && '.join(conds) or 'true'})) continue;")
        read = b.value if x in inlined else b.load  # its fused producers, computed here
        b.emit(f"acc += ({acc_t}){read(x, tuple(xs))} * ({acc_t}){b.load(w, tuple(ws))};")
        for _ in loops:
            b.close()
        b.forget()  # the input's fused producers were computed inside the window loops
        return "acc" if post is None else post_value(b, post, out, idx, "acc")

    return loop_kernel_with_post("conv", out, ["conv"], body, inlined, post)

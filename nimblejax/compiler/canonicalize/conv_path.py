"""Convolutions before fusion: which path each one takes, and the rewrite to it.

`conv_path` is the one place a convolution's path is decided:
- "direct": depthwise-like convolutions (one input channel per group) stay one node,
  lowered to a generated kernel (lowering/conv.py);
- "cudnn": 2-D convolutions cuDNN's forward API takes, where options allow cuDNN and the
  batch is large enough (measured, see CUDNN_MIN_BATCH), become transposes to NHWC/KRSC
  around one `nimble_cudnn_conv`;
- "cudnn_filter_grad": the filter gradients `jax.grad` emits, whose window is the whole
  activation map, become one `nimble_cudnn_conv_filter_grad` (conv_filter_grad.py);
- "cudnn_data_grad": the input gradients of strided convolutions (lhs dilation) become
  one `nimble_cudnn_conv_data_grad` (conv_data_grad.py);
- "gemm": everything else becomes transposes to (N, spatial..., C), `nimble_im2col`
  (patches), one batched dot_general and transposes back. Every layout, stride,
  padding, lhs/rhs dilation, feature_group_count and batch_group_count that JAX emits
  (gradients included) maps onto that scheme.

`nimble_im2col` and `nimble_cudnn_conv` are primitives of ours with JAX reference
implementations, so the CPU interpreter evaluates them like any other node.
"""
from __future__ import annotations

import math
from typing import Sequence

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.extend.core import Primitive

from nimblejax.compiler.canonicalize import conv_data_grad as data_grad
from nimblejax.compiler.canonicalize.conv_common import conv_specs, transpose
from nimblejax.compiler.canonicalize import conv_filter_grad as filter_grad
from nimblejax.compiler.canonicalize.dot import compute_mode
from nimblejax.compiler.canonicalize.registry import rewrites
from nimblejax.compiler.canonicalize.replace import replace_with
from nimblejax.compiler.ir import Node, Var
from nimblejax.compiler import dtypes
from nimblejax.options import Options

# ---- the im2col primitive ------------------------------------------------------------
im2col_p = Primitive("nimble_im2col")


def _out_spatial(size: int, k: int, stride: int, pad: tuple[int, int], lhs_dil: int, rhs_dil: int) -> int:
    dilated_in = (size - 1) * lhs_dil + 1 + pad[0] + pad[1]
    dilated_k = (k - 1) * rhs_dil + 1
    return max(0, (dilated_in - dilated_k) // stride + 1)


def im2col_shape(x_shape, kernel, strides, padding, lhs_dilation, rhs_dilation, groups, mode,
                 transposed=False):
    """((groups, patches, patch size), output spatial sizes); with `transposed`, each
    group's matrix is stored transposed: (groups, patch size, patches)."""
    n, *spatial, c = x_shape
    out_sp = [_out_spatial(s, k, st, p, ld, rd) for s, k, st, p, ld, rd in
              zip(spatial, kernel, strides, padding, lhs_dilation, rhs_dilation)]
    nb = n // groups if mode == "batch" else n
    cg = c // groups if mode == "feature" else c
    rows, cols = nb * math.prod(out_sp), math.prod(kernel) * cg
    return ((groups, cols, rows) if transposed else (groups, rows, cols)), out_sp


@im2col_p.def_abstract_eval
def _im2col_abstract(x, *, kernel, strides, padding, lhs_dilation, rhs_dilation, groups, mode,
                     transposed=False):
    shape, _ = im2col_shape(x.shape, kernel, strides, padding, lhs_dilation, rhs_dilation, groups, mode,
                            transposed)
    return jax.core.ShapedArray(shape, x.dtype)


@im2col_p.def_impl
def _im2col_impl(x, *, kernel, strides, padding, lhs_dilation, rhs_dilation, groups, mode, transposed=False):
    p = _im2col_numpy(x, kernel, strides, padding, lhs_dilation, rhs_dilation, groups, mode)
    return p.transpose(0, 2, 1).copy() if transposed else p


def _im2col_numpy(x, kernel, strides, padding, lhs_dilation, rhs_dilation, groups, mode):
    """Reference semantics (used by the CPU interpreter), in NumPy: pad and dilate, then
    one strided slice per kernel offset. Only data moves, so it is exact; done with JAX's
    eager ops it compiled one program per kernel offset (a filter gradient's window is
    the whole activation map: 256 of them for 16x16), most of a CPU test's time."""
    x = np.asarray(x)
    n, *spatial, c = x.shape
    cfg = [(0, 0, 0)] + [(lo, hi, ld - 1) for (lo, hi), ld in zip(padding, lhs_dilation)] + [(0, 0, 0)]
    xp = _pad(x, cfg)
    _, out_sp = im2col_shape(x.shape, kernel, strides, padding, lhs_dilation, rhs_dilation, groups, mode)
    cols = []
    for offs in np.ndindex(*kernel):
        start = [o * rd for o, rd in zip(offs, rhs_dilation)]
        window = tuple(slice(s0, s0 + (os - 1) * st + 1, st) for s0, os, st in zip(start, out_sp, strides))
        cols.append(xp[(slice(None),) + window + (slice(None),)])
    p = np.stack(cols, axis=-2)  # (N, OS..., KS, C)
    ks = math.prod(kernel)
    if mode == "feature":
        p = p.reshape(n, -1, ks, groups, c // groups).transpose(3, 0, 1, 2, 4)
        return p.reshape(groups, -1, ks * (c // groups))
    p = p.reshape(groups, n // groups, -1, ks, c)
    return p.reshape(groups, -1, ks * c)


def _pad(x: np.ndarray, cfg) -> np.ndarray:
    """lax.pad with zeros, in NumPy: per axis (low, high, interior); low and high may be
    negative (they crop)."""
    for axis, (lo, hi, interior) in enumerate(cfg):
        if interior and x.shape[axis] > 1:
            shape = list(x.shape)
            shape[axis] = (x.shape[axis] - 1) * (interior + 1) + 1
            dilated = np.zeros(shape, x.dtype)
            dilated[(slice(None),) * axis + (slice(None, None, interior + 1),)] = x
            x = dilated
        if lo > 0 or hi > 0:
            widths = [(0, 0)] * x.ndim
            widths[axis] = (max(lo, 0), max(hi, 0))
            x = np.pad(x, widths)
        if lo < 0 or hi < 0:
            x = x[(slice(None),) * axis + (slice(max(-lo, 0), x.shape[axis] + min(hi, 0)),)]
    return x


# ---- the rewrite -----------------------------------------------------------------------
def conv_path(node: Node, options: Options) -> str:
    """'direct' for depthwise-like convolutions (1 input channel per group: a GEMM per
    group would be a batch of tiny matrices); 'cudnn_filter_grad' for filter gradients
    (conv_filter_grad.py), 'gemm_filter_grad' for those of fewer than MIN_CHANNELS
    channels and of 1×1 filters of stride 1 (the forward convolution's patches of x
    times dy: `_filter_grad_gemm`), 'cudnn_data_grad' for strided convolutions' input gradients
    (conv_data_grad.py) and 'cudnn' for the 2-D convolutions cuDNN's forward API takes,
    where cuDNN is found (options.conv=cudnn|im2col overrides), unless the batch is small
    (CUDNN_MIN_BATCH); else 'gemm' (im2col + cuBLAS)."""
    lhs_spec, rhs_spec, _ = conv_specs(node)
    x, w = node.inputs
    cg = w.shape[rhs_spec[1]]
    if node.params["feature_group_count"] > 1 and cg == 1:
        return "direct"
    if _is_plain_1x1(node):
        return "gemm"  # already a GEMM, no im2col: measured faster than XLA's cuDNN call
    if filter_grad.eligible(node):  # the window is the activation map
        if options.conv == "auto" and (filter_grad.few_channels(node)  # an image's first layer
                                       or filter_grad.pointwise(node)):  # x is the patch matrix
            return "gemm_filter_grad"
        return "cudnn_filter_grad" if use_cudnn(options, filter_grad.batch(node)) else "gemm"
    if data_grad.eligible(node):  # a strided convolution's input gradient (lhs dilation)
        return "cudnn_data_grad" if use_cudnn(options, data_grad.batch(node)) else "gemm"
    if _cudnn_eligible(node) and use_cudnn(options, _batch(node)):
        return "cudnn"
    return "gemm"


# Below this batch size im2col + cuBLASLt beat cuDNN's NHWC float32 kernels, measured
# on an H200 (GPU time of the whole model): Inception-v3 at batch 1 814-869 vs
# 1358-2167 µs, ResNet-50 at batch 1 560 vs 704-745 µs. At batch 32 cuDNN wins, also
# for its 17×17 and 8×8 layers (Inception-v3 4393 µs vs 5356 µs with those on im2col).
# Only batches 1 and 32 were measured; 8 is a guess between them.
CUDNN_MIN_BATCH = 8


def _batch(node: Node) -> int:
    _, _, out_spec = conv_specs(node)
    return node.outputs[0].shape[out_spec[0]]


def _is_plain_1x1(node: Node) -> bool:
    p = node.params
    _, rhs_spec, _ = conv_specs(node)
    w = node.inputs[1]
    return (all(w.shape[d] == 1 for d in rhs_spec[2:]) and all(s == 1 for s in p["window_strides"])
            and all(tuple(q) == (0, 0) for q in p["padding"]) and all(d == 1 for d in p["lhs_dilation"])
            and p["feature_group_count"] == 1 and p["batch_group_count"] == 1)


def _cudnn_eligible(node: Node) -> bool:
    x, w = node.inputs
    out = node.outputs[0]
    p = node.params
    floats = ("float32", "float16", "bfloat16")
    _, rhs_spec, _ = conv_specs(node)
    # Filter-gradient convolutions have the whole output gradient as their "filter";
    # cuDNN's forward algorithms are slow there, im2col + GEMM is not (measured).
    small_filter = all(w.shape[d] <= MAX_CUDNN_FILTER for d in rhs_spec[2:])
    return (x.ndim == 4 and small_filter and all(d == 1 for d in p["lhs_dilation"])
            and p["batch_group_count"] == 1
            and dtypes.name(x.dtype) in floats and dtypes.name(x.dtype) == dtypes.name(w.dtype)
            and dtypes.name(out.dtype) in floats and all(lo >= 0 and hi >= 0 for lo, hi in p["padding"]))


def use_cudnn(options: Options, batch: int) -> bool:
    """Whether a convolution cuDNN takes (see _cudnn_eligible) of this batch goes to
    cuDNN: the one place nimblejax decides it. options.conv ("cudnn" | "im2col", from
    NIMBLE_CONV) forces or refuses it; "auto" takes cuDNN where libcudnn was found
    (options.cudnn) and the batch is at least CUDNN_MIN_BATCH."""
    if options.conv != "auto":
        return options.conv == "cudnn"
    return options.cudnn and batch >= CUDNN_MIN_BATCH


MAX_CUDNN_FILTER = 11


@rewrites("conv_general_dilated")
def rewrite_conv(node: Node, options: Options) -> list[Node]:
    """conv_general_dilated → [transposes, im2col, dot_general, transposes], or
    [transposes, nimble_cudnn_conv, transpose], or [node] (direct kernel)."""
    path = conv_path(node, options)
    if path == "direct":
        return [node]
    out = node.outputs[0]
    if path == "cudnn":
        fn = lambda a, b: _via_cudnn(a, b, node, out)  # noqa: E731
    elif path == "cudnn_filter_grad":
        fn = lambda a, b: filter_grad.via_cudnn(a, b, node, _math(node))  # noqa: E731
    elif path == "gemm_filter_grad":
        fn = lambda a, b: _filter_grad_gemm(a, b, node)  # noqa: E731
    elif path == "cudnn_data_grad":
        fn = lambda a, b: data_grad.via_cudnn(a, b, node, _math(node))  # noqa: E731
    else:
        fn = lambda a, b: _decomposed(a, b, node.params, out.shape)  # noqa: E731
    params = tuple(sorted(node.params.items()))  # with the types, all the trace depends on
    nodes = replace_with(node, fn, key=("conv", path, params))
    assert nodes[-1] is not node, "the decomposition must end in the result"
    return nodes


def _decomposed(x, w, params, out_shape: Sequence[int]):
    dn = params["dimension_numbers"]
    lhs_spec, rhs_spec, out_spec = tuple(dn.lhs_spec), tuple(dn.rhs_spec), tuple(dn.out_spec)
    k = len(lhs_spec) - 2
    x = transpose(x, (lhs_spec[0],) + lhs_spec[2:] + (lhs_spec[1],))      # N, S..., C
    w = transpose(w, rhs_spec[2:] + (rhs_spec[1], rhs_spec[0]))           # KS..., Cg, O
    fg, bg = params["feature_group_count"], params["batch_group_count"]
    groups, mode = (fg, "feature") if fg > 1 else (bg, "batch")
    kernel = tuple(w.shape[:k])
    n, c, o = x.shape[0], x.shape[-1], w.shape[-1]
    simple = (groups == 1 and all(s == 1 for s in kernel) and all(s == 1 for s in params["window_strides"])
              and all(p == (0, 0) for p in params["padding"]) and all(d == 1 for d in params["lhs_dilation"]))
    if simple:  # 1x1 convolution: the input already is the patch matrix
        patches = x.reshape(1, -1, c)
    else:
        patches = im2col_p.bind(x, kernel=kernel, strides=tuple(params["window_strides"]),
                                padding=tuple(tuple(p) for p in params["padding"]),
                                lhs_dilation=tuple(params["lhs_dilation"]),
                                rhs_dilation=tuple(params["rhs_dilation"]), groups=groups, mode=mode)
    og = o // groups
    kg = patches.shape[-1]
    wm = w.reshape(kg, groups, og).transpose(1, 0, 2) if groups > 1 else w.reshape(1, kg, o)
    y = lax.dot_general(patches, wm, (((2,), (1,)), ((0,), (0,))), precision=params["precision"],
                        preferred_element_type=params["preferred_element_type"])  # G, M, Og
    out_batch = n // groups if mode == "batch" else n
    nsc_spatial = [out_shape[d] for d in out_spec[2:]]
    y = y.transpose(1, 0, 2) if groups > 1 else y
    y = y.reshape(out_batch, *nsc_spatial, o)
    perm = [0] * (k + 2)
    perm[out_spec[0]] = 0
    perm[out_spec[1]] = k + 1
    for j, d in enumerate(out_spec[2:]):
        perm[d] = 1 + j
    return transpose(y, tuple(perm))


def _filter_grad_gemm(x, dy, node: Node):
    """A filter-gradient convolution (conv_filter_grad.py) as the forward convolution's
    patches of x, transposed, times dy: dW[(r, s, c), k] = Σ_(n, p, q) patches[(n, p, q),
    (r, s, c)] · dy[(n, p, q), k], one GEMM over both in the forward's layout (no
    transposes where the forward ran in NHWC). The patches are written transposed, (r, s,
    c) × (n, p, q): their rows are then N·P·Q long, which keeps the GEMM's operand
    16-byte aligned where R·S·C is not (147 for a 7×7 filter of 3 channels: cuBLASLt
    then takes an align1 kernel, 188.7 µs for ResNet-50's first layer at batch 32 on an
    H200). Its own im2col (`_decomposed`: the window
    the whole activation map) needs x and dy transposed to the filter-gradient layout."""
    p = node.params
    _, _, out_spec = conv_specs(node)
    x, dy, strides, dilation, filt, padding = filter_grad.forward_terms(x, dy, node)
    if filter_grad.pointwise(node):  # the patches are x
        patches, patch_axis = x.reshape(1, -1, x.shape[3]), 1
    else:
        patches, patch_axis = im2col_p.bind(
            x, kernel=filt, strides=strides, padding=padding, lhs_dilation=(1, 1), rhs_dilation=dilation,
            groups=1, mode="feature", transposed=True), 2  # 1, R·S·C, N·P·Q
    k = dy.shape[3]
    dw = lax.dot_general(patches, dy.reshape(1, -1, k), (((patch_axis,), (1,)), ((0,), (0,))),
                         precision=p["precision"], preferred_element_type=p["preferred_element_type"])
    dw = dw.reshape(*filt, x.shape[3], k)  # R, S, C, K: the node's (spatial, batch, feature)
    perm = [0] * 4
    perm[out_spec[0]], perm[out_spec[1]], perm[out_spec[2]], perm[out_spec[3]] = 2, 3, 0, 1
    return transpose(dw, tuple(perm))


# ---- the cuDNN path ----------------------------------------------------------------------
cudnn_conv_p = Primitive("nimble_cudnn_conv")


def _cudnn_out_shape(x_shape, w_shape, padding, strides, dilation):
    n, h, w_, _c = x_shape
    k, r, s, _ = w_shape
    oh = _out_spatial(h, r, strides[0], (padding[0], padding[0]), 1, dilation[0])
    ow = _out_spatial(w_, s, strides[1], (padding[1], padding[1]), 1, dilation[1])
    return (n, oh, ow, k)


@cudnn_conv_p.def_abstract_eval
def _cudnn_abstract(x, w, *, padding, strides, dilation, groups, math, out_dtype):
    return jax.core.ShapedArray(_cudnn_out_shape(x.shape, w.shape, padding, strides, dilation), out_dtype)


@cudnn_conv_p.def_impl
def _cudnn_impl(x, w, *, padding, strides, dilation, groups, math, out_dtype):
    """Reference semantics for the CPU interpreter."""
    return lax.conv_general_dilated(
        jnp.asarray(x), jnp.asarray(w), strides, [(p, p) for p in padding], rhs_dilation=dilation,
        dimension_numbers=("NHWC", "OHWI", "NHWC"), feature_group_count=groups,
        preferred_element_type=out_dtype,
        precision=lax.Precision.HIGHEST if math == "f32" else None)


def _math(node: Node) -> str:
    """cuDNN's math for a convolution: tensor ops for half types, else as XLA's dots."""
    return "half" if dtypes.is_half(node.inputs[0].dtype) else compute_mode(node)


def _via_cudnn(x, w, node: Node, out: Var):
    p = node.params
    lhs_spec, rhs_spec, out_spec = conv_specs(node)
    x = transpose(x, (lhs_spec[0], lhs_spec[2], lhs_spec[3], lhs_spec[1]))   # NHWC
    w = transpose(w, (rhs_spec[0], rhs_spec[2], rhs_spec[3], rhs_spec[1]))   # KRSC
    # cuDNN pads symmetrically: the asymmetric remainder is an explicit pad.
    sym = tuple(min(lo, hi) for lo, hi in p["padding"])
    extra = [(lo - m, hi - m) for (lo, hi), m in zip(p["padding"], sym)]
    if any(e != (0, 0) for e in extra):
        x = lax.pad(x, jnp.zeros((), x.dtype), [(0, 0, 0)] + [(a, b, 0) for a, b in extra] + [(0, 0, 0)])
    y = cudnn_conv_p.bind(x, w, padding=sym, strides=tuple(p["window_strides"]),
                          dilation=tuple(p["rhs_dilation"]), groups=p["feature_group_count"],
                          math=_math(node), out_dtype=np.dtype(out.dtype))
    perm = [0] * 4
    perm[out_spec[0]], perm[out_spec[1]], perm[out_spec[2]], perm[out_spec[3]] = 0, 3, 1, 2
    return transpose(y, tuple(perm))

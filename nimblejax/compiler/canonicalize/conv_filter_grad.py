"""Filter-gradient convolutions as one cuDNN backward-filter call.

`jax.grad` of a convolution with respect to its filter emits another
`conv_general_dilated`: the activations x as its lhs (batch and feature dimensions
swapped), the output gradient dy as its "filter", and the filter's window as its
output. Its window is as large as the activation map, so the forward API does not take it
and im2col would write a patch matrix of kernel-area times the activation's size (231 MB
for a 3×3 layer of ResNet-50 at batch 32). cuDNN's backward-filter API computes it from x
and dy as they are, as XLA does.

In forward terms, with the filter-gradient convolution's own parameters:

    dW[k, r, s, c] = Σ_{n, p, q} x[n, p·st + r·dl - lo, q·st + s·dl - lo, c] · dy[n, p, q, k]

where st is its rhs dilation (the forward stride), dl its window stride (the forward
dilation) and lo its low padding. cuDNN pads symmetrically; where the forward output
size that symmetric padding gives differs from dy's, x is padded (or cropped) explicitly
to exactly the window the sum reads, and cuDNN pads nothing.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.extend.core import Primitive

from nimblejax.compiler.canonicalize.conv_common import conv_specs, forward_vjp, one_float_dtype, transpose
from nimblejax.compiler.ir import Node

filter_grad_p = Primitive("nimble_cudnn_conv_filter_grad")

# The window (the forward filter) cuDNN's backward-filter call is used for, per axis.
MAX_FILTER = 11
# Filter gradients of activations with fewer channels (an image's 3) are one GEMM over
# the forward convolution's patches (conv_path._filter_grad_gemm): for them cuDNN's
# legacy API offers only `wgrad_alg0_engine`. Measured on an H200
# (examples/gpu/probe_conv_wgrad.py, 536b9e3): ResNet-50's first convolution (7×7,
# stride 2, 3 channels) at batch 32, 440 µs through cuDNN against 369 through the
# filter-gradient convolution's own im2col + GEMM (193 of it the im2col, 81 transposes
# of x and dy, which the forward's patches do without; XLA's engine from cuDNN's graph
# API: 237); padded to 4 or 8 channels cuDNN's call took 624 and 1116.
MIN_CHANNELS = 4
# ... while those patches (N·P·Q × R·S·C elements, ResNet-50's first layer at batch 32:
# 236 MB) fit in this many bytes; cuDNN needs no such buffer.
MAX_PATCH_BYTES = 1 << 30
# 1×1 filters of stride 1 (`pointwise`) as one GEMM over x and dy as they are, as XLA
# computes them: off. Measured on an H200 (train steps at batch 32, the switch flipped
# in one process, two runs each, 2026-11-28, with common subexpressions merged after
# canonicalization): MobileNetV2 4745 µs of GPU time against 4898 through cuDNN (the
# same plan measured 5545 in another process: compare within one process only), but
# ResNet-50 9193-9210 against 9043-9049 (its 1×1 GEMMs take what cuDNN's calls took, and
# dz·scale, which they read, becomes a kernel of its own: 34 of them).
POINTWISE_GEMM = False


@filter_grad_p.def_abstract_eval
def _abstract(x, dy, *, w_shape, padding, strides, dilation, groups, math, out_dtype):
    return jax.core.ShapedArray(w_shape, out_dtype)


@filter_grad_p.def_impl
def _impl(x, dy, *, w_shape, padding, strides, dilation, groups, math, out_dtype):
    """Reference semantics (the CPU interpreter): the VJP of the forward convolution
    x (NHWC) * w (KRSC) -> y (NHWC) with respect to w, at dy."""
    return forward_vjp(x, jnp.zeros(w_shape, jnp.asarray(x).dtype), dy, 1, padding=padding, strides=strides,
                       dilation=dilation, groups=groups, math=math, out_dtype=out_dtype)


def eligible(node: Node) -> bool:
    """A 2-D float convolution in filter-gradient form: one dtype, no feature groups
    (a grouped or depthwise convolution's filter gradient has batch groups), no lhs
    dilation, a window (rhs spatial) larger than its output in some axis, an output no
    larger than MAX_FILTER in each, and a non-negative low padding."""
    x, w = node.inputs
    out = node.outputs[0]
    p = node.params
    if x.ndim != 4 or p["feature_group_count"] != 1:
        return False
    if any(d != 1 for d in p["lhs_dilation"]) or any(lo < 0 for lo, _ in p["padding"]):
        return False
    if not one_float_dtype(x, w, out):
        return False
    _, rhs_spec, out_spec = conv_specs(node)
    window = [w.shape[d] for d in rhs_spec[2:]]
    filt = [out.shape[d] for d in out_spec[2:]]
    return all(f <= MAX_FILTER for f in filt) and any(k > f for k, f in zip(window, filt))


def few_channels(node: Node) -> bool:
    """Fewer than MIN_CHANNELS forward activation channels (this convolution's lhs batch
    dimension), in one group, and the forward's patches within MAX_PATCH_BYTES."""
    lhs_spec, _, out_spec = conv_specs(node)
    x, dy = node.inputs
    out = node.outputs[0]
    k = out.shape[out_spec[1]]
    patch_bytes = (dy.size // k) * (out.size // k) * np.dtype(x.dtype).itemsize
    return (x.shape[lhs_spec[0]] < MIN_CHANNELS and node.params["batch_group_count"] == 1
            and patch_bytes <= MAX_PATCH_BYTES)


def pointwise(node: Node) -> bool:
    """A 1×1 forward filter of stride 1, unpadded, in one group: the forward's patch
    matrix is x itself, so its filter gradient is xᵀ · dy, one GEMM with no gather (as
    XLA computes these; cuDNN's backward-filter call otherwise). POINTWISE_GEMM off
    gives them to cuDNN."""
    lhs_spec, rhs_spec, out_spec = conv_specs(node)
    x, dy = node.inputs
    p = node.params
    return (POINTWISE_GEMM and p["batch_group_count"] == 1
            and all(node.outputs[0].shape[d] == 1 for d in out_spec[2:])
            and all(d == 1 for d in p["rhs_dilation"]) and all(lo == 0 for lo, _ in p["padding"])
            and [x.shape[d] for d in lhs_spec[2:]] == [dy.shape[d] for d in rhs_spec[2:]])


def batch(node: Node) -> int:
    """The forward batch: the dimension the filter gradient sums over."""
    lhs_spec, _, _ = conv_specs(node)
    return node.inputs[0].shape[lhs_spec[1]]


def forward_terms(x, dy, node: Node):
    """x and dy in the forward convolution's roles and layouts (x: N, H, W, C, its lhs
    feature, spatial and batch dimensions; dy: N, P, Q, K), the forward's strides (this
    convolution's rhs dilation), dilation (its window strides) and filter size (its
    output's spatial size), and per axis the padding (lo, hi) that gives dy's size exactly."""
    p = node.params
    lhs_spec, rhs_spec, out_spec = conv_specs(node)
    x = transpose(x, (lhs_spec[1], lhs_spec[2], lhs_spec[3], lhs_spec[0]))
    dy = transpose(dy, (rhs_spec[1], rhs_spec[2], rhs_spec[3], rhs_spec[0]))
    strides, dilation = tuple(p["rhs_dilation"]), tuple(p["window_strides"])
    filt = tuple(node.outputs[0].shape[d] for d in out_spec[2:])
    padding = tuple((lo, (need - 1) * st + (f - 1) * dl + 1 - size - lo) for size, need, (lo, _), st, dl, f
                    in zip(x.shape[1:3], dy.shape[1:3], p["padding"], strides, dilation, filt))
    return x, dy, strides, dilation, filt, padding


def via_cudnn(x, dy, node: Node, math: str):
    """The node's value as [transposes to NHWC, pad, nimble_cudnn_conv_filter_grad,
    transpose back] (traced by the caller into graph nodes)."""
    p = node.params
    _, _, out_spec = conv_specs(node)
    out = node.outputs[0]
    x, dy, strides, dilation, filt, exact = forward_terms(x, dy, node)
    # cuDNN pads symmetrically (lo on both sides): where that does not give dy's size, x
    # is padded (or cropped) to the exact window and cuDNN pads nothing.
    pads = []
    for j, (lo, hi) in enumerate(exact):
        symmetric = (x.shape[1 + j] + 2 * lo - dilation[j] * (filt[j] - 1) - 1) // strides[j] + 1
        pads.append((lo, None) if symmetric == dy.shape[1 + j] else (0, (lo, hi)))
    if any(extra is not None for _, extra in pads):
        x = _pad_exactly(x, [extra or (0, 0) for _, extra in pads])
    # The forward convolution's groups are this one's batch groups: group g of x's
    # channels (its lhs batch) with group g of dy's channels (its output features).
    groups = p["batch_group_count"]
    dw = filter_grad_p.bind(
        x, dy, w_shape=(dy.shape[3],) + filt + (x.shape[3] // groups,), padding=tuple(lo for lo, _ in pads),
        strides=strides, dilation=dilation, groups=groups, math=math, out_dtype=np.dtype(out.dtype))
    # dw is (K, R, S, C/G): the node's output has C/G as its batch, K as its feature.
    perm = [0] * 4
    perm[out_spec[0]], perm[out_spec[1]], perm[out_spec[2]], perm[out_spec[3]] = 3, 0, 1, 2
    return transpose(dw, perm)


def _pad_exactly(x, spatial: list[tuple[int, int]]):
    """x (NHWC) padded by (lo, hi) per spatial axis, a negative hi cropping."""
    grow = [(0, 0, 0)] + [(lo, max(hi, 0), 0) for lo, hi in spatial] + [(0, 0, 0)]
    if any(g != (0, 0, 0) for g in grow):
        x = lax.pad(x, jnp.zeros((), x.dtype), grow)
    if any(hi < 0 for _, hi in spatial):
        limit = [x.shape[0]] + [x.shape[1 + j] + min(hi, 0) for j, (_, hi) in enumerate(spatial)] + [x.shape[3]]
        x = lax.slice(x, (0, 0, 0, 0), tuple(limit))
    return x

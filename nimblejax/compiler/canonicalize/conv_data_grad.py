"""Input gradients of strided convolutions as one cuDNN backward-data call.

`jax.grad` of a convolution with stride s with respect to its input emits a
convolution of dy with the flipped filter and lhs dilation s. im2col would gather a
patch matrix of the dilated map (kernel area times its size: 462 MB for one stride-2
3×3 layer of ResNet-50 at batch 32); cuDNN's backward-data API computes it from dy and
the filter, as XLA does.

For the lhs-dilated convolution out[i] = Σ_{p, j: p·ld = i + j·rd - lo'} dy[p]·rhs[j],
the same sum as backward data of a forward convolution with stride ld, dilation rd,
padding lo = (R - 1)·rd - lo' and the filter flipped:

    dx[i] = Σ_{p, r: i = p·ld + r·rd - lo} dy[p] · w[r],   w[r] = rhs[R - 1 - r]

cuDNN's dx is as large as its forward input, whose size must give dy's back: where
the node's output is smaller (the forward's asymmetric "SAME" padding), cuDNN computes
a row or column more and it is sliced off.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.extend.core import Primitive

from nimblejax.compiler.canonicalize.conv_common import conv_specs, forward_vjp, one_float_dtype, transpose
from nimblejax.compiler.ir import Node

data_grad_p = Primitive("nimble_cudnn_conv_data_grad")

# cuDNN's NHWC kernels for a dx of few channels are slow: the input gradient of
# ResNet-50's first convolution (224x224x3, 7x7, stride 2, batch 32) took 18.7 ms against
# XLA's 0.73 ms on an H100 (examples/gpu/benchmark_train.py --conv-grads). Deeper
# layers (64 channels and more) ran at 0.3-1.15x XLA's time.
MIN_CHANNELS = 8


@data_grad_p.def_abstract_eval
def _abstract(dy, w, *, x_shape, padding, strides, dilation, math, out_dtype):
    return jax.core.ShapedArray(x_shape, out_dtype)


@data_grad_p.def_impl
def _impl(dy, w, *, x_shape, padding, strides, dilation, math, out_dtype):
    """Reference semantics (the CPU interpreter): the VJP of the forward convolution
    x (NHWC) * w (KRSC) -> y (NHWC) with respect to x, at dy."""
    return forward_vjp(jnp.zeros(x_shape, jnp.asarray(w).dtype), w, dy, 0, padding=padding, strides=strides,
                       dilation=dilation, groups=1, math=math, out_dtype=out_dtype)


def _forward_geometry(node: Node):
    """Per spatial axis (stride, dilation, padding, cuDNN's dx size), or None where no
    symmetric forward convolution gives dy's size."""
    lhs_spec, rhs_spec, out_spec = conv_specs(node)
    dy, w = node.inputs
    out, p = node.outputs[0], node.params
    axes = []
    for j in range(2):
        st, rd = p["lhs_dilation"][j], p["rhs_dilation"][j]
        taps, need, size = w.shape[rhs_spec[2 + j]], dy.shape[lhs_spec[2 + j]], out.shape[out_spec[2 + j]]
        lo = (taps - 1) * rd - p["padding"][j][0]
        sizes = [h for h in range(size, size + st + 1)
                 if (h + 2 * lo - rd * (taps - 1) - 1) // st + 1 == need]
        if lo < 0 or not sizes:
            return None
        axes.append((st, rd, lo, sizes[0]))
    return axes


def eligible(node: Node) -> bool:
    """A 2-D float convolution of one dtype with lhs dilation (a strided convolution's
    input gradient), no groups, window stride 1, at least MIN_CHANNELS input channels,
    whose geometry a forward convolution with symmetric padding has."""
    dy, w = node.inputs
    out, p = node.outputs[0], node.params
    if dy.ndim != 4 or p["feature_group_count"] != 1 or p["batch_group_count"] != 1:
        return False
    if all(d == 1 for d in p["lhs_dilation"]) or any(s != 1 for s in p["window_strides"]):
        return False
    if not one_float_dtype(dy, w, out):
        return False
    _, _, out_spec = conv_specs(node)
    return out.shape[out_spec[1]] >= MIN_CHANNELS and _forward_geometry(node) is not None


def batch(node: Node) -> int:
    lhs_spec, _, _ = conv_specs(node)
    return node.inputs[0].shape[lhs_spec[0]]


def via_cudnn(dy, rhs, node: Node, math: str):
    """The node's value as [transposes to NHWC/KRSC, a flip of the filter,
    nimble_cudnn_conv_data_grad, a slice where cuDNN's dx is larger, a transpose]."""
    lhs_spec, rhs_spec, out_spec = conv_specs(node)
    out = node.outputs[0]
    geometry = _forward_geometry(node)
    dy = transpose(dy, (lhs_spec[0], lhs_spec[2], lhs_spec[3], lhs_spec[1]))           # N, P, Q, K
    w = lax.rev(transpose(rhs, (rhs_spec[1], rhs_spec[2], rhs_spec[3], rhs_spec[0])), (1, 2))  # K, R, S, C
    n, c = out.shape[out_spec[0]], out.shape[out_spec[1]]
    x_shape = (n, geometry[0][3], geometry[1][3], c)
    dx = data_grad_p.bind(
        dy, w, x_shape=x_shape, padding=tuple(g[2] for g in geometry), strides=tuple(g[0] for g in geometry),
        dilation=tuple(g[1] for g in geometry), math=math, out_dtype=np.dtype(out.dtype))
    want = (n, out.shape[out_spec[2]], out.shape[out_spec[3]], c)
    if tuple(dx.shape) != want:
        dx = lax.slice(dx, (0, 0, 0, 0), want)
    perm = [0] * 4
    perm[out_spec[0]], perm[out_spec[1]], perm[out_spec[2]], perm[out_spec[3]] = 0, 3, 1, 2
    return transpose(dx, perm)

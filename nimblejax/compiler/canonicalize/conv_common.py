"""What the convolution rewrites share: dimension numbers, a transpose that is free when
it permutes nothing, the dtype test of cuDNN's calls, and the forward convolution in
cuDNN's layouts whose VJPs are the reference semantics of its backward calls."""
from __future__ import annotations

import jax
import jax.numpy as jnp
from jax import lax

from nimblejax.compiler import dtypes
from nimblejax.compiler.ir import Node, Var

FLOATS = ("float32", "float16", "bfloat16")


def conv_specs(node: Node):
    """(lhs_spec, rhs_spec, out_spec) of a conv_general_dilated node."""
    dn = node.params["dimension_numbers"]
    return tuple(dn.lhs_spec), tuple(dn.rhs_spec), tuple(dn.out_spec)


def transpose(x, perm: tuple[int, ...]):
    return x if tuple(perm) == tuple(range(x.ndim)) else lax.transpose(x, tuple(perm))


def one_float_dtype(*values: Var) -> bool:
    """All of one floating dtype: cuDNN's legacy API takes x, w and y of one type."""
    names = {dtypes.name(v.dtype) for v in values}
    return len(names) == 1 and names <= set(FLOATS)


def forward_vjp(x, w, cotangent, wrt: int, *, padding, strides, dilation, groups, math, out_dtype):
    """The VJP of y = conv(x (NHWC), w (KRSC)) with symmetric padding, with respect to x
    (wrt=0) or w (wrt=1), at `cotangent`: what cuDNN's backward-data and backward-filter
    calls compute (the CPU interpreter's reference)."""
    x, w = jnp.asarray(x), jnp.asarray(w)

    def forward(x, w):
        return lax.conv_general_dilated(
            x, w, strides, [(p, p) for p in padding], rhs_dilation=dilation,
            dimension_numbers=("NHWC", "OHWI", "NHWC"), feature_group_count=groups,
            preferred_element_type=out_dtype, precision=lax.Precision.HIGHEST if math == "f32" else None)

    _, vjp = jax.vjp(forward, x, w)
    return vjp(jnp.asarray(cotangent).astype(out_dtype))[wrt].astype(out_dtype)

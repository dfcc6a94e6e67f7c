"""`split` → one `slice` per output (lowering then treats each as a view or a copy).

JAX emits `split` for the gradient of `concatenate` (every Inception- or NASNet-style
block's backward pass has one). A slice is an index-only elementwise rule, so each
piece fuses into its consumers' kernels instead of needing a kernel of its own.
"""
from __future__ import annotations

import functools

import jax
from jax import lax
import numpy as np

from nimblejax.compiler.canonicalize.registry import rewrites
from nimblejax.compiler.ir import Node
from nimblejax.compiler.jaxprs import open_jaxpr
from nimblejax.options import Options


@functools.lru_cache(maxsize=None)
def _slice_eqn():
    """The `slice` primitive and its param names, as this JAX version traces them."""
    jaxpr, _ = open_jaxpr(jax.make_jaxpr(lambda a: lax.slice(a, (0,), (1,)))(
        jax.ShapeDtypeStruct((2,), np.float32)))
    eqn = jaxpr.eqns[0]
    return eqn.primitive, tuple(eqn.params)


@rewrites("split", replaces=True)
def rewrite_split(node: Node, options: Options) -> list[Node]:
    (x,) = node.inputs
    axis = int(node.params["axis"])
    primitive, names = _slice_eqn()
    parts, start = [], 0
    for out in node.outputs:
        size = out.shape[axis]
        starts = [0] * x.ndim
        limits = list(x.shape)
        starts[axis], limits[axis] = start, start + size
        values = {"start_indices": tuple(starts), "limit_indices": tuple(limits), "strides": None}
        params = {k: values.get(k) for k in names}
        parts.append(Node(primitive, (x,), (out,), params, node.source))
        start += size
    assert start == x.shape[axis], (node, start)
    return parts

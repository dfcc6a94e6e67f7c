"""`scatter-sub` (x.at[i].subtract(u)) → `neg` of the updates, then `scatter-add` with the
same dimension numbers: `a - u` and `a + (-u)` are the same value bit for bit (IEEE
subtraction is the addition of the negation; integers wrap alike), so the scatter-add
kernels serve both. A literal update is negated in place. The scatter-add carries the
update computation this JAX gives its own scatter-adds (the interpreter binds it)."""
from __future__ import annotations

import functools

import jax
import numpy as np
from jax import lax

from nimblejax.compiler.canonicalize.registry import rewrites
from nimblejax.compiler.ir import Literal, Node, Var
from nimblejax.compiler.jaxprs import open_jaxpr
from nimblejax.options import Options


@rewrites("scatter-sub", replaces=True)
def rewrite_scatter_sub(node: Node, options: Options) -> list[Node]:
    operand, indices, updates = node.inputs
    params = {**node.params, **_add_computation(np.dtype(node.outputs[0].dtype))}
    nodes = []
    if isinstance(updates, Literal):
        with np.errstate(over="ignore"):
            negated = Literal(np.negative(updates.value))
    else:
        negated = Var(updates.shape, updates.dtype, getattr(updates, "weak_type", False))
        nodes.append(Node(lax.neg_p, (updates,), (negated,), {}, node.source))
    nodes.append(Node(lax.scatter_add_p, (operand, indices, negated), node.outputs, params,
                      node.source, node.effectful))
    return nodes


@functools.lru_cache(maxsize=None)
def _add_computation(dtype: np.dtype) -> dict:
    """The update_jaxpr/update_consts params of this JAX's scatter-add on `dtype`."""
    dnums = lax.ScatterDimensionNumbers(update_window_dims=(), inserted_window_dims=(0,),
                                        scatter_dims_to_operand_dims=(0,))
    traced = jax.make_jaxpr(lambda o, u: lax.scatter_add(o, np.zeros((1, 1), np.int32), u, dnums))(
        jax.ShapeDtypeStruct((2,), dtype), jax.ShapeDtypeStruct((1,), dtype))
    eqn, = [e for e in open_jaxpr(traced)[0].eqns if e.primitive is lax.scatter_add_p]
    return {k: eqn.params[k] for k in ("update_jaxpr", "update_consts") if k in eqn.params}

"""dot_general before fusion: every operand laid out as cuBLAS takes it.

cuBLAS needs each operand as a batch of row-major matrices: batch dims leading, then
the free and contracting dims as two contiguous groups. `canonicalize_dot` inserts
transposes (which fusion then folds into producers) when an operand is not laid out so.
`compute_mode` is the math a float32 dot runs in, following its precision as XLA does.
"""
from __future__ import annotations

import jax
from jax import lax

from nimblejax.compiler.canonicalize.registry import rewrites
from nimblejax.compiler.ir import Node, Var
from nimblejax.compiler import dtypes
from nimblejax.options import Options


def dot_dims(node: Node):
    (lc, rc), (lb, rb) = node.params["dimension_numbers"]
    lhs, rhs = node.inputs
    lc, rc, lb, rb = (tuple(int(d) for d in x) for x in (lc, rc, lb, rb))
    lf = tuple(d for d in range(lhs.ndim) if d not in lc and d not in lb)
    rf = tuple(d for d in range(rhs.ndim) if d not in rc and d not in rb)
    return lc, rc, lb, rb, lf, rf


def gemm_layout(node: Node) -> tuple[bool, bool] | None:
    """(trans_a, trans_b) when both operands are already GEMM-ready, else None."""
    lc, rc, lb, rb, lf, rf = dot_dims(node)
    ta = _transposed(lb, lf, lc, node.inputs[0].ndim)
    tb = _transposed(rb, rc, rf, node.inputs[1].ndim)
    return None if ta is None or tb is None else (ta, tb)


def _transposed(batch, rows, cols, ndim: int) -> bool | None:
    """False when an operand's axes are (batch, rows, cols) in order, True when they
    are (batch, cols, rows), None otherwise."""
    ident = tuple(range(ndim))
    if batch + rows + cols == ident:
        return False
    if batch + cols + rows == ident:
        return True
    return None


@rewrites("dot_general", after_merge=True)
def canonicalize_dot(node: Node, options: Options) -> list[Node]:
    """[node] if GEMM-ready, else [transpose(s)..., new dot_general]."""
    if gemm_layout(node) is not None:
        return [node]
    lc, rc, lb, rb, lf, rf = dot_dims(node)
    lhs, rhs = node.inputs
    new_nodes: list[Node] = []

    def permuted(x: Var, perm: tuple[int, ...]) -> Var:
        if perm == tuple(range(x.ndim)):
            return x
        y = Var(tuple(x.shape[p] for p in perm), x.dtype, x.weak_type)
        new_nodes.append(Node(lax.transpose_p, (x,), (y,), {"permutation": perm}, node.source))
        return y

    nb = len(lb)
    a = permuted(lhs, lb + lf + lc)
    b = permuted(rhs, rb + rc + rf)
    dn = ((tuple(range(nb + len(lf), lhs.ndim)), tuple(range(nb, nb + len(rc)))),
          (tuple(range(nb)), tuple(range(nb))))
    params = dict(node.params, dimension_numbers=dn)
    new_nodes.append(Node(node.primitive, (a, b), node.outputs, params, node.source))
    return new_nodes


def compute_mode(node: Node) -> str:
    """'f32' or 'tf32', following `precision` and jax_default_matmul_precision, as XLA."""
    if dtypes.name(node.inputs[0].dtype) != "float32":
        return "f32"
    prec = node.params.get("precision")
    names = [str(getattr(p, "name", p)).upper() for p in
             (prec if isinstance(prec, (tuple, list)) else (prec,)) if p is not None]
    if any(n in ("HIGHEST", "HIGH") for n in names):
        return "f32"
    if names:  # explicit DEFAULT
        return "tf32"
    default = str(jax.config.jax_default_matmul_precision or "default").lower()
    return "f32" if default in ("highest", "float32", "high", "bfloat16_3x") else "tf32"

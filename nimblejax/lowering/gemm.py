"""dot_general → a cuBLAS GEMM description (float types) or a generated kernel (ints).

cuBLAS needs each operand as a batch of row-major matrices: batch dims leading, then
the free and contracting dims as two contiguous groups. `canonicalize_dot` inserts
transposes (which fusion then folds into producers) when an operand is not laid out so.
"""
from __future__ import annotations

from typing import Union

import jax
from jax import lax

from nimblejax.ir import Node, Var
from nimblejax.lowering import dtypes
from nimblejax.lowering.codegen import BLOCK, KernelBuilder, blocks_for
from nimblejax.lowering.registry import register
from nimblejax.lowering.task import GemmCall, Kernel

GEMM_DTYPES = frozenset({"float32", "float16", "bfloat16"})


def _dims(node: Node):
    (lc, rc), (lb, rb) = node.params["dimension_numbers"]
    lhs, rhs = node.inputs
    lc, rc, lb, rb = (tuple(int(d) for d in x) for x in (lc, rc, lb, rb))
    lf = tuple(d for d in range(lhs.ndim) if d not in lc and d not in lb)
    rf = tuple(d for d in range(rhs.ndim) if d not in rc and d not in rb)
    return lc, rc, lb, rb, lf, rf


def _layout(node: Node) -> tuple[bool, bool] | None:
    """(trans_a, trans_b) when both operands are already GEMM-ready, else None."""
    lc, rc, lb, rb, lf, rf = _dims(node)
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


def canonicalize_dot(node: Node) -> list[Node]:
    """[node] if GEMM-ready, else [transpose(s)..., new dot_general]."""
    if _layout(node) is not None:
        return [node]
    lc, rc, lb, rb, lf, rf = _dims(node)
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


@register("dot_general", kind="gemm")
def dot_general(node: Node) -> Union[GemmCall, Kernel]:
    layout = _layout(node)
    if layout is None:
        raise AssertionError("dot_general must be canonicalized before lowering")
    lc, rc, lb, rb, lf, rf = _dims(node)
    lhs, rhs = node.inputs
    out = node.outputs[0]
    size = lambda x, ds: _prod(x.shape[d] for d in ds)  # noqa: E731
    batch, m, k, n = size(lhs, lb), size(lhs, lf), size(lhs, lc), size(rhs, rf)
    ta, tb = layout
    if dtypes.name(lhs.dtype) in GEMM_DTYPES and dtypes.name(lhs.dtype) == dtypes.name(rhs.dtype) \
            and dtypes.name(out.dtype) in GEMM_DTYPES and min(batch, m, n, k) > 0:
        return GemmCall(batch, m, n, k, ta, tb, dtypes.name(lhs.dtype), dtypes.name(out.dtype),
                        compute_mode(node), lhs, rhs, out)
    return naive_matmul(node, batch, m, n, k, ta, tb)


def naive_matmul(node: Node, batch: int, m: int, n: int, k: int, ta: bool, tb: bool) -> Kernel:
    """Integer (and mixed) dots: one thread per output, a serial dot product."""
    lhs, rhs = node.inputs
    out = node.outputs[0]
    acc = dtypes.compute_type(out.dtype)
    b = KernelBuilder()
    b.ops = ["dot"]
    b.output(out)
    a_ix = (f"(bb * {m * k} + kk * {m} + i)" if ta else f"(bb * {m * k} + i * {k} + kk)")
    b_ix = (f"(bb * {n * k} + j * {k} + kk)" if tb else f"(bb * {n * k} + kk * {n} + j)")
    b.open(f"for (long long t = blockIdx.x * (long long)blockDim.x + threadIdx.x; t < {batch * m * n}; "
           f"t += (long long)gridDim.x * blockDim.x)")
    b.emit(f"const long long bb = t / {m * n}; const long long i = (t / {n}) % {m}; "
           f"const long long j = t % {n};")
    b.emit(f"{acc} acc = 0;")
    la = dtypes.load(lhs.dtype, f"{b.input(lhs)}[{a_ix}]")
    lb_ = dtypes.load(rhs.dtype, f"{b.input(rhs)}[{b_ix}]")
    b.emit(f"for (long long kk = 0; kk < {k}; ++kk) acc += ({acc}){la} * ({acc}){lb_};")
    b.store(out, "t", "acc")
    b.close()
    return b.finish("dot", out, blocks_for(batch * m * n), BLOCK)


def _prod(xs) -> int:
    p = 1
    for x in xs:
        p *= int(x)
    return p

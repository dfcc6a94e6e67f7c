"""dot_general before fusion: every operand laid out so a GEMM can read it.

cuBLAS(Lt) reads each operand as a batch of row-major matrices: a leading dimension (one
stored row to the next) and one batch stride, in elements. A dot_general operand whose
batch, row and column axes each form one run of strides in its buffer (`matrix_layout`)
is read in place, with those strides: for BERT at batch 1, the attention's q (1, S, H, D)
batched over heads is H matrices (S x D) with leading dimension H*D and batch stride D.
Other operands get a transpose (which fusion folds into their producers) into a
(batch, rows, cols) or (batch, cols, rows) order, the one that keeps the operand's
innermost axis innermost where there is one (a cheap, coalesced transpose). A batch over
two axes that are not one run (heads of (B, S, H, D) for B > 1: strides S*H*D and D)
has no single batch stride, so such an operand is transposed.

Library GEMMs only: integer dots (a generated kernel) and dots the small-M kernel may
take (lowering/gemm_small.py, batch 1 and a few rows) keep contiguous operands in the
canonical order (batch, free, contracting) for the lhs and (batch, contracting, free)
for the rhs. Each operand keeps its layout when it is one of the two GEMM-ready orders.

A dot's result can be written the same way through a transpose that reads it
(`output_layout`: compiler/epilogue.py takes that transpose into the GEMM).
`compute_mode` is the math a float32 dot runs in, following its precision as XLA does.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Optional, Sequence

import jax
from jax import lax

from nimblejax.compiler.canonicalize.registry import rewrites
from nimblejax.compiler.ir import Node, Var
from nimblejax.compiler import dtypes
from nimblejax.options import Options

Perm = tuple[int, ...]


def dot_dims(node: Node):
    (lc, rc), (lb, rb) = node.params["dimension_numbers"]
    lhs, rhs = node.inputs
    lc, rc, lb, rb = (tuple(int(d) for d in x) for x in (lc, rc, lb, rb))
    lf = tuple(d for d in range(lhs.ndim) if d not in lc and d not in lb)
    rf = tuple(d for d in range(rhs.ndim) if d not in rc and d not in rb)
    return lc, rc, lb, rb, lf, rf


def dot_sizes(node: Node) -> tuple[int, int, int, int]:
    """(batch, m, n, k) of a dot_general in any layout."""
    lc, rc, lb, rb, lf, rf = dot_dims(node)
    lhs, rhs = node.inputs
    return (_size(lhs.shape, lb), _size(lhs.shape, lf), _size(rhs.shape, rf),
            _size(lhs.shape, lc))


def gemm_layout(node: Node) -> tuple[bool, bool] | None:
    """(trans_a, trans_b) when both operands are contiguous in a GEMM-ready order."""
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


# ---- strided layouts ---------------------------------------------------------------------
@dataclass(frozen=True)
class MatrixLayout:
    """A batch of matrices in a buffer, as a GEMM reads or writes it: stored row-major
    as (rows, cols), or as (cols, rows) when `trans`; `ld` elements from one stored row
    to the next, `stride` from one batch entry to the next."""

    trans: bool
    ld: int
    stride: int


def contiguous_strides(shape: Sequence[int]) -> tuple[int, ...]:
    out, step = [], 1
    for d in reversed(shape):
        out.append(step)
        step *= int(d)
    return tuple(reversed(out))


def _run(shape, strides, axes) -> Optional[tuple[int, Optional[int]]]:
    """(size, stride) of a group of axes (in this order) that steps through memory as
    one axis would; stride None when the group has one element (any stride does)."""
    live = [a for a in axes if shape[a] != 1]
    size = _size(shape, axes)
    if not live:
        return size, None
    if any(strides[a] != strides[b] * shape[b] for a, b in zip(live, live[1:])):
        return None
    return size, strides[live[-1]]


def matrix_layout(shape, strides, batch, rows, cols) -> Optional[MatrixLayout]:
    """How a GEMM reads (rows x cols) matrices batched over `batch` (axis groups, each in
    its pairing order) from a buffer with these element strides; None when a group is
    not one run or neither rows nor cols has unit stride."""
    runs = [_run(shape, strides, g) for g in (batch, rows, cols)]
    if any(r is None for r in runs):
        return None
    (nb, sb), (nr, sr), (nc, sc) = runs
    if sc in (1, None) and (sr is None or sr >= nc):
        ld = nc if sr is None else sr
        return MatrixLayout(False, ld, nr * ld if sb is None else sb)
    if sr in (1, None) and (sc is None or sc >= nr):
        ld = nr if sc is None else sc
        return MatrixLayout(True, ld, nc * ld if sb is None else sb)
    return None


def operand_layouts(node: Node) -> tuple[Optional[MatrixLayout], Optional[MatrixLayout]]:
    """How a GEMM reads each operand of `node` in place (lhs: rows m, cols k; rhs: rows
    k, cols n), None for one it cannot read so."""
    lc, rc, lb, rb, lf, rf = dot_dims(node)
    lhs, rhs = node.inputs
    return (matrix_layout(lhs.shape, contiguous_strides(lhs.shape), lb, lf, lc),
            matrix_layout(rhs.shape, contiguous_strides(rhs.shape), rb, rc, rf))


def output_layout(node: Node, perm: Perm) -> Optional[MatrixLayout]:
    """How a GEMM writes `node`'s (batch, m, n) result into the buffer of
    transpose(result, perm), or None; `trans` means it writes C^T (swapped operands)."""
    lc, rc, lb, rb, lf, rf = dot_dims(node)
    y = node.outputs[0]
    z = contiguous_strides(tuple(y.shape[p] for p in perm))
    strides = [0] * y.ndim
    for j, p in enumerate(perm):
        strides[p] = z[j]
    nb, nm = len(lb), len(lf)
    return matrix_layout(y.shape, strides, range(nb), range(nb, nb + nm), range(nb + nm, y.ndim))


# ---- the rewrite ---------------------------------------------------------------------------
def operand_transposes(node: Node) -> tuple[Optional[Perm], Optional[Perm]]:
    """The transpose canonicalize_dot puts before each operand, None where it reads the
    operand as it is."""
    if gemm_layout(node) is not None:
        return None, None
    lc, rc, lb, rb, lf, rf = dot_dims(node)
    lhs, rhs = node.inputs
    if not _strided_gemm(node):  # contiguous, in the canonical order
        return (_unless_identity(lb + lf + lc), _unless_identity(rb + rc + rf))
    in_place = operand_layouts(node)
    choices = ((lb + lf + lc, lb + lc + lf), (rb + rc + rf, rb + rf + rc))
    return tuple(None if layout is not None else _keeping_innermost(options)
                 for layout, options in zip(in_place, choices))


def _unless_identity(perm: Perm) -> Optional[Perm]:
    return None if perm == tuple(range(len(perm))) else perm


def _keeping_innermost(options: tuple[Perm, Perm]) -> Perm:
    """The first order that leaves the innermost axis innermost (the transpose then
    moves whole rows), else the first."""
    return next((p for p in options if p[-1] == len(p) - 1), options[0])


def _strided_gemm(node: Node) -> bool:
    """Whether `node` becomes a library GEMM that may read strided operands: a float GEMM
    the small-M kernel would not take."""
    from nimblejax.compiler.lowering.gemm import is_float_gemm
    from nimblejax.compiler.lowering.gemm_small import takes_small_m

    if not is_float_gemm(node):
        return False
    return not takes_small_m(*dot_sizes(node), False, dtypes.name(node.inputs[0].dtype))


@rewrites("dot_general", after_merge=True)
def canonicalize_dot(node: Node, options: Options) -> list[Node]:
    """[node] if a GEMM reads both operands as they are, else [transpose(s)..., new
    dot_general]."""
    perms = operand_transposes(node)
    if perms == (None, None):
        return [node]
    lc, rc, lb, rb, lf, rf = dot_dims(node)
    new_nodes: list[Node] = []
    operands, contracting, batch = [], [], []
    for x, perm, cont, bat in zip(node.inputs, perms, (lc, rc), (lb, rb)):
        if perm is not None:
            y = Var(tuple(x.shape[p] for p in perm), x.dtype, x.weak_type)
            new_nodes.append(Node(lax.transpose_p, (x,), (y,), {"permutation": perm}, node.source))
            x, cont, bat = y, tuple(perm.index(a) for a in cont), tuple(perm.index(a) for a in bat)
        operands.append(x)
        contracting.append(cont)
        batch.append(bat)
    params = dict(node.params, dimension_numbers=(tuple(contracting), tuple(batch)))
    new_nodes.append(Node(node.primitive, tuple(operands), node.outputs, params, node.source))
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


def _size(shape, axes) -> int:
    return math.prod(int(shape[a]) for a in axes)

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

That is for library GEMMs only: integer dots (a generated kernel) and dots the small-M
kernel may take (lowering/gemm_small.py, batch 1 and a few rows) get contiguous operands,
both in the canonical order (batch, free, contracting) for the lhs and (batch,
contracting, free) for the rhs unless both are in a GEMM-ready order already.

A dot reading an explicit transpose reads the transpose's input in place instead, where
it can (`fold_operand_transposes`, a pass over the graph after merge_dots).
A dot's result can be written the same way through a transpose that reads it
(`output_layout`: compiler/epilogue.py takes that transpose into the GEMM).
`compute_mode` is the math a float32 dot runs in, following its precision as XLA does.
"""
from __future__ import annotations

import functools
import math
from dataclasses import dataclass, replace
from typing import Optional, Sequence

import jax
from jax import lax

from nimblejax.compiler.canonicalize.registry import rewrites
from nimblejax.compiler.ir import Graph, Node, Var
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


def output_layout(node: Node, perm: Perm, shape: Optional[Sequence[int]] = None
                  ) -> Optional[MatrixLayout]:
    """How a GEMM writes `node`'s (batch, m, n) result into the buffer of
    transpose(value, perm), or None; `trans` means it writes C^T (swapped operands).
    `value` is the result itself, or of `shape`: the result with axes of size 1 put in
    or taken out (jnp.matmul's squeeze and broadcast of a batch of one)."""
    lc, rc, lb, rb, lf, rf = dot_dims(node)
    y = node.outputs[0]
    shape = tuple(y.shape if shape is None else shape)
    if [d for d in shape if d != 1] != [d for d in y.shape if d != 1]:
        return None
    z = contiguous_strides(tuple(shape[p] for p in perm))
    at = [0] * len(shape)
    for j, p in enumerate(perm):
        at[p] = z[j]
    wide = iter(at[a] for a in range(len(shape)) if shape[a] != 1)
    strides = [0 if d == 1 else next(wide) for d in y.shape]  # size 1: any stride does
    nb, nm = len(lb), len(lf)
    return matrix_layout(y.shape, strides, range(nb), range(nb, nb + nm), range(nb + nm, y.ndim))


# ---- the rewrite ---------------------------------------------------------------------------
def operand_transposes(node: Node) -> tuple[Optional[Perm], Optional[Perm]]:
    """The transpose canonicalize_dot puts before each operand, None where it reads the
    operand as it is."""
    if gemm_layout(node) is not None:
        return None, None
    lc, rc, lb, rb, lf, rf = dot_dims(node)
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


def is_float_gemm(node: Node) -> bool:
    """Whether a dot_general is a float GEMM a library could compute."""
    from nimblejax.compiler.lowering.task import GEMM_DTYPES  # lazy: lowering imports us

    lhs, rhs = node.inputs
    names = (dtypes.name(lhs.dtype), dtypes.name(rhs.dtype), dtypes.name(node.outputs[0].dtype))
    return (names[0] in GEMM_DTYPES and names[0] == names[1] and names[2] in GEMM_DTYPES
            and min(dot_sizes(node)) > 0)


def _strided_gemm(node: Node) -> bool:
    """Whether `node` becomes a library GEMM that may read strided operands: a float GEMM
    the small-M kernel would not take."""
    from nimblejax.compiler.lowering.gemm_small import takes_small_m  # lazy, as above

    if not is_float_gemm(node):
        return False
    return not takes_small_m(*dot_sizes(node), False, dtypes.name(node.inputs[0].dtype))


def fold_operand_transposes(graph: Graph) -> Graph:
    """Dots that read an explicit transpose (`q.transpose(0, 2, 1, 3) @ k`), perhaps
    squeezed (jnp.matmul drops a batch of one), read its input instead, with the
    transpose composed into their dimension numbers, where a GEMM reads that input in
    place and the dot is the transpose's only reader (the transpose is then dead code).
    A squeeze becomes one of the input (a view). The transpose must keep the operand's
    free axes in their order (the result's axis order would change otherwise)."""
    producer = {v: n for n in graph.nodes for v in n.outputs}
    consumers = graph.consumers()
    outputs = {a for a in graph.outputs if isinstance(a, Var)}
    nodes = []
    for node in graph.nodes:
        if node.name == "dot_general" and _strided_gemm(node):
            for side in (0, 1):  # through a chain of transposes: `k.T` of a transposed k
                while (fold := _fold_transpose(node, side, producer, consumers, outputs)) is not None:
                    folded, dead, made = fold
                    nodes.extend(made)
                    producer.update((v, n) for n in made for v in n.outputs)
                    _replace_readers(consumers, (node, *dead), (*made, folded))
                    node = folded
        nodes.append(node)
    return replace(graph, nodes=tuple(nodes))


def _replace_readers(consumers: dict, gone: tuple[Node, ...], made: tuple[Node, ...]) -> None:
    """Keep `consumers` true after the nodes `gone` were replaced by `made`."""
    touched = {a for n in gone + made for a in n.inputs if isinstance(a, Var)}
    for v in touched:
        users = [u for u in consumers.get(v, []) if all(u is not g for g in gone)]
        consumers[v] = users + [n for n in made for a in n.inputs if a is v]


def _fold_transpose(node: Node, side: int, producer, consumers, outputs):
    """(the dot reading the transpose's input, the nodes left dead, the nodes made), or
    None where operand `side` is not such a transpose or the GEMM could not read it."""
    view = _transposed_view(node.inputs[side], node, producer, consumers, outputs)
    if view is None:
        return None
    src, perm, dead, made = view
    (lc, rc), (lb, rb) = node.params["dimension_numbers"]
    cont, batch = ((lc, rc)[side], (lb, rb)[side])
    free = [a for a in range(len(perm)) if a not in cont and a not in batch]
    if any(perm[a] > perm[b] for a, b in zip(free, free[1:])):
        return None
    cs, bs = [list(d) for d in ((lc, rc), (lb, rb))]
    cs[side], bs[side] = (tuple(perm[int(a)] for a in cont), tuple(perm[int(a)] for a in batch))
    inputs = list(node.inputs)
    inputs[side] = src
    params = dict(node.params, dimension_numbers=(tuple(cs), tuple(bs)))
    folded = Node(node.primitive, tuple(inputs), node.outputs, params, node.source)
    return (folded, dead, made) if operand_layouts(folded)[side] is not None else None


def _transposed_view(x: Var, reader: Node, producer, consumers, outputs):
    """(src, perm, dead, made) when x is transpose(src0, ...), perhaps with axes of size
    1 dropped after it (a squeeze, or a reshape that only drops them), read by `reader`
    alone: x's axis j is src's axis perm[j]; `made` holds a reshape of src0 (src: a view,
    where a squeeze is a kernel) dropping those axes, `dead` the nodes the reader no
    longer needs. A squeeze of anything else becomes such a reshape too (perm the
    identity)."""
    def only_for(v: Var, user: Node) -> bool:
        return v not in outputs and consumers.get(v) == [user] and user.inputs.count(v) == 1

    p = producer.get(x)
    if p is None or not only_for(x, reader):
        return None
    dropped: tuple[int, ...] = ()
    dead = [p]
    if p.name in ("squeeze", "reshape") and isinstance(p.inputs[0], Var) and only_for(p.inputs[0], p):
        dropped = _dropped_unit_axes(p.inputs[0].shape, x.shape, p)
        if dropped is None:
            return None
        if p.name == "squeeze" and producer.get(p.inputs[0], p).name != "transpose":
            made = _reshape(p.inputs[0], tuple(x.shape), reader.source)
            return made.outputs[0], tuple(range(x.ndim)), tuple(dead), (made,)
        p = producer.get(p.inputs[0])
        dead.append(p)
    if p is None or p.name != "transpose" or not isinstance(p.inputs[0], Var):
        return None
    src, perm = p.inputs[0], tuple(int(a) for a in p.params["permutation"])
    if not dropped:
        return src, perm, tuple(dead), ()
    gone = sorted(perm[d] for d in dropped)  # src's axes of size 1 that are dropped
    kept = [perm[i] for i in range(len(perm)) if i not in dropped]
    made = _reshape(src, tuple(d for a, d in enumerate(src.shape) if a not in gone),
                    reader.source)
    renumber = {a: a - sum(g < a for g in gone) for a in kept}
    return made.outputs[0], tuple(renumber[a] for a in kept), tuple(dead), (made,)


def _dropped_unit_axes(shape, new, node: Node) -> Optional[tuple[int, ...]]:
    """The axes of size 1 of `shape` that leave `new` (the rest, in order), else None."""
    if node.name == "squeeze":
        return tuple(sorted(int(d) % len(shape) for d in node.params["dimensions"]))
    if node.params.get("dimensions") is not None:
        return None
    dropped, j = [], 0
    for i, d in enumerate(shape):
        if j < len(new) and new[j] == d:
            j += 1
        elif d == 1:
            dropped.append(i)
        else:
            return None
    return tuple(dropped) if j == len(new) and dropped else None


def _reshape(x: Var, shape: tuple[int, ...], source: str) -> Node:
    """A reshape node of x, with this JAX's params for lax.reshape."""
    prim, params = _reshape_eqn(tuple(x.shape), shape, str(x.dtype))
    return Node(prim, (x,), (Var(shape, x.dtype, x.weak_type),), dict(params), source)


@functools.lru_cache(maxsize=256)
def _reshape_eqn(shape: tuple[int, ...], new: tuple[int, ...], dtype: str):
    jaxpr = jax.make_jaxpr(lambda v: lax.reshape(v, new))(jax.ShapeDtypeStruct(shape, dtype))
    (eqn,) = jaxpr.jaxpr.eqns
    return eqn.primitive, tuple(eqn.params.items())


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

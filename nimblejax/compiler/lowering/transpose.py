"""Tiled transpose: a fused group that permutes the axes of one input, as a batched 2-D
transpose through shared memory, so that both its reads and its writes are coalesced.

The elementwise template gives one thread per output element; when the group moves the
input's innermost axis, neighbouring threads then read addresses a row apart (on an
H200 a (3,3,512,512) f32 HWIO→OHWI weight transpose took 24 µs where a copy of the
same bytes takes 4 µs). Here a block of 32×8 threads reads a 32×32 tile along the
input's rows into shared memory, then writes it along the output's rows.

Scope: the group is a chain from one input X to the output made of exactly one
`transpose`, views that keep the row-major order (reshape, squeeze, a broadcast_in_dim
that only adds unit axes) and pointwise ops whose other operands are scalars (literals,
0-d values or their broadcasts): `w.T`, `(w * 2.0).T.astype(bf16)`. With unit axes
dropped and axes that stay adjacent merged, the permutation must read
out[p][c][r] = in[p][r][c]; otherwise `transpose_kernel` returns None and the caller
uses the elementwise template.
"""
from __future__ import annotations

import math
from typing import Mapping, Optional

from nimblejax.compiler.ir import Atom, Literal, Node, Var
from nimblejax.compiler import dtypes
from nimblejax.compiler.lowering.codegen import Index, KernelBuilder, kernel_name, linear, with_prelude
from nimblejax.compiler.lowering.elementwise import BINARY_NAMES, UNARY_NAMES
from nimblejax.compiler.lowering.registry import rule_for
from nimblejax.compiler.lowering.task import Kernel

TILE = 32
ROWS = 8  # threads per block along y: each thread moves TILE // ROWS elements each way
# Below this extent a tile leaves most of its threads idle, while the strided reads of
# the elementwise template stay within a few cache lines: keep that template there.
MIN_EXTENT = 16
MAX_GRID_YZ = 65535
POINTWISE = UNARY_NAMES | BINARY_NAMES | {"convert_element_type", "integer_pow",
                                          "reduce_precision", "select_n", "clamp"}
TOKEN: Index = ("tile",)  # every chain value is memoized at this one (symbolic) index


def transpose_kernel(root: Var, inlined: Mapping[Var, Node]) -> Optional[Kernel]:
    """A shared-memory tiled kernel computing `root` (its producers in `inlined`, `root`
    included), or None when the group is not a transpose of one input (see module doc)."""
    chain = _chain(root, inlined)
    if chain is None:
        return None
    x, nodes = chain
    transposes = [n for n in nodes if n.name == "transpose"]
    if len(transposes) != 1:
        return None
    t = transposes[0]
    dims = batched_2d(t.inputs[0].shape, t.params["permutation"])
    if dims is None or not _fits(*dims):
        return None
    return _emit(root, inlined, x, nodes, *dims)


# ---- applicability --------------------------------------------------------------------
def _chain(root: Var, inlined: Mapping[Var, Node]) -> Optional[tuple[Var, tuple[Node, ...]]]:
    """The group as a chain X → … → root: (X, its nodes from X up), or None when it
    reads anything other than one input and scalars."""
    nodes: list[Node] = []
    var: Atom = root
    while var in inlined:
        node = inlined[var]
        var = _chain_operand(node, inlined)
        if var is None:
            return None
        nodes.append(node)
    return (var, tuple(reversed(nodes))) if isinstance(var, Var) else None


def _chain_operand(node: Node, inlined: Mapping[Var, Node]) -> Optional[Atom]:
    """The one non-scalar operand of a chain node (None if the node does not qualify)."""
    if node.name == "transpose" or _is_view(node):
        return node.inputs[0]
    if node.name not in POINTWISE:
        return None
    big = {a for a in node.inputs if not _is_scalar(a, inlined)}
    return big.pop() if len(big) == 1 else None


def _is_view(node: Node) -> bool:
    """A node that keeps the row-major order of its operand's elements (iota has no
    operand: it is not a view of anything)."""
    if not node.inputs:
        return False
    x, out = node.inputs[0], node.outputs[0]
    if node.name == "reshape":
        return node.params.get("dimensions") is None
    return node.name in ("squeeze", "broadcast_in_dim") and math.prod(x.shape) == out.size


def _is_scalar(a: Atom, inlined: Mapping[Var, Node]) -> bool:
    """A literal, a 0-d value, or a broadcast of one: the same value at every index."""
    if isinstance(a, Literal) or not a.shape:
        return True
    node = inlined.get(a)
    return node is not None and node.name == "broadcast_in_dim" and not node.inputs[0].shape


def batched_2d(shape, perm) -> Optional[tuple[int, int, int]]:
    """(P, R, C) such that transpose(x, perm), x viewed as (P, R, C), is the (P, C, R)
    array out[p][c][r] = x[p][r][c]; None if the permutation has no such form."""
    kept = [a for a in range(len(shape)) if shape[a] != 1]
    pos = {a: i for i, a in enumerate(kept)}
    runs: list[list[int]] = []  # input axes adjacent in both the input and the output
    for a in (pos[a] for a in perm if shape[a] != 1):
        if runs and runs[-1][-1] + 1 == a:
            runs[-1].append(a)
        else:
            runs.append([a])
    by_input = sorted(runs)
    sizes = [math.prod(shape[kept[i]] for i in run) for run in by_input]
    order = [by_input.index(run) for run in runs]
    if order == [1, 0]:
        return 1, sizes[0], sizes[1]
    if order == [0, 2, 1]:
        return sizes[0], sizes[1], sizes[2]
    return None


def _fits(n_p: int, n_r: int, n_c: int) -> bool:
    return min(n_r, n_c) >= MIN_EXTENT and -(-n_c // TILE) <= MAX_GRID_YZ and n_p <= MAX_GRID_YZ


# ---- code -------------------------------------------------------------------------------
def _emit(root: Var, inlined: Mapping[Var, Node], x: Var, nodes: tuple[Node, ...],
          n_p: int, n_r: int, n_c: int) -> Kernel:
    """Block (32, 8) moves the 32×32 tile (blockIdx.x, blockIdx.y) of batch blockIdx.z."""
    b = KernelBuilder(inlined)
    out, src = b.output(root), b.input(x)
    batch, at = (f"{n_p}, ", "[p]") if n_p > 1 else ("", "")
    read = f"{src}{at}[r][c]"
    if any(n.name in POINTWISE for n in nodes):
        read = f"f({read})"
    b.emit(f"// {src} as ({batch}{n_r}, {n_c}) -> {out} as ({batch}{n_c}, {n_r}): "
           f"{out}{at}[c][r] = {read}")
    b.emit(f"__shared__ {dtypes.storage_type(x.dtype)} tile[{TILE}][{TILE + 1}];  "
           f"// +1: column reads hit 32 banks")
    b.emit(f"const int r0 = blockIdx.x * {TILE}, c0 = blockIdx.y * {TILE};")
    p = "0"
    if n_p > 1:
        b.emit("const int p = blockIdx.z;")
        p = "p"
    guard = [f"r < {n_r}"] * (n_r % TILE != 0) + [f"c < {n_c}"] * (n_c % TILE != 0)
    # Read along the input's rows (c is innermost there).
    b.open(f"for (int k = threadIdx.y; k < {TILE}; k += {ROWS})")
    b.emit("const int r = r0 + k, c = c0 + threadIdx.x;")
    load = f"tile[k][threadIdx.x] = {src}[{linear((p, 'r', 'c'), (n_p, n_r, n_c))}];"
    b.emit(f"if ({' && '.join(guard)}) {load}" if guard else load)
    b.close()
    b.emit("__syncthreads();")
    # Write along the output's rows (r is innermost there), applying the pointwise ops.
    b.open(f"for (int k = threadIdx.y; k < {TILE}; k += {ROWS})")
    b.emit("const int r = r0 + threadIdx.x, c = c0 + k;")
    if guard:
        b.open(f"if ({' && '.join(guard)})")
    v = b.tmp(dtypes.compute_type(x.dtype), dtypes.load(x.dtype, "tile[threadIdx.x][k]"))
    b.store(root, linear((p, "c", "r"), (n_p, n_c, n_r)), _apply(b, nodes, v))
    if guard:
        b.close()
    b.close()
    b.forget()
    text = f"{b.signature('NAME')} {{\n" + "\n".join(b.lines) + "\n}\n"
    name = kernel_name("transpose", b.ops, root.dtype, text)
    grid = (-(-n_r // TILE), -(-n_c // TILE), n_p)
    return Kernel(name, with_prelude(text.replace("NAME", name, 1)), grid, (TILE, ROWS, 1),
                  b.params())


def _apply(b: KernelBuilder, nodes: tuple[Node, ...], value: str) -> str:
    """The chain's pointwise ops applied, in order, to `value` (an element of X): each
    op's chain operand is memoized at TOKEN, so its rule reads `value` there."""
    for node in nodes:
        if node.name not in POINTWISE:
            continue  # the transpose and the views only move elements: the tile did that
        for a in node.inputs:
            if not _is_scalar(a, b.inlined):
                b.memo[(a.id, TOKEN)] = value
        value = rule_for(node).fn(b, node, TOKEN)
        b.ops.append(node.name)
    return value

"""A GEMM with few output tiles and a long K as partial products summed by its reader
(split-K, with the sum in the next kernel instead of a kernel of its own).

Why: BERT's dense layers at batch 1 are 128 × 768 (or × 3072) outputs over K = 768 or
3072: a handful of 128 × 128 tiles for 132 SMs. cuBLASLt answers with split-K, partial
sums in its workspace and a second kernel that adds them and applies the epilogue; on an
H100 at batch 1 those 60 reduction kernels took 204 µs of BERT's kernel time, on the
critical path of every layer (BENCHMARKS.md). Here the dot becomes one batched GEMM over
`s` slices of K, whose `s` results (contiguous, one after another) are added by
ordinary `add`s of their slices: views, which fusion inlines into the kernel that reads
the dot's result anyway (the bias add and GELU, the residual add and LayerNorm's row
kernel). One kernel and one graph node fewer on the critical path per GEMM.

Which dots (`split_factor`): float32, no batch axes, one contracting axis (the lhs's
last), at least MIN_M rows, at most MAX_TILES output tiles, and every reader an `add` (a bias or a residual, which
fusion puts in an elementwise or row kernel). `s` is the largest power of two up to
MAX_SPLIT whose slices keep MIN_SLICE_K of K and whose tiles (GEMM_TILE square, as
merge_dots counts them) make at most one wave on the GPU's SMs. The partial products
are float32 and the sum's order is fixed (((p0 + p1) + p2) + ...), as a split-K GEMM's
is. On an H200, BERT at batch 1: 0.696 → 0.645 ms of GPU time; those constants were
the best of five settings measured (BENCHMARKS.md, 2026-11-29). `Options.split_k`
(NIMBLE_SPLIT_K=0) turns it off.
"""
from __future__ import annotations

from jax import lax

from nimblejax.compiler import dtypes
from nimblejax.compiler.canonicalize.dot import dot_dims, dot_sizes
from nimblejax.compiler.canonicalize.merge_dots import GEMM_TILE, GPU_SMS
from nimblejax.compiler.canonicalize.replace import replace_with
from nimblejax.compiler.ir import Graph, Node, Var

MIN_M = 64          # fewer rows: the small-M and tensor-core kernels' GEMMs (an RNN, an MLP)
# More output tiles than this: left to cuBLASLt. The measured gain is at 4 to 24 tiles
# (BERT's and GPT's layers at batch 1); a batch of 8 (48 tiles) was not measured.
MAX_TILES = 32
MIN_SLICE_K = 192   # the K of one partial product, at least
MAX_SPLIT = 8       # partial products, at most: each is read again by the sum
READERS = frozenset({"add", "add_any"})


def split_k_dots(graph: Graph) -> Graph:
    """Every dot of `graph` that `split_factor` splits, as partial products and their
    sum (a pass over the graph: it reads each dot's readers)."""
    readers = graph.consumers()
    outputs = {v for v in graph.outputs if isinstance(v, Var)}
    nodes: list[Node] = []
    for node in graph.nodes:
        s = split_factor(node, readers, outputs) if node.name == "dot_general" else 1
        nodes.extend(split_dot(node, s) if s > 1 else [node])
    return Graph(graph.inputs, graph.outputs, tuple(nodes), graph.consts, graph.control)


def split_factor(node: Node, readers: dict, outputs: set) -> int:
    """How many slices of K the dot is computed in (1: as it is)."""
    lhs, rhs = node.inputs
    out = node.outputs[0]
    if not all(dtypes.name(v.dtype) == "float32" for v in (lhs, rhs, out)):
        return 1
    lc, rc, lb, rb, lf, rf = dot_dims(node)
    if lb or len(lc) != 1 or lc[0] != lhs.ndim - 1 or len(rc) != 1:
        return 1
    uses = readers.get(out, [])
    if not uses or out in outputs or any(u.name not in READERS for u in uses):
        return 1
    _, m, n, k = dot_sizes(node)
    if m < MIN_M:
        return 1
    tiles = -(-m // GEMM_TILE) * -(-n // GEMM_TILE)
    if tiles > MAX_TILES:
        return 1
    s = 1
    while (2 * s <= MAX_SPLIT and k % (2 * s) == 0 and k // (2 * s) >= MIN_SLICE_K
           and tiles * 2 * s <= GPU_SMS):
        s *= 2
    return s


def split_dot(node: Node, s: int) -> list[Node]:
    """The dot as one GEMM batched over `s` slices of K, and the sum of its results."""
    rc = dot_dims(node)[1][0]  # the rhs's contracting axis (the lhs's is its last)
    k = node.inputs[0].shape[-1]
    precision = node.params.get("precision")
    preferred = node.params.get("preferred_element_type")

    def partial_sums(a, b):
        a = a.reshape(a.shape[:-1] + (s, k // s))              # (..., s, k/s)
        b = b.reshape(b.shape[:rc] + (s, k // s) + b.shape[rc + 1:])
        dims = (((a.ndim - 1,), (rc + 1,)), ((a.ndim - 2,), (rc,)))
        p = lax.dot_general(a, b, dims, precision=precision, preferred_element_type=preferred)
        total = lax.index_in_dim(p, 0, keepdims=False)        # p: (s, lhs free..., rhs free...)
        for i in range(1, s):
            total = total + lax.index_in_dim(p, i, keepdims=False)
        return total

    return replace_with(node, partial_sums,
                        key=("split_k", s, rc, str(precision), str(preferred)))

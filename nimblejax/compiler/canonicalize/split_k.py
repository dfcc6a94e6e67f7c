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

Which dots (`split_factor`): float32, batch axes of size 1 at most (a convolution's GEMM,
conv_path.py), one contracting axis (the lhs's last), at least MIN_M rows (MIN_M_LONG_K
where K is at least LONG_K: beyond what the tensor-core kernel takes), K at most MAX_K,
at most MAX_TILES output tiles, and every reader an `add` or a `mul` (a bias, a residual,
a batch norm's scale) or a reshape read only by those (a convolution's NHWC result), none
of them a result of the function: fusion puts the sum in the elementwise or row kernel
that computes them. `s` is the largest power of two up to MAX_SPLIT whose slices keep
MIN_SLICE_K of K and whose tiles (GEMM_TILE square, as merge_dots counts them) make at
most one wave on the GPU's SMs. The partial products are float32 and the sum's order is
fixed (((p0 + p1) + p2) + ...), as a split-K GEMM's is. On an H200 at batch 1, GPU time:
BERT 0.696 → 0.645 ms (those constants were the best of five settings measured),
Inception-v3 0.733 → 0.679, ResNet-50 0.524 → 0.513 (BENCHMARKS.md, 2026-11-29).
The tensor-core kernel (gemm_tc.py) computing the partial products instead of cuBLASLt
was measured slower at every tile tried (BERT 0.64 → 0.77 to 0.99 ms). `Options.split_k`
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
# ... unless K is this long: the tensor-core kernel reads at most 32 K floats a block
# (gemm_tc.MAX_BLOCK_READ, K <= 512 at its 32 x 32 tile), so these stay cuBLASLt's, which
# splits them itself (ResNet-50's last stage at batch 1: 49 x 512 x 4608).
MIN_M_LONG_K, LONG_K = 16, 1024
# More output tiles than this: left to cuBLASLt. Measured on an H200: 4 to 24 tiles gain
# (BERT's and GPT's layers at batch 1), 32 lose (a 512-wide encoder at batch 8, 1024 x
# 512: GPU time 3 to 6% more than whole; examples/gpu/benchmark_transformers.py).
MAX_TILES = 24
MIN_SLICE_K = 192   # the K of one partial product, at least
# The longest K split: the longest measured is 4608 (ResNet-50's 3 x 3 convolutions of 512
# channels). A filter gradient of a training step contracts over the batch's pixels (up
# to 401408) with its SGD update in cuBLASLt's epilogue: not measured split, left whole.
MAX_K = 8192
MAX_SPLIT = 8       # partial products, at most: each is read again by the sum
READERS = frozenset({"add", "add_any", "mul"})


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
    if any(lhs.shape[d] != 1 for d in lb) or len(lc) != 1 or lc[0] != lhs.ndim - 1 or len(rc) != 1:
        return 1
    if not _summed_by_readers(out, readers, outputs):
        return 1
    _, m, n, k = dot_sizes(node)
    if m < (MIN_M_LONG_K if k >= LONG_K else MIN_M) or k > MAX_K:
        return 1
    tiles = -(-m // GEMM_TILE) * -(-n // GEMM_TILE)
    if tiles > MAX_TILES:
        return 1
    s = 1
    while (2 * s <= MAX_SPLIT and k % (2 * s) == 0 and k // (2 * s) >= MIN_SLICE_K
           and tiles * 2 * s <= GPU_SMS):
        s *= 2
    return s


def _summed_by_readers(var: Var, readers: dict, outputs: set, through_reshape: bool = True) -> bool:
    """Whether every reader of `var` (not a result of the function) is one of READERS,
    or a reshape whose readers all are: the kernels fusion makes of those add the
    partial products as they read them."""
    uses = readers.get(var, [])
    return bool(uses) and var not in outputs and all(
        u.name in READERS or (through_reshape and u.name == "reshape"
                              and _summed_by_readers(u.outputs[0], readers, outputs, through_reshape=False))
        for u in uses)


def split_dot(node: Node, s: int) -> list[Node]:
    """The dot as one GEMM batched over `s` slices of K, and the sum of its results (the
    batch axes, all of size 1, dropped around it)."""
    _, rc, lb, rb, _, _ = dot_dims(node)
    rc = rc[0] - sum(d < rc[0] for d in rb)  # the rhs's contracting axis without its batch axes
    k = node.inputs[0].shape[-1]
    out_shape = node.outputs[0].shape
    precision = node.params.get("precision")
    preferred = node.params.get("preferred_element_type")

    def partial_sums(a, b):
        a = a.reshape(tuple(d for i, d in enumerate(a.shape) if i not in lb))
        b = b.reshape(tuple(d for i, d in enumerate(b.shape) if i not in rb))
        return whole(a, b).reshape(out_shape)

    def whole(a, b):
        a = a.reshape(a.shape[:-1] + (s, k // s))              # (..., s, k/s)
        b = b.reshape(b.shape[:rc] + (s, k // s) + b.shape[rc + 1:])
        dims = (((a.ndim - 1,), (rc + 1,)), ((a.ndim - 2,), (rc,)))
        p = lax.dot_general(a, b, dims, precision=precision, preferred_element_type=preferred)
        total = lax.index_in_dim(p, 0, keepdims=False)        # p: (s, lhs free..., rhs free...)
        for i in range(1, s):
            total = total + lax.index_in_dim(p, i, keepdims=False)
        return total

    return replace_with(node, partial_sums,
                        key=("split_k", s, rc, lb, rb, str(precision), str(preferred)))

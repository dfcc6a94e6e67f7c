"""The order in which XLA's GPU backend combines the elements of one argmax/argmin.

JAX lowers argmax/argmin to a variadic reduce of (value, iota) whose reducer picks its
first operand when that is NaN (jax/_src/lax/lax.py, _ArgMinMaxReducer). Among non-NaN
values the reducer is associative (the best value, the lowest index among equals), but
when both operands are NaN the first one wins, so which NaN's index comes back depends
on how XLA arranges the reduction. Every arrangement XLA uses is a tree in which the
earlier operand is always the left one (the running accumulator in a thread's loop, the
lower lane in a shuffle, the lower warp in the cross-warp step), so the result is the
first NaN of one fixed permutation of the reduced axis: the leaves of that tree read
left to right. `nan_rank` gives each position its place in that permutation; the
argmax kernel returns the NaN of lowest rank when a row has a NaN.

The arrangement, as XLA chooses it (openxla/xla):
- xla/service/gpu/reduction_utils.cc, GetReductionKindAndContiguousComponents: a
  reduce of axis `axis` of (A, R, B) (B the product of the later dims) is a row
  reduction [1, A, R] when B == 1, else a column reduction [A, R, B].
- IsUnnestedReductionFasterThanElemental: rows shorter than the warp size (32) whose
  length does not divide 32, and small columns (R < 32, or R < 64 and B < 32, or
  R < 128 and B < 8, or R < 256 and B < 3), become loop fusions: the elemental emitter
  folds the axis in order, accumulator first (the first NaN wins).
- ReductionIsRaceFree: rows longer than 1024 * 16 and columns longer than 32 * 128
  are split first by xla/backends/gpu/transforms/tree_reduction_rewriter.cc
  (ComputeSplitParams: R padded to k1 * k2, an inner reduce of each k2-long piece, then
  an outer one over the k1 results; each a fusion of its own, chosen by these rules).
- xla/backends/gpu/codegen/emitters/reduction.cc, CreateReductionFusion:
  * never MultiRowReductionFusion: its TryCreate sizes vectors by the fusion's smallest
    output width, and the variadic reduce's tuple-shaped root has none
    (hlo_fusion_analysis.cc, SmallestBitWidth skips non-arrays: INT_MAX), so the vector
    size comes out 0 and it declines (measured: (20000, 32) and (5000, 64) rows order
    as the row emitter's);
  * RowReductionFusion: T = min(1024, roundup(ceil(R / 16), 32)) threads per row, vector
    size v = GetVectorSizeForMlir (reduction_base.cc); thread t folds the vectors
    p = s*T + t (s = 0, 1, ...), each element of a vector in order; a shuffle-down tree
    (offsets 16..1, ShuffleReduceOp lowering passes the own lane's value first) in each
    warp, then warp w's result goes to lane w of one warp (lanes past the warp count
    hold the init value) for one more shuffle tree;
  * ColumnReductionFusion / SmallColumnReductionFusion: slot g of S (32, or the
    small-column emitter's shared_rows_) folds rows g, g+S, g+2S, ...; then, through
    shared memory, a shuffle tree over the S slots.
A shuffle-down tree over 2^b lanes puts lane l at position bitreverse_b(l).

Integer and bool argmax have no NaN, so their result does not depend on the order.

Checked against jax.jit on an H100 (jax 0.11.2) for 52 shapes and float32, float16 and
bfloat16 (tests/compiler/lowering/data/argmax_gpu_probe.json.gz: 13078 rows with two or
more NaNs, all reproduced). Version-dependent: ROW_ELEMENTS_PER_THREAD below; a fusion
whose input is wider or narrower than the argmax operand (XLA fusing a convert producer
into the reduce) would get another vector size than this model assumes.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

WARP = 32
MIN_THREADS_X_ROW = 1024      # MinThreadsXRowReduction()
ROW_TILE = 16                 # GetReductionTiling: row tile_x (the race-free row bound)
# RowReductionFusion's kMinorReducedElementsPerThread: 16 in the XLA of jax 0.11.2 (the
# probe's 3x5000 rows take 320 threads); newer XLA starts its loop at 32.
ROW_ELEMENTS_PER_THREAD = 16
COL_TILE = 128                # GetReductionTiling: column tile_y


@dataclass(frozen=True)
class Arrangement:
    """kind: "seq" (loop fusion), "row" (threads, vec, tile), "col" (slots),
    "split" (k1, k2, inner, outer)."""
    kind: str
    threads: int = 1
    vec: int = 1
    tile: int = 1
    k1: int = 0
    k2: int = 0
    inner: "Arrangement | None" = None
    outer: "Arrangement | None" = None


def dims3(shape, axis) -> tuple[int, int, int]:
    a = math.prod(shape[:axis])
    return a, int(shape[axis]), math.prod(shape[axis + 1:])


def _vector_size(minor_dim: int, num_threads: int, in_bits: int) -> int:
    """reduction_base.cc, GetVectorSizeForMlir."""
    if minor_dim % 2 or num_threads * 2 > minor_dim:
        return 1
    if in_bits >= 64:
        return 1
    if in_bits >= 32:
        return 2
    if num_threads * 4 > minor_dim:
        return 2
    return 4 if minor_dim % 4 == 0 else 2


def _ceil_div(a: int, b: int) -> int:
    return -(-a // b)


def _round_up(a: int, b: int) -> int:
    return _ceil_div(a, b) * b


def _split_params(r: int, bound: int, is_row: bool) -> tuple[int, int]:
    """tree_reduction_rewriter.cc, ComputeSplitParams (k1 pieces of k2 elements)."""
    k2 = math.isqrt(r)
    if k2 > bound:
        k2 = bound
    min_pad = (k2 - r % k2) % k2
    best_k1 = (r + min_pad) // k2
    for i in range(k2 - 1, k2 // 2, -1):
        pad = (i - r % i) % i
        if pad < min_pad or (pad == min_pad and i & (i - 1) == 0):
            min_pad, best_k1 = pad, (r + pad) // i
    best_k2 = (r + min_pad) // best_k1
    k1, k2 = best_k1, best_k2
    swap = False
    if k1 <= bound:
        if is_row:
            if k2 % 2 == 0 and r % 2 == 0:
                swap = k2 * 2 < k1 or k1 % 2 == 0
            else:
                swap = r % 2 == 0 or k1 % 2 != 0
        else:
            swap = True
    return (k2, k1) if swap else (k1, k2)


def _stage2_bits(bits: int, bf16: bool) -> int:
    """The input width of a split reduction's second fusion: its parameters are the
    first one's outputs, the values and the int32 indices. XLA reduces bfloat16 values
    as float32 (the optimized HLO reduces a convert to f32 inside the fusion, whose
    parameter stays bf16), so a bfloat16 split hands float32 to its second stage
    (measured: (64, 50257) and (8, 300000) rows on the H100; float16 stays 16-bit)."""
    return 32 if bf16 else min(bits, 32)


def arrangement(a: int, r: int, b: int, bits: int, bf16: bool = False) -> Arrangement:
    """XLA's arrangement for reducing the middle of (a, r, b) whose fusion reads
    `bits`-wide values (its smallest input width)."""
    if r <= 1:
        return Arrangement("seq")
    if b == 1:  # row reduction [1, a, r]
        if r < WARP and WARP % r:
            return Arrangement("seq")
        if r > MIN_THREADS_X_ROW * ROW_TILE:
            k1, k2 = _split_params(r, MIN_THREADS_X_ROW * ROW_TILE, True)
            return Arrangement("split", k1=k1, k2=k2,
                               inner=arrangement(a * k1, k2, 1, bits, bf16),
                               outer=arrangement(a, k1, 1, _stage2_bits(bits, bf16)))
        t = min(MIN_THREADS_X_ROW, _round_up(_ceil_div(r, ROW_ELEMENTS_PER_THREAD), WARP))
        v = _vector_size(r, t, bits)
        tile = min(ROW_ELEMENTS_PER_THREAD // v, _ceil_div(r // v, t))
        return Arrangement("row", threads=t, vec=v, tile=tile)
    # column reduction [a, r, b]
    if (r < WARP or (r < 2 * WARP and b < WARP) or (r < 4 * WARP and b < 8)
            or (r < 8 * WARP and b < 3)):
        return Arrangement("seq")
    if r > WARP * COL_TILE:
        k1, k2 = _split_params(r, WARP * COL_TILE, False)
        return Arrangement("split", k1=k1, k2=k2,
                           inner=arrangement(a * k1, k2, b, bits, bf16),
                           outer=arrangement(a, k1, b, _stage2_bits(bits, bf16)))
    if WARP % b == 0:  # SmallColumnReductionFusion
        v = _vector_size(r * b, WARP, bits)
        shared_rows = v * 128 // b
        while shared_rows > WARP and v > 1:
            v //= 2
            shared_rows //= 2
        return Arrangement("col", threads=min(shared_rows, WARP))
    return Arrangement("col", threads=WARP)


def arrangement_for(shape, axis, dtype) -> Arrangement:
    import numpy as np
    bits = 8 * np.dtype(dtype).itemsize
    return arrangement(*dims3(shape, axis), bits, bf16=np.dtype(dtype).name == "bfloat16")


def bitrev(x: int, bits: int) -> int:
    return int(format(x, f"0{bits}b")[::-1], 2) if bits else 0


def rank_span(p: Arrangement, r: int) -> int:
    """One more than the largest rank nan_rank gives a position of an r-long axis."""
    if p.kind == "seq":
        return r
    if p.kind == "row":
        return WARP * WARP * p.tile * p.vec
    if p.kind == "col":
        return p.threads * _ceil_div(r, p.threads)
    return rank_span(p.outer, p.k1) * rank_span(p.inner, p.k2)


def nan_rank(p: Arrangement, r: int, i: int) -> int:
    """Position i's place among the leaves of XLA's combining tree (lower wins)."""
    if p.kind == "seq":
        return i
    if p.kind == "row":
        q, s2 = divmod(i, p.vec)
        s1, t = divmod(q, p.threads)
        w, lane = divmod(t, WARP)
        return ((bitrev(w, 5) * WARP + bitrev(lane, 5)) * p.tile + s1) * p.vec + s2
    if p.kind == "col":
        k, g = divmod(i, p.threads)
        return bitrev(g, p.threads.bit_length() - 1) * _ceil_div(r, p.threads) + k
    g, j = divmod(i, p.k2)
    return nan_rank(p.outer, p.k1, g) * rank_span(p.inner, p.k2) + nan_rank(p.inner, p.k2, j)


def _brev_c(x: str, bits: int) -> str:
    if bits == 0:
        return "0"
    terms = []
    for i in range(bits):
        shift = bits - 1 - 2 * i
        bit = f"({x} & {1 << i})"
        terms.append(f"({bit} << {shift})" if shift > 0 else f"({bit} >> {-shift})" if shift else bit)
    return "(" + " | ".join(terms) + ")"


def emit_nan_rank(tmp, p: Arrangement, r: int, i: str) -> str:
    """C code for nan_rank(p, r, i) of the C int expression `i`: `tmp(ctype, expr)`
    declares a temporary and returns its name (KernelBuilder.tmp). Returns a long long."""
    ll = "long long"
    if p.kind == "seq":
        return tmp(ll, f"(long long)({i})")
    if p.kind == "row":
        q = tmp("int", f"({i}) / {p.vec}") if p.vec > 1 else i
        s2 = f"(({i}) % {p.vec})" if p.vec > 1 else "0"
        t = tmp("int", f"{q} % {p.threads}")
        s1 = f"({q} / {p.threads})"
        w = tmp("int", f"{t} >> 5")
        lane = tmp("int", f"{t} & 31")
        return tmp(ll, f"(((long long){_brev_c(w, 5)} * {WARP} + {_brev_c(lane, 5)}) * {p.tile}"
                       f" + {s1}) * {p.vec} + {s2}")
    if p.kind == "col":
        g = tmp("int", f"({i}) % {p.threads}")
        return tmp(ll, f"(long long){_brev_c(g, p.threads.bit_length() - 1)} * "
                       f"{_ceil_div(r, p.threads)} + ({i}) / {p.threads}")
    g = tmp("int", f"({i}) / {p.k2}")
    j = tmp("int", f"({i}) % {p.k2}")
    outer = emit_nan_rank(tmp, p.outer, p.k1, g)
    inner = emit_nan_rank(tmp, p.inner, p.k2, j)
    return tmp(ll, f"{outer} * {rank_span(p.inner, p.k2)} + {inner}")

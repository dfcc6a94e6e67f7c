"""Attention on tensor cores: attention.py's one-kernel attention for rows too long for
its float32 FMAs (BERT's and GPT's 128 keys and more), both products as TF32 mma.sync,
as JAX's default precision computes them in its GEMMs.

A block takes 16 consecutive queries of one batch entry (one mma row group), shared by
`warps` warps, each taking every `warps`-th 8 columns of the products:

1. scores: the queries sit in registers as mma fragments (TF32); the keys come through
   shared memory `keys` at a time, copied by the whole block (coalesced, four floats a
   load where the layout allows); each warp multiplies its columns of the chunk and
   writes alpha * q . k (+ the mask, where the scores' GEMM had one as its residual) into
   the block's scores, 16 x (length + 4) floats of shared memory (zeros past the end);
2. the row kernel's passes (rows.py), as in attention.py: a warp per row, the block's 16
   rows shared among its warps, reading the scores and leaving the probabilities in
   shared memory;
3. values: the probabilities are read back as fragments, the values come through shared
   memory `keys` rows at a time, and each warp accumulates its 16 x (width / warps) share
   of the result in registers, written where the second GEMM would have.

Nothing of the scores reaches global memory, and three launches become one. Where the
keys and values are one chunk, their copies (cp.async) run while the queries load and
while the row passes run. Why 16 queries a block: every phase is a chain of latencies (a
copy, then products, then shuffles), so the kernel wants many small blocks side by side
(BERT at batch 1: 96 blocks) rather than a few large ones. Measured on an H100
(`examples/gpu/probe_attention.py`, causal `jax.nn.dot_product_attention`, GPU µs of the
plan, batch x queries x heads x head size):

| shape | three kernels | this kernel | (blocks of 64 queries, copies not overlapped) |
|---|---|---|---|
| 1x128x12x64 (BERT at batch 1) | 11.5 | 9.3 | 24.3 |
| 1x128x8x64 (GPT at batch 1) | 11.7 | 8.5 | 23.2 |
| 2x128x12x64 | 18.7 | 15.3 | 27.7 |
| 8x128x8x64 | 24.2 | 27.3 | 30.4 |
| 32x128x12x64 (BERT at batch 32) | 96.7 | 113.3 | 103.7 |
| 1x256x8x64 | 15.0 | 15.4 | 52.6 |
| 1x512x8x64 | 24.7 | 37.9 | 142.0 |

With more work each block re-reads its head's keys and values for only 16 queries, where
the GEMMs' tiles share them: from about 64 M multiply-adds (MAX_MACS) the three kernels
win. Both products round their operands to TF32 (round to nearest) and accumulate in
float32, as the library GEMMs do under JAX's default precision; a program asking for
"highest" precision keeps its GEMMs.

Shared memory strides: scores rows (the length padded to a whole chunk) + 4 floats apart
(a fragment read of row g, column t hits bank 4g + t: all 32 distinct), keys head + 4
and values width + 8 apart (bank 4g + t and 8t + g). All of it within the 48 KB of
static shared memory the runtime's launches have: `keys` is the largest chunk of 128,
64, 32 that fits.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

from nimblejax.compiler.lowering.task import GemmCall

ROWS = 16  # queries per block: one mma row group
MAX_HEAD = 128  # the head size and the values' width: registers per thread
MAX_SHARED = 48 * 1024  # bytes of static shared memory a launch may use
KEY_CHOICES = (128, 64, 32)  # keys (values) per chunk through shared memory
WARP_CHOICES = (8, 4, 2, 1)  # warps per block, the most that split the products evenly
# At most this many multiply-adds (queries x keys x (head size + width), over the batch):
# beyond, the GEMMs and the row kernel win (module docstring's table).
MAX_MACS = 1 << 26


@dataclass(frozen=True)
class Shape:
    """How the kernel is cut: `keys` per chunk, `warps` per block."""

    keys: int
    warps: int

    @property
    def threads(self) -> int:
        return 32 * self.warps


def shape_for(g1: GemmCall, g2: GemmCall, width: int) -> Optional[Shape]:
    """The kernel's cut where it applies, else None: TF32 products on both sides (the
    caller, attention.py, has checked that the first has no epilogue but maybe a
    residual, an additive mask read as the scores are stored), a multiple of 16 queries, head size and width multiples of 8 of at most
    MAX_HEAD, at most MAX_MACS multiply-adds, and the block's scores and a chunk fitting
    shared memory."""
    if g1.compute != "tf32" or g2.compute != "tf32":
        return None
    if g1.m % ROWS or g1.k % 8 or g1.k > MAX_HEAD or width % 8 or width > MAX_HEAD:
        return None
    if g1.batch * g1.m * g1.n * (g1.k + width) > MAX_MACS:
        return None
    for keys in KEY_CHOICES:
        if 4 * (ROWS * _stride(g1.n, keys) + keys * _tile_floats(g1.k, width)) <= MAX_SHARED:
            return Shape(keys, next(w for w in WARP_CHOICES if width // 8 % w == 0 and keys // 8 % w == 0))
    return None


def _padded(n: int, keys: int) -> int:
    return -(-n // keys) * keys


def _stride(length: int, keys: int) -> int:
    """Floats from one row of scores to the next."""
    return _padded(length, keys) + 4


def _tile_floats(head: int, width: int) -> int:
    return max(head + 4, width + 8)


def declare(b, g1: GemmCall, shape: Shape, width: int) -> None:
    """The block's indices and shared memory."""
    b.emit(f"// {g1.batch * g1.m} rows (batch {g1.batch} x {g1.m} queries) of {g1.n} scores, "
           f"{ROWS} a block of {shape.warps} warps: scores = {g1.alpha!r} * q . k (head size "
           f"{g1.k}) and p . v ({width} wide) on tensor cores (TF32), the row kernel's passes between")
    b.emit("const int lane = threadIdx.x % 32, warp = threadIdx.x / 32;")
    b.emit("const int group = lane / 4, tig = lane % 4;  // the mma fragments' row and column")
    b.emit(f"const long long row0 = (long long)blockIdx.x * {ROWS};")
    b.emit(f"const long long bq = row0 / {g1.m}, q0 = row0 % {g1.m};")
    b.emit(f"__shared__ float sc_rows[{ROWS * _stride(g1.n, shape.keys)}];")
    b.emit(f"__shared__ __align__(16) float tile[{shape.keys * _tile_floats(g1.k, width)}];")


def scores(b, g1: GemmCall, shape: Shape, offset) -> None:
    """Phase 1: the block's scores in shared memory (`offset(g, which, row, col)`: the C
    offset of op(which)[row][col] in batch entry bq)."""
    head, stride, ss, keys = g1.k, g1.k + 4, _stride(g1.n, shape.keys), shape.keys
    qa, one = b.input(g1.a), _padded(g1.n, keys) == keys
    copy_keys = lambda: _copy_tile(b, b.input(g1.b), lambda r, e: offset(g1, "b", e, r), "c0", g1.n,  # noqa: E731
                                   head, stride, g1.trans_b and _aligned(g1, "b"), shape)
    if one:  # the keys' copy is under way while the queries load
        b.emit("const int c0 = 0;")
        copy_keys()
    b.emit(f"unsigned qa[{head // 8}][4];  // the block's queries, TF32")
    b.emit("#pragma unroll")
    b.open(f"for (int s = 0; s < {head // 8}; ++s)")
    b.emit("const long long r = q0 + group;")
    for e, (dr, dk) in enumerate(((0, 0), (8, 0), (0, 4), (8, 4))):
        b.emit(f"qa[s][{e}] = nimble_tf32({qa}[{offset(g1, 'a', f'r + {dr}', f's * 8 + tig + {dk}')}]);")
    b.close()
    if one:
        b.emit("nimble_cp_async_wait<0>();")
        b.emit("__syncthreads();")
        b.open("")
    else:
        b.open(f"for (int c0 = 0; c0 < {_padded(g1.n, keys)}; c0 += {keys})")
        b.emit("__syncthreads();  // the last chunk's readers are done")
        copy_keys()
        b.emit("nimble_cp_async_wait<0>();")
        b.emit("__syncthreads();")
    per = keys // 8 // shape.warps
    b.emit("#pragma unroll")
    b.open(f"for (int j = 0; j < {per}; ++j)")
    b.emit(f"const int n = (warp + j * {shape.warps}) * 8;  // the 8 keys' first, within the chunk")
    b.emit("float acc[4] = {0.0f, 0.0f, 0.0f, 0.0f};")
    b.emit("#pragma unroll")
    b.open(f"for (int s = 0; s < {head // 8}; ++s)")
    b.emit(f"const float* const kt = tile + (n + group) * {stride} + s * 8 + tig;")
    b.emit("const unsigned fb[2] = {nimble_tf32(kt[0]), nimble_tf32(kt[4])};")
    b.emit("nimble_mma_tf32(acc, qa[s], fb);")
    b.close()
    b.emit(f"float* const at = sc_rows + group * {ss} + c0 + n + 2 * tig;")
    alpha = _scale(g1.alpha)
    if g1.epilogue.residual:  # + R (beta = 1), stored as the scores are; zeros past the end
        res = b.input(g1.residual)
        b.emit(f"const long long rc = (bq * {g1.m} + q0 + group) * {g1.n} + c0 + n + 2 * tig;")
        b.emit(f"const bool in0 = c0 + n + 2 * tig < {g1.n}, in1 = c0 + n + 2 * tig + 1 < {g1.n};")
        b.emit(f"at[0] = in0 ? {alpha}acc[0] + {res}[rc] : 0.0f; "
               f"at[1] = in1 ? {alpha}acc[1] + {res}[rc + 1] : 0.0f;")
        b.emit(f"at[{8 * ss}] = in0 ? {alpha}acc[2] + {res}[rc + {8 * g1.n}] : 0.0f; "
               f"at[{8 * ss + 1}] = in1 ? {alpha}acc[3] + {res}[rc + {8 * g1.n + 1}] : 0.0f;")
    else:
        b.emit(f"at[0] = {alpha}acc[0]; at[1] = {alpha}acc[1];")
        b.emit(f"at[{8 * ss}] = {alpha}acc[2]; at[{8 * ss + 1}] = {alpha}acc[3];")
    b.close()
    b.close()
    b.emit("__syncthreads();  // every score of the block is in")


def open_rows(b, g1: GemmCall, shape: Shape) -> None:
    """Phase 2's loop: the block's rows shared among its warps, each with the names the
    row passes read (o, sc, rowbase)."""
    b.open(f"for (int rr = warp; rr < {ROWS}; rr += {shape.warps})")
    b.emit("const long long o = row0 + rr;")
    b.emit(f"float* const sc = sc_rows + rr * {_stride(g1.n, shape.keys)};")
    b.emit(f"const long long rowbase = o * {g1.n};")


def _values_operand(b, g2: GemmCall, probs_first: bool, offset):
    """(width, C name, offset(j, d) of x[j][d], whether it reads float4s): the values as
    the second GEMM reads them."""
    if probs_first:  # x[j][d] = op(B)[j][d]
        return (g2.n, b.input(g2.b), lambda r, e: offset(g2, "b", r, e),
                not g2.trans_b and _aligned(g2, "b"))
    return (g2.m, b.input(g2.a), lambda r, e: offset(g2, "a", e, r),  # x[j][d] = op(A)[d][j]
            g2.trans_a and _aligned(g2, "a"))


def prefetch_values(b, g2: GemmCall, probs_first: bool, shape: Shape, length: int, offset) -> None:
    """Where the values are one chunk: their copy into the tile (the keys' readers are
    done), under way while the row passes run."""
    if _padded(length, shape.keys) == shape.keys:
        width, x, at, vector = _values_operand(b, g2, probs_first, offset)
        b.emit("const int j0 = 0;")
        _copy_tile(b, x, at, "j0", length, width, width + 8, vector, shape)


def values(b, g2: GemmCall, probs_first: bool, shape: Shape, length: int, offset) -> None:
    """Phase 3: this warp's 16 queries x (width / warps) of p . v, written where the
    second GEMM writes its result: the probabilities are its A read row by row
    (`probs_first`: result row q, column d) or its B read transposed (column q, row d)."""
    width, x, at, vector = _values_operand(b, g2, probs_first, offset)
    stride, ss, keys = width + 8, _stride(length, shape.keys), shape.keys
    per = width // 8 // shape.warps
    b.emit(f"float oacc[{per}][4] = {{}};")
    if _padded(length, keys) == keys:  # prefetched
        b.emit("nimble_cp_async_wait<0>();")
        b.emit("__syncthreads();  // every probability and value of the block is in")
        b.open("")
    else:
        b.emit("__syncthreads();  // every probability of the block is in")
        b.open(f"for (int j0 = 0; j0 < {_padded(length, keys)}; j0 += {keys})")
        b.emit("__syncthreads();  // the last chunk's readers are done")
        _copy_tile(b, x, at, "j0", length, width, stride, vector, shape)
        b.emit("nimble_cp_async_wait<0>();")
        b.emit("__syncthreads();")
    b.emit("#pragma unroll")
    b.open(f"for (int s = 0; s < {keys // 8}; ++s)")
    b.emit(f"const float* const pr = sc_rows + group * {ss} + j0 + s * 8 + tig;")
    b.emit(f"const unsigned fa[4] = {{nimble_tf32(pr[0]), nimble_tf32(pr[{8 * ss}]), "
           f"nimble_tf32(pr[4]), nimble_tf32(pr[{8 * ss + 4}])}};")
    b.emit("#pragma unroll")
    b.open(f"for (int j = 0; j < {per}; ++j)")
    b.emit(f"const float* const vt = tile + (s * 8 + tig) * {stride} + (warp + j * {shape.warps}) * 8 + group;")
    b.emit(f"const unsigned fb[2] = {{nimble_tf32(vt[0]), nimble_tf32(vt[{4 * stride}])}};")
    b.emit("nimble_mma_tf32(oacc[j], fa, fb);")
    b.close()
    b.close()
    b.close()
    out = b.output(g2.c)
    ldc, stride_c = g2.layout("c")
    # Where (query q, column d) goes, and the step to q + 8 and to d + 1.
    place, q8, d1 = ((f"(q0 + group) * {ldc}LL + d", 8 * ldc, 1) if probs_first
                     else (f"(long long)d * {ldc} + q0 + group", 8, ldc))
    alpha = _scale(g2.alpha)
    b.emit("#pragma unroll")
    b.open(f"for (int j = 0; j < {per}; ++j)")
    b.emit(f"const int d = (warp + j * {shape.warps}) * 8 + 2 * tig;")
    b.emit(f"float* const at = {out} + bq * {stride_c}LL + {place};")
    b.emit(f"at[0] = {alpha}oacc[j][0]; at[{d1}LL] = {alpha}oacc[j][1];")
    b.emit(f"at[{q8}LL] = {alpha}oacc[j][2]; at[{q8 + d1}LL] = {alpha}oacc[j][3];")
    b.close()


def _aligned(g: GemmCall, which: str) -> bool:
    """Whether operand `which` can be read four floats at a time along its stored rows:
    its leading dimension and batch stride are multiples of 4 (the buffer itself is)."""
    ld, stride = g.layout(which)
    return ld % 4 == 0 and stride % 4 == 0 and g.stored(which)[1] % 4 == 0


def _copy_tile(b, src: str, offset, first: str, count: int, width: int, stride: int,
               vector: bool, shape: Shape) -> None:
    """The block's asynchronous copy (cp.async, committed) of rows [first, first + keys)
    of the source (`offset(r, e)`: element e of row r; zeros from row `count` on) into
    `tile`, row r at r * stride: every copy of a thread issued before any completes.
    Where `vector` (the source is contiguous along a row, aligned), consecutive threads
    copy consecutive float4s of a row, else consecutive elements of a column."""
    keys, threads = shape.keys, shape.threads
    size = 4 if vector else 1
    items = keys * width // size
    b.emit("#pragma unroll")
    b.open(f"for (int u = 0; u < {-(-items // threads)}; ++u)")
    b.emit(f"const int i = threadIdx.x + u * {threads};")
    if items % threads:
        b.emit(f"if (i >= {items}) break;")
    tile_coordinates(b, keys, width // size, vector, size)
    b.emit(f"const bool ok = {first} + r < {count};")
    b.emit(f"nimble_cp_async{4 * size}(tile + r * {stride} + e, {src} + (ok ? {offset(f'{first} + r', 'e')} : 0), ok);")
    b.close()
    b.emit("nimble_cp_async_commit();")


def tile_coordinates(b, rows: int, per_row: int, along_rows: bool, size: int = 1) -> None:
    """Declare item i's row r and first element e in a tile of `rows` rows of `per_row`
    items of `size` elements: consecutive items along a row where `along_rows`, else
    along a column."""
    if along_rows:
        b.emit(f"const int r = i / {per_row}, e = i % {per_row}{f' * {size}' if size > 1 else ''};")
    else:
        b.emit(f"const int r = i % {rows}, e = i / {rows};")


def _scale(alpha: float) -> str:
    return "" if alpha == 1.0 else f"{float(alpha)!r}f * "

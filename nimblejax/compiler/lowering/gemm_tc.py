"""TF32 tensor-core GEMMs for small float32 problems (an MLP's SGD step, an LSTM's step
at batch 32) as one generated kernel, not cuBLASLt.

Why: cuBLASLt's kernels are built for large tiles; at M = 8..128 and small K most of a
tile is padding, and a launch costs 2.4 to 3.5 µs however small the problem. This kernel
is a plain mma.sync pipeline on 16- or 32-row tiles, narrow enough to make enough blocks.
Measured on an H100 (python -m nimblejax.bench.gemm_tc; GPU µs per launch from CUDA
events around a graph of 100 launches, median of 5; XLA: its kernels per call from JAX's
profiler (CUPTI), median of 30; the product alone unless named; () outside the rule):

    taken            kernel cuBLASLt  XLA   |  taken              kernel cuBLASLt  XLA
    32x128x64          1.51   3.09   1.86   |  32x1024x512          4.25   5.15   4.14
    32x128x64 b+relu   1.90   3.27   1.95   |  16x1024x512          4.09   5.04   3.49
    32x64x128          1.91   3.54   2.02   |  32x2048x512          4.84   5.76   4.42
    32x128x10          1.59   2.39   1.26   |  32x2048x512 resid.   5.39   5.86   4.32
    64x128x64          1.83   3.16   2.72   |  96x512x256           3.07   4.91   3.30
    16x128x64          1.64   2.80   1.66   |  64x2048x256          3.66   4.85   3.20
    (8x256x256         2.54   4.48   2.43)  |  128x1024x256         3.44   4.96   4.48
    128x768x32         1.94   2.89   1.70   |  32x4096x256          3.69   4.84   3.10
    SGD 64x128x32      1.95   3.36   1.60   |  32x4096x512          5.09   7.01   4.45
    SGD 128x768x32     2.47   3.44   1.86   |  32x1024x256          3.01   4.78   2.56
                                            |  32x1024x256 b+gelu   3.95   5.32   4.00
    left to cuBLASLt (BERT, GPT at batch 1), the kernel at its 32 x 32 tile:
    128x768x768        6.49   6.50   6.77   |  128x768x768 b+gelu   7.56   6.87   6.94
    128x2304x768      13.85   8.16  11.04   |  128x3072x768 b+gelu 17.50  12.06  11.90
    128x3072x768      16.83   9.21  11.87   |  128x768x3072 resid. 21.50  10.01  11.42
    128x768x3072      20.95   9.87  11.47   |  (SGD: w - 0.01 * x.T @ dy, x.T read in place)

It loses where M = 128 and K >= 768, whatever its tile and pipeline: the best of 14
tiles (`--sweep`) took 12.36 µs at 128x2304x768, 13.28 at 128x3072x768, 20.67 at
128x768x3072; deeper pipelines in dynamic shared memory (up to 146 KB: K steps of 64 and
128, 6 to 12 stages, `examples/gpu/probe_tc_deep.py`) were no faster (128x768x768: 6.57
µs at 4 stages, 6.8 to 13.7 deeper; cuBLASLt 6.54), so its loads are not what limits it.

The rule (`measured_faster`), each condition with its reason:
- batch == 1: batched GEMMs (attention's heads) were not measured.
- MIN_M <= M <= MAX_M (16..128). Fewer rows leave most of each 16-row
  product idle and were measured at one shape only (8x256x256, a win): they keep
  cuBLASLt until more are (M <= 8 with a large K * N is gemm_small.py's anyway).
- at most SM_COUNT blocks: one wave; more (larger N) was not measured.
- K * (BM + BN) <= MAX_BLOCK_READ floats (128 KB read by a block): the largest measured
  wins (32x2048x512, 32x4096x512) read that much; 128x768x768 reads 1.5 times more and
  ties.
Only float32 with TF32 math qualifies (`qualifies`): precision HIGHEST stays on
cuBLASLt in full float32.

The tile (`choose_tile`): 16 x 32 with eight warps, four splitting K (HALF), where its
blocks fit one wave and K <= 512 (probe_tc_deep.py --small, 2026-11-28: 32x2048x512 4.32
µs against 4.85 at 32 x 32, 32x1024x256 2.50 against 3.01, 96x512x256 2.59 against
3.04; two waves lost, 64x2048x256 3.87 against 3.51). Else, as swept before: 32 x 32 with
2 x 2 warps (two splitting K) where they make 64 blocks or more, 32 x 16 with four warps
splitting K where those make 32 or more, else 32 x 8. 64-row tiles were slower at every
shape (64x128x64: 2.53 to 3.34 against 1.71).

The kernel (`tc_matmul`) computes exactly what its GemmCall asks cuBLASLt for:
C[b] = act(alpha * op(A[b]) @ op(B[b]) + R[b] + bias), any trans_a / trans_b, leading
dimensions and batch strides, the epilogue of compiler/epilogue.py (alpha, a bias vector
for every row, a residual R of C's contiguous layout read with beta = 1, relu or the tanh
GELU, applied in cuBLASLt's order: activation last).

- A block computes a BM x BN tile of C. Its warps form a WARPS_M x WARPS_N grid over the
  tile, times SPLIT_K groups that each take every SPLIT_K-th 8-deep slice of a K step
  (more warps per block where the tile alone has few: small M). Each warp's
  (BM/WARPS_M) x (BN/WARPS_N) sub-tile is FM x FN tensor-core products
  `mma.sync.aligned.m16n8k8.row.col.f32.tf32.tf32.f32` with float32 accumulators;
  operands are rounded to TF32 by `cvt.rna.tf32.f32` (nearest, ties away) as they come
  from shared memory. At the end the SPLIT_K groups' accumulators are added through
  shared memory, group 0 first, in a fixed order: results are deterministic.
- K is walked BK at a time through a STAGES-deep ring of shared-memory tiles filled by
  `cp.async` (16 bytes where the operand's contiguous axis, leading dimension and batch
  stride are multiples of 4 floats, else 4): the copies of the next STAGES - 1 steps are
  in flight while the current one is multiplied. Past M, N or K the copies write zeros.
- Shared tiles are stored as the operand is in memory, rows padded (`smem_stride`) so
  that a warp's fragment reads hit 32 banks; all in 48 KB of static shared memory.

The PTX sits in `__device__` helpers under `#ifndef NIMBLE_TC_PTX` (gemm_tc_ptx.py; a
module may hold several such kernels; the CPU emulator defines NIMBLE_TC_PTX and supplies
its own). With a post group (gemm_post.py) the epilogue also computes the GEMM's
elementwise reader; with a gate-sliced one (gemm_gates.py: an LSTM cell) a block's
columns are the same units of every gate, and the group is computed from the tile staged
in shared memory.
"""
from __future__ import annotations

import dataclasses
import hashlib
from dataclasses import dataclass
from typing import Optional

from nimblejax.compiler.epilogue_gelu import GELU_CUBIC, SQRT_2_OVER_PI
from nimblejax.compiler.lowering.gemm_gates import GatePost, gate_epilogue, units
from nimblejax.compiler.lowering.gemm_post import PostCode
from nimblejax.compiler.lowering.codegen import with_prelude
from nimblejax.compiler.lowering.gemm_tc_ptx import PTX_HELPERS
from nimblejax.compiler.lowering.task import GemmCall, Kernel

SMEM_BYTES = 48 * 1024  # static shared memory a block may declare
MAX_GRID_Z = 65535  # the batch runs on blockIdx.z
MAX_OFFSET = 2**31 - 1  # offsets inside one matrix are ints
SM_COUNT = 132  # H100 and H200: more blocks than this were not measured
MIN_M, MAX_M = 16, 128
MAX_BLOCK_READ = 32 * 1024  # K * (BM + BN) floats (128 KB), the largest measured win


@dataclass(frozen=True)
class Tile:
    """A block's tile of C (bm x bn), K step (bk), warps and pipeline depth."""

    bm: int
    bn: int
    bk: int
    warps_m: int
    warps_n: int
    split_k: int
    stages: int

    def __post_init__(self) -> None:
        if self.bm % (16 * self.warps_m) or self.bn % (8 * self.warps_n) or self.bk % 8 \
                or (self.bk // 8) % self.split_k or self.stages < 2:
            raise ValueError(f"inconsistent tile {self}")

    @property
    def threads(self) -> int:
        return 32 * self.warps_m * self.warps_n * self.split_k

    @property
    def fm(self) -> int:  # m16 products per warp along M
        return self.bm // self.warps_m // 16

    @property
    def fn(self) -> int:  # n8 products per warp along N
        return self.bn // self.warps_n // 8

    @property
    def label(self) -> str:
        return (f"{self.bm}x{self.bn}x{self.bk} w{self.warps_m}x{self.warps_n}x{self.split_k} "
                f"s{self.stages}")


# ---- the rule ------------------------------------------------------------------------------
def qualifies(call: GemmCall) -> bool:
    """Whether the kernel computes `call` exactly (layouts, dtypes, epilogue), whatever
    its speed: float32 in and out, TF32 math, beta only for a residual."""
    return (call.dtype == "float32" and call.compute == "tf32" and call.out_dtype in (None, "float32")
            and call.beta == (1.0 if call.epilogue.residual else 0.0)
            and call.batch <= MAX_GRID_Z
            and all(_matrix_extent(call, w) <= MAX_OFFSET for w in "abc"))


def takes_tc(call: GemmCall) -> bool:
    """Whether a GEMM runs as this kernel rather than cuBLASLt (module docstring)."""
    return qualifies(call) and measured_faster(call)


def measured_faster(call: GemmCall) -> bool:
    """The measured rule (module docstring): one matrix of 16 to 128 rows, one wave of
    blocks, and at most MAX_BLOCK_READ floats of A and B read by a block."""
    tile = choose_tile(call)
    blocks = -(-call.m // tile.bm) * -(-call.n // tile.bn)
    return (call.batch == 1 and MIN_M <= call.m <= MAX_M and blocks <= SM_COUNT
            and call.k * (tile.bm + tile.bn) <= MAX_BLOCK_READ)


def _matrix_extent(call: GemmCall, which: str) -> int:
    rows, cols = call.stored(which)
    return (rows - 1) * call.layout(which)[0] + cols


# ---- the tile ------------------------------------------------------------------------------
# The rule's tiles (module docstring): HALF, 16 x 32 with eight warps; 32 rows by 32, 16
# or 8 columns with four warps; two or four warps splitting each K step; four stages.
TILES = {32: Tile(32, 32, 32, 1, 2, 2, 4), 16: Tile(32, 16, 32, 1, 1, 4, 4),
         8: Tile(32, 8, 32, 1, 1, 4, 4)}
HALF = Tile(16, 32, 32, 1, 2, 4, 4)
MIN_BLOCKS = {32: 64, 16: 32}  # the widest tile that still gives this many blocks
HALF_MAX_K = 512  # the deepest K measured with HALF (32x2048x512)


def choose_tile(call: GemmCall) -> Tile:
    """HALF where it makes one wave (SM_COUNT blocks) and K <= HALF_MAX_K, else the widest
    32-row tile that makes MIN_BLOCKS blocks, else 32 x 8 (module docstring)."""
    if call.k <= HALF_MAX_K and -(-call.m // HALF.bm) * -(-call.n // HALF.bn) <= SM_COUNT:
        return HALF
    row_tiles = -(-call.m // 32)
    for bn in (32, 16):
        if row_tiles * -(-call.n // bn) >= MIN_BLOCKS[bn]:
            return TILES[bn]
    return TILES[8]


def smem_stride(contiguous: int, k_major: bool, bk: int) -> int:
    """Floats from one stored row of a shared tile to the next: a K-major tile (rows of
    M or N, BK floats each) pads to BK + 4 (4 * row + k: 32 banks); an M/N-major tile (rows
    of K) to a multiple of 4 that is 8 or 24 mod 32 (8 * k + row, or 24 * k + row)."""
    if k_major:
        return bk + 4
    s = contiguous
    while s % 32 not in (8, 24):
        s += 4
    return s


@dataclass(frozen=True)
class _Operand:
    """How one operand (A or B) is read: from memory into a shared tile and from the tile
    into fragments."""

    name: str  # "A" or "B"
    k_major: bool  # K is the stored rows' contiguous axis
    mn: int  # the tile's extent along M (A) or N (B)
    mn_size: int  # M or N
    ld: int
    batch_stride: int
    vec: int  # floats per cp.async
    stride: int  # smem_stride
    bk: int

    @property
    def tile_floats(self) -> int:
        return (self.mn if self.k_major else self.bk) * self.stride

    def at(self, smem: str, mn: str, k: str) -> str:
        """The shared tile's element (mn, k)."""
        return f"{smem}[({mn}) * {self.stride} + ({k})]" if self.k_major else \
            f"{smem}[({k}) * {self.stride} + ({mn})]"


def _operand(call: GemmCall, which: str, tile: Tile) -> _Operand:
    trans = call.trans_a if which == "a" else call.trans_b
    k_major = (not trans) if which == "a" else trans
    mn, mn_size = (tile.bm, call.m) if which == "a" else (tile.bn, call.n)
    ld, stride = call.layout(which)
    contiguous_size = call.k if k_major else mn_size
    aligned = contiguous_size % 4 == 0 and ld % 4 == 0 and (call.batch == 1 or stride % 4 == 0)
    return _Operand(which.upper(), k_major, mn, mn_size, ld, stride, 4 if aligned else 1,
                    smem_stride(mn, k_major, tile.bk), tile.bk)


def smem_floats(call: GemmCall, tile: Tile, staged: int = 0) -> int:
    """The block's shared floats: the stage ring, or the split-K sums or the `staged`
    tile (gemm_gates.py) where larger."""
    a, b = _operand(call, "a", tile), _operand(call, "b", tile)
    ring = tile.stages * (a.tile_floats + b.tile_floats)
    return max(ring, (tile.split_k - 1) * tile.bm * tile.bn, staged)


# ---- the kernel ------------------------------------------------------------------------------
def tc_matmul(call: GemmCall, tile: Optional[Tile] = None, post: PostCode | GatePost | None = None) -> Kernel:
    """The kernel computing `call` (its operands given), with `tile` or choose_tile's;
    with `post` (gemm_post.py, gemm_gates.py), its elementwise reader's outputs instead of C."""
    assert qualifies(call), call
    tile = tile or choose_tile(call)
    gates = post if isinstance(post, GatePost) else None
    assert not gates or (call.batch == 1 and units(tile, gates.gates, gates.width) == gates.units), (call, tile)
    assert smem_floats(call, tile, _staged(tile, gates)) * 4 <= SMEM_BYTES, (call, tile)
    body = _source(call, tile, post)
    digest = hashlib.sha1(body.encode()).hexdigest()[:4]
    then = (f"_gates{gates.gates}" if gates else "") + ("_then_" + "_".join(post.ops[-2:]) if post else "")
    name = f"nimble_gemm_tc_{_shape_label(call)}{then}_{digest}"
    grid = (-(-call.n // tile.bn), -(-call.m // tile.bm), call.batch)
    outputs = gates.outputs if gates else (post.output if post else call.c,)
    params = outputs + (call.a, call.b) + ((call.bias,) if call.epilogue.bias else ()) \
        + ((call.residual,) if call.epilogue.residual else ()) + (post.inputs if post else ())
    return Kernel(name, with_prelude(PTX_HELPERS + body.replace("NAME", name, 1)), grid,
                  (tile.threads, 1, 1), params, scalars=gates.scalars if gates else ())


def _shape_label(call: GemmCall) -> str:
    """'128x768x768_nn_bias_gelu_tanh': M x N x K, batch, n / t for op(A) and op(B), epilogue."""
    shape = f"{call.m}x{call.n}x{call.k}" + (f"_b{call.batch}" if call.batch > 1 else "")
    ops = ("t" if call.trans_a else "n") + ("t" if call.trans_b else "n")
    return "_".join(filter(None, (shape, ops, call.epilogue.label(call.alpha).replace("+", "_"))))


def _staged(tile: Tile, gates: Optional[GatePost]) -> int:
    """The floats of a gate post's staged tile (gemm_gates.py), or 0."""
    return tile.bm * gates.stride if gates else 0


def _source(call: GemmCall, tile: Tile, post: PostCode | GatePost | None = None) -> str:
    gates = post if isinstance(post, GatePost) else None
    a, b = _operand(call, "a", tile), _operand(call, "b", tile)
    if gates and not b.k_major and not gates.aligned:  # a copy must stay in one gate
        b = dataclasses.replace(b, vec=1)
    ldc, stride_c = call.layout("c")
    ep = call.epilogue
    outs = [f"float* __restrict__ out{k}" for k in range(len(gates.outputs))] if gates else ["float* __restrict__ C"]
    args = outs + ["const float* __restrict__ A", "const float* __restrict__ B"]
    args += ["const float* __restrict__ bias"] * ep.bias + ["const float* __restrict__ R"] * ep.residual
    args += post.params if post else []
    first = (f"u0 = blockIdx.x * {gates.units};  // units u0.. of each gate" if gates
             else f"n0 = blockIdx.x * {tile.bn};")
    k_steps = -(-call.k // tile.bk)
    lines = [
        f"// C ({call.m} x {call.n}) = {_formula(call)}; A stored "
        f"{call.stored('a')} ld {a.ld}, B stored {call.stored('b')} ld {b.ld}, C ld {ldc}"
        + (f", batch {call.batch}" if call.batch > 1 else "") + ".",
        f"// TF32 tensor cores, float32 sums. Tile {tile.label}: block (x, y, z) = "
        "(column tile, row tile, batch entry).",
        f'extern "C" __global__ void __launch_bounds__({tile.threads}, 1) NAME({", ".join(args)}) {{',
        f"  __shared__ __align__(16) float smem[{smem_floats(call, tile, _staged(tile, gates))}];",
        f"  float* const As = smem;  // {tile.stages} stages of {a.tile_floats} floats",
        f"  float* const Bs = smem + {tile.stages * a.tile_floats};",
        "  const int tid = threadIdx.x, warp = tid / 32, lane = tid % 32;",
        "  const int group = lane / 4, thread = lane % 4;  // PTX's groupID, threadID_in_group",
        f"  const int wm = warp % {tile.warps_m}, wn = (warp / {tile.warps_m}) % {tile.warps_n}, "
        f"wk = warp / {tile.warps_m * tile.warps_n};",
        f"  const int m0 = blockIdx.y * {tile.bm}, {first}",
        *(f"  {line}" for line in (gates.prologue if gates else ())),
    ]
    if call.batch > 1:
        lines += ["  const long long batch = blockIdx.z;",
                  f"  A += batch * {a.batch_stride}; B += batch * {b.batch_stride}; "
                  f"C += batch * {stride_c};" + (f" R += batch * {stride_c};" if ep.residual else "")]
    lines += [
        f"  float acc[{tile.fm}][{tile.fn}][4];",
        "  #pragma unroll",
        f"  for (int i = 0; i < {tile.fm}; ++i)",
        "    #pragma unroll",
        f"    for (int j = 0; j < {tile.fn}; ++j)",
        "      #pragma unroll",
        "      for (int e = 0; e < 4; ++e) acc[i][j][e] = 0.0f;",
        "  // Copies of K step k0 / BK into stage s (zeros past M, N and K).",
        "  auto load_stage = [&](int s, int k0) {",
        *_copy_lines(a, tile, call.k),
        *_copy_lines(b, tile, call.k, gates.column if gates else None),
        "  };",
        "  // This warp's share of the products of stage s: its K group's 8-deep slices.",
        "  auto multiply_stage = [&](int s) {",
        f"    const float* const as = As + s * {a.tile_floats};",
        f"    const float* const bs = Bs + s * {b.tile_floats};",
        "    #pragma unroll",
        f"    for (int q = 0; q < {tile.bk // 8 // tile.split_k}; ++q) {{",
        f"      const int k = (q * {tile.split_k} + wk) * 8 + thread;",
        f"      unsigned fa[{tile.fm}][4], fb[{tile.fn}][2];",
        "      #pragma unroll",
        f"      for (int i = 0; i < {tile.fm}; ++i) {{",
        f"        const int r = wm * {tile.bm // tile.warps_m} + i * 16 + group;",
        f"        fa[i][0] = nimble_tf32({a.at('as', 'r', 'k')});",
        f"        fa[i][1] = nimble_tf32({a.at('as', 'r + 8', 'k')});",
        f"        fa[i][2] = nimble_tf32({a.at('as', 'r', 'k + 4')});",
        f"        fa[i][3] = nimble_tf32({a.at('as', 'r + 8', 'k + 4')});",
        "      }",
        "      #pragma unroll",
        f"      for (int j = 0; j < {tile.fn}; ++j) {{",
        f"        const int c = wn * {tile.bn // tile.warps_n} + j * 8 + group;",
        f"        fb[j][0] = nimble_tf32({b.at('bs', 'c', 'k')});",
        f"        fb[j][1] = nimble_tf32({b.at('bs', 'c', 'k + 4')});",
        "      }",
        "      #pragma unroll",
        f"      for (int i = 0; i < {tile.fm}; ++i)",
        "        #pragma unroll",
        f"        for (int j = 0; j < {tile.fn}; ++j) nimble_mma_tf32(acc[i][j], fa[i], fb[j]);",
        "    }",
        "  };",
        f"  // The pipeline: {tile.stages - 1} steps in flight ahead of the one multiplied.",
        "  #pragma unroll",
        f"  for (int s = 0; s < {tile.stages - 1}; ++s) {{",
        f"    if (s < {k_steps}) load_stage(s, s * {tile.bk});",
        "    nimble_cp_async_commit();",
        "  }",
        f"  for (int step = 0; step < {k_steps}; ++step) {{",
        f"    nimble_cp_async_wait<{tile.stages - 2}>();  // this step's copies are done",
        "    __syncthreads();  // ... for every thread, and the step before is multiplied",
        f"    const int next = step + {tile.stages - 1};",
        f"    if (next < {k_steps}) load_stage(next % {tile.stages}, next * {tile.bk});",
        "    nimble_cp_async_commit();",
        f"    multiply_stage(step % {tile.stages});",
        "  }",
        *(gate_epilogue(call.m, tile, gates, _steps(call), _split_k_sum(tile, keep=True)) if gates
          else _split_k_sum(tile) + _epilogue(call, tile, post)),
        "}",
    ]
    return "\n".join(lines) + "\n"


def _formula(call: GemmCall) -> str:
    ep = call.epilogue
    prod = ("op(A) @ op(B)" if call.alpha == 1.0 else f"{call.alpha!r} * op(A) @ op(B)")
    expr = " + ".join([prod] + ["R"] * ep.residual + ["bias"] * ep.bias)
    return f"{ep.activation}({expr})" if ep.activation != "none" else expr


def _copy_lines(op: _Operand, tile: Tile, k: int, column: Optional[str] = None) -> list[str]:
    """One operand's tile of a K step: chunks of `vec` floats, consecutive threads on
    consecutive chunks of a stored row (coalesced). `column`: B's column of the tile's
    column `mn` (gemm_gates.py), if not n0 + mn."""
    rows, cols = (op.mn, tile.bk) if op.k_major else (tile.bk, op.mn)
    per_row = cols // op.vec
    chunks = rows * per_row
    iters = -(-chunks // tile.threads)
    smem = "As" if op.name == "A" else "Bs"
    r_name, c_name = ("mn", "kk") if op.k_major else ("kk", "mn")
    g_mn, g_k = (column or f"{'m0' if op.name == 'A' else 'n0'} + mn", "k0 + kk")
    # The chunk's first element in memory; K-major: row mn, column k.
    offset = f"({g_mn}) * {op.ld} + {g_k}" if op.k_major else f"({g_k}) * {op.ld} + {g_mn}"
    lines = ["    #pragma unroll",
             f"    for (int i = 0; i < {iters}; ++i) {{",
             f"      const int c = tid + i * {tile.threads};"]
    if chunks % tile.threads:
        lines.append(f"      if (c >= {chunks}) break;")
    lines += [f"      const int {r_name} = c / {per_row}, {c_name} = c % {per_row} * {op.vec};",
              f"      const bool ok = {g_mn} < {op.mn_size} && {g_k} < {k};",
              f"      nimble_cp_async{op.vec * 4}(&{smem}[s * {op.tile_floats} + {r_name} * {op.stride} "
              f"+ {c_name}], {op.name} + (ok ? {offset} : 0), ok);",
              "    }"]
    return lines


def _split_k_sum(tile: Tile, keep: bool = False) -> list[str]:
    """K groups 1.. hand their sums to group 0 through shared memory, added in order;
    then they return, or with `keep` stay (barriers follow: gemm_gates.py)."""
    if tile.split_k == 1:
        return []
    per = tile.fm * tile.fn * 4
    slot = tile.bm * tile.bn  # floats per K group: its warps' accumulators, lane-minor
    at = (f"smem[(g - 1) * {slot} + ((warp % {tile.warps_m * tile.warps_n}) * {per} "
          f"+ (i * {tile.fn} + j) * 4 + e) * 32 + lane]")
    loops = ["    #pragma unroll",
             f"    for (int i = 0; i < {tile.fm}; ++i)",
             "      #pragma unroll",
             f"      for (int j = 0; j < {tile.fn}; ++j)",
             "        #pragma unroll",
             "        for (int e = 0; e < 4; ++e)"]
    return [
        "  // The K groups' sums meet in shared memory, group 0 adding 1, 2, ... in order.",
        "  nimble_cp_async_wait<0>();",
        "  __syncthreads();  // the last stage is multiplied: the ring is free",
        "  if (wk > 0) {",
        "    const int g = wk;",
        *loops,
        f"          {at} = acc[i][j][e];",
        "  }",
        "  __syncthreads();",
        "  if (wk == 0)  // (every thread stays)" if keep else "  if (wk > 0) return;  // (no barrier follows)",
        f"  for (int g = 1; g < {tile.split_k}; ++g) {{",
        *loops,
        f"          acc[i][j][e] += {at};",
        "  }",
    ]


def _epilogue(call: GemmCall, tile: Tile, post: Optional[PostCode] = None) -> list[str]:
    """alpha, residual, bias, activation, the post group, then C: each lane's two
    neighbouring columns of rows `group` and `group + 8` of each product (PTX's layout)."""
    n, ldc = call.n, call.layout("c")[0]
    steps = _steps(call)
    lines = ["  #pragma unroll",
             f"  for (int i = 0; i < {tile.fm}; ++i)",
             "    #pragma unroll",
             f"    for (int j = 0; j < {tile.fn}; ++j)",
             "      #pragma unroll",
             "      for (int h = 0; h < 2; ++h) {",
             f"        const int row = m0 + wm * {tile.bm // tile.warps_m} + i * 16 + group + 8 * h;",
             f"        const int col0 = n0 + wn * {tile.bn // tile.warps_n} + j * 8 + 2 * thread;"]
    value = ["float v = acc[i][j][2 * h + e];", *steps]
    if post:  # its value at (row, col) becomes v
        value += ["{", *(f"  {line}" for line in post.lines), f"  v = {post.result};", "}"]
    if n % 2 == 0 and ldc % 2 == 0:  # col0 and col0 + 1 both inside, 8-byte aligned
        lines += [f"        if (row >= {call.m} || col0 >= {n}) continue;",
                  "        float out[2];",
                  "        #pragma unroll",
                  "        for (int e = 0; e < 2; ++e) {",
                  "          const int col = col0 + e;",
                  *(f"          {s}" for s in value),
                  "          out[e] = v;",
                  "        }",
                  f"        *reinterpret_cast<float2*>(&C[row * {ldc} + col0]) = make_float2(out[0], out[1]);"]
    else:
        lines += [f"        if (row >= {call.m}) continue;",
                  "        #pragma unroll",
                  "        for (int e = 0; e < 2; ++e) {",
                  "          const int col = col0 + e;",
                  f"          if (col >= {n}) continue;",
                  *(f"          {s}" for s in value),
                  f"          C[row * {ldc} + col] = v;",
                  "        }"]
    return lines + ["      }"]


def _steps(call: GemmCall) -> list[str]:
    """The GEMM's epilogue on `v`, C's value at (row, col), in cuBLASLt's order."""
    ep, steps = call.epilogue, []
    if call.alpha != 1.0:
        steps.append(f"v *= {_float(call.alpha)};")
    steps += [f"v += R[row * {call.n} + col];"] * ep.residual + ["v += bias[col];"] * ep.bias
    if ep.activation == "relu":
        steps.append("v = fmaxf(v, 0.0f);")
    elif ep.activation == "gelu_tanh":
        steps.append(f"v = 0.5f * v * (1.0f + nimble_tanh({_float(SQRT_2_OVER_PI)} * "
                     f"(v + {_float(GELU_CUBIC)} * v * v * v)));")
    return steps


def _float(x: float) -> str:
    """A C float literal that rounds to the float32 nearest x."""
    text = repr(float(x))
    if "inf" in text or "nan" in text:
        raise ValueError(f"no C literal for {x}")
    return (text if ("." in text or "e" in text) else text + ".0") + "f"

"""Small-M GEMMs (an RNN's recurrent `h @ W_hh` at batch 1 to 8) as one generated
kernel, not cuBLASLt.

Why: in a plan's per-task profile on an H100, cuBLASLt (and plain cuBLAS) took 9.5 µs
for the LSTM's 1x2048x512 float32 step GEMM, while XLA's whole step (GEMM and gate math)
takes about 5.3 µs. Timed alone, this kernel beats cuBLASLt up to M = 8 and loses at
M = 32 (SMALL_M_MAX). The library's tiles are built for large M: with M = 32 most of a tile is
padding, and the few tiles left cannot fill 132 SMs without split-K passes. The problem
is small enough to read straight through: B (K x N) is read once, coalesced, and A (M x K,
64 KB here) is read by every block from L2 as warp-wide broadcasts.

The rule (`takes_small_m`), each condition with its reason:
- batch == 1: the recurrent step is one matrix product; batched dots keep the library.
- M <= SMALL_M_MAX = 8 (rows of the row-major output), measured (below); the kernel
  itself handles up to 32: each thread keeps M accumulators in registers, and the
  block's partial sums (M x 256 floats, 32 KB at M = 32) fit static shared memory.
- K * N >= 2**19: below that the library's launch is short anyway and the branchy MLP's
  256x256 layers keep their cuBLASLt epilogues; BERT's GEMMs (M = 128 and more) keep the
  library by the M limit.
- N >= 512: a block owns 8 to 32 columns, so a narrower output leaves most SMs idle
  (the library's split-K does better there).
- K * N < 2**31: 32-bit offsets.
- float32 / bfloat16 / float16 inputs of one dtype (is_library_gemm's types), float32
  accumulation, B not transposed (B stored (K, N): a warp's 32 lanes read 32 neighbouring
  columns of one row of B). A may be stored either way. A transposed B (an LSTM's
  backward `dz @ W_hh.T`) keeps the library.

Precision: every product and sum is a full float32 FMA, which is at least as accurate as
the TF32 cuBLASLt uses where JAX allows it, and is what precision=HIGHEST asks for.
Results are deterministic: the K-chunk partial sums are added in a fixed order.

Kernel: a block is COLUMNS x CHUNKS = 256 threads. Thread (col, chunk) owns output column
j = block * COLUMNS + col and the rows k of its K-chunk; it keeps the M accumulators of
column j in registers. It reads its chunk's B[k, j] (coalesced across the warp) STAGE rows
at a time into registers, all those loads in flight together, then, four k at a time,
A[i, k] for every row i: the same address across the lanes of one chunk (a broadcast),
one 16-byte load of four floats (8 bytes of four halves) where A is row-major and
K % 4 == 0. A chunk walks along A's rows, so after its first load of a row the rest of
that 128-byte line is in L1. Then the chunks' partial sums are added through shared
memory, chunk 0 first, and each block writes its columns of C. Registers (ptxas, sm_90,
M = 32): 88 for float32, 160 for halves (more loads in flight), no spills; capping them
at 128 (two blocks per SM) made ptxas spill.

With a gate-sliced post group (an LSTM cell reading C through G gate slices of H
columns: compiler/fusion_gemm_gates.py), a block's columns are U = columns / G units of
every gate (column col: gate col / U, unit blockIdx.x * U + col % U), the chunks' sums go
to a staged tile in shared memory instead of C, and the block computes the cell for its
M x U elements (lowering/gemm_gates.py's slots), its loads of the cell's other operands
issued at the kernel's start. The LSTM's step at batch 1 is then one kernel, not a GEMM
and a cell kernel on the recurrence's critical path.
"""
from __future__ import annotations

import hashlib
from dataclasses import dataclass
from typing import Optional

from nimblejax.compiler import dtypes
from nimblejax.compiler.ir import Var, short_dtype
from nimblejax.compiler.lowering.codegen import with_prelude
from nimblejax.compiler.lowering.gemm_gates import GatePost, slot_lines
from nimblejax.compiler.lowering.task import Kernel

# Measured on an H100 (python -m nimblejax.bench.gemm_small, f32, µs of the dot alone):
# 1x2048x512 2.38 against cuBLASLt's 2.83, 8x1024x1024 4.34 against 5.57, but
# 32x2048x512 10.39 against 5.85: from M = 32 on, the library's tiles win.
SMALL_M_MAX = 8
MIN_KN = 2 ** 19
MIN_N = 512
THREADS = 256
TARGET_BLOCKS = 128  # an H100 has 132 SMs: one block each
STAGE = 32  # rows of B a thread loads before it multiplies (registers: b[STAGE])
SMALL_M_DTYPES = frozenset({"float32", "float16", "bfloat16"})


def takes_small_m(batch: int, m: int, n: int, k: int, trans_b: bool, dtype: str) -> bool:
    """Whether a GEMM of these sizes runs as the small-M kernel (module docstring)."""
    return (batch == 1 and 1 <= m <= SMALL_M_MAX and n >= MIN_N and MIN_KN <= k * n < 2 ** 31
            and not trans_b and dtype in SMALL_M_DTYPES)


def columns_per_block(n: int) -> int:
    """The widest block (32, 16 or 8 columns) that still gives TARGET_BLOCKS blocks:
    wider blocks read A fewer times over the grid."""
    for cols in (32, 16):
        if -(-n // cols) >= TARGET_BLOCKS:
            return cols
    return 8


def chunk_length(k: int, chunks: int) -> int:
    """Rows of K per chunk: a multiple of 4 (the unrolled step, and float4 alignment)."""
    per = -(-k // chunks)
    return -(-per // 4) * 4


@dataclass(frozen=True)
class SmallTile:
    """A block's share of C, as gemm_gates.py splits a tile: its bm rows (all M) by bn
    columns, on `threads` threads."""

    bm: int
    bn: int
    threads: int = THREADS


def small_tile(m: int, n: int) -> SmallTile:
    return SmallTile(m, columns_per_block(n))


def small_m_matmul(out: Var, a: Var, b: Var, m: int, n: int, k: int, trans_a: bool,
                   gates: Optional[GatePost] = None) -> Kernel:
    """C (m x n) = op(A) @ B, B stored (k, n) row-major, A (m, k) or, if trans_a, (k, m);
    with `gates` (gemm_gates.py: an LSTM cell reading C through gate slices, all float32),
    a block's columns are U units of each gate and it writes the post group's outputs
    instead of C."""
    cols = columns_per_block(n)
    chunks = THREADS // cols
    length = chunk_length(k, chunks)
    dtype = dtypes.name(a.dtype)
    vector = dtype if not trans_a and k % 4 == 0 else None
    body = _source(m, n, k, trans_a, cols, chunks, length, a, b, out, vector, gates)
    digest = hashlib.sha1(body.encode()).hexdigest()[:4]
    then = f"_gates{gates.gates}_then_" + "_".join(gates.ops[-2:]) if gates else ""
    name = f"nimble_gemm_small_m{m}_{short_dtype(a.dtype)}{then}_{digest}"
    source = with_prelude(body.replace("NAME", name, 1))
    params = (gates.outputs + (a, b) + gates.inputs) if gates else (out, a, b)
    return Kernel(name, source, (-(-n // cols), 1, 1), (THREADS, 1, 1), params,
                  scalars=gates.scalars if gates else ())


def _source(m: int, n: int, k: int, trans_a: bool, cols: int, chunks: int, length: int,
            a: Var, b: Var, out: Var, vector: str | None, gates: Optional[GatePost] = None) -> str:
    sa, sb, sc = (dtypes.storage_type(v.dtype) for v in (a, b, out))
    a_at = (lambda i, kk: dtypes.load(a.dtype, f"A[({kk}) * {m} + {i}]")) if trans_a else \
        (lambda i, kk: dtypes.load(a.dtype, f"A[{i} * {k} + ({kk})]"))
    b_at = lambda kk: dtypes.load(b.dtype, f"B[({kk}) * {n} + j]")  # noqa: E731
    layout = f"A stored ({k}, {m})" if trans_a else f"A stored ({m}, {k})"
    stage = min(length, STAGE)
    outs = [f"float* __restrict__ out{i}" for i in range(len(gates.outputs))] if gates else \
        [f"{sc}* __restrict__ C"]
    args = outs + [f"const {sa}* __restrict__ A", f"const {sb}* __restrict__ B"] + \
        (list(gates.params) if gates else [])
    if gates:  # column col of the block: unit u0 + col % U of gate col / U
        u = gates.units
        column = [f"  const int tid = threadIdx.x, m0 = 0, u0 = blockIdx.x * {u};",
                  *(f"  {x}" for x in gates.prologue),
                  f"  const int j = (col / {u}) * {gates.width} + u0 + col % {u};"]
    else:
        column = [f"  const int j = blockIdx.x * {cols} + col;"]
    lines = [
        f"// C ({m} x {n}) = A @ B, {layout}, B stored ({k}, {n}), float32 accumulation.",
        f"// Thread (col, chunk): column j of C, rows [k_begin, k_end) of B; {m} accumulators.",
        f'extern "C" __global__ void __launch_bounds__({THREADS}) NAME({", ".join(args)}) {{',
        f"  const int col = threadIdx.x % {cols}, chunk = threadIdx.x / {cols};",
        *column,
        f"  const int k_begin = chunk * {length};",
        f"  const int k_end = min(k_begin + {length}, {k});",
        f"  float acc[{m}];",
        "  #pragma unroll",
        f"  for (int i = 0; i < {m}; ++i) acc[i] = 0.0f;",
        f"  if (j < {n}) {{",
        f"    for (int k0 = k_begin; k0 < k_end; k0 += {stage}) {{",
        f"      // This stage's {stage} values of column j of B first: their loads are in",
        "      // flight together (one L2 latency per stage, not one per four rows).",
        f"      float b[{stage}];",
        "      #pragma unroll",
        f"      for (int q = 0; q < {stage}; ++q) b[q] = k0 + q < k_end ? {b_at('k0 + q')} : 0.0f;",
        "      #pragma unroll",
        f"      for (int q = 0; q < {stage}; q += 4) {{",
        "        const int k = k0 + q;",
        "        if (k + 4 <= k_end) {",
        "          #pragma unroll",
        f"          for (int i = 0; i < {m}; ++i) {{",
        *_four_products(a_at, vector, k),
        "          }",
        *_tail(a_at, m, k),
        "      }",
        "    }",
        "  }",
        "  // Every thread gets here (no early return): the chunks' sums meet in shared memory.",
        f"  __shared__ float partial[{chunks}][{m}][{cols}];",
        "  #pragma unroll",
        f"  for (int i = 0; i < {m}; ++i) partial[chunk][i][col] = acc[i];",
        "  __syncthreads();",
        *(_staged(m, cols, chunks, gates) if gates else _written(m, n, cols, chunks, out)),
        "}",
    ]
    return "\n".join(lines) + "\n"


def _written(m: int, n: int, cols: int, chunks: int, out: Var) -> list[str]:
    """The chunks' sums added and written to C."""
    return [f"  for (int o = threadIdx.x; o < {m * cols}; o += {THREADS}) {{",
            f"    const int i = o / {cols}, c = o % {cols}, jc = blockIdx.x * {cols} + c;",
            f"    if (jc >= {n}) continue;",
            "    float sum = partial[0][i][c];",
            f"    for (int s = 1; s < {chunks}; ++s) sum += partial[s][i][c];  // fixed order",
            f"    C[i * {n} + jc] = {dtypes.store(out.dtype, 'sum')};",
            "  }"]


def _staged(m: int, cols: int, chunks: int, gates: GatePost) -> list[str]:
    """The chunks' sums added into the staged tile Z ([row][gate * U + unit]), then the
    post group at each of the thread's slots (gemm_gates.slot_lines)."""
    return [f"  __shared__ float Z[{m * gates.stride}];",
            f"  for (int o = threadIdx.x; o < {m * cols}; o += {THREADS}) {{",
            f"    const int i = o / {cols}, c = o % {cols};",
            "    float sum = partial[0][i][c];",
            f"    for (int s = 1; s < {chunks}; ++s) sum += partial[s][i][c];  // fixed order",
            f"    Z[i * {gates.stride} + c] = sum;",
            "  }",
            "  __syncthreads();",
            *slot_lines(gates, SmallTile(m, cols), m)]


def _four_products(a_at, vector: str | None, k: int) -> list[str]:
    """acc[i] += A[i, k..k+3] * b[q..q+3]: one 16-byte (float32) or 8-byte (half types)
    load of A where `vector` (A's dtype) says the four are aligned, else four loads."""
    pad = " " * 12
    if vector is None:
        return [f"{pad}acc[i] = fmaf({a_at('i', f'k + {r}')}, b[q + {r}], acc[i]);" for r in range(4)]
    if vector == "float32":
        load = f"{pad}const float4 a = *reinterpret_cast<const float4*>(&A[i * {k} + k]);"
        values = ("a.x", "a.y", "a.z", "a.w")
    else:  # four halves in a uint2, the lower address in the low bits (little-endian)
        load = f"{pad}const uint2 a = *reinterpret_cast<const uint2*>(&A[i * {k} + k]);"
        values = tuple(_half_of(vector, word, high) for word in ("a.x", "a.y") for high in (False, True))
    return [load, *(f"{pad}acc[i] = fmaf({v}, b[q + {r}], acc[i]);" for r, v in enumerate(values))]


def _half_of(dtype: str, word: str, high: bool) -> str:
    """The float value of the low or high 16-bit half of a 32-bit `word` of A."""
    if dtype == "bfloat16":  # a bfloat16 is the top half of a float32: exact
        return f"__uint_as_float({word} & 0xffff0000u)" if high else f"__uint_as_float({word} << 16)"
    bits = f"({word} >> 16)" if high else f"({word} & 0xffffu)"
    return f"__half2float(__ushort_as_half((unsigned short){bits}))"


def _tail(a_at, m: int, k: int) -> list[str]:
    """The group of 1 to 3 rows at the end of K, where K % 4 != 0."""
    if k % 4 == 0:
        return ["        }"]
    return ["        } else if (k < k_end) {  // K not a multiple of 4: the last rows",
            "          #pragma unroll",
            "          for (int r = 0; r < 3; ++r) {",
            "            if (k + r >= k_end) break;",
            "            #pragma unroll",
            f"            for (int i = 0; i < {m}; ++i)",
            f"              acc[i] = fmaf({a_at('i', 'k + r')}, b[q + r], acc[i]);",
            "          }",
            "        }"]

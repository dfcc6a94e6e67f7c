"""The C code of a gate-sliced post group (compiler/fusion_gemm_gates.py: an LSTM cell)
inside the tensor-core GEMM kernel (gemm_tc.py).

The GEMM's result z is (M, G·H); gate k is its columns [k·H, (k+1)·H). The post group
reads z only through those G slices, at (row, k·H + unit), and computes values of shape
(M, H) at (row, unit) (fusion_gemm_gates.py proves it). A block's BN columns are then G
runs of U = BN / G: tile column c is gate c / U, unit u0 + c % U, so that the block holds
units [u0, u0 + U) of every gate (U divides H: no block runs past a gate).

- B's copies take U contiguous columns from each gate's segment: 16-byte copies where U
  and H are multiples of 4 floats (a copy then never straddles two gates and stays
  16-byte aligned), 4-byte copies otherwise.
- After the split-K sum (every thread stays: barriers follow), K group 0 writes its
  accumulators, after the GEMM's own epilogue, to shared memory as [row][gate·U + unit]
  (rows padded so that the reads below hit distinct banks).
- Then each thread takes (row, unit) elements of the block's BM x U, reads the gates it
  needs from there (`gate0` .. `gate{G-1}`), computes the post group with the fused
  kernels' KernelBuilder (its other operands read as the fused kernel would read them)
  and writes each of the group's outputs at row·H + unit.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

from nimblejax.compiler import dtypes
from nimblejax.compiler.ir import Var
from nimblejax.compiler.lowering.codegen import KernelBuilder


@dataclass(frozen=True)
class GatePost:
    gates: int                # G
    width: int                # H: z's columns per gate, the outputs' columns
    lines: tuple[str, ...]    # statements computing the outputs at (row, unit)
    results: tuple[str, ...]  # the C name of each output's value there
    outputs: tuple[Var, ...]  # what the kernel writes (instead of the GEMM's result)
    read: tuple[int, ...]     # the gates the lines read (as `gate{k}`)
    inputs: tuple[Var, ...]   # the other buffers read, the kernel's last params
    params: tuple[str, ...]   # their declarations (KernelBuilder.input_params)
    ops: tuple[str, ...]

    def units(self, tile) -> Optional[int]:
        """U, the units of each gate a block of `tile` holds, or None where the tile does
        not split into whole runs (BN not a multiple of G, or U not dividing H)."""
        return units(tile, self.gates, self.width)

    def aligned(self, tile) -> bool:
        """Whether B's copies along N may be 16 bytes (4 floats in one gate, aligned)."""
        return self.units(tile) % 4 == 0 and self.width % 4 == 0

    def column(self, tile) -> str:
        """The GEMM column of the tile's column `mn` (a C expression)."""
        u = self.units(tile)
        return f"(mn / {u}) * {self.width} + u0 + mn % {u}"

    def stage_stride(self, tile) -> int:
        """Floats per row of the staged tile: BN padded to U mod 32, so that a warp's
        reads of one gate (rows apart by the stride, U units each) hit distinct banks."""
        return tile.bn + (self.units(tile) - tile.bn) % 32


def units(tile, gates: int, width: int) -> Optional[int]:
    """gate_post.units, before the code exists (fusion_gemm_gates.py asks it)."""
    if gates < 2 or tile.bn % gates:
        return None
    u = tile.bn // gates
    return u if width % u == 0 else None


class _Builder(KernelBuilder):
    """A KernelBuilder that reads the GEMM's result at (row, k·H + unit) as `gate{k}`."""

    def __init__(self, inlined, gemm_out: Var, gates: int, width: int) -> None:
        super().__init__(inlined)
        self.gemm_out = gemm_out
        # The column indices a gate slice makes (rules_elementwise.slice_ of "unit").
        self.columns = {"unit": 0} | {f"({k * width} + unit)": k for k in range(1, gates)}
        self.read: set[int] = set()

    def load(self, var: Var, idx) -> str:
        if var is not self.gemm_out:
            return super().load(var, idx)
        assert len(idx) == 2 and idx[0] == "row" and idx[1] in self.columns, \
            f"the GEMM's result read at {idx}, not through a gate slice"
        k = self.columns[idx[1]]
        self.read.add(k)
        return f"gate{k}"


def gate_code(post, gemm_out: Var, gates: int) -> GatePost:
    """`post` (a FUSED fusion.Group whose outputs are (M, H), reading `gemm_out` (M, G·H)
    through `gates` slices: fusion_gemm_gates.py)."""
    width = gemm_out.shape[-1] // gates
    inlined = {n.outputs[0]: n for n in post.nodes}
    b = _Builder(inlined, gemm_out, gates, width)
    results = tuple(b.tmp("float", dtypes.round_to(v.dtype, b.value(v, ("row", "unit"))))
                    for v in post.outputs)
    lines = tuple(line.strip() for line in b.lines)
    return GatePost(gates, width, lines, results, tuple(post.outputs), tuple(sorted(b.read)),
                    tuple(b.inputs), tuple(b.input_params()), tuple(b.ops))


def gate_epilogue(m: int, tile, gp: GatePost, steps: list[str], split_sum: list[str]) -> list[str]:
    """The kernel's end: `split_sum` (the K groups' sums, every thread staying), the tile
    staged after the GEMM's epilogue `steps` (on `v` at (row, col)), then the post group
    at (row, unit) for the block's BM x U elements."""
    u, stride = gp.units(tile), gp.stage_stride(tile)
    place = [f"const int col = (c / {u}) * {gp.width} + u0 + c % {u};", "const int row = m0 + r;"] \
        if steps else []
    value = ["float v = acc[i][j][2 * h + e];", *steps, f"Z[r * {stride} + c] = v;"]
    gates = [f"const float gate{k} = Z[r * {stride} + {k * u} + u];" for k in gp.read]
    stores = [f"out{k}[row * {gp.width} + unit] = {result};" for k, result in enumerate(gp.results)]
    return [
        *(split_sum or ["  nimble_cp_async_wait<0>();", "  __syncthreads();  // the ring is free"]),
        "  __syncthreads();  // the K groups' sums are read: the stage may overwrite them",
        f"  // The tile's C to shared memory as [row][gate * {u} + unit], then the post group.",
        "  float* const Z = smem;",
        "  if (wk == 0) {",
        "    #pragma unroll",
        f"    for (int i = 0; i < {tile.fm}; ++i)",
        "      #pragma unroll",
        f"      for (int j = 0; j < {tile.fn}; ++j)",
        "        #pragma unroll",
        "        for (int h = 0; h < 2; ++h)",
        "          #pragma unroll",
        "          for (int e = 0; e < 2; ++e) {",
        f"            const int r = wm * {tile.bm // tile.warps_m} + i * 16 + group + 8 * h;",
        f"            const int c = wn * {tile.bn // tile.warps_n} + j * 8 + 2 * thread + e;",
        *(f"            {s}" for s in place + value),
        "          }",
        "  }",
        "  __syncthreads();",
        f"  for (int q = tid; q < {tile.bm * u}; q += {tile.threads}) {{",
        f"    const int r = q / {u}, u = q % {u}, row = m0 + r, unit = u0 + u;",
        f"    if (row >= {m}) break;  // (q only grows)",
        *(f"    {s}" for s in gates + list(gp.lines) + stores),
        "  }",
    ]

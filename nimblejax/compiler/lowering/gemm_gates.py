"""The C code of a gate-sliced post group (compiler/fusion_gemm_gates.py: an LSTM cell)
inside the tensor-core GEMM kernel (gemm_tc.py), or the small-M kernel (gemm_small.py:
its block of columns is the tile, BN columns by its M rows).

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
- Then each thread takes (row, unit) elements of the block's BM x U (`slots` of them: a
  thread's slot s is element tid + s * threads), reads the gates it needs from there
  (`gate{k}_{s}`), computes the post group with the fused kernels' KernelBuilder (its
  other operands read as the fused kernel would read them) and writes each of the
  group's outputs at row·H + unit.
- What does not depend on z (xproj_t's and the bias's loads, c_{t-1}'s, their index
  math: SSA declarations outside any block that read no gate) is computed at the
  kernel's start, so that those loads are in flight while the GEMM runs rather than
  after it (measured: fusion_gemm_gates.py). They are pure (loads of buffers this kernel
  does not write, arithmetic): only when they run changes. A row past M reads row M - 1
  there, a slot past the block's BM x U its last element (in bounds, in the same block;
  nothing is written for them).
"""
from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Optional

from nimblejax.compiler import dtypes
from nimblejax.compiler.ir import Var
from nimblejax.compiler.lowering.codegen import KernelBuilder


@dataclass(frozen=True)
class GatePost:
    gates: int                       # G
    width: int                       # H: z's columns per gate, the outputs' columns
    units: int                       # U: the units of each gate a block holds
    stride: int                      # floats per row of the staged tile
    prologue: tuple[str, ...]        # the kernel's first statements: slots, loads
    lines: tuple[tuple[str, ...], ...]    # per slot: statements after the tile is staged
    results: tuple[tuple[str, ...], ...]  # per slot: each output's C name
    outputs: tuple[Var, ...]         # what the kernel writes (instead of the GEMM's result)
    inputs: tuple[Var, ...]          # the other buffers read, the kernel's last params
    params: tuple[str, ...]          # their declarations, then the scalars' (KernelBuilder)
    ops: tuple[str, ...]
    scalars: tuple[int, ...] = ()    # the kernel's scalar arguments (KernelBuilder.hoist)

    @property
    def aligned(self) -> bool:
        """Whether B's copies along N may be 16 bytes (4 floats in one gate, aligned)."""
        return self.units % 4 == 0 and self.width % 4 == 0

    @property
    def column(self) -> str:
        """The GEMM column of the tile's column `mn` (a C expression)."""
        return f"(mn / {self.units}) * {self.width} + u0 + mn % {self.units}"


def units(tile, gates: int, width: int) -> Optional[int]:
    """U = BN / G, the units of each gate a block of `tile` holds, or None where the tile
    does not split so (BN not a multiple of G, or U not dividing H)."""
    if gates < 2 or tile.bn % gates:
        return None
    u = tile.bn // gates
    return u if width % u == 0 else None


class _Builder(KernelBuilder):
    """A KernelBuilder that reads the GEMM's result at (row_s, k·H + unit_s) as
    `gate{k}_{s}`, s the slot being built."""

    def __init__(self, inlined, gemm_out: Var, gates: int, width: int) -> None:
        super().__init__(inlined, hoist=True)
        self.gemm_out, self.gates, self.width = gemm_out, gates, width
        self.slot = 0

    def picked_index(self, node, axis: int, value: int) -> str:
        if node.inputs[0] is self.gemm_out:  # a gate slice: read as gate{k}_{s} below
            return str(value)
        return super().picked_index(node, axis, value)

    def load(self, var: Var, idx) -> str:
        if var is not self.gemm_out:
            return super().load(var, idx)
        s = self.slot
        # The column indices a gate slice makes (rules_elementwise.slice_ of unit_s).
        columns = {f"unit{s}": 0} | {f"({k * self.width} + unit{s})": k for k in range(1, self.gates)}
        # (A result of one row is read at row "0": codegen.operand_index.)
        assert len(idx) == 2 and idx[0] in (f"row{s}", "0") and idx[1] in columns, \
            f"the GEMM's result read at {idx}, not through a gate slice"
        return f"gate{columns[idx[1]]}_{s}"


def gate_code(post, gemm_out: Var, gates: int, tile, m: int) -> GatePost:
    """`post` (a FUSED fusion.Group whose outputs are (M, H), reading `gemm_out` (M, G·H)
    through `gates` slices: fusion_gemm_gates.py) in the kernel of `tile`, M = m."""
    width = gemm_out.shape[-1] // gates
    u = units(tile, gates, width)
    slots = -(-tile.bm * u // tile.threads)
    b = _Builder({n.outputs[0]: n for n in post.nodes}, gemm_out, gates, width)
    prologue, lines, results = [], [], []
    for s in range(slots):
        b.forget()  # a slot's values are declared in its own block
        b.slot, start = s, len(b.lines)
        names = tuple(b.tmp("float", dtypes.round_to(v.dtype, b.value(v, (f"row{s}", f"unit{s}"))))
                      for v in post.outputs)
        early, late = _split(b.lines[start:], {f"gate{k}_{s}" for k in range(gates)})
        prologue += [f"const int q{s} = min(tid + {s * tile.threads}, {tile.bm * u - 1}), "
                     f"lr{s} = q{s} / {u}, lu{s} = q{s} % {u};  // slot {s}: the tile's row, unit",
                     f"const int row{s} = min(m0 + lr{s}, {m - 1}), unit{s} = u0 + lu{s};", *early]
        lines.append(late)
        results.append(names)
    return GatePost(gates, width, u, tile.bn + (u - tile.bn) % 32, tuple(prologue), tuple(lines),
                    tuple(results), tuple(post.outputs), tuple(b.inputs),
                    tuple(b.input_params() + b.scalar_params()), tuple(b.ops), b.scalar_values())


_DECLARATION = re.compile(r"(?:const )?[A-Za-z_][\w ]*? (v\d+) = [^;{}]*;")
_NAME = re.compile(r"\b(?:v\d+|gate\d+_\d+)\b")


def _split(lines: list[str], gates: set[str]) -> tuple[list[str], list[str]]:
    """`lines` (the builder's, in order) as those that may run at the kernel's start
    (declarations outside any block that read no gate, directly or not) and the rest."""
    early, late, waits, depth = [], [], set(gates), 0
    for line in (line.strip() for line in lines):
        found = _DECLARATION.fullmatch(line)
        if depth == 0 and found and not set(_NAME.findall(line)) & waits:
            early.append(line)
        else:
            late.append(line)
            waits |= set(_NAME.findall(line))  # (what it declares, and may assign)
        depth += line.count("{") - line.count("}")
    return early, late


def gate_epilogue(m: int, tile, gp: GatePost, steps: list[str], split_sum: list[str]) -> list[str]:
    """The kernel's end: `split_sum` (the K groups' sums, every thread staying), the tile
    staged after the GEMM's epilogue `steps` (on `v` at (row, col)), then the post group
    at each of the thread's slots."""
    u, stride = gp.units, gp.stride
    place = [f"const int col = (c / {u}) * {gp.width} + u0 + c % {u};", "const int row = m0 + r;"] \
        if steps else []
    value = ["float v = acc[i][j][2 * h + e];", *steps, f"Z[r * {stride} + c] = v;"]
    lines = [
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
    ]
    return lines + slot_lines(gp, tile, m)


def slot_lines(gp: GatePost, tile, m: int) -> list[str]:
    """The post group at each of a thread's slots, reading the gates from the staged tile
    Z ([row][gate * U + unit], gp.stride floats a row) of the block's tile.bm rows."""
    u, stride, lines = gp.units, gp.stride, []
    for s, (body, results) in enumerate(zip(gp.lines, gp.results)):
        read = set(_NAME.findall(" ".join(body)))
        gates = [f"const float gate{k}_{s} = Z[lr{s} * {stride} + {k * u} + lu{s}];" for k in range(gp.gates)
                 if f"gate{k}_{s}" in read]
        stores = [f"out{k}[row{s} * {gp.width} + unit{s}] = {name};" for k, name in enumerate(results)]
        lines += [f"  {{  // slot {s}: element tid + {s * tile.threads} of the block's {tile.bm} x {u}",
                  *(f"    {x}" for x in gates + list(body)),
                  f"    if (tid + {s * tile.threads} < {tile.bm * u} && m0 + lr{s} < {m}) {{",
                  *(f"      {x}" for x in stores), "    }", "  }"]
    return lines

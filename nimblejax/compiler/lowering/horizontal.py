"""The kernel of a HORIZONTAL group (compiler/fusion_horizontal.py): its member
elementwise groups in one launch, each on its own range of blocks.

    extern "C" __global__ void horizontal_..(out0, out1, .., in0, ..) {
      if (blockIdx.x < 4) {            // member 0: blocks [0, 4)
        for (int i = (blockIdx.x - 0) * 256 + threadIdx.x; i < 1000; i += 4 * 256) { .. }
      } else if (blockIdx.x < 6) {     // member 1: blocks [4, 6)
        ..
      }
    }

A member gets one thread per element (the pass admits members below 2^20 elements, so
a member has at most 4096 blocks of 256 threads), and the same code a FUSED group's
kernel would run (every inlined producer recomputed at the element), so its values
are those of the kernels it replaces.
"""
from __future__ import annotations

from typing import Sequence

from nimblejax.compiler.lowering.codegen import BLOCK, KernelBuilder, blocks_for
from nimblejax.compiler.lowering.task import Kernel


def horizontal_kernel(members: Sequence) -> Kernel:
    """One kernel for fusion groups `members` (FUSED, one output each, independent)."""
    b = KernelBuilder()
    start = 0
    for k, g in enumerate(members):
        out = g.outputs[0]
        b.inlined = {n.outputs[0]: n for n in g.nodes}  # this member's values only
        blocks = blocks_for(out.size)
        b.open(("if" if k == 0 else "else if") + f" (blockIdx.x < {start + blocks})")
        _member_loop(b, out, start, blocks)
        b.close()
        b.forget()  # values computed inside this member's scope are gone
        start += blocks
    return b.finish("horizontal", members[-1].outputs[0], start, BLOCK)


def _member_loop(b: KernelBuilder, out, start: int, blocks: int) -> None:
    n = out.size
    b.open(f"for (int i = ((int)blockIdx.x - {start}) * {BLOCK} + (int)threadIdx.x; i < {n}; "
           f"i += {blocks * BLOCK})")
    idx = b.index_vars("i", out.shape)
    b.store(out, "i", b.value(out, idx))
    b.close()

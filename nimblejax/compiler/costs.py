"""A rough GPU time per task, from the bytes it moves and the arithmetic it does.

The timeline picture (bench/timeline.py) places tasks by it where no measured times are
given, and a segmented plan (compiler/segments.py) balances its segments by it. Only
proportions matter to either: the figures are those of a current data-center GPU.
"""
from __future__ import annotations

from nimblejax.compiler.kinds import TaskKind

LAUNCH_US = 2.0  # fixed cost of one task inside a CUDA graph
BYTES_PER_US = 2.0e6  # memory bandwidth, 2 TB/s
FLOPS_PER_US = {"tf32": 300e6, "f32": 50e6, "f32_from_half": 600e6, "half": 600e6}


def estimate_us(task) -> float:
    """A launch cost, plus the longer of moving the task's bytes and doing its
    arithmetic (GEMMs and convolutions)."""
    moved = sum(v.nbytes for v in task.inputs) + sum(v.nbytes for v in task.outputs)
    us = moved / BYTES_PER_US
    if task.kind is TaskKind.GEMM and task.gemm is not None:
        g = task.gemm
        us = max(us, 2.0 * g.batch * g.m * g.n * g.k / FLOPS_PER_US.get(g.compute, 50e6))
    elif task.kind is TaskKind.CUDNN and task.conv is not None:
        c = task.conv
        n, oh, ow, k = c.y_shape
        _, r, s, cg = c.w_shape
        us = max(us, 2.0 * n * oh * ow * k * r * s * cg / FLOPS_PER_US.get(c.math, 50e6))
    return LAUNCH_US + us

"""A rough GPU time per task, from the bytes it moves and the arithmetic it does.

The timeline picture (bench/timeline.py) places tasks by it where no measured times are
given, the bench prints the prediction it makes beside the measured GPU time, and a
segmented plan (compiler/segments.py) balances its segments by it (only proportions
matter there).

The constants are those of a current data-center GPU, with LAUNCH_US and FILL_US fitted
to the suite's 16 plans on an H200 (commit a4be0bd, BENCHMARKS.md): the plans' predicted
GPU time was off by a median of 30% (up to 50%) with a 2 µs launch and no throughput
bound, by 15% (up to 46%, the LSTM's steps, whose weights stay in L2) with these.
"""
from __future__ import annotations

from typing import Iterable

from nimblejax.compiler.kinds import TaskKind

LAUNCH_US = 3.0  # fixed cost of one task inside a CUDA graph, the kernel's ramp included
BYTES_PER_US = 2.0e6  # memory bandwidth, 2 TB/s
FLOPS_PER_US = {"tf32": 300e6, "f32": 50e6, "f32_from_half": 600e6, "half": 600e6}
# A task with this much work (µs at the rates above) or more keeps the whole GPU busy, so
# tasks on other streams cannot overlap it; smaller ones are latency-bound and can.
FILL_US = 2.0


def work_us(task) -> float:
    """The longer of moving the task's bytes and doing its arithmetic (GEMMs and
    convolutions), at the whole GPU's rates."""
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
    return us


def estimate_us(task) -> float:
    """A launch cost plus the task's work."""
    return LAUNCH_US + work_us(task)


def throughput_bound_us(tasks: Iterable) -> float:
    """The least time the tasks take however many streams run them: each one's work,
    weighted by how much of the GPU it fills (min(1, work / FILL_US)). Many streams of
    large tasks (Inception-v3 and NASNet-A at batch 32) share the GPU rather than overlap."""
    total = 0.0
    for task in tasks:
        w = work_us(task)
        total += w * min(1.0, w / FILL_US)
    return total

"""Split long reductions with few outputs into two reductions, so that enough threads
work on them (a batch-norm statistic reduces 100k+ elements into a few dozen outputs).

A graph rewrite before fusion, in JAX primitives (a reshape and two reductions), so
the CPU interpreter runs it like any other plan and the producers still fuse into
the first reduction.
"""
from __future__ import annotations

import math

import jax.numpy as jnp

from nimblejax.compiler.canonicalize.replace import replace_with
from nimblejax.compiler.ir import Node
from nimblejax.compiler import dtypes
from nimblejax.options import Options

SPLITTABLE = {"reduce_sum": jnp.sum, "reduce_max": jnp.max, "reduce_min": jnp.min}
MIN_REDUCED = 16384      # shorter rows are fine in one kernel
# Shorter columns are fine in one kernel. A column kernel gives each output 8 threads, so
# a few thousand outputs of a few hundred elements (EfficientNet-B0's squeeze over 28x28
# at batch 32: 4608 outputs of 784, 144 blocks of 8 warps for an H100's 132 SMs) leave
# the GPU latency-bound on one load per thread at a time.
MIN_COLUMN = 128
TARGET_THREADS = 32768   # column reductions: outputs of the first reduction
TARGET_ROWS = 2048       # row reductions: rows of the first reduction


def split_reduction(node: Node, options: Options) -> list[Node]:
    """[reshape, reduce, reduce] for a long reduction with few outputs, else [node]
    (registered in reductions.py)."""
    if dtypes.name(node.inputs[0].dtype) not in ("float32", "int32"):
        return [node]
    x = node.inputs[0]
    axes = tuple(sorted(int(a) for a in node.params["axes"]))
    k = len(axes)
    if k == 0 or axes != tuple(range(axes[0], axes[0] + k)):
        return [node]
    lead, reduced, tail = x.shape[: axes[0]], math.prod(x.shape[a] for a in axes), x.shape[axes[-1] + 1:]
    n_out = max(1, math.prod(lead) * math.prod(tail))
    if n_out >= TARGET_THREADS:
        return [node]
    if tail:  # column (the innermost axis is kept): [lead, reduced, tail]
        if reduced < MIN_COLUMN:
            return [node]
        chunk = _divisor_near(reduced, max(8, reduced * n_out // TARGET_THREADS))
    elif n_out < TARGET_ROWS and reduced >= MIN_REDUCED:  # row: the innermost axes go
        chunk = _divisor_near(reduced, max(1024, reduced * n_out // TARGET_ROWS))
    else:
        return [node]
    if chunk in (1, reduced):
        return [node]
    # Reduce [lead, reduced // chunk, chunk, tail] over the chunk, then over the rest.
    shape = tuple(lead) + (reduced // chunk, chunk) + tuple(tail)
    first, second = len(lead) + 1, len(lead)
    op = SPLITTABLE[node.name]
    return replace_with(node, lambda a: op(op(a.reshape(shape), axis=first), axis=second))


def _divisor_near(n: int, target: int) -> int:
    """The divisor of n closest to target (n itself when none is within 4x)."""
    best = n
    for d in range(1, int(math.isqrt(n)) + 1):
        if n % d == 0:
            for c in (d, n // d):
                if abs(math.log(c / target)) < abs(math.log(best / target)):
                    best = c
    return best if best / target < 4 and target / best < 4 else n

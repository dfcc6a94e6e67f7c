"""Attention as one kernel (compiler/lowering/attention.py) against its three kernels
(scores GEMM, softmax, values GEMM) and against jax.jit, by size (run on the GPU
machine): where the fused kernel pays, which sets attention.MAX_MACS.

    PYTHONPATH=. python3 examples/gpu/probe_attention.py

Each program is `jax.nn.dot_product_attention(q, k, v, is_causal=True)` on
(batch, seq, heads, head) float32 inputs; nimble's GPU µs per call (its graph, CUDA
events), jax.jit's µs per call back to back, medians.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

import nimblejax as nimble
from nimblejax.bench import timing
from nimblejax.bench.needs_gpu import require_gpu
from nimblejax.compiler.lowering import attention

SHAPES = [(1, 16, 2, 8), (1, 64, 4, 32), (1, 64, 12, 64), (1, 128, 4, 64), (1, 128, 8, 64),
          (1, 128, 12, 64), (2, 128, 12, 64), (1, 256, 8, 64)]


def causal(q, k, v):
    return jax.nn.dot_product_attention(q, k, v, is_causal=True)


def main() -> None:
    require_gpu(__file__)
    rng = np.random.default_rng(0)
    print("| batch×seq×heads×head | MACs | jax.jit µs back to back | nimble 3 kernels GPU µs | nimble fused GPU µs | fused / 3 kernels |")
    print("|---|---|---|---|---|---|")
    limit = attention.MAX_MACS
    for b, s, h, d in SHAPES:
        args = [jnp.asarray(rng.standard_normal((b, s, h, d)), jnp.float32) for _ in range(3)]
        j = jax.jit(causal)
        jax.block_until_ready(j(*args))
        jax_us = timing.throughput_us(j, tuple(args))  # back to back: bound by the GPU here
        times = []
        for fused in (False, True):
            attention.MAX_MACS = 1 << 40 if fused else 0
            f = nimble.jit(lambda q, k, v: causal(q, k, v), backend="cuda")
            jax.block_until_ready(f(*args))
            times.append(timing.nimble_gpu_us(f))
        attention.MAX_MACS = limit
        macs = b * h * s * s * 2 * d
        print(f"| {b}×{s}×{h}×{d} | {macs / 1e6:.1f}M | {jax_us:.1f} | {times[0]:.1f} | {times[1]:.1f} "
              f"| {times[1] / times[0]:.2f} |", flush=True)


if __name__ == "__main__":
    main()

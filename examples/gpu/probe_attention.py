"""Attention as one kernel against its three kernels (scores GEMM, softmax, values GEMM)
and against jax.jit, by size (run on the GPU machine): the float32 FMA kernel
(compiler/lowering/attention.py, where it may: rows of at most MAX_ROW keys) and the
tensor-core kernel (attention_tc.py): where each pays, which sets attention.MAX_MACS and
MAX_ROW, and attention_tc.MAX_MACS (each kernel is measured past its limits).

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
from nimblejax.compiler.lowering import attention, attention_tc

SHAPES = [(1, 16, 2, 8), (1, 64, 4, 32), (1, 64, 12, 64), (1, 128, 4, 64), (1, 128, 8, 64),
          (1, 128, 12, 64), (2, 128, 12, 64), (8, 128, 8, 64), (32, 128, 12, 64), (1, 256, 8, 64),
          (1, 512, 8, 64)]


def causal(q, k, v):
    return jax.nn.dot_product_attention(q, k, v, is_causal=True)


def _plan_with(kernel: str):
    """Set the fusion's limits so `kernel` ("3 kernels", "FMA", "tensor cores") is taken."""
    attention.MAX_MACS = 1 << 40 if kernel == "FMA" else 0
    attention.MAX_ROW = 1 << 20 if kernel == "FMA" else LIMITS[1]
    attention_tc.shape_for = SHAPE_FOR if kernel == "tensor cores" else (lambda *a: None)
    attention_tc.MAX_MACS = 1 << 40 if kernel == "tensor cores" else TC_LIMIT


LIMITS = (attention.MAX_MACS, attention.MAX_ROW)
TC_LIMIT = attention_tc.MAX_MACS
SHAPE_FOR = attention_tc.shape_for


def main() -> None:
    require_gpu(__file__)
    rng = np.random.default_rng(0)
    kernels = ("3 kernels", "FMA", "tensor cores")
    print("| batch×seq×heads×head | MACs | jax.jit µs back to back | "
          + " | ".join(f"nimble {k} GPU µs" for k in kernels) + " |")
    print("|---|---|---|" + "---|" * len(kernels))
    for b, s, h, d in SHAPES:
        args = [jnp.asarray(rng.standard_normal((b, s, h, d)), jnp.float32) for _ in range(3)]
        j = jax.jit(causal)
        want = j(*args)
        jax_us = timing.throughput_us(j, tuple(args))  # back to back: bound by the GPU here
        cells = []
        for kernel in kernels:
            _plan_with(kernel)
            f = nimble.jit(lambda q, k, v: causal(q, k, v), backend="cuda")
            got = f(*args)
            err = float(jnp.max(jnp.abs(got - want)) / jnp.max(jnp.abs(want)))
            cells.append(f"{timing.nimble_gpu_us(f):.1f} ({err:.0e})")
        attention.MAX_MACS, attention.MAX_ROW = LIMITS
        attention_tc.shape_for, attention_tc.MAX_MACS = SHAPE_FOR, TC_LIMIT
        macs = b * h * s * s * 2 * d
        print(f"| {b}×{s}×{h}×{d} | {macs / 1e6:.1f}M | {jax_us:.1f} | " + " | ".join(cells) + " |",
              flush=True)


if __name__ == "__main__":
    main()

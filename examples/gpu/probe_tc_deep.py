"""The TF32 tensor-core GEMM kernel (compiler/lowering/gemm_tc.py) with deeper pipelines
than 48 KB of static shared memory allows: its shared ring declared as dynamic shared
memory (up to 227 KB a block on an H100), larger K steps and more stages in flight, on
the shapes it leaves to cuBLASLt (BERT's and GPT's dense layers at batch 1) and the
LSTM's step at batch 32 (run on the GPU machine).

    PYTHONPATH=. python3 examples/gpu/probe_tc_deep.py [--small]

GPU µs per launch from CUDA events around a graph of REPEATS launches (as
`python -m nimblejax.bench.gemm_tc --sweep`), each checked against a float64 product of
the TF32-rounded operands; cuBLASLt's autotuned choice on the same shape for reference.
"""
from __future__ import annotations

import numpy as np

from nimblejax.bench.gemm_tc import REPEATS, tf32
from nimblejax.bench.needs_gpu import require_gpu

SHAPES = ((128, 768, 768), (128, 2304, 768), (128, 3072, 768), (128, 768, 3072), (32, 2048, 512),
          (32, 1024, 512))
# Tile(bm, bn, bk, warps_m, warps_n, split_k, stages)
TILES = ((32, 32, 32, 1, 2, 2, 4), (32, 32, 32, 1, 2, 2, 8), (32, 32, 32, 1, 2, 2, 12),
         (32, 32, 64, 1, 2, 2, 4), (32, 32, 64, 1, 2, 4, 6), (32, 32, 128, 1, 2, 4, 4),
         (32, 32, 128, 1, 2, 8, 3), (32, 16, 64, 1, 1, 4, 6), (32, 16, 128, 1, 1, 8, 4),
         (32, 64, 64, 1, 2, 4, 4), (32, 64, 32, 1, 2, 2, 8), (64, 32, 64, 2, 1, 2, 4),
         (64, 64, 32, 2, 2, 2, 6), (32, 8, 128, 1, 1, 8, 4), (16, 32, 64, 1, 2, 4, 6),
         (16, 64, 64, 1, 2, 4, 4), (16, 32, 128, 1, 2, 8, 4))
# `--small`: 16-row tiles that fit 48 KB of static shared memory, against the rule's
# tiles, on the shapes the rule takes (M = 16..128)
SMALL_SHAPES = ((32, 128, 64), (32, 64, 128), (64, 128, 64), (32, 1024, 256), (32, 1024, 512),
                (32, 2048, 512), (16, 1024, 512), (96, 512, 256), (64, 2048, 256), (128, 1024, 256),
                (32, 4096, 256), (32, 4096, 512), (128, 768, 32))
SMALL_TILES = ((32, 32, 32, 1, 2, 2, 4), (32, 16, 32, 1, 1, 4, 4), (32, 8, 32, 1, 1, 4, 4),
               (16, 32, 32, 1, 2, 2, 4), (16, 32, 32, 1, 2, 4, 4), (16, 32, 64, 1, 2, 4, 3),
               (16, 16, 32, 1, 1, 4, 4), (16, 64, 32, 1, 2, 2, 4), (16, 8, 32, 1, 1, 4, 4))
MAX_SMEM = 227 * 1024


def deep_kernel(call, tile):
    """(source with a dynamic shared ring, name, grid, block, shared bytes) or None."""
    from nimblejax.compiler.lowering import gemm_tc

    floats = gemm_tc.smem_floats(call, tile)
    if floats * 4 > MAX_SMEM:
        return None
    limit, gemm_tc.SMEM_BYTES = gemm_tc.SMEM_BYTES, MAX_SMEM
    try:
        kernel = gemm_tc.tc_matmul(call, tile)
    finally:
        gemm_tc.SMEM_BYTES = limit
    static = f"__shared__ __align__(16) float smem[{floats}];"
    assert static in kernel.source
    source = kernel.source.replace(static, "extern __shared__ __align__(16) float smem[];")
    return source, kernel.name, kernel.grid, kernel.block, floats * 4


def lt_us(m: int, n: int, k: int) -> float:
    """cuBLASLt's autotuned choice on this shape, timed as its autotuner times it."""
    from nimblejax.runtime.libs import cublaslt

    choices = [c for key, c in cublaslt._ALGO_CACHE.items() if (key[0].m, key[0].n, key[0].k) == (m, n, k)]
    return min((c.timings_us[c.index] for c in choices if c.timings_us), default=float("nan"))


def main() -> None:
    import sys

    require_gpu(__file__)
    small = "--small" in sys.argv[1:]
    shapes, tiles = (SMALL_SHAPES, SMALL_TILES) if small else (SHAPES, TILES)
    import cupy
    import jax
    import jax.numpy as jnp

    import nimblejax as nimble
    from nimblejax.bench.timing import cuda_event_us
    from nimblejax.compiler.ir import Var
    from nimblejax.compiler.lowering import gemm_tc
    from nimblejax.compiler.lowering.task import GemmCall
    from nimblejax.runtime.compile import OPTIONS

    rng = np.random.default_rng(1)
    stream = cupy.cuda.Stream(non_blocking=True)
    print("| M×N×K | tile | blocks | shared KB | µs | rel err |")
    print("|---|---|---|---|---|---|")
    for m, n, k in shapes:
        f32 = np.dtype("float32")
        call = GemmCall(1, m, n, k, False, False, "float32", "tf32",
                        a=Var((m, k), f32), b=Var((k, n), f32), c=Var((m, n), f32))
        a = rng.standard_normal((m, k)).astype(np.float32)
        b = (rng.standard_normal((k, n)) / np.sqrt(k)).astype(np.float32)
        want = tf32(a).astype(np.float64) @ tf32(b).astype(np.float64)
        da, db = cupy.asarray(a), cupy.asarray(b)
        # cuBLASLt: a plan of the plain product with the kernel's rule off
        rule, gemm_tc.measured_faster = gemm_tc.measured_faster, (lambda call: False)
        try:
            f = nimble.jit(lambda x, y: jnp.matmul(x, y), backend="cuda")
            jax.block_until_ready(f(jnp.asarray(a), jnp.asarray(b)))
        finally:
            gemm_tc.measured_faster = rule
        print(f"| {m}×{n}×{k} | cuBLASLt (autotuned, alone) | | | {lt_us(m, n, k):.2f} | |", flush=True)
        for t in tiles:
            tile = gemm_tc.Tile(*t)
            if tile.bm > 2 * m:
                continue
            try:
                made = deep_kernel(call, tile)
                if made is None:
                    continue
                source, name, grid, block, shared = made
                fn = cupy.RawModule(code=source, options=OPTIONS).get_function(name)
            except Exception as e:  # noqa: BLE001 - a tile the generator or NVRTC refuses
                print(f"| {m}×{n}×{k} | {tile.label} | refused: {type(e).__name__} {str(e)[:80]} |")
                continue
            fn.max_dynamic_shared_size_bytes = shared
            dc = cupy.full((m, n), np.nan, np.float32)
            with stream:
                fn(grid, block, (dc, da, db), stream=stream, shared_mem=shared)
                stream.synchronize()
                err = float(np.abs(cupy.asnumpy(dc) - want).max() / np.abs(want).max())
                stream.begin_capture()
                for _ in range(REPEATS):
                    fn(grid, block, (dc, da, db), stream=stream, shared_mem=shared)
                graph = stream.end_capture()
            us = cuda_event_us(lambda: graph.launch(stream), stream, calls=20) / REPEATS
            print(f"| {m}×{n}×{k} | {tile.label} | {int(np.prod(grid))} | {shared / 1024:.0f} "
                  f"| {us:.2f} | {err:.1e} |", flush=True)


if __name__ == "__main__":
    main()

"""BERT's and the LSTM's GEMM shapes alone: jax.jit's GPU time per GEMM against nimble's
(run on the GPU machine).

    PYTHONPATH=. python3 examples/gpu/probe_gemms.py

Each program is a chain of `depth` dense layers of one shape (x @ w + b, then back to
the input width), so both sides are GPU-bound and the per-GEMM time is the program's
GPU time over its GEMM count. nimble's row also lists the cuBLASLt candidates its
autotuner timed for each GEMM (µs, the chosen one first).
"""
from __future__ import annotations

import ctypes
import functools

import jax
import jax.numpy as jnp
import numpy as np

import nimblejax as nimble
from nimblejax.bench import timing
from nimblejax.bench.needs_gpu import require_gpu

SHAPES = [  # (rows, width, hidden): x (rows, width) @ (width, hidden) @ (hidden, width)
    (128, 768, 768), (128, 768, 3072), (32, 512, 2048), (1, 512, 2048), (4096, 768, 3072)]


def chain(depth: int):
    def fn(x, ws):
        for w1, b1, w2, b2 in ws[:depth]:
            x = jnp.tanh(x @ w1 + b1) @ w2 + b2
        return x
    return fn


# cublasLtMatmulAlgoConfigAttributes_t: CUBLASLT_ALGO_CONFIG_SPLITK_NUM, _REDUCTION_SCHEME
SPLITK_NUM, REDUCTION_SCHEME = 2, 3


@functools.cache
def _config_get_attribute():
    from nimblejax.runtime.libs import cublaslt

    fn = cublaslt._library().cublasLtMatmulAlgoConfigGetAttribute
    fn.argtypes = [ctypes.c_void_p, ctypes.c_int, ctypes.c_void_p, ctypes.c_size_t,
                   ctypes.POINTER(ctypes.c_size_t)]
    return fn


def _config(algo, attribute: int, default: int) -> int:
    value, written = ctypes.c_uint32(default), ctypes.c_size_t(0)
    _config_get_attribute()(ctypes.byref(algo), attribute, ctypes.byref(value), 4, ctypes.byref(written))
    return int(value.value)


def split_k(algo) -> int:
    """The number of K splits of a cuBLASLt algorithm (1: one kernel, no reduction)."""
    return _config(algo, SPLITK_NUM, 1)


def reduction_scheme(algo) -> int:
    """How its K splits are summed: cublasLtReductionScheme_t (0 none, 1 in place in the
    GEMM's kernel, 2 and 4 in a second kernel)."""
    return _config(algo, REDUCTION_SCHEME, 0)


def scheme_graphs(names: str, batch: int, masks: str, merge_all: bool = False,
                  dtype: str = "float32") -> None:
    """Each bench model's nimble graph (GPU µs, median of 3) with the autotuner offered
    only the reduction schemes of each mask (cublasLtReductionScheme_t bits; 7 = all, as
    cuBLASLt's default), against jax.jit back to back. `merge_all`: every mergeable set
    of dots merged, their operands concatenated each call (merge_dots' cost rule off)."""
    import importlib

    from nimblejax.bench.models import MODELS
    from nimblejax.runtime.libs import cublaslt

    if merge_all:  # the module (the package exports its function under the same name)
        rule = importlib.import_module("nimblejax.compiler.canonicalize.merge_dots")
        rule._worth_concatenating = lambda *a: True

    print("| model | batch | jax.jit µs | " + " | ".join(f"schemes {m}: graph µs (splits, schemes)" for m in masks.split(",")) + " |")
    print("|---|---|---|" + "---|" * len(masks.split(",")))
    for name in names.split(","):
        fn, args = MODELS[name].build(batch, dtype=dtype, rng=np.random.default_rng(0))
        j = jax.jit(fn)
        want = j(*args).astype(jnp.float32)
        cells = [f"{timing.throughput_us(j, args, calls=50):.1f}"]
        for mask in masks.split(","):
            cublaslt.REDUCTION_SCHEMES = int(mask)
            cublaslt._ALGO_CACHE.clear()
            f = nimble.jit(fn, backend="cuda")
            err = float(jnp.max(jnp.abs(f(*args).astype(jnp.float32) - want)) / jnp.max(jnp.abs(want)))
            us = sorted(timing.nimble_gpu_us(f) for _ in range(3))[1]
            algos = [cublaslt.MatmulAlgo.from_buffer_copy(c.algo) for c in cublaslt._ALGO_CACHE.values()]
            splits = sum(split_k(a) > 1 for a in algos)
            schemes = sorted({reduction_scheme(a) for a in algos if split_k(a) > 1})
            cells.append(f"{us:.1f} ({splits}/{len(algos)} split, {schemes}, err {err:.0e})")
        cublaslt.REDUCTION_SCHEMES = 7
        print(f"| {name} | {batch} | " + " | ".join(cells) + " |", flush=True)


def drop_split_k() -> None:
    """From now on nimble's autotuner times only cuBLASLt candidates without K splits
    (where a shape has any): an experiment, to see what the split-K reduction kernels cost
    inside a plan."""
    from nimblejax.runtime.libs import cublaslt

    heuristics = cublaslt.LtGemm._heuristics

    def whole_k(self, handle):
        results = heuristics(self, handle)
        kept = [r for r in results if split_k(r.algo) <= 1]
        return kept or results

    cublaslt.LtGemm._heuristics = whole_k
    cublaslt._ALGO_CACHE.clear()


def model_choices(name: str, batch: int) -> None:
    """Each distinct GEMM of a bench model's plan: its layout, the best candidate's µs
    (timed alone, back to back in a graph), its K splits, and the other candidates."""
    from nimblejax.bench.models import MODELS
    from nimblejax.runtime.libs import cublaslt

    fn, args = MODELS[name].build(batch, rng=np.random.default_rng(0))
    cublaslt._ALGO_CACHE.clear()
    jax.block_until_ready(nimble.jit(fn, backend="cuda")(*args))
    print(f"{name} batch {batch}: {len(cublaslt._ALGO_CACHE)} distinct cuBLASLt GEMMs")
    print("| batch×m×n×k | trans a, b | ld a, b, c | strides a, b, c | epilogue | best µs | splits | candidates µs |")
    print("|---|---|---|---|---|---|---|---|")

    def best(choice) -> float:
        return choice.timings_us[choice.index] if choice.timings_us else float("nan")

    rows = sorted(cublaslt._ALGO_CACHE.items(), key=lambda kv: -best(kv[1]))
    for (call, *_), choice in rows:
        t = choice.timings_us or ()
        algo = cublaslt.MatmulAlgo.from_buffer_copy(choice.algo)
        print(f"| {call.batch}×{call.m}×{call.n}×{call.k} | {int(call.trans_a)}, {int(call.trans_b)} "
              f"| {call.lda}, {call.ldb}, {call.ldc} | {call.stride_a}, {call.stride_b}, {call.stride_c} "
              f"| {call.epilogue} alpha={call.alpha:g} | {best(choice):.2f} | {split_k(algo)} "
              f"| {','.join(f'{x:.1f}' for x in sorted(x for x in t if x is not None))} |")
    print(f"sum of distinct GEMMs' best: {sum(best(c) for _, c in rows):.1f} µs")


def main() -> None:
    import argparse

    ap = argparse.ArgumentParser()
    ap.add_argument("--requested", type=int, default=None,
                    help="candidates asked of cublasLtMatmulAlgoGetHeuristic (default: nimble's)")
    ap.add_argument("--shapes", default=None, help="rows x width x hidden,... e.g. 32x512x2048")
    ap.add_argument("--no-split-k", action="store_true", help="time only candidates without K splits")
    ap.add_argument("--model", default=None,
                    help="instead of the chains: the autotuner's choice for each GEMM of this "
                         "bench model's plan (with --batch)")
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--schemes", default=None,
                    help="with --model (names, comma-separated): the graph's GPU µs for each "
                         "mask of cuBLASLt reduction schemes offered, e.g. 7,1,0")
    ap.add_argument("--dtype", default="float32", help="with --schemes: the models' parameters and inputs")
    ap.add_argument("--merge-all", action="store_true",
                    help="with --schemes: merge every mergeable set of dots (operands concatenated each call)")
    opts = ap.parse_args()
    require_gpu(__file__)
    from nimblejax.runtime.libs import cublaslt

    if opts.requested:
        cublaslt.REQUESTED_ALGOS = opts.requested
    if opts.no_split_k:
        drop_split_k()
    if opts.model and opts.schemes:
        scheme_graphs(opts.model, opts.batch, opts.schemes, opts.merge_all, opts.dtype)
        return
    if opts.model:
        model_choices(opts.model, opts.batch)
        return
    shapes = SHAPES if not opts.shapes else [tuple(int(d) for d in s.split("x")) for s in opts.shapes.split(",")]
    print(f"candidates asked: {cublaslt.REQUESTED_ALGOS}")
    rng = np.random.default_rng(0)
    depth = 8
    print("| rows × width × hidden | jax.jit µs/GEMM | nimble µs/GEMM | nimble graph µs | jax.jit µs | autotuned candidates µs (per GEMM shape) |")
    print("|---|---|---|---|---|---|")
    for rows, width, hidden in shapes:
        def p(*shape):
            return jnp.asarray(rng.standard_normal(shape) / np.sqrt(shape[0]), jnp.float32)
        ws = [(p(width, hidden), p(hidden), p(hidden, width), p(width)) for _ in range(depth)]
        xs = [(p(rows, width), ws) for _ in range(8)]
        fn = chain(depth)
        j, f = jax.jit(fn), nimble.jit(fn, backend="cuda")
        cublaslt._ALGO_CACHE.clear()
        err = float(jnp.max(jnp.abs(f(*xs[0]) - j(*xs[0]))))
        ju = min(timing.throughput_us(j, a, calls=50) for a in xs[:3])
        nu = timing.nimble_gpu_us(f)
        cands = []
        for key, choice in cublaslt._ALGO_CACHE.items():
            t = [x for x in (choice.timings_us or ()) if x is not None]
            best = choice.timings_us[choice.index] if choice.timings_us else None
            cands.append(f"{key[0].m}x{key[0].n}x{key[0].k}: best {best:.1f} of " +
                         ",".join(f"{x:.1f}" for x in sorted(t)) if best else str(key[0]))
        print(f"| {rows}×{width}×{hidden} | {ju / (2 * depth):.2f} | {nu / (2 * depth):.2f} | {nu:.1f} "
              f"| {ju:.1f} | {'; '.join(cands)} (max abs err {err:.1e}) |", flush=True)


if __name__ == "__main__":
    main()

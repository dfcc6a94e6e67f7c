"""Time one model's generated kernels of a family alone, and variants of their source
(run on the GPU machine): where a kernel's time goes without hardware counters, by
leaving a stage out and taking the difference.

    PYTHONPATH=. python3 examples/gpu/probe_kernel_variants.py --model efficientnet_b0 \
        --dtype bfloat16 --batch 32 --family dwconv

Variants (text edits of the generated source; results are not checked, only timed):
  as-is      the kernel as planned
  no-round   a 16-bit value's rounding after each operation left out (float math)
  fast-exp   expf → __expf
  libdevice  XLA's erf and tanh formulas (xla_math.py) → CUDA's erff and tanhf
Each kernel runs alone on random operands, CUDA events over `--calls` launches.
"""
from __future__ import annotations

import argparse
import importlib
import re

import cupy
import jax.numpy as jnp
import numpy as np

import nimblejax as nimble
from nimblejax.bench.models import MODELS
from nimblejax.bench.needs_gpu import require_gpu
from nimblejax.runtime.compile import OPTIONS

ROUND = re.compile(r"__bfloat162float\(__float2bfloat16_rn\(|__half2float\(__float2half_rn\(")


def variants(src: str) -> dict[str, str]:
    return {"as-is": src, "no-round": ROUND.sub("((", src), "fast-exp": src.replace("expf(", "__expf("),
            "libdevice": src.replace("nimble_erf(", "erff(").replace("nimble_tanh(", "tanhf(")}


def operand(var, rng) -> cupy.ndarray:
    dtype = np.dtype(var.dtype)
    bits = rng.standard_normal(max(var.size, 1)).astype(np.float32)
    if str(dtype) == "bfloat16":
        host = (bits.view(np.uint32) >> 16).astype(np.uint16)
    elif dtype == np.float16:
        host = bits.astype(np.float16).view(np.uint16)
    elif dtype.kind == "f":
        host = bits.astype(dtype)
    else:
        host = rng.integers(0, 2, max(var.size, 1)).astype(dtype)
    return cupy.asarray(host)


def time_us(fn, grid, block, args, calls: int) -> float:
    start, stop = cupy.cuda.Event(), cupy.cuda.Event()
    for _ in range(3):
        fn(grid, block, args)
    start.record()
    for _ in range(calls):
        fn(grid, block, args)
    stop.record()
    stop.synchronize()
    return cupy.cuda.get_elapsed_time(start, stop) * 1e3 / calls


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="efficientnet_b0")
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--batch", type=int, default=32)
    ap.add_argument("--family", default="dwconv", help="a text the kernels' names contain")
    ap.add_argument("--calls", type=int, default=50)
    ap.add_argument("--limit", type=int, default=24)
    ap.add_argument("--set", action="append", default=[],
                    help="module.NAME=value: a constant of nimblejax.compiler.lowering.<module> for this run")
    opts = ap.parse_args()
    require_gpu(__file__)
    for item in opts.set:
        target, value = item.split("=")
        module, name = target.rsplit(".", 1)
        setattr(importlib.import_module(f"nimblejax.compiler.lowering.{module}"), name, int(value))
    fn, args = MODELS[opts.model].abstract(opts.batch, jnp.dtype(opts.dtype))
    plan = nimble.jit(fn).lower(*args).plan
    rng = np.random.default_rng(0)
    kernels = [t.kernel for t in plan.tasks if t.kernel is not None and opts.family in t.kernel.name]
    totals: dict[str, float] = {}
    print(f"{opts.model} {opts.dtype} batch {opts.batch} {' '.join(opts.set)}: {len(kernels)} kernels named *{opts.family}*")
    for k in kernels[:opts.limit]:
        ops = [operand(v, rng) for v in k.params]
        row = []
        for label, src in variants(k.source).items():
            f = cupy.RawModule(code=src, options=OPTIONS).get_function(k.name)
            us = time_us(f, k.grid, k.block, tuple(ops), opts.calls)
            totals[label] = totals.get(label, 0.0) + us
            row.append(f"{label} {us:7.2f}")
        shapes = " ".join("x".join(map(str, v.shape)) for v in k.params[:2])
        print(f"{k.name:48s} grid {k.grid[0]:6d} block {k.block[0]:4d} [{shapes}]  " + "  ".join(row), flush=True)
    print("total µs: " + "  ".join(f"{k} {v:.1f}" for k, v in totals.items()))


if __name__ == "__main__":
    main()

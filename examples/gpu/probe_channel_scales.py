"""The batch-norm scale folded into the weights (compiler/canonicalize/channel_scales.py),
on and off, against jax.jit on the CNNs (run on the GPU machine).

    PYTHONPATH=. python3 examples/gpu/probe_channel_scales.py --models resnet50,inception_v3 --batch 32,1

In one process, rounds alternating: jax.jit, nimble without the fold (no weights count as
small enough: MAX_WEIGHT_RATIO = 0, planned first) and nimble with it. Looped µs (a fresh
input each call, parameters the same objects, one block at the end) and the graphs' GPU
µs (CUDA events), medians of the rounds; the relative error against jax.jit.
"""
from __future__ import annotations

import argparse
import gc
import statistics

import jax
import jax.numpy as jnp
import numpy as np

import nimblejax as nimble
import nimblejax.compiler.canonicalize.channel_scales as channel_scales
from nimblejax.bench import timing
from nimblejax.bench.models import MODELS
from nimblejax.bench.needs_gpu import require_gpu


def rel_err(got, want) -> float:
    pairs = zip(jax.tree_util.tree_leaves(got), jax.tree_util.tree_leaves(want))
    return max(float(np.max(np.abs(np.asarray(g) - np.asarray(w))) / (np.max(np.abs(np.asarray(w))) + 1e-30))
               for g, w in pairs)


def planned(fn, args, ratio: float):
    """nimble.jit(fn), planned and compiled under the given weight ratio."""
    keep, channel_scales.MAX_WEIGHT_RATIO = channel_scales.MAX_WEIGHT_RATIO, ratio
    try:
        f = nimble.jit(fn)
        jax.block_until_ready(f(*args))
        return f, len(f.plan(*args).tasks)
    finally:
        channel_scales.MAX_WEIGHT_RATIO = keep


def measure(name: str, batch: int, rounds: int) -> str:
    fn, args = MODELS[name].build(batch, rng=np.random.default_rng(0))
    params, x = args
    fresh = np.random.default_rng(1)
    sets = [(params, jnp.asarray(fresh.standard_normal(x.shape), x.dtype)) for _ in range(8)]
    jitted = jax.jit(fn)
    want = jitted(*args)
    (off, n_off), (on, n_on) = planned(fn, args, 0.0), planned(fn, args, channel_scales.MAX_WEIGHT_RATIO)
    t = {k: [] for k in ("jax", "off", "on", "gpu_off", "gpu_on")}
    for _ in range(rounds):
        t["jax"].append(timing.looped_us(jitted, sets, calls=100, repeats=3))
        t["off"].append(timing.looped_us(off, sets, calls=100, repeats=3))
        t["on"].append(timing.looped_us(on, sets, calls=100, repeats=3))
        t["gpu_off"].append(timing.nimble_gpu_us(off, calls=50))
        t["gpu_on"].append(timing.nimble_gpu_us(on, calls=50))
    m = {k: statistics.median(v) for k, v in t.items()}
    return (f"| {name} | {batch} | {n_off} → {n_on} | {m['jax']:.0f} | {m['off']:.0f} | {m['on']:.0f} | "
            f"{m['jax'] / m['off']:.2f}× → {m['jax'] / m['on']:.2f}× | {m['gpu_off']:.0f} → {m['gpu_on']:.0f} | "
            f"{rel_err(off(*args), want):.1e} → {rel_err(on(*args), want):.1e} |")


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--models", default="resnet50,inception_v3,mobilenet_v2,efficientnet_b0")
    ap.add_argument("--batch", default="32,1")
    ap.add_argument("--rounds", type=int, default=3)
    opts = ap.parse_args()
    require_gpu(__file__)
    print("| model | batch | tasks | jax.jit looped µs | nimble, fold off | fold on | speedup | GPU µs | rel. error |")
    print("|---|---|---|---|---|---|---|---|---|")
    for batch in (int(b) for b in opts.batch.split(",")):
        for name in opts.models.split(","):
            print(measure(name, batch, opts.rounds), flush=True)
            gc.collect()


if __name__ == "__main__":
    main()

"""Every GPU kernel of one call, jax.jit's against nimble's, from JAX's profiler (CUPTI):
where a model's GPU time differs, kernel family by family (run on the GPU machine).

    PYTHONPATH=. python3 examples/gpu/trace_kernels.py --models bert --batch 1
    PYTHONPATH=. python3 examples/gpu/trace_kernels.py --train --models resnet50 --batch 32

With `--train`, a training step of `nimblejax.bench.train` (value_and_grad of the
cross-entropy, then SGD) instead of the model's forward pass.

Both sides run `--calls` calls inside one `jax.profiler.trace`; a kernel's time is its
total over the traced calls divided by their number. Kernels are grouped by name with
digits and hashes dropped.
"""
from __future__ import annotations

import argparse
import collections
import re

import jax
import numpy as np

import nimblejax as nimble
from nimblejax.bench import gpu_trace, timing
from nimblejax.bench.models import MODELS
from nimblejax.bench.needs_gpu import require_gpu


def kernel_times(fn, args, calls: int) -> dict[str, list[float]]:
    """{kernel name: [µs of each launch]} over `calls` calls of fn, from JAX's profiler."""
    jax.block_until_ready(fn(*args))

    def run():
        for _ in range(calls):
            out = fn(*args)
        jax.block_until_ready(out)

    out: dict[str, list[float]] = collections.defaultdict(list)
    for a in gpu_trace.traced(run):
        out[a.name].append(a.dur)
    return out


def family(name: str) -> str:
    name = re.sub(r"_[0-9a-f]{4}$", "", name)
    name = re.sub(r"\d+", "#", name)
    return name[:90]


def table(times: dict[str, list[float]], calls: int) -> dict[str, tuple[int, float]]:
    fam: dict[str, list] = collections.defaultdict(lambda: [0, 0.0])
    for name, durs in times.items():
        f = fam[family(name)]
        f[0] += len(durs)
        f[1] += sum(durs)
    return {k: (n / calls, us / calls) for k, (n, us) in fam.items()}


def train_step(name: str, batch: int):
    """bench.train's step of a model and its arguments (params, x, labels)."""
    from nimblejax.bench.data_parallel import build
    from nimblejax.bench.train import make_step

    apply, params, x, labels = build(name, batch, np.random.default_rng(0))
    return make_step(apply), (params, x, labels)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--models", default="bert")
    ap.add_argument("--batch", default="1")
    ap.add_argument("--calls", type=int, default=10)
    ap.add_argument("--dtype", default="float32", help="the models' parameters and inputs (float32, bfloat16)")
    ap.add_argument("--top", type=int, default=25)
    ap.add_argument("--no-split-k", action="store_true",
                    help="nimble's autotuner times only cuBLASLt candidates without K splits")
    ap.add_argument("--train", action="store_true", help="a training step (bench.train's) of each model")
    ap.add_argument("--constants", action="store_true",
                    help="close over the parameters (constants of the program) instead of passing them")
    opts = ap.parse_args()
    require_gpu(__file__)
    if opts.no_split_k:
        from probe_gemms import drop_split_k  # this folder's

        drop_split_k()
    for batch in [int(b) for b in opts.batch.split(",")]:
        for name in opts.models.split(","):
            if opts.train:
                fn, args = train_step(name, batch)
            else:
                fn, args = MODELS[name].build(batch, dtype=opts.dtype, rng=np.random.default_rng(0))
            if opts.constants:
                params, x = args
                fn, args = (lambda f, p: lambda x: f(p, x))(fn, params), (x,)
            sides = {"jax.jit": jax.jit(fn), "nimble": nimble.jit(fn, backend="cuda")}
            tables = {k: table(kernel_times(f, args, opts.calls), opts.calls) for k, f in sides.items()}
            last = 1 if opts.train else len(args) - 1  # the input that is fresh each call
            fresh = [tuple(jax.numpy.asarray(a) + 0 if i == last else a
                           for i, a in enumerate(args)) for _ in range(3)]
            ju = min(timing.throughput_us(sides["jax.jit"], a, calls=50) for a in fresh)
            print(f"\n{name} batch {batch}{' (parameters constant)' if opts.constants else ''}: "
                  f"jax.jit back-to-back {ju:.1f} µs, nimble graph {timing.nimble_gpu_us(sides['nimble']):.1f} µs")
            print(f"\n=== {name} batch {batch} {opts.dtype}: kernels per call, µs per call (sum of kernel durations)")
            for side, t in tables.items():
                total = sum(us for _, us in t.values())
                count = sum(n for n, _ in t.values())
                print(f"\n{side}: {count:.0f} kernels, {total:.1f} µs")
                print("| kernel family | launches | µs | µs each |")
                print("|---|---|---|---|")
                for k, (n, us) in sorted(t.items(), key=lambda kv: -kv[1][1])[:opts.top]:
                    print(f"| `{k}` | {n:.0f} | {us:.1f} | {us / max(n, 1):.2f} |")


if __name__ == "__main__":
    main()

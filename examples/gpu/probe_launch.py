"""Host cost of launching a plan's captured graph, by plan size, next to the whole
call (run on the GPU machine: its host and driver).

    PYTHONPATH=. python3 examples/gpu/probe_launch.py --models mlp,lstm,gpt --batch 1

For each model: the plan's tasks and streams, the host µs of one `cuGraphLaunch` of its
graph, and nimble's call: looped µs, and the host µs a caller waits for each call to
return (jax.jit's too), parameters the same arrays every call and a fresh input. Host times are taken
over bursts of BURST launches or calls started on an idle GPU (`burst_host_us`).
"""
from __future__ import annotations

import argparse
import itertools
import statistics
import time

import jax
import numpy as np

import nimblejax as nimble
from nimblejax.bench.models import MODELS
from nimblejax.bench.needs_gpu import require_gpu
from nimblejax.bench.timing import looped_and_host_us

BURST = 4


def burst_host_us(launch, sync, bursts: int = 200, size: int = BURST) -> float:
    """Median host µs per launch over bursts of `size` launches, each burst started on an
    idle GPU: the launches return before the GPU catches up, so a full launch queue never
    makes the host wait (a long loop would time the GPU instead)."""
    times = []
    for _ in range(bursts):
        sync()
        t0 = time.perf_counter()
        for _ in range(size):
            launch()
        times.append((time.perf_counter() - t0) / size * 1e6)
    sync()
    return statistics.median(times)


def call_host_us(fn, arg_sets) -> float:
    calls, out = itertools.count(), [None]

    def call():
        out[0] = fn(*arg_sets[next(calls) % len(arg_sets)])
    return burst_host_us(call, lambda: jax.block_until_ready(out[0]))


def launch_host_us(exe) -> float:
    import cupy

    exe.rest()  # the graph pointed at the arena alone (bench.timing.nimble_gpu_us)
    stream = exe.streams[0]
    return burst_host_us(lambda: cupy.cuda.runtime.graphLaunch(exe.raw_exec, stream.ptr),
                         stream.synchronize)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--models", default="mlp,lstm,gpt")
    ap.add_argument("--batch", type=int, default=1)
    opts = ap.parse_args()
    require_gpu(__file__)
    print("| model | tasks | streams | cuGraphLaunch host µs | jax.jit looped µs | jax.jit call host µs "
          "| nimble looped µs | nimble call host µs |")
    print("|---|---|---|---|---|---|---|---|")
    for name in opts.models.split(","):
        spec = MODELS[name]
        fn, (params, x) = spec.build(opts.batch, rng=np.random.default_rng(0))
        xs = [(params, x + i * 1e-3) for i in range(8)]
        f = nimble.jit(fn)
        jax.block_until_ready(f(*xs[0]))
        jax.block_until_ready(f(*xs[1]))
        j = jax.jit(fn)
        jax.block_until_ready(j(*xs[0]))
        cells = []
        for g in (j, f):
            looped, _ = looped_and_host_us(g, xs, calls=300)
            cells += [looped, call_host_us(g, xs)]
        exe = f.executables()[-1]
        tasks, streams = len(exe.plan.tasks), exe.plan.schedule.num_streams
        print(f"| {name} b{opts.batch} | {tasks} | {streams} | {launch_host_us(exe):.1f} | "
              + " | ".join(f"{c:.1f}" for c in cells) + " |", flush=True)


if __name__ == "__main__":
    main()

"""Where a looped call's time goes beyond its graph's GPU time: the GPU's busy and idle
time per call, and what runs besides nimble's graph, from JAX's profiler (CUPTI); run on
the GPU machine.

    PYTHONPATH=. python3 examples/gpu/trace_call_gaps.py --models bert --batch 1

For each model: nimble.jit called looped (a fresh input each call from a few made ahead,
the parameters the same objects, one block at the end), then its captured graph launched
back to back alone (as the bench's GPU time does). Per call: the span of GPU activity,
the time some kernel or copy ran (the union of their intervals), the idle rest, the
idle gaps of 2 µs or more, and the kernels and copies that are not nimble's (XLA's own
around the custom call, the handler's copies), by name. The question: BERT at batch 1
loops 35 µs a call slower than its graph (BENCHMARKS.md, 2026-11-29).
"""
from __future__ import annotations

import argparse
import collections
import json
import pathlib

import jax
import numpy as np

from nimblejax.bench import gpu_trace
from nimblejax.bench.needs_gpu import require_gpu

GAP_US = 2.0  # idle gaps at least this long are listed
# Kernels of nimble's plans: generated ones and the libraries' (cuBLASLt, cuDNN).
NIMBLE_KERNELS = ("nimble_", "cutlass", "sm90_", "sm80_", "cublas", "xmma", "nvjet", "cudnn",
                  "splitK", "gemv", "gemm", "convolve")


def summary(events: list, calls: int) -> dict:
    """Per call: the span, the busy time (the union of the intervals), the idle time, the
    idle gaps of GAP_US or more, and the non-nimble kernels and copies by name."""
    busy_intervals = gpu_trace.union((e.start, e.end) for e in events)
    span = busy_intervals[-1][1] - busy_intervals[0][0]
    busy = sum(b - a for a, b in busy_intervals)
    gaps = [a - b for (_, b), (a, _) in zip(busy_intervals, busy_intervals[1:]) if a - b >= GAP_US]
    others: dict = collections.defaultdict(lambda: [0, 0.0])
    for _, dur, name, _, _ in events:
        if not any(k in name for k in NIMBLE_KERNELS):
            others[name[:70]][0] += 1
            others[name[:70]][1] += dur
    return {"span_us": span / calls, "busy_us": busy / calls, "idle_us": (span - busy) / calls,
            "gaps_per_call": len(gaps) / calls, "gap_us_per_call": sum(gaps) / calls,
            "largest_gaps_us": sorted(gaps, reverse=True)[:5],
            "others": {k: (n / calls, us / calls) for k, (n, us) in sorted(others.items(), key=lambda kv: -kv[1][1])}}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--models", default="bert")
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--calls", type=int, default=50)
    ap.add_argument("--json", default="", help="write the summaries here too")
    opts = ap.parse_args()
    require_gpu(__file__)
    import cupy

    import nimblejax as nimble
    from nimblejax.bench.models import MODELS
    from nimblejax.bench.models.layers import on_device

    results = {}
    for name in opts.models.split(","):
        fn, args = MODELS[name].build(opts.batch, np.float32, np.random.default_rng(0), tiny=False)
        fresh = np.random.default_rng(1)  # a fresh last argument each call, as the bench's loop
        x = args[-1]
        arg_sets = [args[:-1] + (on_device(fresh.standard_normal(x.shape), x.dtype),) for _ in range(8)]
        f = nimble.jit(fn)
        jax.block_until_ready(f(*arg_sets[0]))

        def looped(calls, f=f, arg_sets=arg_sets):
            for i in range(calls):
                out = f(*arg_sets[i % len(arg_sets)])
            jax.block_until_ready(out)

        exe = f.executables()[-1]

        def graph_alone(calls, exe=exe):
            exe.rest()  # the graph pointed back at its arena, as the bench's GPU time runs it
            s0 = exe.streams[0]
            for _ in range(calls):
                for raw in exe.raw_execs:
                    cupy.cuda.runtime.graphLaunch(raw, s0.ptr)
            s0.synchronize()

        looped(5)
        rows = {label: summary(gpu_trace.traced(lambda run=run: run(opts.calls)), opts.calls)
                for label, run in (("looped", looped), ("graph alone", graph_alone))}
        results[f"{name} b{opts.batch}"] = rows
        print(f"=== {name} batch {opts.batch}: µs per call")
        print("\n".join(line for label, r in rows.items() for line in report(label, r)))
    if opts.json:
        pathlib.Path(opts.json).write_text(json.dumps(results, indent=1))


def report(label: str, r: dict) -> list[str]:
    """One summary's lines: its times, then what ran that is not nimble's."""
    largest = ", ".join(f"{g:.1f}" for g in r["largest_gaps_us"])
    head = (f"  {label:12s} span {r['span_us']:8.1f}  busy {r['busy_us']:8.1f}  idle {r['idle_us']:7.1f}"
            f"  gaps >= {GAP_US} µs: {r['gaps_per_call']:.1f} a call, {r['gap_us_per_call']:.1f} µs; largest {largest}")
    return [head] + [f"      not nimble's: {n:4.1f} x {k}  {us:.1f} µs" for k, (n, us) in list(r["others"].items())[:8]]


if __name__ == "__main__":
    main()

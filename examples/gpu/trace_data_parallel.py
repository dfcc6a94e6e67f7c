"""Where a data-parallel step's time goes on each GPU, jax.jit's against nimble's, from
JAX's profiler (CUPTI): the step's span, its busy and idle time, the all-reduce (NCCL)
kernels, and how much of them overlaps other work (run on a machine with 2 GPUs).

    PYTHONPATH=. python3 examples/gpu/trace_data_parallel.py --model resnet50 --per-device-batch 32

Each side runs `--calls` steps of `nimblejax.bench.data_parallel`'s step (its pmean
included, state fed back, a fresh batch each call) inside one `jax.profiler.trace`.
Per GPU and per step: span (first kernel start to last kernel end over the traced
steps, divided by the steps), busy (the union of kernel intervals), NCCL kernels' time,
and the part of it during which some other kernel ran on that GPU (overlapped).
"""
from __future__ import annotations

import argparse
import collections
import json
import re
import tempfile

import jax
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

import nimblejax as nimble
from nimblejax.bench import data_parallel as dp
from nimblejax.bench import gpu_trace
from nimblejax.bench.needs_gpu import require_gpu
from nimblejax.bench.timing import fed_back_us


def gpu_events(log_dir: str) -> dict[str, list[tuple[float, float, str, int]]]:
    """{GPU process name: [(start µs, end µs, name, stream)]} from the perfetto trace."""
    out: dict[str, list] = collections.defaultdict(list)
    for a in gpu_trace.read(log_dir):
        out[a.gpu].append((a.start, a.end, a.name, a.stream))
    return out


def overlap(a: tuple[float, float], spans: list[tuple[float, float]]) -> float:
    return sum(max(0.0, min(a[1], b) - max(a[0], s)) for s, b in spans)


def is_nccl(name: str) -> bool:
    return "nccl" in name.lower()


def summarize(events: list[tuple[float, float, str, int]], steps: int) -> dict:
    """One GPU's figures per step (µs), and its kernel families by total time."""
    t0, t1 = min(e[0] for e in events), max(e[1] for e in events)
    busy = gpu_trace.union([(a, b) for a, b, _, _ in events])
    others = gpu_trace.union([(a, b) for a, b, n, _ in events if not is_nccl(n)])
    nccl = [(a, b) for a, b, n, _ in events if is_nccl(n)]
    fam: dict[str, list] = collections.defaultdict(lambda: [0, 0.0])
    for a, b, n, _ in events:
        f = fam[re.sub(r"\d+", "#", n)[:80]]
        f[0] += 1
        f[1] += b - a
    return dict(
        span_us=(t1 - t0) / steps,
        busy_us=sum(b - a for a, b in busy) / steps,
        nccl_us=sum(b - a for a, b in nccl) / steps,
        nccl_overlapped_us=sum(overlap(iv, others) for iv in nccl) / steps,
        nccl_kernels=len(nccl) / steps,
        streams=len({s for *_, s in events}),
        top=sorted(((k, n / steps, us / steps) for k, (n, us) in fam.items()), key=lambda r: -r[2])[:12],
    )


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="resnet50")
    ap.add_argument("--per-device-batch", type=int, default=32)
    ap.add_argument("--devices", type=int, default=2)
    ap.add_argument("--calls", type=int, default=10)
    ap.add_argument("--json", default=None)
    opts = ap.parse_args()
    require_gpu(__file__)
    devices = jax.devices()[:opts.devices]
    mesh = Mesh(np.array(devices), ("data",))
    rng = np.random.default_rng(0)
    apply, params, x, labels = dp.build(opts.model, opts.per_device_batch * len(devices), rng)
    loss = dp.cross_entropy(apply)
    data = NamedSharding(mesh, P("data"))
    batches = [(jax.device_put(x + 0.01 * i, data), jax.device_put(labels, data)) for i in range(4)]
    start = jax.device_put(params, NamedSharding(mesh, P()))
    sides = {"jax.jit": jax.value_and_grad(loss), "nimble": nimble.jit(jax.value_and_grad(loss), backend="cuda")}
    report = {}
    for side, grad_fn in sides.items():
        step = dp.dp_step(grad_fn, mesh)
        state = [jax.tree_util.tree_map(jax.numpy.copy, start)]
        fed_back_us(step, state, batches, 5)
        wall = fed_back_us(step, state, batches, 30)
        with tempfile.TemporaryDirectory() as log_dir:
            with jax.profiler.trace(log_dir, create_perfetto_trace=True):
                fed_back_us(step, state, batches, opts.calls)
            per_gpu = {gpu: summarize(ev, opts.calls) for gpu, ev in sorted(gpu_events(log_dir).items())}
        report[side] = dict(wall_us=wall, gpus=per_gpu)
        print(f"\n=== {side}: {opts.model}, {len(devices)} GPUs, batch {opts.per_device_batch} per GPU: "
              f"{wall:.0f} µs a step (looped, untraced)")
        for gpu, s in per_gpu.items():
            print(f"{gpu}: span {s['span_us']:.0f} µs, busy {s['busy_us']:.0f}, NCCL {s['nccl_us']:.0f} "
                  f"in {s['nccl_kernels']:.1f} kernels ({s['nccl_overlapped_us']:.0f} overlapped), "
                  f"{s['streams']} streams")
            for k, n, us in s["top"]:
                print(f"    {us:9.1f} µs {n:6.1f}×  {k}")
    if opts.json:
        with open(opts.json, "w") as fh:
            json.dump(report, fh, indent=1)


if __name__ == "__main__":
    main()

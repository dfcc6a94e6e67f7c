"""Does XLA overlap an all-reduce with a nimble custom call that runs after it? The
question behind launching one plan as several graphs (issue 34): if the gradients of a
first custom call are all-reduced while a second custom call computes, a backward pass
split in two hides its all-reduce as XLA's own does (run on a machine with 2 GPUs).

    PYTHONPATH=. python3 examples/gpu/probe_overlap.py [--mb 100] [--work 40]

Per device, inside `jax.shard_map` under `jax.jit`: `g = first(a)` (a nimble function
writing `--mb` MB), `s = psum(g)`, `h = second(b)` (a nimble function of `--work`
chained 2048² GEMMs that does not read g), and both results returned. From JAX's
profiler: per GPU, the all-reduce kernels' time and how much of it ran while another
kernel (the second call's) ran; then the same step with `second` reading `s` (no
overlap possible), and jax.jit's own version of each.
"""
from __future__ import annotations

import argparse

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

import nimblejax as nimble
from nimblejax.bench import data_parallel as dp
from nimblejax.bench.needs_gpu import require_gpu
from nimblejax.bench.timing import looped_us


def first(a):
    return jnp.tanh(a) * 2.0


def second(b, work: int):
    for _ in range(work):
        b = jnp.tanh(b @ b) * 0.5
    return b


def step_fn(mesh: Mesh, f1, f2, dependent: bool):
    def local(a, b):
        g = f1(a)
        s = jax.lax.psum(g, "data")
        h = f2(b + jnp.sum(s[:1, :1]) if dependent else b)
        return s, h

    return jax.jit(dp.shard_map(local, mesh, (P("data"), P("data")), (P("data"), P("data")), check=False))


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--mb", type=int, default=100, help="MB all-reduced per device")
    ap.add_argument("--work", type=int, default=40, help="chained 2048x2048 GEMMs in the second call")
    ap.add_argument("--backend", default="cuda", help="nimble's backend (interpret: a dry run, no trace)")
    opts = ap.parse_args()
    if opts.backend == "cuda":
        require_gpu(__file__)
        from trace_data_parallel import gpu_events, summarize  # this folder's
    devices = jax.devices()
    mesh = Mesh(np.array(devices), ("data",))
    n = len(devices)
    rows = opts.mb * (1 << 20) // (4 * 4096)
    data = NamedSharding(mesh, P("data"))
    rng = np.random.default_rng(0)
    a = jax.device_put(jnp.asarray(rng.standard_normal((n * rows, 4096)), jnp.float32), data)
    b = jax.device_put(jnp.asarray(rng.standard_normal((n * 2048, 2048)) * 0.02, jnp.float32), data)
    second_w = lambda b: second(b, opts.work)  # noqa: E731
    sides = {"nimble": (nimble.jit(first, backend=opts.backend), nimble.jit(second_w, backend=opts.backend)),
             "jax.jit": (first, second_w)}
    for side, (f1, f2) in sides.items():
        for dependent in (False, True):
            step = step_fn(mesh, f1, f2, dependent)
            jax.block_until_ready(step(a, b))
            us = looped_us(step, [(a, b)], calls=10, repeats=3)
            label = f"{side}, second call {'reads' if dependent else 'does not read'} the all-reduce"
            if opts.backend != "cuda":
                print(f"{label}: {us:.0f} µs a step (dry run)")
                continue
            import tempfile

            with tempfile.TemporaryDirectory() as log_dir:
                with jax.profiler.trace(log_dir, create_perfetto_trace=True):
                    jax.block_until_ready([step(a, b) for _ in range(5)])
                per_gpu = {g: summarize(ev, 5) for g, ev in sorted(gpu_events(log_dir).items())}
            print(f"\n{label}: {us:.0f} µs a step")
            for g, s in per_gpu.items():
                print(f"  {g}: busy {s['busy_us']:.0f} µs, NCCL {s['nccl_us']:.0f} "
                      f"({s['nccl_overlapped_us']:.0f} overlapped), span {s['span_us']:.0f}")


if __name__ == "__main__":
    main()

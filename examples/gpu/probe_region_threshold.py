"""Is a small co-execution region worth a nimble plan? (issue 33: the measured rule behind
compiler/partition.py's MIN_REGION_EQNS.) A function with one equation nimble leaves to
XLA (an FFT, a few µs) and a region beside it: an elementwise chain of n equations (which
XLA fuses into one kernel), or n independent small reductions (which XLA runs as
several kernels). Each is timed with the region as a nimble plan (MIN_REGION_EQNS = 1)
and left to XLA (MIN_REGION_EQNS above n, no HEAVY primitive counted), and under
jax.jit; looped µs per call, a fresh input each call, rounds alternated, medians.

    PYTHONPATH=. python3 examples/gpu/probe_region_threshold.py [--json out.json]
"""
from __future__ import annotations

import argparse
import contextlib
import json
import statistics
import warnings

import jax
import jax.numpy as jnp
import numpy as np

import nimblejax as nimble
from nimblejax.bench.needs_gpu import require_gpu
from nimblejax.bench.timing import looped_us
from nimblejax.compiler import partition


def chain(n: int, size: int):
    def f(x, s):
        y = x * jnp.sum(jnp.abs(jnp.fft.rfft(s)))  # the FFT is left to XLA
        for _ in range(n // 2):
            y = jnp.tanh(y) * 1.01
        return y
    return f, (size,)


def reductions(n: int, size: int):
    def f(x, s):
        y = x * jnp.sum(jnp.abs(jnp.fft.rfft(s)))
        return [jnp.max(y[i::n // 2] * (i + 1)) for i in range(n // 2)]  # mul + reduce each
    return f, (size,)


@contextlib.contextmanager
def threshold(value: int, heavy: frozenset):
    saved = partition.MIN_REGION_EQNS, partition.HEAVY
    partition.MIN_REGION_EQNS, partition.HEAVY = value, heavy
    try:
        yield
    finally:
        partition.MIN_REGION_EQNS, partition.HEAVY = saved


def run(kind, n: int, size: int, backend=None) -> dict:
    f, shape = {"chain": chain, "reductions": reductions}[kind](n, size)
    r = np.random.default_rng(0)
    s = jnp.asarray(r.standard_normal((8, 8)), jnp.float32)
    sets = [(jnp.asarray(r.standard_normal(shape), jnp.float32), s) for _ in range(4)]
    configs = {"jax.jit": jax.jit(f)}
    with threshold(1, partition.HEAVY):  # plans are made at the first call
        configs["region planned"] = nimble.jit(f, backend=backend)
        jax.block_until_ready(configs["region planned"](*sets[0]))
        regions = configs["region planned"].partition(*sets[0]).regions()
        planned = sum(len(reg.steps) for reg in regions)
    with threshold(10 ** 9, frozenset()):
        configs["region to XLA"] = nimble.jit(f, backend=backend)
        jax.block_until_ready(configs["region to XLA"](*sets[0]))
    times: dict = {k: [] for k in configs}
    for rnd in range(5):
        for k in (list(configs) if rnd % 2 == 0 else list(configs)[::-1]):
            times[k].append(looped_us(configs[k], sets, calls=100, repeats=1))
    return {"kind": kind, "n": n, "size": size, "equations_planned": planned,
            **{k: statistics.median(v) for k, v in times.items()}}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--json")
    ap.add_argument("--backend", default=None, help="interpret: a CPU check of the script")
    ap.add_argument("--quick", action="store_true", help="one size, two counts (a check)")
    opts = ap.parse_args()
    if opts.backend != "interpret":
        require_gpu(__file__)
    warnings.filterwarnings("ignore", message="nimblejax: .* nimble region")
    print("| region | n | its equations | elements | jax.jit µs | region planned µs | region to XLA µs | planned / to XLA |")
    print("|---|---|---|---|---|---|---|---|")
    rows = []
    plan = (("chain", (4, 64)), ("reductions", (4, 32))) if opts.quick else \
        (("chain", (4, 8, 16, 32, 64)), ("reductions", (4, 8, 16, 32)))
    for kind, counts in plan:
        for size in ((4096,) if opts.quick else (4096, 1 << 20)):
            for n in counts:
                row = run(kind, n, size, opts.backend)
                rows.append(row)
                print(f"| {kind} | {n} | {row['equations_planned']} | {size} | {row['jax.jit']:.1f} | {row['region planned']:.1f} | "
                      f"{row['region to XLA']:.1f} | {row['region planned'] / row['region to XLA']:.2f} |",
                      flush=True)
    if opts.json:
        with open(opts.json, "w") as fh:
            json.dump({"device": jax.devices()[0].device_kind, "rows": rows}, fh, indent=1)


if __name__ == "__main__":
    main()

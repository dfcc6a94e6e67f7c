"""GPU runtime benchmark: nimble.jit against jax.jit, side by side in one process.

    PYTHONPATH=. python3 examples/benchmark_runtime.py [--json out.json]

Rows: a trivial 1-input function, the branchy MLP of DESIGN.md (8 branches × 6 layers
of 256×256 dense + bias + tanh, summed) at batch 1 and 32, and a 100-leaf parameter
pytree. Columns: median end-to-end µs (with block_until_ready) and GPU µs.
"""
from __future__ import annotations

import argparse
import json
import os
import sys

import jax
import jax.numpy as jnp
import numpy as np

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "tests"))

import nimblejax as nimble  # noqa: E402
from models import branchy_args, branchy_mlp  # noqa: E402
from nimblejax.runtime import io  # noqa: E402
from nimblejax.bench.timing import (concurrent_jax, e2e_us, nimble_gpu_us,  # noqa: E402
                                    throughput_us)


def trivial(x):
    return x * 2.0 + 1.0


def pytree_sum(params, x):
    return x + sum(jnp.sum(p) for p in params)


def cases(rng):
    yield "trivial (1 in, 1 out)", trivial, (jnp.asarray(rng.standard_normal(256), jnp.float32),)
    for batch in (1, 32):
        yield (f"branchy MLP 8x6x256, batch {batch}", branchy_mlp,
               branchy_args(rng, branches=8, layers=6, width=256, batch=batch))
    params = [jnp.asarray(rng.standard_normal(16), jnp.float32) for _ in range(100)]
    yield "100-leaf pytree sum", pytree_sum, (params, jnp.asarray(rng.standard_normal(16), jnp.float32))


def measure(fn, args) -> dict:
    want = np.asarray(jax.jit(fn)(*args))
    rows = {}
    jitted = jax.jit(fn)
    rows["jax.jit"] = (e2e_us(jitted, args), throughput_us(jitted, args))
    conc = concurrent_jax(fn, args)
    if conc is not None:
        rows["jax.jit concurrent"] = (e2e_us(conc, args), throughput_us(conc, args))
    for label, opts in (("nimble eager", dict(eager=True)), ("nimble 1-stream", dict(max_streams=1)),
                        ("nimble multi-stream", dict()),
                        ("nimble multi-stream, output=cupy", dict(output="cupy")),
                        ("nimble multi-stream, XLA unpack", dict(unpack=True))):
        unpack = opts.pop("unpack", False)
        saved = io.UNPACK_MIN_OUTPUTS
        if unpack:  # hand even a single output over through the XLA unpack call
            io.UNPACK_MIN_OUTPUTS = 1
        f = nimble.jit(fn, backend="cuda", **opts)
        f(*args)
        io.UNPACK_MIN_OUTPUTS = saved
        got = f(*args)
        got = got.get() if hasattr(got, "get") else np.asarray(got)
        err = float(np.max(np.abs(got - want)) / (np.max(np.abs(want)) + 1e-30))
        rows[label] = (e2e_us(f, args), nimble_gpu_us(f), err)
    return rows


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--json")
    opts = ap.parse_args()
    import cupy

    dev = cupy.cuda.runtime.getDeviceProperties(0)["name"].decode()
    print(f"GPU: {dev}; jax {jax.__version__}; cupy {cupy.__version__}")
    results = {}
    rng = np.random.default_rng(0)
    print("| case | config | e2e µs | GPU µs | host overhead µs | speedup vs jax.jit (e2e) | max rel err |")
    print("|---|---|---|---|---|---|---|")
    for name, fn, args in cases(rng):
        rows = measure(fn, args)
        results[name] = rows
        base = rows["jax.jit"][0]
        for cfg, vals in rows.items():
            e2e, gpu = vals[0], vals[1]
            err = f"{vals[2]:.1e}" if len(vals) > 2 else ""
            over = f"{e2e - gpu:.1f}" if gpu is not None else ""
            print(f"| {name} | {cfg} | {e2e:.1f} | {gpu:.1f} | {over} | {base / e2e:.2f}x | {err} |")
    if opts.json:
        with open(opts.json, "w") as fh:
            json.dump({"gpu": dev, "results": results}, fh, indent=1)


if __name__ == "__main__":
    main()

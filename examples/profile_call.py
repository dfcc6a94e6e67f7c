"""Where a nimble.jit call's host time goes (run on the GPU machine).

    PYTHONPATH=. python3 examples/profile_call.py
"""
from __future__ import annotations

import cProfile
import os
import pstats
import statistics
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "tests"))
import nimblejax as nimble  # noqa: E402
from models import branchy_args, branchy_mlp  # noqa: E402


def med_us(fn, n=500) -> float:
    for _ in range(10):
        fn()
    ts = []
    for _ in range(n):
        t0 = time.perf_counter()
        fn()
        ts.append(time.perf_counter() - t0)
    return statistics.median(ts) * 1e6


def main() -> None:
    import cupy

    args = branchy_args(np.random.default_rng(0), branches=8, layers=6, width=256, batch=1)
    f = nimble.jit(branchy_mlp, backend="cuda")
    jax.block_until_ready(f(*args))
    (exe,) = f.executables()
    leaves = jax.tree_util.tree_leaves(args)
    s0 = exe.streams[0]
    rows = {
        "whole call + block": lambda: jax.block_until_ready(f(*args)),
        "tree_flatten": lambda: jax.tree_util.tree_flatten((args, {})),
        "NimbleFunction._flatten": lambda: f._flatten(args, {}),
        "bind inputs (unchanged)": lambda: exe._bind_inputs(leaves),
        "graph.launch + sync": lambda: (exe.graph.launch(s0), s0.synchronize()),
        "outputs (alloc + copy) + sync": lambda: (exe._outputs(leaves), s0.synchronize()),
        "executable call": lambda: exe(leaves),
    }
    arr = cupy.ones(256, dtype=cupy.float32)
    rows["jnp.asarray(cupy)"] = lambda: jnp.asarray(arr)
    rows["jax.dlpack.from_dlpack(cupy)"] = lambda: jax.dlpack.from_dlpack(arr)
    rows["cupy.empty"] = lambda: cupy.empty(256, dtype=np.uint8)
    x = jnp.ones(256)
    rows["x.__dlpack__(stream)"] = lambda: x.__dlpack__(stream=s0.ptr)
    rows["copy_in one changed input"] = lambda: exe._bind_inputs(
        [jnp.asarray(l) if i == len(leaves) - 1 else l for i, l in enumerate(leaves)])
    for name, fn in rows.items():
        print(f"{name:36s} {med_us(fn):8.1f} µs")
    prof = cProfile.Profile()
    prof.enable()
    for _ in range(300):
        jax.block_until_ready(f(*args))
    prof.disable()
    pstats.Stats(prof).sort_stats("tottime").print_stats(14)
    print("input copies after all calls:", exe.stats["input_copies"], "calls:", exe.stats["calls"])


if __name__ == "__main__":
    main()

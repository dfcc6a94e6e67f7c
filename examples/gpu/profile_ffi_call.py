"""Where the looped time of a nimble call goes on the XLA FFI path: per-leaf host cost
against jax.jit (parameters resident: the same arrays every call, x fresh), the split of
one call into nimble's Python (the residency check) and the jitted call it makes (JAX's
dispatch, the custom call, the handler's copy kernels and graph launch), and the Python
frames a steady-state call runs.

    PYTHONPATH=. python3 examples/gpu/profile_ffi_call.py
"""
from __future__ import annotations

import sys

import jax
import jax.numpy as jnp
import numpy as np

import nimblejax as nimble
from nimblejax.bench.needs_gpu import require_gpu
from nimblejax.bench.timing import looped_us


def summed(params, x):
    return x + sum(jnp.sum(p) for p in params)


def frames_per_call(f, args, calls=10) -> dict:
    seen: dict = {}

    def profile(frame, event, arg):
        if event == "call":
            name = frame.f_code.co_filename.split("site-packages/")[-1]
            seen[name] = seen.get(name, 0) + 1

    jax.block_until_ready(f(*args))
    sys.setprofile(profile)
    try:
        for _ in range(calls):
            f(*args)
    finally:
        sys.setprofile(None)
    return {k: v / calls for k, v in sorted(seen.items(), key=lambda kv: -kv[1])[:6]}


def main() -> None:
    require_gpu(__file__)
    rng = np.random.default_rng(0)
    from nimblejax.bench.timing import nimble_gpu_us

    print("| leaves | jax.jit looped µs | nimble looped µs | of which the jitted call µs "
          "| so nimble's Python µs | nimble GPU µs (graph) |")
    print("|---|---|---|---|---|---|")
    for n in (0, 1, 8, 32, 96):
        params = [jnp.asarray(rng.standard_normal(64), jnp.float32) for _ in range(n)]
        xs = [(params, jnp.asarray(rng.standard_normal(64), jnp.float32)) for _ in range(16)]
        j = jax.jit(summed)
        f = nimble.jit(summed, backend="cuda")
        f(*xs[0]), f(*xs[1])  # the second call is the first with the parameters resident
        if f._resident is not None and f._entry != f._op_jit_fn:
            inner = f._resident.fn  # what a steady-state call runs after its residency check
            passed = [[jax.tree_util.tree_leaves(a)[i] for i in f._resident.passed] for a in xs]
        else:  # few leaves or nothing resident: f is its jitted operation (api.py)
            inner, passed = f._op_jit_fn, [list(a) for a in xs]
        lj, ln = looped_us(j, xs), looped_us(f, xs)
        li = looped_us(inner, [tuple(p) for p in passed])
        print(f"| {n} | {lj:.1f} | {ln:.1f} | {li:.1f} | {ln - li:.1f} | {nimble_gpu_us(f):.1f} |",
              flush=True)
    print("Python frames per steady-state call (nimble, 96 leaves):", frames_per_call(f, xs[0]))
    print("Python frames per steady-state call (jax.jit, 96 leaves):", frames_per_call(j, xs[0]))


if __name__ == "__main__":
    main()

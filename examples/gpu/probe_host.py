"""Host cost of the steady-state call's parts, per call, 97 leaves (96 held):
tree_flatten, ArrayImpl.is_deleted over the held leaves, the residency check with the
jitted call replaced, and the whole wrapper (run on the GPU machine: its host)."""
from __future__ import annotations

import time

import jax
import jax.numpy as jnp
import numpy as np

import nimblejax as nimble
from jax._src.array import ArrayImpl
from nimblejax.bench.needs_gpu import require_gpu


def per_call_us(fn, k=3000, rounds=5):
    out = []
    for _ in range(rounds):
        t = time.perf_counter()
        for i in range(k):
            fn(i)
        out.append((time.perf_counter() - t) / k * 1e6)
    return sorted(out)[rounds // 2]


def summed(params, x):
    return x + sum(jnp.sum(p) for p in params)


def main() -> None:
    require_gpu(__file__)
    rng = np.random.default_rng(0)
    params = [jnp.asarray(rng.standard_normal(64), jnp.float32) for _ in range(96)]
    xs = [(params, jnp.asarray(rng.standard_normal(64), jnp.float32)) for _ in range(16)]
    f = nimble.jit(summed)
    f(*xs[0]), f(*xs[1])
    rec = f._resident
    leaves = jax.tree_util.tree_leaves(xs[0])
    rows = {
        "empty Python call": per_call_us(lambda i: None),
        "tree_flatten((args, {}))": per_call_us(lambda i: jax.tree_util.tree_flatten((xs[i % 16], {}))),
        "is_deleted x96": per_call_us(lambda i: [p.is_deleted() for p in params]),
        "map(ArrayImpl.is_deleted) x96": per_call_us(lambda i: list(map(ArrayImpl.is_deleted, params))),
        "identity compare x97": per_call_us(lambda i: [a is b for a, b in zip(leaves, leaves)]),
    }
    if rec is not None:
        outs, fn = rec.outs, rec.fn
        rec.fn = lambda *a: outs
        try:
            rows["steady check alone (fn replaced)"] = per_call_us(
                lambda i: f._steady(jax.tree_util.tree_leaves(xs[i % 16]), rec))
            rows["whole wrapper (fn replaced)"] = per_call_us(lambda i: f(*xs[i % 16]))
        finally:
            rec.fn = fn
        passed = [[jax.tree_util.tree_leaves(a)[i] for i in rec.passed] for a in xs]
        rows["the jitted call alone"] = per_call_us(lambda i: fn(*passed[i % 16]), k=1000)
        inside = [0.0]

        def timed(*a):
            t = time.perf_counter()
            try:
                return fn(*a)
            finally:
                inside[0] += time.perf_counter() - t

        rec.fn = timed
        try:
            calls = 5 * 1000
            rows["nimble call, the jitted call timed inside it"] = per_call_us(lambda i: f(*xs[i % 16]), k=1000)
            rows["  of which inside the jitted call"] = inside[0] / calls * 1e6
        finally:
            rec.fn = fn
    rows["nimble call"] = per_call_us(lambda i: f(*xs[i % 16]), k=1000)
    j = jax.jit(summed)
    rows["jax.jit call"] = per_call_us(lambda i: j(*xs[i % 16]), k=1000)
    jax.block_until_ready(f(*xs[0]))
    for k, v in rows.items():
        print(f"| {k} | {v:.2f} |")


if __name__ == "__main__":
    main()

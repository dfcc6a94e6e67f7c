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
from nimblejax.bench.timing import looped_and_host_us, looped_us


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


def handler_counters(f) -> dict:
    """The FFI handler's counters (FfiRunner.stats) summed over f's arenas so far."""
    from nimblejax.runtime.ffi_runner import FfiRunner

    total: dict = {}
    for runner in f.runners():
        if isinstance(runner, FfiRunner):
            for ordinal in runner.exes:
                for k, v in runner.stats(ordinal).items():
                    total[k] = total.get(k, 0) + v
    return total


def per_call(before: dict, after: dict) -> dict:
    """Each counter's growth per handler call between two handler_counters readings."""
    calls = max(after.get("calls", 0) - before.get("calls", 0), 1)
    return {k: (v - before.get(k, 0)) / calls for k, v in after.items()}


def wrapper_alone_us(f, xs) -> float:
    """nimble's Python per steady-state call with the jitted call replaced by one that
    returns the last results: flatten, the residency check, unflatten."""
    record = f._resident
    if record is None or f._entry == f._op_jit_fn:
        return 0.0
    fn, outs = record.fn, record.outs
    record.fn = lambda *a: outs
    try:
        return looped_us(f, xs)
    finally:
        record.fn = fn


def main() -> None:
    require_gpu(__file__)
    rng = np.random.default_rng(0)
    from nimblejax.bench.timing import nimble_gpu_us

    print("| leaves | jax.jit looped µs | nimble looped µs | of which the jitted call µs "
          "| so nimble's Python µs | the wrapper alone µs | the FFI handler µs | nimble GPU µs (graph) |")
    print("|---|---|---|---|---|---|---|---|")
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
        lj, before = looped_us(j, xs), handler_counters(f)
        ln = looped_us(f, xs)
        after = handler_counters(f)
        li = looped_us(inner, [tuple(p) for p in passed])
        handler = per_call(before, after)["handler_ns"] / 1e3 if after else float("nan")
        print(f"| {n} | {lj:.1f} | {ln:.1f} | {li:.1f} | {ln - li:.1f} | {wrapper_alone_us(f, xs):.1f} "
              f"| {handler:.1f} | {nimble_gpu_us(f):.1f} |", flush=True)
    case_rows()
    print("Python frames per steady-state call (nimble, 96 leaves):", frames_per_call(f, xs[0]))
    print("Python frames per steady-state call (jax.jit, 96 leaves):", frames_per_call(j, xs[0]))


def case_rows() -> None:
    """The cases of benchmark_runtime.py but the leaf-reading ones (the table above):
    per call, looped and host-only time, the handler's host time, its copies and the
    kernel nodes it re-points."""
    import benchmark_runtime as br

    print("\n| case | jax.jit looped µs (host) | nimble looped µs (host) | nimble GPU µs (graph) "
          "| FFI handler µs | of which: "
          "setting nodes / copy launches / graph launch µs | copy kernels beside the graph "
          "| copies in the graph | nodes set | path |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    from nimblejax.bench.timing import nimble_gpu_us

    for name, fn, arg_sets, feed, donate in br.cases(np.random.default_rng(0)):
        if name.startswith("read"):
            continue
        j = jax.jit(fn, donate_argnums=donate)
        f = nimble.jit(fn, backend="cuda", donate_argnums=donate)
        lj, hj = looped_and_host_us(j, br._fresh_copies(arg_sets, donate), feed)
        looped_us(f, br._fresh_copies(arg_sets, donate), feed, calls=20, repeats=1)
        before = handler_counters(f)
        ln, hn = looped_and_host_us(f, br._fresh_copies(arg_sets, donate), feed)
        per = per_call(before, handler_counters(f))
        parts = " / ".join(f"{per[k] / 1e3:.1f}" for k in ("set_nodes_ns", "copy_launch_ns", "graph_launch_ns"))
        print(f"| {name} | {lj:.1f} ({hj:.1f}) | {ln:.1f} ({hn:.1f}) | {nimble_gpu_us(f):.1f} "
              f"| {per['handler_ns'] / 1e3:.1f} | {parts} | {per['copy_launches']:.1f} "
              f"| {per['graph_copies']:.1f} | {per['nodes_set'] + per['copy_node_sets']:.1f} | {f.call_path} |", flush=True)


if __name__ == "__main__":
    main()

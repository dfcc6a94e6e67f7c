"""Runtime benchmark as programs run it: nimble.jit against jax.jit in one process.

    PYTHONPATH=. python3 examples/gpu/benchmark_runtime.py [--json out.json] [--calls N]

Per case, three figures (median µs per call):
- looped: a fresh input each call (or the training state fed back), one block at the end;
- blocked: block_until_ready after every call, a fresh input each call;
- GPU: CUDA events around back-to-back launches of nimble's graph; for jax.jit, its
  looped time (its GPU time whenever dispatch keeps ahead of the GPU).
jax.jit is taken at its better setting (default or XLA's concurrent command buffers);
nimble through its default call path (a JAX operation: the XLA FFI handler) and, for
comparison, the Python call path.
"""
from __future__ import annotations

import argparse
import json
import statistics

import jax
import jax.numpy as jnp
import numpy as np


import nimblejax as nimble
from nimblejax.bench.needs_gpu import require_gpu
from tests.helpers.models import branchy_args, branchy_mlp
from nimblejax.bench.timing import blocked_us, concurrent_jax, looped_us, nimble_gpu_us

FRESH = 16  # distinct input arrays cycled through (no identity cache can help)
ROUNDS = 5  # alternating rounds of every configuration


def trivial(x):
    return x * 2.0 + 1.0


def mlp_loss(params, x, y):
    h = x
    for w, b in params[:-1]:
        h = jnp.tanh(h @ w + b)
    w, b = params[-1]
    return jnp.mean((h @ w + b - y) ** 2)


def sgd_step(params, x, y):
    loss, grads = jax.value_and_grad(mlp_loss)(params, x, y)
    return jax.tree_util.tree_map(lambda p, g: p - 0.01 * g, params, grads), loss


def leaves_step(params, x):
    """An update over many small parameter leaves, fed back (optimizer-like)."""
    new = [p * 0.999 + 0.001 * jnp.tanh(x[: p.shape[0]]) for p in params]
    return new, sum(jnp.sum(p) for p in new)


def read_leaves(xs):
    """Reads N arrays: the host cost per leaf of a call."""
    return sum(jnp.sum(x) for x in xs)


def rand(rng, *shape, scale=1.0):
    return jnp.asarray(rng.standard_normal(shape) * scale, jnp.float32)


def cases(rng):
    """(name, fn, arg sets, feed, donate_argnums)."""
    xs = [(rand(rng, 256),) for _ in range(FRESH)]
    yield "trivial (1 in, 1 out)", trivial, xs, None, ()
    for batch in (1, 32):
        params, _ = branchy_args(rng, branches=8, layers=6, width=256, batch=batch)
        sets = [(params, rand(rng, batch, 256)) for _ in range(FRESH)]
        yield f"branchy MLP 8x6x256, B={batch}", branchy_mlp, sets, None, ()
    widths = [784, 512, 512, 10]
    params = [(rand(rng, a, b, scale=a ** -0.5), rand(rng, b, scale=0.1)) for a, b in zip(widths, widths[1:])]
    data = [(rand(rng, 64, 784), rand(rng, 64, 10)) for _ in range(FRESH)]
    feed = _feed_state(data)
    yield "MLP SGD train loop, B=64, donated, params fed back", sgd_step, [(params,) + data[0]], feed, (0,)
    leaves = [rand(rng, 64) for _ in range(96)]
    inputs = [rand(rng, 64) for _ in range(FRESH)]
    yield "step over 96 parameter leaves, fed back", leaves_step, [(leaves, inputs[0])], \
        _feed_state([(x,) for x in inputs]), (0,)
    for n in (32, 200):
        same = [rand(rng, 256) for _ in range(n)]
        yield f"read {n} leaves, the same arrays every call", read_leaves, [(same,)] * FRESH, None, ()
        fresh = [([rand(rng, 256) for _ in range(n)],) for _ in range(FRESH)]
        yield f"read {n} leaves, fresh arrays every call", read_leaves, fresh, None, ()


def _feed_state(data):
    """The training loop: the step's new state and the next batch of data."""
    counter = iter(range(1 << 62))

    def feed(args, out):
        return (out[0],) + data[next(counter) % len(data)]

    return feed


def _fresh_copies(arg_sets, donate):
    """Donated arguments are consumed by each call: give every timed loop its own copy."""
    if not donate:
        return arg_sets
    return [tuple(jax.tree_util.tree_map(jnp.copy, a) if i in donate else a for i, a in enumerate(s))
            for s in arg_sets]


def measure(fn, arg_sets, feed, donate, calls: int) -> dict:
    want = jax.tree_util.tree_map(np.asarray, jax.jit(fn)(*_fresh_copies(arg_sets, donate)[0]))
    configs = {"jax.jit": jax.jit(fn, donate_argnums=donate)}
    conc = concurrent_jax(fn, _fresh_copies(arg_sets, donate)[0]) if not donate else None
    if conc is not None:
        configs["jax.jit concurrent"] = conc
    configs["nimble (XLA op)"] = nimble.jit(fn, backend="cuda", donate_argnums=donate)
    configs["nimble (Python path)"] = nimble.jit(fn, backend="cuda", donate_argnums=donate,
                                                 call_path="python")
    rows = {}
    for label, f in configs.items():
        got = jax.tree_util.tree_map(np.asarray, f(*_fresh_copies(arg_sets, donate)[0]))
        err = max(float(np.max(np.abs(g - w)) / (np.max(np.abs(w)) + 1e-30))
                  for g, w in zip(jax.tree_util.tree_leaves(got), jax.tree_util.tree_leaves(want)))
        rows[label] = dict(looped_rounds=[], blocked_rounds=[], max_rel_err=err,
                           path=getattr(f, "call_path", None))
    # The host is shared: the configurations alternate in rounds, medians of the rounds.
    for _ in range(ROUNDS):
        for label, f in configs.items():
            rows[label]["looped_rounds"].append(
                looped_us(f, _fresh_copies(arg_sets, donate), feed, calls=calls, repeats=1))
            if feed is None:
                rows[label]["blocked_rounds"].append(blocked_us(f, arg_sets, calls=calls // 2))
    for label, f in configs.items():
        r = rows[label]
        r["looped_us"] = statistics.median(r["looped_rounds"])
        r["blocked_us"] = statistics.median(r["blocked_rounds"]) if r["blocked_rounds"] else None
        r["gpu_us"] = nimble_gpu_us(f) if label.startswith("nimble") else r["looped_us"]
    best_looped = min(r["looped_us"] for k, r in rows.items() if k.startswith("jax"))
    blocked = [r["blocked_us"] for k, r in rows.items() if k.startswith("jax") and r["blocked_us"]]
    for r in rows.values():
        r["speedup_looped"] = best_looped / r["looped_us"]
        r["speedup_blocked"] = min(blocked) / r["blocked_us"] if blocked and r["blocked_us"] else None
    return rows


def _fmt(v, spec=".1f"):
    return "" if v is None else format(v, spec)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--json")
    ap.add_argument("--calls", type=int, default=200)
    opts = ap.parse_args()
    require_gpu(__file__)
    import cupy

    dev = cupy.cuda.runtime.getDeviceProperties(0)["name"].decode()
    print(f"GPU: {dev}; jax {jax.__version__}; cupy {cupy.__version__}")
    results = {}
    rng = np.random.default_rng(0)
    print("| case | config | looped µs | blocked µs | GPU µs | speedup looped | speedup blocked | max rel err |")
    print("|---|---|---|---|---|---|---|---|")
    for name, fn, arg_sets, feed, donate in cases(rng):
        rows = measure(fn, arg_sets, feed, donate, opts.calls)
        results[name] = rows
        for cfg, r in rows.items():
            print(f"| {name} | {cfg} | {_fmt(r['looped_us'])} | {_fmt(r['blocked_us'])} | "
                  f"{_fmt(r['gpu_us'])} | {_fmt(r['speedup_looped'], '.2f')}x | "
                  f"{_fmt(r['speedup_blocked'], '.2f')}{'x' if r['speedup_blocked'] else ''} | "
                  f"{r['max_rel_err']:.1e} |", flush=True)
    if opts.json:
        with open(opts.json, "w") as fh:
            json.dump({"gpu": dev, "jax": jax.__version__, "results": results}, fh, indent=1)


if __name__ == "__main__":
    main()

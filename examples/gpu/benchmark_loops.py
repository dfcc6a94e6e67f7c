"""Loops inside the graph (issue: loops): a run-time `while_loop` (Newton's iteration to
convergence), a long `lax.scan`, a `fori_loop` of SGD steps, flax's `nn.RNN` of an LSTM
cell and a diffrax Tsit5 solve (where flax and diffrax are installed), jax.jit against nimble
with loops="unroll" (what cannot be unrolled runs under XLA: co-execution) and with
loops="graph" (WHILE nodes, the default). Looped µs per
call (fresh input each call, one block at the end), rounds alternated in one process;
the first call's seconds (trace, plan, compile, capture).

    PYTHONPATH=. python3 examples/gpu/benchmark_loops.py [--json out.json] [--only NAME]
        [--no-host-callbacks]
"""
from __future__ import annotations

import argparse
import json
import statistics
import time

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

import nimblejax as nimble
from nimblejax.bench.needs_gpu import require_gpu
from nimblejax.bench.timing import looped_us

ROUNDS = 3
FRESH = 8


def newton(a):
    def body(c):
        x, _, k = c
        nx = 0.5 * (x + a / x)
        return nx, jnp.max(jnp.abs(nx - x)), k + 1
    x, _, k = lax.while_loop(lambda c: (c[1] > 1e-6) & (c[2] < 100), body,
                             (a, jnp.float32(jnp.inf), jnp.int32(0)))
    return x, k  # (the last step's size is rounding noise: not compared)


def rnn(params, xs):
    w, u = params

    def step(h, x):
        h = jnp.tanh(h @ w + x @ u)
        return h, h
    return lax.scan(step, jnp.zeros((1, w.shape[0]), xs.dtype), xs)[0]


def sgd_loop(params, x, y):
    def loss(p):
        h = jnp.tanh(x @ p[0])
        return jnp.mean((h @ p[1] - y) ** 2)

    def step(_, p):
        g = jax.grad(loss)(p)
        return jax.tree_util.tree_map(lambda a, b: a - 0.01 * b, p, g)
    return lax.fori_loop(0, 100, step, params)


def flax_lstm(features: int):
    """flax's `nn.RNN` over an `nn.LSTMCell` (a `lax.scan` inside flax), or None without flax."""
    try:
        import flax.linen as nn
    except ImportError:
        return None
    model = nn.RNN(nn.LSTMCell(features=features))
    return model, lambda variables, xs: model.apply(variables, xs)


def ode_solve():
    """diffrax's Tsit5 over 100 constant steps of y' = -k y + sin(y), 16 values (equinox's
    run-time checks as it ships them), or None without diffrax."""
    try:
        import diffrax
    except ImportError:
        return None

    def solve(y0, k):
        term = diffrax.ODETerm(lambda t, y, a: -a @ y + jnp.sin(y))
        return diffrax.diffeqsolve(term, diffrax.Tsit5(), t0=0.0, t1=1.0, dt0=0.01, y0=y0, args=k,
                                   max_steps=128).ys
    return solve


def cases(rng):
    r = lambda *s: jnp.asarray(rng.standard_normal(s), jnp.float32)  # noqa: E731
    yield "while: Newton on 256 values", newton, [(jnp.abs(r(256)) * 50 + 0.5,) for _ in range(FRESH)]
    params = (r(256, 256) * 0.06, r(256, 256) * 0.06)
    for t in (64, 1024):
        yield f"scan: RNN H=256 B=1 T={t}", rnn, [(params, r(t, 1, 256)) for _ in range(FRESH)]
    mlp = (r(64, 128) * 0.1, r(128, 10) * 0.1)
    yield "fori_loop: 100 SGD steps, MLP 64x128x10", sgd_loop, [(mlp, r(32, 64), r(32, 10))
                                                               for _ in range(FRESH)]
    made = flax_lstm(256)
    if made is not None:
        model, apply = made
        variables = model.init(jax.random.key(0), r(1, 64, 256))
        yield "flax nn.RNN(LSTMCell) H=256 B=1 T=64", apply, [(variables, r(1, 64, 256)) for _ in range(FRESH)]
    solve = ode_solve()
    if solve is not None:
        k = jnp.asarray(0.3 * rng.standard_normal((16, 16)) + np.eye(16), jnp.float32)
        yield "diffrax Tsit5, 100 constant steps, 16 values", solve, [(r(16), k) for _ in range(FRESH)]


def first_call_s(f, args) -> float:
    t0 = time.perf_counter()
    jax.block_until_ready(f(*args))
    return time.perf_counter() - t0


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--json")
    ap.add_argument("--only", default="", help="run the programs whose name holds this (any case)")
    ap.add_argument("--no-host-callbacks", action="store_true",
                    help="equinox's checks as EQX_ON_ERROR=nan makes them (a failed check gives "
                         "NaN, no host callback): nimble can plan a diffrax solve whole")
    opts = ap.parse_args()
    require_gpu(__file__)
    if opts.no_host_callbacks:
        import equinox._errors  # read by each check as it is traced

        equinox._errors.EQX_ON_ERROR = "nan"
        jax.clear_caches()  # equinox's helpers traced at import kept their callbacks
    results = {}
    print("| program | config | looped µs | speedup | first call s | max rel err |")
    print("|---|---|---|---|---|---|")
    for name, fn, sets in cases(np.random.default_rng(0)):
        if opts.only and opts.only.lower() not in name.lower():
            continue
        want = jax.tree_util.tree_leaves(jax.jit(fn)(*sets[0]))
        configs = {"jax.jit": jax.jit(fn), "nimble (loops=unroll)": nimble.jit(fn, loops="unroll"),
                   "nimble (loops=graph, the default)": nimble.jit(fn, loops="graph")}
        rows = {}
        for label, f in configs.items():
            try:
                first = first_call_s(f, sets[0])
                got = jax.tree_util.tree_leaves(f(*sets[0]))
                err = max(float(np.max(np.abs(np.asarray(g, np.float64) - np.asarray(w, np.float64)))
                                / (np.max(np.abs(np.asarray(w, np.float64))) + 1e-30))
                          for g, w in zip(got, want))
                rows[label] = dict(first_call_s=first, max_rel_err=err, rounds=[])
            except Exception as exc:  # noqa: BLE001 (a row that cannot run says why)
                rows[label] = dict(error=f"{type(exc).__name__}: {str(exc)[:200]}")
        for _ in range(ROUNDS):
            for label, f in configs.items():
                if "error" not in rows[label]:
                    rows[label]["rounds"].append(looped_us(f, sets, calls=50, repeats=1))
        base = min(r_["rounds"] and statistics.median(r_["rounds"]) or float("inf")
                   for k, r_ in rows.items() if k.startswith("jax"))
        for label, r_ in rows.items():
            if "error" in r_:
                print(f"| {name} | {label} | {r_['error']} | | | |", flush=True)
                continue
            r_["looped_us"] = statistics.median(r_["rounds"])
            r_["speedup_looped"] = base / r_["looped_us"]
            print(f"| {name} | {label} | {r_['looped_us']:.1f} | {r_['speedup_looped']:.2f}x | "
                  f"{r_['first_call_s']:.2f} | {r_['max_rel_err']:.1e} |", flush=True)
        results[name] = rows
    if opts.json:
        dev = jax.devices()[0].device_kind
        with open(opts.json, "w") as fh:
            json.dump({"gpu": dev, "jax": jax.__version__, "results": results}, fh, indent=1)


if __name__ == "__main__":
    main()

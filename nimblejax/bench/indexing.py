"""Embedding lookup (gather) and its backward (scatter-add): nimble.jit against jax.jit.

    PYTHONPATH=. python3 -m nimblejax.bench.indexing [--vocab 32000] [--dim 512]
        [--tokens 4096] [--dtypes f32,bf16] [--out indexing.json]

Cases, per dtype: `lookup` (table[ids]), `lookup+scale` (table[ids] * 2, the gather fused
with its consumer), `backward` (zeros_like(table).at[ids].add(g), the gradient of a
lookup). For each: looped µs/call (a fresh ids/g array each call, one block at the end),
blocked µs/call (block after every call), and GPU µs (CUDA events around nimble's graph;
jax.jit back to back as its stand-in), with the bytes each case must move and the
bandwidth that gives. Without a GPU it prints the nimble plans only.
"""
from __future__ import annotations

import argparse
import json
import platform
import time
from typing import Callable, Optional, Sequence

import jax
import jax.numpy as jnp
import numpy as np

import nimblejax as nimble
from nimblejax.bench.cli import gpu_available
from nimblejax.bench.results import gpu_name
from nimblejax.bench.timing import blocked_us, looped_us, nimble_gpu_us, throughput_us
from nimblejax.compiler.kinds import TaskKind

DTYPES = {"f32": jnp.float32, "bf16": jnp.bfloat16, "f16": jnp.float16}
ARG_SETS = 8  # distinct argument objects cycled through by the looped and blocked loops


def cases(vocab: int, dim: int, tokens: int, dtype) -> dict[str, tuple[Callable, Callable, int]]:
    """name → (function, make_args(rng) -> the varying args, bytes it must move)."""
    item = np.dtype(dtype).itemsize
    table = jnp.asarray(np.random.default_rng(0).normal(size=(vocab, dim)), dtype)
    row_bytes = tokens * dim * item

    def ids(r):
        return jnp.asarray(r.integers(0, vocab, tokens), jnp.int32)

    def grads(r):
        return (ids(r), jnp.asarray(r.normal(size=(tokens, dim)), dtype))

    lookup = lambda i: table[i]  # noqa: E731
    scaled = lambda i: table[i] * 2  # noqa: E731
    backward = lambda i, g: jnp.zeros((vocab, dim), dtype).at[i].add(g)  # noqa: E731
    # Moved bytes: rows read + rows written; the backward also writes the whole table.
    return {"lookup": (lookup, lambda r: (ids(r),), 2 * row_bytes),
            "lookup+scale": (scaled, lambda r: (ids(r),), 2 * row_bytes),
            "backward": (backward, grads, 2 * row_bytes + vocab * dim * item)}


def time_case(fn: Callable, make: Callable, rng, rounds: int = 5) -> dict:
    """jax.jit and nimble alternated in `rounds` rounds in this process (the host is
    shared: a row can move by ±40% between runs); medians of the rounds."""
    arg_sets = [make(rng) for _ in range(ARG_SETS)]
    fns = {"jax": jax.jit(fn), "nimble": nimble.jit(fn)}
    for f in fns.values():
        jax.block_until_ready(f(*arg_sets[0]))
    seen: dict = {}
    for _ in range(rounds):
        for name, f in fns.items():
            seen.setdefault(f"{name}_looped_us", []).append(looped_us(f, arg_sets, calls=100, repeats=1))
            seen.setdefault(f"{name}_blocked_us", []).append(blocked_us(f, arg_sets, calls=50))
    row = {k: float(np.median(v)) for k, v in seen.items()}
    row["jax_gpu_us"] = throughput_us(fns["jax"], arg_sets[0])
    row["nimble_gpu_us"] = nimble_gpu_us(fns["nimble"])
    want, got = fns["jax"](*arg_sets[1]), fns["nimble"](*arg_sets[1])
    diff = np.abs(np.asarray(got, np.float32) - np.asarray(want, np.float32))
    row["max_abs_err"] = float(diff.max())
    return row


def plan_case(fn: Callable, make: Callable, rng) -> dict:
    plan = nimble.jit(fn, backend="interpret").plan(*make(rng))
    kernels = [t for t in plan.tasks if t.kind is TaskKind.KERNEL]
    return {"tasks": len(plan.tasks), "kernels": [t.kernel.name for t in kernels],
            "launches": sum(len(t.kernel.launches) for t in kernels)}


def run(opts: argparse.Namespace) -> dict:
    gpu = gpu_available()
    rows = []
    for key in opts.dtypes:
        for name, (fn, make, nbytes) in cases(opts.vocab, opts.dim, opts.tokens, DTYPES[key]).items():
            rng = np.random.default_rng(1)
            row = {"case": name, "dtype": key, "bytes": nbytes}
            row.update(time_case(fn, make, rng) if gpu else plan_case(fn, make, rng))
            if gpu and row.get("nimble_gpu_us"):
                row["nimble_gb_per_s"] = nbytes / row["nimble_gpu_us"] / 1e3
            rows.append(row)
    meta = {"gpu": gpu_name() if gpu else None, "jax": jax.__version__,
            "python": platform.python_version(), "vocab": opts.vocab, "dim": opts.dim,
            "tokens": opts.tokens, "time": time.strftime("%Y-%m-%d %H:%M:%S")}
    return {"meta": meta, "rows": rows}


def print_table(results: dict) -> None:
    rows = results["rows"]
    if rows and "jax_looped_us" not in rows[0]:
        print("No CUDA GPU is visible: nimble's plans only (nothing is timed).")
        for r in rows:
            print(f"{r['case']:13s} {r['dtype']:5s} {r['launches']} launches  {' '.join(r['kernels'])}")
        return
    print(f"{results['meta']['gpu']}: vocab {results['meta']['vocab']} x dim "
          f"{results['meta']['dim']}, {results['meta']['tokens']} tokens (µs per call)")
    head = ("case", "dtype", "jax loop", "nimble loop", "jax block", "nimble block",
            "jax gpu", "nimble gpu", "GB/s", "max err")
    print(" ".join(f"{h:>12s}" for h in head))
    for r in rows:
        vals = [r["case"], r["dtype"]] + [_fmt(r.get(k)) for k in (
            "jax_looped_us", "nimble_looped_us", "jax_blocked_us", "nimble_blocked_us",
            "jax_gpu_us", "nimble_gpu_us", "nimble_gb_per_s")] + [f"{r['max_abs_err']:.2g}"]
        print(" ".join(f"{v:>12s}" for v in vals))


def _fmt(v: Optional[float]) -> str:
    return "-" if v is None else f"{v:.1f}"


def parse_args(argv: Optional[Sequence[str]]) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--vocab", type=int, default=32000)
    p.add_argument("--dim", type=int, default=512)
    p.add_argument("--tokens", type=int, default=4096)
    p.add_argument("--dtypes", default="f32,bf16", help=f"comma-separated: {','.join(DTYPES)}")
    p.add_argument("--out", help="write the results as JSON to this path")
    opts = p.parse_args(argv)
    opts.dtypes = [d.strip() for d in opts.dtypes.split(",") if d.strip()]
    unknown = [d for d in opts.dtypes if d not in DTYPES]
    if unknown:
        p.error(f"unknown dtypes {unknown}; known: {sorted(DTYPES)}")
    return opts


def main(argv: Optional[Sequence[str]] = None) -> int:
    opts = parse_args(argv)
    results = run(opts)
    print_table(results)
    if opts.out:
        with open(opts.out, "w") as f:
            json.dump(results, f, indent=2)
        print(f"wrote {opts.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

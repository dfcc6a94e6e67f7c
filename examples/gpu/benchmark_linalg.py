"""Small dense linear algebra (issue 33): nimble's generated kernels
(compiler/lowering/rules_linalg.py) against the same nimble function with its Cholesky,
LU and triangular solves left to XLA's cuSOLVER/cuBLAS calls through co-execution, and
against jax.jit. Looped µs per call (a fresh input each call, one block at the end),
rounds alternated in one process, medians.

    PYTHONPATH=. python3 examples/gpu/benchmark_linalg.py [--json out.json]

`--backend interpret` runs the same rows on the CPU interpreter (a check of the script,
not a timing).
"""
from __future__ import annotations

import argparse
import contextlib
import json
import statistics
import warnings
from typing import Callable, Iterator

import jax
import jax.numpy as jnp
import numpy as np

import nimblejax as nimble
from nimblejax.bench.needs_gpu import require_gpu
from nimblejax.bench.timing import looped_us
from nimblejax.compiler.lowering import rules_linalg

ROUNDS = 5
FRESH = 4


def spd(r: np.random.Generator, *shape: int) -> np.ndarray:
    x = r.standard_normal(shape).astype(np.float32)
    return x @ np.swapaxes(x, -1, -2) + shape[-1] * np.eye(shape[-1], dtype=np.float32)


def mvn_value_and_grad(s, x):
    """A multivariate normal's log density of a batch of points and its gradient."""
    logpdf = lambda s, x: jax.scipy.stats.multivariate_normal.logpdf(x, jnp.zeros(x.shape[-1]), s).sum()  # noqa: E731
    return jax.value_and_grad(logpdf, argnums=(0, 1))(s, x)


def cases() -> Iterator[tuple[str, Callable, Callable]]:
    """name, function, argument maker (from a Generator)."""
    yield "cholesky, 256 matrices 16×16", jnp.linalg.cholesky, lambda r: (spd(r, 256, 16, 16),)
    yield "cholesky, one 32×32", jnp.linalg.cholesky, lambda r: (spd(r, 32, 32),)
    yield "cholesky, one 64×64 (above MAX_DIM: XLA's)", jnp.linalg.cholesky, lambda r: (spd(r, 64, 64),)
    yield ("multivariate normal log density + gradient, 16-dim, 256 points", mvn_value_and_grad,
           lambda r: (spd(r, 16, 16), r.standard_normal((256, 16)).astype(np.float32)))
    yield ("jnp.linalg.solve 32×32, 8 right-hand sides", jnp.linalg.solve,
           lambda r: (r.standard_normal((32, 32)).astype(np.float32), r.standard_normal((32, 8)).astype(np.float32)))
    yield ("cho_solve 32×32 (factor + two triangular solves)",
           lambda a, b: jax.scipy.linalg.cho_solve(jax.scipy.linalg.cho_factor(a), b),
           lambda r: (spd(r, 32, 32), r.standard_normal(32).astype(np.float32)))


@contextlib.contextmanager
def linalg_left_to_xla():
    """Plans built inside take no matrix into nimble's kernels: co-execution runs them
    under XLA (cuSOLVER / cuBLAS), around nimble's regions."""
    saved, rules_linalg.MAX_DIM = rules_linalg.MAX_DIM, 0
    try:
        yield
    finally:
        rules_linalg.MAX_DIM = saved


def max_rel_err(got, want) -> float:
    return max(float(np.max(np.abs(np.asarray(g, np.float64) - np.asarray(w, np.float64)))
                     / (np.max(np.abs(np.asarray(w, np.float64))) + 1e-30))
               for g, w in zip(jax.tree_util.tree_leaves(got), jax.tree_util.tree_leaves(want)))


def run_case(fn: Callable, make: Callable, backend) -> dict:
    sets = [tuple(jnp.asarray(a) for a in make(np.random.default_rng(s))) for s in range(FRESH)]
    configs = {"jax.jit": jax.jit(fn), "nimble kernels": nimble.jit(fn, backend=backend)}
    want = jax.block_until_ready(configs["jax.jit"](*sets[0]))
    row = {"max_rel_err": max_rel_err(configs["nimble kernels"](*sets[0]), want)}
    with linalg_left_to_xla():  # the plan is built at the first call
        configs["nimble, linalg to XLA"] = nimble.jit(fn, backend=backend)
        row["max_rel_err_xla"] = max_rel_err(configs["nimble, linalg to XLA"](*sets[0]), want)
    kernels = configs["nimble kernels"]
    row["tasks"] = ("co-executed" if kernels.partition(*sets[0]).xla_steps()
                    else len(kernels.plan(*sets[0]).tasks))
    times: dict = {k: [] for k in configs}
    for r in range(ROUNDS):
        for k in (list(configs) if r % 2 == 0 else list(configs)[::-1]):
            times[k].append(looped_us(configs[k], sets, calls=100, repeats=1))
    row.update({k: statistics.median(v) for k, v in times.items()})
    return row


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--json")
    ap.add_argument("--backend", default=None, help="interpret: the CPU interpreter")
    opts = ap.parse_args()
    if opts.backend != "interpret":
        require_gpu(__file__)
    warnings.filterwarnings("ignore", message="nimblejax: .* nimble region")
    print("| program | jax.jit µs | nimble, kernels µs | nimble, linalg to XLA µs | kernels / jax.jit | "
          "kernels / to XLA | tasks | max rel err |")
    print("|---|---|---|---|---|---|---|---|")
    results = {}
    for name, fn, make in cases():
        row = run_case(fn, make, opts.backend)
        results[name] = row
        jx, nb, xl = row["jax.jit"], row["nimble kernels"], row["nimble, linalg to XLA"]
        print(f"| {name} | {jx:.1f} | {nb:.1f} | {xl:.1f} | {jx / nb:.2f}x | {xl / nb:.2f}x | "
              f"{row['tasks']} | {row['max_rel_err']:.1e} |", flush=True)
    if opts.json:
        with open(opts.json, "w") as fh:
            json.dump({"device": jax.devices()[0].device_kind, "jax": jax.__version__,
                       "results": results}, fh, indent=1)


if __name__ == "__main__":
    main()

"""The library programs of tests/end_to_end/test_lib_*.py (issue 33), timed as programs
run them: jax.jit against nimble.jit in one process, looped (a fresh input each call,
or a training state fed back; one block at the end), rounds alternated. ODE solves,
root finds and samplers are small-kernel programs with run-time loops: co-execution runs
those loops under XLA around nimble regions, unless equinox's checks make no host
callback (EQX_ON_ERROR=nan, set before the run), when the whole program is one plan.

    PYTHONPATH=. python3 examples/gpu/benchmark_libraries.py [--json out.json] [--only NAME]
    EQX_ON_ERROR=nan PYTHONPATH=. python3 examples/gpu/benchmark_libraries.py

`--backend interpret` runs the same rows on the CPU interpreter (a check of the script,
not a timing).
"""
from __future__ import annotations

import argparse
import importlib
import json
import os
import statistics
import time
import warnings
from typing import Callable, Iterator, Optional

import jax
import numpy as np

import nimblejax as nimble
from nimblejax.bench.needs_gpu import require_gpu
from nimblejax.bench.timing import looped_us

ROUNDS = 3
FRESH = 4  # distinct input sets cycled through


def library(name: str):
    """The test module of one library, or None where the library is not installed (its
    pytest.importorskip raises pytest's Skipped, a BaseException)."""
    try:
        return importlib.import_module(f"tests.end_to_end.test_lib_{name}")
    except BaseException as exc:  # noqa: BLE001
        if type(exc).__name__ == "Skipped" or isinstance(exc, ImportError):
            print(f"(skipped: {name}: {exc})")
            return None
        raise


Case = tuple[str, Callable, list, Optional[Callable]]  # name, fn, arg sets, feed


def fresh(make: Callable[[int], tuple]) -> list:
    return [make(seed) for seed in range(FRESH)]


def cases() -> Iterator[Case]:
    if (m := library("equinox")) is not None:
        for name in sorted(m.PROGRAMS):
            fn = m.PROGRAMS[name]
            sets = []
            for seed in range(FRESH):
                f, params, inputs = fn(np.random.default_rng(seed))
                sets.append((params, *inputs))
            feed = (lambda a, out: (out[0], out[1], *a[2:])) if name == "train_step" else None
            yield f"equinox {name}", f, sets, feed
    if (m := library("diffrax")) is not None:
        yield "diffrax Tsit5 constant step", m.tsit5, fresh(m.ode_args), None
        yield "diffrax Tsit5 PID controller", m.tsit5_pid, fresh(m.ode_args), None
    if (m := library("numpyro")) is not None:
        yield "numpyro eight schools potential", m.potential, fresh(m.schools), None
        yield "numpyro eight schools gradient", jax.grad(m.potential), fresh(m.schools), None
        yield "numpyro log_prob x6", m.log_probs, fresh(m.log_prob_args), None
        yield "numpyro Gamma/Beta/Dirichlet samples", m.samples, \
            [(jax.random.PRNGKey(s), *m.sampler_args(s)) for s in range(FRESH)], None
    if (m := library("lineax")) is not None:
        for name in sorted(m.PROGRAMS):
            yield f"lineax {name}", m.PROGRAMS[name], fresh(m.system), None
    if (m := library("optimistix")) is not None:
        yield "optimistix Newton", m.newton_root, fresh(m.vectors), None
        yield "optimistix BFGS", m.bfgs_minimise, fresh(m.vectors), None


def first_call_s(f: Callable, args: tuple) -> float:
    t0 = time.perf_counter()
    jax.block_until_ready(f(*args))
    return time.perf_counter() - t0


def max_rel_err(got, want) -> float:
    errs = [float(np.max(np.abs(np.asarray(g, np.float64) - np.asarray(w, np.float64)), initial=0.0)
                  / (np.max(np.abs(np.asarray(w, np.float64)), initial=0.0) + 1e-30))
            for g, w in zip(jax.tree_util.tree_leaves(got), jax.tree_util.tree_leaves(want))]
    return max(errs, default=0.0)


def where(f: Callable, args: tuple) -> str:
    """What ran where: one plan, or co-execution's regions and XLA equations."""
    report = nimble.explain(f, *args)
    if hasattr(report, "regions"):
        return f"{len(report.regions)} regions, {len(report.xla)} XLA eqns"
    return f"one plan, {report.num_tasks} tasks"


def run_case(name: str, fn: Callable, sets: list, feed, backend: Optional[str]) -> dict:
    configs = {"jax.jit": jax.jit(fn), "nimble": nimble.jit(fn, backend=backend)}
    rows: dict = {}
    want = None
    for label, f in configs.items():  # jax.jit first: its output is the reference
        try:
            first = first_call_s(f, sets[0])
            got = f(*sets[0])
            want = got if want is None else want
            rows[label] = dict(first_call_s=first, max_rel_err=max_rel_err(got, want), rounds=[])
        except Exception as exc:  # noqa: BLE001 (a row that cannot run says why)
            rows[label] = dict(error=f"{type(exc).__name__}: {str(exc)[:200]}")
    if "error" not in rows["nimble"]:
        rows["nimble"]["where"] = where(configs["nimble"], sets[0])
    for _ in range(ROUNDS):
        for label, f in configs.items():
            if "error" not in rows[label]:
                rows[label]["rounds"].append(looped_us(f, sets, feed=feed, calls=50, repeats=1))
    return rows


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--json")
    ap.add_argument("--only", default="")
    ap.add_argument("--backend", default=None, help="interpret: the CPU interpreter")
    opts = ap.parse_args()
    if opts.backend != "interpret":
        require_gpu(__file__)
    # Co-execution's warning (what went to XLA) once per program: the table says it.
    warnings.filterwarnings("ignore", message="nimblejax: .* nimble region")
    print(f"EQX_ON_ERROR={os.environ.get('EQX_ON_ERROR', 'raise')}")
    print("| program | jax.jit µs | nimble µs | speedup | nimble ran as | first call s (jax / nimble) | max rel err |")
    print("|---|---|---|---|---|---|---|")
    results = {}
    for name, fn, sets, feed in cases():
        if opts.only and opts.only not in name:
            continue
        rows = run_case(name, fn, sets, feed, opts.backend)
        results[name] = rows
        if any("error" in r for r in rows.values()):
            print(f"| {name} | " + " | ".join(r.get("error", "") for r in rows.values()) + " | | | | |")
            continue
        jx, nb = (statistics.median(rows[k]["rounds"]) for k in ("jax.jit", "nimble"))
        rows["jax.jit"]["looped_us"], rows["nimble"]["looped_us"] = jx, nb
        print(f"| {name} | {jx:.1f} | {nb:.1f} | {jx / nb:.2f}x | {rows['nimble']['where']} | "
              f"{rows['jax.jit']['first_call_s']:.2f} / {rows['nimble']['first_call_s']:.2f} | "
              f"{rows['nimble']['max_rel_err']:.1e} |", flush=True)
    if opts.json:
        with open(opts.json, "w") as fh:
            json.dump({"device": jax.devices()[0].device_kind, "jax": jax.__version__,
                       "eqx_on_error": os.environ.get("EQX_ON_ERROR", "raise"),
                       "results": results}, fh, indent=1)


if __name__ == "__main__":
    main()

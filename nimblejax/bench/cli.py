"""`python -m nimblejax.bench` / `nimblejax-bench`: nimble.jit against jax.jit on the
benchmark models (see BENCHMARKS_HOWTO.md).

With a GPU: each model × batch × configuration is timed (looped and GPU time; with
--full also end to end), checked against jax.jit, and described by its plan. Every row
is printed (and flushed) as soon as it is measured, progress and an ETA go to stderr,
and the run ends with the geometric-mean speedups. Without a GPU: one line saying so,
then nimble's plan for every model from abstract arguments (nothing is materialized).

This module reads the arguments and picks the run; plans.py makes the plan-only run,
measure.py the timed one, results.py and report.py record and print what they find,
progress.py keeps the ETA.
"""
from __future__ import annotations

import argparse
import sys
from typing import Optional, Sequence

import jax.numpy as jnp
import numpy as np

from nimblejax.bench.configs import (ALIASES, CONFIGS, DEFAULT_BUDGET_S, DTYPES, FULL_REPEAT, LOOPS,
                                     QUICK_CONFIGS)
from nimblejax.bench.measure import run_gpu
from nimblejax.bench.plans import run_plans


def parse_args(argv: Optional[Sequence[str]] = None) -> argparse.Namespace:
    from nimblejax.bench.models import MODELS, SUITE

    ap = argparse.ArgumentParser(
        prog="nimblejax-bench",
        description="Benchmark nimble.jit against jax.jit on published models. By default: "
                    "jax.jit against nimble's multi-stream graph, looped and GPU time, "
                    f"about {DEFAULT_BUDGET_S:g} s of timed calls per row. Every model at batch 1 "
                    "and 32 took 4m32s on a fresh H200 (commit a4be0bd), 202 s of it jax.jit's "
                    "first calls (XLA compiling its programs), which later runs load from JAX's "
                    "persistent compilation cache (the second run: 2m04s). "
                    "Rows are printed as they are measured; progress and an ETA go to stderr. "
                    "--full is the long run. Without a GPU: nimble's plan of each model, what its "
                    "columns mean and what to try next; nothing is timed.")
    ap.add_argument("--models", default="all",
                    help=f"comma list of models, or 'all' (default: the suite, {', '.join(SUITE)}); "
                         f"also {', '.join(m for m in MODELS if m not in SUITE)}")
    ap.add_argument("--batch", default="1,32", help="comma list of batch sizes (default 1,32)")
    ap.add_argument("--full", action="store_true",
                    help="the long run: every configuration, --repeat 200 calls per measurement, "
                         "end-to-end (blocked) time beside looped and GPU time, cold and warm "
                         "compile times")
    ap.add_argument("--repeat", type=int, default=None,
                    help=f"timed calls per loop of a measurement (median of {LOOPS} loops); "
                         f"default: what --budget allows (at most {FULL_REPEAT}), "
                         f"{FULL_REPEAT} with --full")
    ap.add_argument("--budget", type=float, default=DEFAULT_BUDGET_S, metavar="SECONDS",
                    help="seconds of timed calls per row when --repeat is not given "
                         f"(default {DEFAULT_BUDGET_S:g})")
    ap.add_argument("--configs", default=None,
                    help=f"comma list of configurations, or 'all': {', '.join(CONFIGS)} "
                         f"(default: {','.join(QUICK_CONFIGS)}; all with --full)")
    ap.add_argument("--dtype", default="float32",
                    help=f"parameter and input dtype: {', '.join(DTYPES)} (default float32)")
    ap.add_argument("--tiny", action="store_true", help="the tiny test configurations (smoke tests)")
    ap.add_argument("--json", metavar="OUT", help="write every result to this JSON file")
    ap.add_argument("--plot", metavar="OUT.png",
                    help="bar charts of the looped and GPU-time speedups (needs matplotlib)")
    ap.add_argument("--timeline", metavar="OUT.png",
                    help="draw each plan's streams over time (one file per model and batch: "
                         "OUT_<model>_b<batch>.png when there are several); from measured "
                         "per-task GPU times, or estimated ones without a GPU (needs matplotlib)")
    ap.add_argument("--no-cold", dest="cold", action="store_false", default=None,
                    help="with --full: do not empty the kernel caches before the cold compile "
                         "timing (the default run never empties them)")
    ap.add_argument("--no-jax-cache", dest="jax_cache", action="store_false",
                    help="the default run keeps jax.jit's compiled executables in JAX's "
                         "persistent compilation cache (under nimblejax's cache directory, "
                         "unless jax_compilation_cache_dir is set already), so that later runs "
                         "load them instead of compiling again; this turns that off (--full "
                         "never uses it: it times cold compiles)")
    ap.add_argument("--compile-ahead", type=int, default=0, metavar="N",
                    help="compile jax.jit's programs ahead on N threads while the run works "
                         "(bench/ahead.py; default 0: each program compiles at its model's "
                         "first call). Measured on a fresh H100 (b53a0a8): with 4 threads the "
                         "first two rows took 5 minutes, each waiting for autotuning compiles "
                         "running side by side on the GPU")
    ap.add_argument("--seed", type=int, default=0, help="numpy seed of the random weights")
    # For tests of the timing path on a CPU: nimble's backend for the nimble rows.
    ap.add_argument("--nimble-backend", default="cuda", choices=("cuda", "interpret"),
                    help=argparse.SUPPRESS)
    opts = ap.parse_args(argv)
    opts.model_names = _pick(opts.models, list(MODELS), "model", {}, everything=list(SUITE))
    configs = opts.configs or ("all" if opts.full else ",".join(QUICK_CONFIGS))
    picked = _pick(configs, list(CONFIGS), "configuration", ALIASES)
    # jax.jit first: every nimble row's speedups are known when it is printed.
    opts.config_keys = [k for k in CONFIGS if k in picked]
    opts.cold = bool(opts.full and opts.cold is not False)
    try:
        opts.batches = [int(b) for b in opts.batch.split(",") if b.strip()]
    except ValueError:
        ap.error(f"--batch wants a comma list of integers, got {opts.batch!r}")
    if not opts.batches or min(opts.batches) < 1:
        ap.error("--batch wants positive batch sizes")
    if opts.repeat is not None and opts.repeat < 1:
        ap.error("--repeat must be at least 1")
    if opts.repeat is None and opts.full:
        opts.repeat = FULL_REPEAT
    if not opts.budget > 0:
        ap.error("--budget must be a positive number of seconds")
    try:
        opts.dtype = bench_dtype(opts.dtype)
    except ValueError as e:
        ap.error(str(e))
    return opts


def bench_dtype(text: str) -> np.dtype:
    """The dtype named by --dtype, or ValueError with a one-line reason."""
    choices = ", ".join(DTYPES)
    try:
        dtype = jnp.dtype(text.strip())
    except TypeError:
        raise ValueError(f"--dtype {text!r} is not a dtype; choose from {choices}") from None
    if dtype.itemsize == 8 or dtype.kind == "c":
        raise ValueError(f"--dtype {text}: nimble has no 64-bit or complex types (and running it "
                         f"as float32 would mislabel the results); choose from {choices}")
    if dtype.name not in DTYPES:
        raise ValueError(f"--dtype {text}: the benchmark models are floating-point networks; "
                         f"choose from {choices}")
    return dtype


def _pick(text: str, known: list, what: str, aliases: dict, everything: list | None = None) -> list:
    if text.strip().lower() == "all":
        return list(known if everything is None else everything)
    out = []
    for name in (n.strip() for n in text.split(",")):
        if not name:
            continue
        name = aliases.get(name, name)
        if name not in known:
            raise SystemExit(f"nimblejax-bench: unknown {what} {name!r}; choose from {', '.join(known)}")
        if name not in out:
            out.append(name)
    return out


def gpu_available() -> bool:
    from nimblejax import api

    return api.gpu_available()


def main(argv: Optional[Sequence[str]] = None) -> int:
    opts = parse_args(argv)
    from nimblejax.bench import report

    out = sys.stdout
    if gpu_available():
        results = run_gpu(opts, out)
    else:
        report.say("No CUDA GPU is visible, so nothing is timed: below is the plan nimble.jit "
                   "makes for each model (planning only, nothing runs).", out)
        results = run_plans(opts, out)
    if opts.json:
        report.write_json(results, opts.json)
        report.say(f"wrote {opts.json}", out)
    if opts.plot:
        why = report.plot_speedups(results, opts.plot)
        report.say(why if why else f"wrote {opts.plot}", out)
    return 0


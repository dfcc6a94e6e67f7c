"""`python -m nimblejax.bench` / `nimblejax-bench`: nimble.jit against jax.jit on the
benchmark models (see BENCHMARKS_HOWTO.md).

With a GPU: every model × batch × configuration is timed (end-to-end and GPU time),
checked against jax.jit, and described by its plan. Without one: one line saying so,
then nimble's plan for every model from abstract arguments (nothing is materialized).
"""
from __future__ import annotations

import argparse
import gc
import os
import platform
import shutil
import sys
import tempfile
import time
import traceback
from typing import Any, Callable, Optional, Sequence

import jax
import jax.numpy as jnp
import numpy as np

# Configurations, in the order they run: key → label.
CONFIGS = {
    "jax": "jax.jit",
    "jax-concurrent": "jax.jit concurrent",
    "nimble-eager": "nimble eager",
    "nimble-1-stream": "nimble 1-stream",
    "nimble": "nimble multi-stream",
}
ALIASES = {"jax.jit": "jax", "concurrent": "jax-concurrent", "jax.jit-concurrent": "jax-concurrent",
           "eager": "nimble-eager", "1-stream": "nimble-1-stream", "1stream": "nimble-1-stream",
           "nimble-1stream": "nimble-1-stream", "multi-stream": "nimble",
           "nimble-multi-stream": "nimble"}
NIMBLE_OPTIONS = {"nimble-eager": dict(eager=True), "nimble-1-stream": dict(max_streams=1),
                  "nimble": dict()}
JAX_CONFIGS = ("jax", "jax-concurrent")
# Dtypes the benchmark models run in: nimble's floating types. nimble has no 64-bit
# types, and without jax_enable_x64 JAX would quietly build float64 arrays as float32,
# so float64 is refused rather than mislabelled; the models are floating-point networks,
# so integer types (which nimble supports) are refused too.
DTYPES = ("float32", "bfloat16", "float16")


def parse_args(argv: Optional[Sequence[str]] = None) -> argparse.Namespace:
    from nimblejax.bench.models import MODELS

    ap = argparse.ArgumentParser(
        prog="nimblejax-bench",
        description="Benchmark nimble.jit against jax.jit on published models.")
    ap.add_argument("--models", default="all",
                    help=f"comma list of models, or 'all' (default): {', '.join(MODELS)}")
    ap.add_argument("--batch", default="1,32", help="comma list of batch sizes (default 1,32)")
    ap.add_argument("--repeat", type=int, default=200, help="timed calls per measurement (default 200)")
    ap.add_argument("--configs", default="all",
                    help=f"comma list of configurations, or 'all' (default): {', '.join(CONFIGS)}")
    ap.add_argument("--dtype", default="float32",
                    help=f"parameter and input dtype: {', '.join(DTYPES)} (default float32)")
    ap.add_argument("--tiny", action="store_true", help="the tiny test configurations (smoke tests)")
    ap.add_argument("--json", metavar="OUT", help="write every result to this JSON file")
    ap.add_argument("--plot", metavar="OUT.png", help="bar chart of speedups (needs matplotlib)")
    ap.add_argument("--no-cold", dest="cold", action="store_false",
                    help="do not empty the kernel caches before the cold compile timing")
    ap.add_argument("--seed", type=int, default=0, help="numpy seed of the random weights")
    # For tests of the timing path on a CPU: nimble's backend for the nimble rows.
    ap.add_argument("--nimble-backend", default="cuda", choices=("cuda", "interpret"),
                    help=argparse.SUPPRESS)
    opts = ap.parse_args(argv)
    opts.model_names = _pick(opts.models, list(MODELS), "model", {})
    opts.config_keys = _pick(opts.configs, list(CONFIGS), "configuration", ALIASES)
    try:
        opts.batches = [int(b) for b in opts.batch.split(",") if b.strip()]
    except ValueError:
        ap.error(f"--batch wants a comma list of integers, got {opts.batch!r}")
    if not opts.batches or min(opts.batches) < 1:
        ap.error("--batch wants positive batch sizes")
    if opts.repeat < 1:
        ap.error("--repeat must be at least 1")
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


def _pick(text: str, known: list, what: str, aliases: dict) -> list:
    if text.strip().lower() == "all":
        return list(known)
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

    console = report._console()
    if gpu_available():
        results = run_gpu(opts, console)
    else:
        console.print("No CUDA GPU is visible: showing nimble's plans only (nothing is timed).",
                      soft_wrap=True)
        results = run_plans(opts, console)
    report.print_results(results, console)
    if opts.json:
        report.write_json(results, opts.json)
        console.print(f"wrote {opts.json}", soft_wrap=True)
    if opts.plot:
        why = report.plot_speedups(results, opts.plot)
        console.print(why if why else f"wrote {opts.plot}", soft_wrap=True)
    return 0


def _meta(opts: argparse.Namespace, mode: str, gpu: Optional[str]) -> dict:
    import nimblejax

    return {"mode": mode, "gpu": gpu, "jax": jax.__version__, "nimblejax": nimblejax.__version__,
            "python": platform.python_version(), "models": opts.model_names,
            "batches": opts.batches, "configs": [CONFIGS[k] for k in opts.config_keys],
            "repeat": opts.repeat, "dtype": str(opts.dtype), "tiny": opts.tiny,
            "cold_caches": opts.cold, "time": time.strftime("%Y-%m-%d %H:%M:%S")}


def _progress(console):
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

    return Progress(TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(),
                    TimeElapsedColumn(), console=console, transient=True)


def _first_line(e: BaseException) -> str:
    lines = str(e).strip().splitlines()
    return lines[0] if lines else type(e).__name__


def _failure(e: BaseException) -> tuple[str, str]:
    """(status, message) of an exception: unsupported primitives are not crashes."""
    if isinstance(e, NotImplementedError):
        return "unsupported", _first_line(e)
    return "error", f"{type(e).__name__}: {_first_line(e)}"


# ---- without a GPU: plans only ------------------------------------------------------------

def abstract_model(spec, batch: int, dtype, tiny: bool) -> tuple:
    """(fn, args as jax.ShapeDtypeStruct) without materializing weights."""
    if spec.abstract is not None:
        return spec.abstract(batch, dtype, tiny=tiny)
    fn, args = spec.build(batch, dtype, np.random.default_rng(0), tiny=tiny)
    return fn, jax.tree_util.tree_map(lambda a: jax.ShapeDtypeStruct(np.shape(a), a.dtype), args)


def plan_row(spec, batch: int, dtype, tiny: bool, max_streams: Optional[int] = None) -> dict:
    import nimblejax as nimble

    row: dict[str, Any] = {"model": spec.name, "batch": batch, "config": "plan", "status": "ok"}
    t0 = time.perf_counter()
    try:
        fn, args = abstract_model(spec, batch, dtype, tiny)
        row["params"] = int(sum(np.prod(a.shape, dtype=np.int64)
                                for a in jax.tree_util.tree_leaves(args[0]))) if len(args) > 1 else None
        plan = nimble.jit(fn, backend="interpret", max_streams=max_streams).plan(*args)
        row.update(plan_stats(plan))
    except Exception as e:  # noqa: BLE001 - a row per model, whatever happens
        row["status"], row["error"] = _failure(e)
    row["plan_s"] = time.perf_counter() - t0
    return row


def plan_stats(plan) -> dict:
    kinds = [t.kind for t in plan.tasks]
    counts = {k: kinds.count(k) for k in sorted(set(kinds))}
    return {"tasks": len(kinds), "kernels": kinds.count("kernel"), "gemms": kinds.count("gemm"),
            "task_kinds": counts,
            "streams": int(plan.schedule.num_streams), "events": int(plan.num_events),
            "arena_bytes": int(plan.memory.arena_bytes),
            "arena_input_bytes": int(sum(v.nbytes for v in plan.graph.inputs if v in plan.memory.offsets)),
            "memory": plan.memory.describe()}


def run_plans(opts: argparse.Namespace, console) -> dict:
    from nimblejax.bench.models import MODELS

    rows = []
    with _progress(console) as progress:
        task = progress.add_task("planning", total=len(opts.model_names) * len(opts.batches))
        for name in opts.model_names:
            for batch in opts.batches:
                progress.update(task, description=f"planning {name} batch {batch}")
                rows.append(plan_row(MODELS[name], batch, opts.dtype, opts.tiny))
                progress.advance(task)
    return {"meta": _meta(opts, "plan", None), "rows": rows}


# ---- with a GPU ---------------------------------------------------------------------------

def run_gpu(opts: argparse.Namespace, console) -> dict:
    from nimblejax.bench.models import MODELS

    gpu = gpu_name() if opts.nimble_backend == "cuda" else f"{jax.default_backend()} (nimble interpret)"
    rows: list[dict] = []
    caches = _KernelCaches(enabled=opts.cold)
    try:
        with _progress(console) as progress:
            total = len(opts.model_names) * len(opts.batches) * len(opts.config_keys)
            task = progress.add_task("benchmark", total=total)
            for model in opts.model_names:
                for batch in opts.batches:
                    def step(config: str, model=model, batch=batch) -> None:
                        progress.update(task, description=f"{model} b{batch}: {CONFIGS[config]}")

                    rows += measure_model(MODELS[model], batch, opts, caches, step)
                    progress.advance(task, len(opts.config_keys))
                    gc.collect()
    finally:
        caches.cleanup()
    return {"meta": _meta(opts, "gpu", gpu), "rows": rows}


def gpu_name() -> str:
    try:
        import cupy

        name = cupy.cuda.runtime.getDeviceProperties(0)["name"]
        return name.decode() if isinstance(name, bytes) else str(name)
    except Exception:  # noqa: BLE001
        return "GPU"


def _rel_err(got, want) -> float:
    g_leaves = jax.tree_util.tree_leaves(got)
    w_leaves = jax.tree_util.tree_leaves(want)
    err = 0.0
    for g, w in zip(g_leaves, w_leaves):
        g = np.asarray(g.get() if hasattr(g, "get") else g, dtype=np.float64)
        w = np.asarray(w, dtype=np.float64)
        scale = float(np.max(np.abs(w))) if w.size else 0.0
        err = max(err, float(np.max(np.abs(g - w))) / (scale + 1e-30) if w.size else 0.0)
    return err


def _timed_first_call(make: Callable[[], Callable], args: tuple) -> tuple[Callable, Any, float]:
    t0 = time.perf_counter()
    f = make()
    out = f(*args)
    jax.block_until_ready(out)
    return f, out, time.perf_counter() - t0


class _KernelCaches:
    """Empties the kernel caches for cold compile timings: a fresh CUPY_CACHE_DIR (CuPy's
    on-disk cache) and nimble's in-process module cache. Warm timings keep the disk cache
    that the cold compile just filled, and empty only the in-process one."""

    def __init__(self, enabled: bool) -> None:
        self.enabled = enabled
        self.root = tempfile.mkdtemp(prefix="nimblejax-bench-cupy-") if enabled else None
        self.saved = os.environ.get("CUPY_CACHE_DIR")
        self.count = 0

    @staticmethod
    def _clear_in_process() -> None:
        try:
            from nimblejax.runtime import compile as nimble_compile
        except ImportError:  # pragma: no cover
            return
        modules = getattr(nimble_compile, "_modules", None)
        if isinstance(modules, dict):
            modules.clear()

    def cold(self) -> None:
        if not self.enabled:
            return
        self.count += 1
        os.environ["CUPY_CACHE_DIR"] = os.path.join(self.root, str(self.count))
        self._clear_in_process()

    def warm(self) -> None:
        if self.enabled:
            self._clear_in_process()

    def cleanup(self) -> None:
        if not self.enabled:
            return
        if self.saved is None:
            os.environ.pop("CUPY_CACHE_DIR", None)
        else:
            os.environ["CUPY_CACHE_DIR"] = self.saved
        shutil.rmtree(self.root, ignore_errors=True)


def measure_model(spec, batch: int, opts: argparse.Namespace, caches: Optional[_KernelCaches] = None,
                  step: Callable[[str], None] = lambda config: None) -> list[dict]:
    """Rows for one model at one batch size; failures become rows, never exceptions."""
    import nimblejax as nimble
    from nimblejax.bench import timing

    caches = caches or _KernelCaches(enabled=False)
    backend = getattr(opts, "nimble_backend", "cuda")
    base = {"model": spec.name, "batch": batch}
    try:
        fn, args = spec.build(batch, opts.dtype, np.random.default_rng(opts.seed), tiny=opts.tiny)
        jax.block_until_ready(args)
        jitted, want, jax_cold = _timed_first_call(lambda: jax.jit(fn), args)
        want = jax.tree_util.tree_map(np.asarray, want)
    except Exception as e:  # noqa: BLE001
        status, msg = _failure(e)
        return [dict(base, config=CONFIGS[k], status=status, error=msg) for k in opts.config_keys]
    # Looped timing feeds a fresh input each call (params stay), as a serving loop does.
    fresh = np.random.default_rng(opts.seed + 1)
    x = args[-1]
    arg_sets = [args[:-1] + (jnp.asarray(fresh.standard_normal(x.shape), x.dtype),) for _ in range(8)]
    try:
        temp = int(jax.jit(fn).lower(*args).compile().memory_analysis().temp_size_in_bytes)
    except Exception:  # noqa: BLE001 - not every backend reports it
        temp = None

    rows = []
    for key in opts.config_keys:
        step(key)
        row = dict(base, config=CONFIGS[key], status="ok", xla_temp_bytes=temp)
        try:
            if key == "jax":
                _, _, warm = _timed_first_call(lambda: jax.jit(fn), args)
                row.update(compile_cold_s=jax_cold, compile_warm_s=warm, max_rel_err=0.0,
                           e2e_ms=timing.e2e_us(jitted, args, calls=opts.repeat) / 1e3,
                           looped_ms=timing.looped_us(jitted, arg_sets, calls=opts.repeat) / 1e3,
                           gpu_ms=timing.throughput_us(jitted, args, calls=opts.repeat) / 1e3)
            elif key == "jax-concurrent":
                t0 = time.perf_counter()
                conc = timing.concurrent_jax(fn, args)
                cold = time.perf_counter() - t0
                if conc is None:
                    row.update(status="skipped",
                               error="this XLA does not accept concurrent command-buffer scheduling")
                else:
                    row.update(compile_cold_s=cold, max_rel_err=_rel_err(conc(*args), want),
                               e2e_ms=timing.e2e_us(conc, args, calls=opts.repeat) / 1e3,
                               looped_ms=timing.looped_us(conc, arg_sets, calls=opts.repeat) / 1e3,
                               gpu_ms=timing.throughput_us(conc, args, calls=opts.repeat) / 1e3)
                conc = None
            else:
                options = NIMBLE_OPTIONS[key]
                caches.cold()
                f, got, cold = _timed_first_call(lambda: nimble.jit(fn, backend=backend, **options), args)
                caches.warm()
                _, _, warm = _timed_first_call(lambda: nimble.jit(fn, backend=backend, **options), args)
                row.update(compile_cold_s=cold, compile_warm_s=warm, max_rel_err=_rel_err(got, want))
                exes = f.executables()
                plan = getattr(exes[-1], "plan", None) if exes else None
                row.update(plan_stats(plan if plan is not None else f.plan(*args)))
                row["e2e_ms"] = timing.e2e_us(f, args, calls=opts.repeat) / 1e3
                row["looped_ms"] = timing.looped_us(f, arg_sets, calls=opts.repeat) / 1e3
                row["call_path"] = f.call_path
                gpu_us = timing.nimble_gpu_us(f, calls=opts.repeat) if backend == "cuda" else None
                row["gpu_ms"] = None if gpu_us is None else gpu_us / 1e3
                f = got = None
        except Exception as e:  # noqa: BLE001 - record and go on with the next one
            row["status"], row["error"] = _failure(e)
            if os.environ.get("NIMBLEJAX_BENCH_TRACEBACK"):
                traceback.print_exc(file=sys.stderr)
        rows.append(row)
        gc.collect()
    add_speedups(rows)
    return rows


def add_speedups(rows: list[dict]) -> None:
    """speedup_e2e / speedup_looped / speedup_gpu: the best (lowest) time of the jax.jit configurations
    that ran, divided by the row's time."""
    jax_rows = [r for r in rows if r.get("config") in (CONFIGS[k] for k in JAX_CONFIGS)
                and r.get("status") == "ok"]
    for field, out in (("e2e_ms", "speedup_e2e"), ("looped_ms", "speedup_looped"),
                       ("gpu_ms", "speedup_gpu")):
        times = [r[field] for r in jax_rows if r.get(field)]
        best = min(times) if times else None
        for r in rows:
            t = r.get(field)
            r[out] = best / t if best and t and r.get("status") == "ok" else None


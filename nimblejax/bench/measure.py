"""The run with a GPU: each model × batch × configuration timed (looped and GPU time;
with --full also end to end, and cold and warm compiles), checked against jax.jit and
described by its plan, every row printed as soon as its figures are final."""
from __future__ import annotations

import argparse
import contextlib
import gc
import os
import shutil
import sys
import tempfile
import time
import traceback
from typing import Any, Callable, Optional

import jax
import jax.numpy as jnp
import numpy as np

from nimblejax.bench.ahead import AheadCompiler, compile_jax, workers
from nimblejax.bench.configs import CONFIGS, FULL_REPEAT, JAX_CONFIGS, LOOPS, NIMBLE_OPTIONS
from nimblejax.bench.plans import plan_stats
from nimblejax.bench.progress import Progress, prior_s
from nimblejax.bench.results import (add_speedups, draw_timeline, failure, geomeans, gpu_name,
                                     run_meta, timeline_path)


def run_gpu(opts: argparse.Namespace, out=None) -> dict:
    from nimblejax.bench import report
    from nimblejax.bench.models import MODELS

    out = out if out is not None else sys.stdout
    gpu = gpu_name() if opts.nimble_backend == "cuda" else f"{jax.default_backend()} (nimble interpret)"
    units = [(m, b) for m in opts.model_names for b in opts.batches]
    cache_dir, warm = jax_compile_cache(opts)
    progress = Progress(units, lambda u: prior_s(u[0], u[1], opts, "gpu", warm))
    labels = ", ".join(CONFIGS[k] for k in opts.config_keys)
    how = (f"{opts.repeat} calls per loop" if opts.repeat is not None else
           f"about {opts.budget:g} s of timed calls per row")
    progress.note(f"nimblejax-bench: {len(opts.model_names)} models × batch "
                  f"{','.join(map(str, opts.batches))} × {len(opts.config_keys)} configurations "
                  f"({labels}); {'looped, e2e and GPU' if opts.full else 'looped and GPU'} time, "
                  f"{how}; estimated {Progress.clock_text(progress.estimate_s())} on one H100"
                  + ("" if opts.full else " (--full: every configuration, 200 calls per loop)"))
    if cache_dir:
        progress.note(f"jax.jit's executables are cached in {cache_dir} "
                      + ("(filled by an earlier run: loaded, not compiled)" if warm else
                         "(empty: this first run compiles them, about 3 min of XLA compiling and "
                         "autotuning for the whole suite on an H100; later runs load them)"))
    ahead = start_ahead(opts, units, cache_dir, progress.note)
    printer = report.RowPrinter(report.gpu_columns(opts.full), out, before=progress.clear)
    printer.title(f"nimble.jit vs jax.jit on {gpu}")
    rows: list[dict] = []
    caches = _KernelCaches(enabled=opts.cold)
    try:
        for model, batch in units:
            def step(config: str, model=model, batch=batch) -> None:
                progress.step(f"{model} batch {batch}: {CONFIGS[config]}")

            rows += measure_model(MODELS[model], batch, opts, caches, step, emit=printer.row,
                                  say=printer.say, ahead=ahead)
            progress.finish((model, batch))
            gc.collect()
    finally:
        caches.cleanup()
        if ahead is not None:
            ahead.close()
    progress.close()
    summary = geomeans(rows)
    for line in report.geomean_lines(summary):
        printer.say(line)
    return {"meta": run_meta(opts, "gpu", gpu), "rows": rows, "summary": {"geomeans": summary}}


def start_ahead(opts: argparse.Namespace, units: list, cache_dir: Optional[str],
                note: Callable[[str], None]) -> Optional[AheadCompiler]:
    """jax.jit's programs of every unit compiling ahead (bench/ahead.py) on
    `--compile-ahead` threads, where the run asks for it, keeps them in JAX's persistent
    cache (the default run) and has several units."""
    from nimblejax.bench.models import MODELS

    threads = getattr(opts, "compile_ahead", 0)
    if not threads or not cache_dir or opts.full or "jax" not in opts.config_keys or len(units) < 2:
        return None
    n = min(threads, workers())
    note(f"jax.jit's programs compile ahead, {n} at a time, into that cache; none while a row "
         "is timed")
    return AheadCompiler(units, lambda u: compile_jax(MODELS[u[0]], u[1], opts.dtype, opts.tiny), n)


def jax_compile_cache(opts: argparse.Namespace) -> tuple[Optional[str], bool]:
    """(directory, whether it holds entries already) of JAX's persistent compilation
    cache for this run, turned on here for the default GPU run; (None, False) where it is
    not used (--full times cold compiles, --no-jax-cache, the CPU test path)."""
    if opts.full or not opts.jax_cache or opts.nimble_backend != "cuda":
        return None, False
    from nimblejax import options as options_mod

    current = jax.config.jax_compilation_cache_dir
    path = current or os.path.join(options_mod.cache_dir(), "jax-compilation-cache")
    try:
        warm = os.path.isdir(path) and any(os.scandir(path))
    except OSError:
        warm = False
    if not current:
        jax.config.update("jax_compilation_cache_dir", path)
    return path, warm



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
                  step: Callable[[str], None] = lambda config: None,
                  emit: Callable[[dict], None] = lambda row: None,
                  say: Callable[[str], None] = lambda line: None,
                  ahead: Optional[AheadCompiler] = None) -> list[dict]:
    """Rows for one model at one batch size; failures become rows, never exceptions.
    `emit(row)` gets each row as soon as its figures are final: a nimble row right after
    it is measured, the jax.jit rows once every jax.jit configuration has run (the best
    of them is what the speedups divide). With `ahead`, jax.jit's first call waits for
    its program's compile there, and the timings wait for quiet."""
    caches = caches or _KernelCaches(enabled=False)
    base = {"model": spec.name, "batch": batch}
    t_start = time.perf_counter()
    ahead_s = None
    try:
        fn, args = spec.build(batch, opts.dtype, np.random.default_rng(opts.seed), tiny=opts.tiny)
        jax.block_until_ready(args)
        if ahead is not None:
            ahead_s = ahead.wait((spec.name, batch))
        jitted, want, jax_first = _timed_first_call(lambda: jax.jit(fn), args)
        want = jax.tree_util.tree_map(np.asarray, want)
    except Exception as e:  # noqa: BLE001
        status, msg = failure(e)
        rows = [dict(base, config=CONFIGS[k], status=status, error=msg) for k in opts.config_keys]
        for row in rows:
            emit(row)
        return rows
    # Looped timing feeds a fresh input each call (params stay), as a serving loop does.
    fresh = np.random.default_rng(opts.seed + 1)
    x = args[-1]
    arg_sets = [args[:-1] + (jnp.asarray(fresh.standard_normal(x.shape), x.dtype),) for _ in range(8)]
    try:
        temp = int(jitted.lower(*args).compile().memory_analysis().temp_size_in_bytes)
    except Exception:  # noqa: BLE001 - not every backend reports it
        temp = None
    quiet = ahead.quiet if ahead is not None else contextlib.nullcontext
    ctx = _Row(opts, fn, args, arg_sets, want, caches, quiet)
    ctx.ahead_s = ahead_s
    rows: list[dict] = []
    pending: list[dict] = []
    for i, key in enumerate(opts.config_keys):
        step(key)
        t0 = time.perf_counter()
        row = dict(base, config=CONFIGS[key], status="ok", xla_temp_bytes=temp)
        try:
            if key == "jax":
                ctx.jax_row(row, jitted, jax_first)
            elif key == "jax-concurrent":
                ctx.concurrent_row(row)
            else:
                ctx.nimble_row(row, key, say)
        except Exception as e:  # noqa: BLE001 - record and go on with the next one
            row["status"], row["error"] = failure(e)
            if os.environ.get("NIMBLEJAX_BENCH_TRACEBACK"):
                traceback.print_exc(file=sys.stderr)
        # Seconds the row took; the first one also carries building the model and
        # jax.jit's first call (the reference outputs).
        row["wall_s"] = time.perf_counter() - (t_start if i == 0 else t0)
        rows.append(row)
        pending.append(row)
        add_speedups(rows)
        if not any(k in JAX_CONFIGS for k in opts.config_keys[i + 1:]):
            for r in pending:
                emit(r)
            pending.clear()
        if ctx.after is not None:  # the timeline, drawn once its row is out
            ctx.after()
            ctx.after = None
        gc.collect()
    return rows


class _Row:
    """The measurements of one model × batch: what each configuration's row holds."""

    def __init__(self, opts, fn, args, arg_sets, want, caches,
                 quiet: Callable[[], Any] = contextlib.nullcontext) -> None:
        self.opts, self.fn, self.args, self.arg_sets = opts, fn, args, arg_sets
        self.want, self.caches, self.quiet = want, caches, quiet
        self.ahead_s: Optional[float] = None  # seconds jax.jit's program compiled ahead
        self.backend = getattr(opts, "nimble_backend", "cuda")
        self.after: Optional[Callable[[], None]] = None

    def calls(self, f) -> int:
        """Calls per loop: --repeat, else what the row's time budget allows (its two
        measurements, LOOPS loops each), from two blocked calls."""
        from nimblejax.bench import timing

        if self.opts.repeat is not None:
            return self.opts.repeat
        per_call = timing.e2e_us(f, self.args, calls=2, warmup=1) / 1e6
        return int(min(FULL_REPEAT, max(2, self.opts.budget / (2 * LOOPS * max(per_call, 1e-6)))))

    def timings(self, row: dict, f, gpu: Callable[[int], Optional[float]]) -> None:
        """looped_ms first, then (--full) e2e_ms, then gpu_ms; no compile ahead runs
        meanwhile."""
        from nimblejax.bench import timing

        with self.quiet():
            n = self.calls(f)
            row["timed_calls"] = n
            row["looped_ms"] = timing.looped_us(f, self.arg_sets, calls=n, repeats=LOOPS) / 1e3
            if self.opts.full:
                row["e2e_ms"] = timing.e2e_us(f, self.args, calls=n) / 1e3
            us = gpu(n)
            row["gpu_ms"] = None if us is None else us / 1e3

    def jax_row(self, row: dict, jitted, first_s: float) -> None:
        from nimblejax.bench import timing

        if self.opts.full:
            _, _, warm = _timed_first_call(lambda: jax.jit(self.fn), self.args)
            row.update(compile_cold_s=first_s, compile_warm_s=warm)
        else:
            row["first_call_s"] = first_s
        if self.ahead_s is not None:
            row["xla_compiled_ahead_s"] = self.ahead_s  # then first_call_s loaded it
        row["max_rel_err"] = 0.0
        self.timings(row, jitted, lambda n: timing.throughput_us(jitted, self.args, calls=n,
                                                                 repeats=LOOPS))

    def concurrent_row(self, row: dict) -> None:
        from nimblejax.bench import timing

        t0 = time.perf_counter()
        conc = timing.concurrent_jax(self.fn, self.args)
        first = time.perf_counter() - t0
        if conc is None:
            row.update(status="skipped",
                       error="this XLA does not accept concurrent command-buffer scheduling")
            return
        row["compile_cold_s" if self.opts.full else "first_call_s"] = first
        row["max_rel_err"] = _rel_err(conc(*self.args), self.want)
        self.timings(row, conc, lambda n: timing.throughput_us(conc, self.args, calls=n,
                                                               repeats=LOOPS))

    def nimble_row(self, row: dict, key: str, say: Callable[[str], None]) -> None:
        import nimblejax as nimble
        from nimblejax.bench import timing

        options = NIMBLE_OPTIONS[key]
        make = lambda: nimble.jit(self.fn, backend=self.backend, **options)  # noqa: E731
        if self.opts.full:
            self.caches.cold()
            f, got, cold = _timed_first_call(make, self.args)
            self.caches.warm()
            _, _, warm = _timed_first_call(make, self.args)
            row.update(compile_cold_s=cold, compile_warm_s=warm)
        else:
            f, got, first = _timed_first_call(make, self.args)
            row["first_call_s"] = first
        row["max_rel_err"] = _rel_err(got, self.want)
        exes = f.executables()
        plan = getattr(exes[-1], "plan", None) if exes else None
        plan = plan if plan is not None else f.plan(*self.args)
        row.update(plan_stats(plan))
        row["call_path"] = f.call_path
        cuda = self.backend == "cuda"
        self.timings(row, f, lambda n: timing.nimble_gpu_us(f, calls=n) if cuda else None)
        if self.opts.timeline and key == self._timeline_config():
            path = timeline_path(self.opts.timeline, row["model"], row["batch"], self.opts)
            title = f"{row['model']} batch {row['batch']}, {CONFIGS[key]}"

            def draw(exe=exes[-1] if cuda and exes else None) -> None:
                say(draw_timeline(plan, path, title, _task_us(exe) if exe is not None else None))

            self.after = draw

    def _timeline_config(self) -> Optional[str]:
        nimble_keys = [k for k in self.opts.config_keys if k in NIMBLE_OPTIONS]
        return "nimble" if "nimble" in nimble_keys else (nimble_keys[-1] if nimble_keys else None)


def _task_us(exe) -> Optional[list]:
    """Measured GPU µs of every task of an executable (nimblejax.bench.profile), in the
    plan's launch order."""
    from nimblejax.bench.profile import task_times

    try:
        return [r["us"] for r in task_times(exe, repeats=3)]
    except Exception:  # noqa: BLE001 - then the timeline uses estimates, and says so
        return None


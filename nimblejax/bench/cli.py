"""`python -m nimblejax.bench` / `nimblejax-bench`: nimble.jit against jax.jit on the
benchmark models (see BENCHMARKS_HOWTO.md).

With a GPU: each model × batch × configuration is timed (looped and GPU time; with
--full also end to end), checked against jax.jit, and described by its plan. Every row
is printed (and flushed) as soon as it is measured, progress and an ETA go to stderr,
and the run ends with the geometric-mean speedups. Without a GPU: one line saying so,
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


# The default run: jax.jit against nimble's multi-stream graph, looped and GPU time, the
# calls of each measurement sized to a time budget. --full is the long run.
QUICK_CONFIGS = ("jax", "nimble")
DEFAULT_BUDGET_S = 0.5  # seconds of timed calls per row (looped + GPU time) by default
FULL_REPEAT = 200
LOOPS = 5  # every measurement is the median of this many loops of `calls` calls


def parse_args(argv: Optional[Sequence[str]] = None) -> argparse.Namespace:
    from nimblejax.bench.models import MODELS

    ap = argparse.ArgumentParser(
        prog="nimblejax-bench",
        description="Benchmark nimble.jit against jax.jit on published models. By default: "
                    "jax.jit against nimble's multi-stream graph, looped and GPU time, "
                    f"about {DEFAULT_BUDGET_S:g} s of timed calls per row. Every model at batch 1 "
                    "and 32 took 312 s on a fresh H100 (measured at commit ca3739d), about "
                    "3 min of it XLA compiling jax.jit's programs, which later runs load from "
                    "JAX's persistent compilation cache. "
                    "Rows are printed as they are measured; progress and an ETA go to stderr. "
                    "--full is the long run. Without a GPU: nimble's plan of each model, what its "
                    "columns mean and what to try next; nothing is timed.")
    ap.add_argument("--models", default="all",
                    help=f"comma list of models, or 'all' (default): {', '.join(MODELS)}")
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
    ap.add_argument("--seed", type=int, default=0, help="numpy seed of the random weights")
    # For tests of the timing path on a CPU: nimble's backend for the nimble rows.
    ap.add_argument("--nimble-backend", default="cuda", choices=("cuda", "interpret"),
                    help=argparse.SUPPRESS)
    opts = ap.parse_args(argv)
    opts.model_names = _pick(opts.models, list(MODELS), "model", {})
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


def _meta(opts: argparse.Namespace, mode: str, gpu: Optional[str]) -> dict:
    """What this run did, and nothing it did not: a plan-only run records no timing
    settings."""
    import nimblejax

    meta = {"mode": mode, "gpu": gpu, "jax": jax.__version__, "nimblejax": nimblejax.__version__,
            "python": platform.python_version(), "models": opts.model_names,
            "batches": opts.batches, "dtype": str(opts.dtype), "tiny": opts.tiny}
    if mode == "gpu":
        meta.update(run="full" if opts.full else "default",
                    configs=[CONFIGS[k] for k in opts.config_keys],
                    timed=["looped", "e2e", "gpu"] if opts.full else ["looped", "gpu"],
                    loops=LOOPS, cold_caches=opts.cold)
        if opts.repeat is not None:
            meta["repeat"] = opts.repeat
        else:
            meta["budget_s"] = opts.budget
    else:
        from nimblejax import options as options_mod

        o = options_mod.from_env(None)
        meta["plan_options"] = {"gemm": o.gemm, "conv": o.conv, "cudnn": o.cudnn,
                                "max_streams": o.max_streams}
    meta["time"] = time.strftime("%Y-%m-%d %H:%M:%S")
    return meta


def _first_line(e: BaseException) -> str:
    lines = str(e).strip().splitlines()
    return lines[0] if lines else type(e).__name__


def _failure(e: BaseException) -> tuple[str, str]:
    """(status, message) of an exception: unsupported primitives are not crashes."""
    if isinstance(e, NotImplementedError):
        return "unsupported", _first_line(e)
    return "error", f"{type(e).__name__}: {_first_line(e)}"


def timeline_path(path: str, model: str, batch: int, opts: argparse.Namespace) -> str:
    """--timeline's file for one model and batch: the path itself when the run has one
    model and one batch, else <stem>_<model>_b<batch><suffix>."""
    if len(opts.model_names) == 1 and len(opts.batches) == 1:
        return path
    stem, ext = os.path.splitext(path)
    return f"{stem}_{model}_b{batch}{ext or '.png'}"


def _draw_timeline(plan, path: str, title: str, task_us: Optional[list] = None) -> str:
    """Draw one timeline; the line to print (written, or why not)."""
    from nimblejax.bench import timeline

    try:
        timeline.draw_timeline(plan, path, task_us=task_us, title=title)
    except ImportError as e:
        return f"no timeline: {e}"
    return f"wrote {path}"


# ---- time estimates ---------------------------------------------------------------------

# Seconds one model × batch takes in the default run on one H100 (jax 0.11.2, measured
# 2026-11-24 on a fresh machine, then again with the compile caches filled): building the
# weights, jax.jit's first call, nimble's first call (plan, NVRTC, graph capture) and
# about 1.5 s of timing. (cold, warm): cold is the first run on a machine, when XLA
# compiles and autotunes every model (177 s of the suite's 281 s) and NVRTC compiles
# nimble's kernels; warm loads jax.jit's executables from JAX's persistent cache (NASNet's
# first execution still takes 25 s) and nimble's kernels from CuPy's cache. Only the
# estimate and the ETA use these.
PRIOR_S = {"mlp": (7.3, 2.5), "bert": (12.7, 3.3), "lstm": (7.1, 2.1), "resnet50": (9.4, 2.4),
           "mobilenet_v2": (19.3, 4.4), "efficientnet_b0": (19.6, 4.7),
           "inception_v3": (11.6, 2.7), "nasnet_mobile": (53.3, 28.6)}
PRIOR_PLAN_S = 0.6  # planning one model without a GPU (2 cores, CI)


def prior_s(model: str, batch: int, opts: argparse.Namespace, mode: str,
            warm: bool = False) -> float:
    """Expected seconds of one model × batch (the estimate and the ETA's starting point)."""
    if mode == "plan":
        return PRIOR_PLAN_S
    cold_s, warm_s = PRIOR_S.get(model, (5.0, 2.0))
    base = 1.0 if opts.tiny else (warm_s if warm and not opts.full else cold_s)
    extra_configs = max(0, len(opts.config_keys) - len(QUICK_CONFIGS))
    base *= 1.0 + 0.5 * extra_configs
    if opts.full:
        base *= 2.0  # cold and warm compiles of every nimble configuration
    if opts.repeat is not None:  # calls instead of a budget: about 2 ms a call on average
        timed = (3 if opts.full else 2) * LOOPS * opts.repeat * 0.002
        base += timed * len(opts.config_keys)
    return base


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


class Progress:
    """Progress and an ETA on stderr, never on stdout: one line per step where stderr is
    a log or a pipe, one updated status line on a terminal."""

    def __init__(self, units: list, prior: Callable[[Any], float], stream=None,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.units = list(units)
        self.prior = {u: float(prior(u)) for u in self.units}
        self.stream = stream if stream is not None else sys.stderr
        self.clock = clock
        self.t0 = clock()
        self.done: list = []
        self.tty = bool(getattr(self.stream, "isatty", lambda: False)())
        self._status = False

    @staticmethod
    def clock_text(seconds: float) -> str:
        seconds = max(0, int(round(seconds)))
        return f"{seconds // 60}m{seconds % 60:02d}s"

    def estimate_s(self) -> float:
        """Seconds still to go: the priors left, scaled by how far off the done ones were."""
        left = sum(self.prior[u] for u in self.units if u not in self.done)
        done_prior = sum(self.prior[u] for u in self.done)
        if done_prior > 0:
            left *= (self.clock() - self.t0) / done_prior
        return left

    def _write(self, text: str) -> None:
        if self.tty:
            self.stream.write("\r\x1b[K" + text)
            self._status = True
        else:
            self.stream.write(text + "\n")
        self.stream.flush()

    def clear(self) -> None:
        """Before a line on stdout: take the status line off the terminal."""
        if self.tty and self._status:
            self.stream.write("\r\x1b[K")
            self.stream.flush()
            self._status = False

    def note(self, text: str) -> None:
        self.clear()
        self.stream.write(text + "\n")
        self.stream.flush()

    def step(self, text: str) -> None:
        n = len(self.done) + 1
        self._write(f"[{n}/{len(self.units)}] {text}  ({self.clock_text(self.clock() - self.t0)} "
                    f"elapsed, ETA {self.clock_text(self.estimate_s())})")

    def finish(self, unit) -> None:
        self.done.append(unit)

    def close(self) -> None:
        self.clear()
        self.note(f"done in {self.clock_text(self.clock() - self.t0)}")


# ---- without a GPU: plans only ------------------------------------------------------------

def abstract_model(spec, batch: int, dtype, tiny: bool) -> tuple:
    """(fn, args as jax.ShapeDtypeStruct) without materializing weights."""
    if spec.abstract is not None:
        return spec.abstract(batch, dtype, tiny=tiny)
    fn, args = spec.build(batch, dtype, np.random.default_rng(0), tiny=tiny)
    return fn, jax.tree_util.tree_map(lambda a: jax.ShapeDtypeStruct(np.shape(a), a.dtype), args)


def plan_row(spec, batch: int, dtype, tiny: bool, max_streams: Optional[int] = None,
             keep_plan: Optional[list] = None) -> dict:
    import nimblejax as nimble

    row: dict[str, Any] = {"model": spec.name, "batch": batch, "config": "plan", "status": "ok"}
    t0 = time.perf_counter()
    try:
        fn, args = abstract_model(spec, batch, dtype, tiny)
        row["params"] = int(sum(np.prod(a.shape, dtype=np.int64)
                                for a in jax.tree_util.tree_leaves(args[0]))) if len(args) > 1 else None
        f = nimble.jit(fn, backend="interpret", max_streams=max_streams)
        plan = f.plan(*args)
        row.update(plan_stats(plan))
        row["note"] = plan_notes(plan, f.options, batch)
        if keep_plan is not None:
            keep_plan.append(plan)
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


# Said of every batch ≥ 8 row of a CNN on a machine without cuDNN: the plan-only table
# marks it with a star and says it once below (report.plan_legend).
NO_CUDNN = " (no cuDNN found here: with it, the im2col ones go to cuDNN at this batch)"


def plan_notes(plan, options, batch: Optional[int] = None) -> str:
    """The plan's notable decisions in a few words: how parallel it is, the path of its
    convolutions, and the control flow it flattened. `options`: the plan's (its
    convolutions' path is canonicalize/conv_path.py's `use_cudnn`, at `batch` when known)."""
    from nimblejax.bench.profile import task_family
    from nimblejax.compiler.canonicalize.conv_path import use_cudnn

    tasks = len(plan.tasks)
    cp = plan.critical_path
    parts = [f"critical path {cp} of {tasks} tasks" if cp < tasks else
             f"a chain: each of the {tasks} tasks needs the one before"]
    families = [task_family(t).split("_")[0] for t in plan.tasks]
    im2col = families.count("im2col")
    convs = [(im2col, "im2col+GEMM"), (families.count("conv"), "direct"),
             (sum(t.kind == "cudnn" for t in plan.tasks), "cuDNN")]
    conv_text = ", ".join(f"{n} {path}" for n, path in convs if n)
    if conv_text:
        # Not found here, and the one decision would take cuDNN at this batch if it were.
        if (im2col and batch is not None and options.conv == "auto" and not options.cudnn
                and use_cudnn(options.replace(cudnn=True), batch)):
            conv_text += NO_CUDNN
        parts.append(f"convs: {conv_text}")
    if plan.control:
        parts.append(f"{len(plan.control)} loops/conds flattened")
    return "; ".join(parts)


def run_plans(opts: argparse.Namespace, out=None) -> dict:
    from nimblejax.bench import report
    from nimblejax.bench.models import MODELS

    out = out if out is not None else sys.stdout
    units = [(m, b) for m in opts.model_names for b in opts.batches]
    progress = Progress(units, lambda u: prior_s(u[0], u[1], opts, "plan"))
    printer = report.RowPrinter(report.PLAN_COLUMNS, out, before=progress.clear)
    rows = []
    for name, batch in units:
        progress.step(f"planning {name} batch {batch}")
        plans: list = []
        row = plan_row(MODELS[name], batch, opts.dtype, opts.tiny, keep_plan=plans)
        rows.append(row)
        printer.row(dict(row, note=row.get("note", "").replace(NO_CUDNN, " *")))
        if opts.timeline and plans:
            path = timeline_path(opts.timeline, name, batch, opts)
            printer.say(_draw_timeline(plans[0], path, f"{name} batch {batch}"))
        progress.finish((name, batch))
    progress.close()
    for line in report.plan_legend(rows, NO_CUDNN, timeline=bool(opts.timeline)):
        printer.say(line)
    return {"meta": _meta(opts, "plan", None), "rows": rows}


# ---- with a GPU ---------------------------------------------------------------------------

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
    printer = report.RowPrinter(report.gpu_columns(opts.full), out, before=progress.clear)
    printer.title(f"nimble.jit vs jax.jit on {gpu}")
    rows: list[dict] = []
    caches = _KernelCaches(enabled=opts.cold)
    try:
        for model, batch in units:
            def step(config: str, model=model, batch=batch) -> None:
                progress.step(f"{model} batch {batch}: {CONFIGS[config]}")

            rows += measure_model(MODELS[model], batch, opts, caches, step, emit=printer.row,
                                  say=printer.say)
            progress.finish((model, batch))
            gc.collect()
    finally:
        caches.cleanup()
    progress.close()
    summary = geomeans(rows)
    for line in report.geomean_lines(summary):
        printer.say(line)
    return {"meta": _meta(opts, "gpu", gpu), "rows": rows, "summary": {"geomeans": summary}}


def geomeans(rows: list[dict]) -> list[dict]:
    """Per nimble configuration and batch: the geometric means of the looped, GPU-time
    (and, where measured, end-to-end) speedups over the rows that have them."""
    out = []
    configs = list(dict.fromkeys(r["config"] for r in rows
                                 if r.get("config") not in (CONFIGS[k] for k in JAX_CONFIGS)))
    batches = list(dict.fromkeys(r["batch"] for r in rows))
    for config in configs:
        for batch in batches:
            mine = [r for r in rows if r["config"] == config and r["batch"] == batch
                    and r.get("status") == "ok"]
            entry: dict[str, Any] = {"config": config, "batch": batch}
            for field, name in (("speedup_looped", "looped"), ("speedup_gpu", "gpu"),
                                ("speedup_e2e", "e2e")):
                vals = [r[field] for r in mine if r.get(field)]
                if vals:
                    entry[name] = float(np.exp(np.mean(np.log(vals))))
                    entry[f"{name}_models"] = len(vals)
            if len(entry) > 2:
                out.append(entry)
    return out


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
                  step: Callable[[str], None] = lambda config: None,
                  emit: Callable[[dict], None] = lambda row: None,
                  say: Callable[[str], None] = lambda line: None) -> list[dict]:
    """Rows for one model at one batch size; failures become rows, never exceptions.
    `emit(row)` gets each row as soon as its figures are final: a nimble row right after
    it is measured, the jax.jit rows once every jax.jit configuration has run (the best
    of them is what the speedups divide)."""
    caches = caches or _KernelCaches(enabled=False)
    base = {"model": spec.name, "batch": batch}
    t_start = time.perf_counter()
    try:
        fn, args = spec.build(batch, opts.dtype, np.random.default_rng(opts.seed), tiny=opts.tiny)
        jax.block_until_ready(args)
        jitted, want, jax_first = _timed_first_call(lambda: jax.jit(fn), args)
        want = jax.tree_util.tree_map(np.asarray, want)
    except Exception as e:  # noqa: BLE001
        status, msg = _failure(e)
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
    ctx = _Row(opts, fn, args, arg_sets, want, caches)
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
            row["status"], row["error"] = _failure(e)
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

    def __init__(self, opts, fn, args, arg_sets, want, caches) -> None:
        self.opts, self.fn, self.args, self.arg_sets = opts, fn, args, arg_sets
        self.want, self.caches = want, caches
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
        """looped_ms first, then (--full) e2e_ms, then gpu_ms."""
        from nimblejax.bench import timing

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
                say(_draw_timeline(plan, path, title, _task_us(exe) if exe is not None else None))

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


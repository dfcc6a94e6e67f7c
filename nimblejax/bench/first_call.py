"""The cold first call: jax.jit against nimble, each in a fresh process with empty caches.

    python -m nimblejax.bench.first_call --models resnet50,bert --batch 1,32 --json out.json

Each (model, batch, side) runs in its own Python process with a fresh CuPy kernel cache
and JAX's persistent compilation cache off, so neither side finds anything compiled
before. The model's weights and input are made and moved to the GPU first; the timed span
is ``f = jit(fn); block(f(params, x))``: tracing, planning, compiling, building and the
first run. nimble's child imports nimblejax first, which starts importing CuPy in the
background (runtime/preload.py) while the model is built, as in a user's program; the
jax.jit child turns that off (NIMBLE_PRELOAD=0). Each row also has `process_s`, from the
child's start (after `import nimblejax`) to the end of the first call, so that time moved
out of the call shows. nimble's built handler and the runtime's own copy kernels (built once per
install, cached under ``nimblejax.options.cache_dir()``) are kept; ``--cold-handler``
empties that cache too.
``--phases`` runs the timed span under cProfile and adds where it went (`PHASES`:
seconds under the profiler, cumulative, so nested phases overlap; the first call itself
is slower so), and the functions with the most cumulative seconds (`profile_top`, in
the JSON; nimble's fifteen first printed). ``--variant inline:NIMBLE_DEFER_BUILD=0`` also
times nimble's first call under those environment variables (repeatable), and
``--rounds N`` runs everything N times, alternating, the table giving medians:

    python -m nimblejax.bench.first_call --models mlp,lstm --batch 1 \
        --variant inline:NIMBLE_DEFER_BUILD=0 --rounds 3
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time

STARTED = time.perf_counter()  # this module's import: in a child, the process's start but for `import nimblejax`

SIDES = ("jax", "nimble")
# (label, a file path's ending, function names): the parts of a first call --phases reports.
PHASES = (
    ("import cupy", "cupy/__init__.py", ("<module>",)),
    ("trace and plan", "nimblejax/compiler/pipeline.py", ("compile_function",)),
    ("graph build and capture", "nimblejax/runtime/graph.py", ("__init__",)),
    ("  NVRTC, waited for", "nimblejax/runtime/compile.py", ("compile_kernels",)),
    ("  cuBLASLt's algorithms", "nimblejax/runtime/launch.py", ("_lt_gemms",)),
    ("  cuDNN's algorithms", "nimblejax/runtime/launch.py", ("_cudnn_convs",)),
    ("XLA compiles", "jax/_src/compiler.py", ("backend_compile", "backend_compile_and_load")),
)


def phase_seconds(stats) -> dict:
    """Cumulative seconds per PHASES label from a pstats.Stats (0.0: not called)."""
    out = {label: 0.0 for label, _, _ in PHASES}
    for (path, _, name), (_, _, _, cumulative, _) in stats.stats.items():
        for label, ending, names in PHASES:
            if name in names and path.endswith(ending):
                out[label] += cumulative
    return {label: round(seconds, 3) for label, seconds in out.items()}


def profile_top(stats, total_s: float, n: int = 40) -> list:
    """The `n` functions with the most cumulative seconds under the profiler, leaving out
    those holding nearly all of the call (its outer frames): [where, seconds, calls], where
    a path is shortened to its package (what `--phases` leaves unnamed shows here)."""
    rows = []
    for (path, line, name), (_, calls, _, cumulative, _) in stats.stats.items():
        if cumulative < 0.9 * total_s:
            rows.append([f"{_short(path)}:{line}({name})", round(cumulative, 3), calls])
    rows.sort(key=lambda r: -r[1])
    return rows[:n]


def _short(path: str) -> str:
    """A profiled file's path from its package on: after site-packages/, or from
    nimblejax/ (a checkout)."""
    if "site-packages/" in path:
        return path.rsplit("site-packages/", 1)[-1]
    return "nimblejax/" + path.rsplit("/nimblejax/", 1)[-1] if "/nimblejax/" in path else path


def child(model: str, batch: int, side: str, phases: bool = False) -> dict:
    """Runs in the fresh process: times the first call and checks it against jax.jit's
    answer from the same process (computed after the timing, so it warms nothing)."""
    import jax
    import jax.numpy as jnp
    import numpy as np

    import nimblejax as nimble
    from nimblejax.bench.models import MODELS

    fn, (params, x) = MODELS[model].build(batch, jnp.float32, np.random.default_rng(0))
    jax.block_until_ready((params, x))
    profiler = None
    if phases:
        import cProfile

        profiler = cProfile.Profile()
        profiler.enable()
    t0 = time.perf_counter()
    f = jax.jit(fn) if side == "jax" else nimble.jit(fn)
    out = jax.block_until_ready(f(params, x))
    seconds = time.perf_counter() - t0
    row = {"model": model, "batch": batch, "side": side, "first_call_s": round(seconds, 3),
           "process_s": round(time.perf_counter() - STARTED, 3)}
    if profiler is not None:
        import pstats

        profiler.disable()
        stats = pstats.Stats(profiler)
        row["phases_s"] = phase_seconds(stats)
        row["profile_top"] = profile_top(stats, seconds)
    if side == "nimble":
        want = np.asarray(jax.jit(fn)(params, x), np.float32)
        got = np.asarray(out, np.float32)
        row["max_abs_error"] = float(np.max(np.abs(got - want)))
        row["max_abs_value"] = float(np.max(np.abs(want)))
    return row


def fresh_env(root: str, cold_handler: bool) -> dict:
    """This process's environment for a child with empty kernel caches (a CuPy cache
    folder under `root`) and JAX's compilation cache off; with `cold_handler` an empty
    nimblejax cache too (the handler and the runtime's kernels built again)."""
    env = dict(os.environ)
    env["CUPY_CACHE_DIR"] = tempfile.mkdtemp(prefix="cupy-", dir=root)
    env["JAX_ENABLE_COMPILATION_CACHE"] = "false"
    env.pop("JAX_COMPILATION_CACHE_DIR", None)
    if cold_handler:
        env["NIMBLEJAX_CACHE_DIR"] = tempfile.mkdtemp(prefix="nimblejax-", dir=root)
    return env


def run_one(model: str, batch: int, side: str, root: str, cold_handler: bool,
            phases: bool = False, variant: tuple = ("nimble", {})) -> dict:
    """One side's first call in a fresh process; nimble's under `variant`'s environment
    (a label and the variables it sets: `--variant`), named in the row."""
    cmd = [sys.executable, "-m", "nimblejax.bench.first_call", "--child", model, str(batch), side]
    cmd += ["--phases"] if phases else []
    env = fresh_env(root, cold_handler)
    if side == "jax":  # a jax.jit program imports no nimblejax: no CuPy loading beside it
        env["NIMBLE_PRELOAD"] = "0"
    label = None
    if side == "nimble":
        label, extra = variant
        env.update(extra)
    done = subprocess.run(cmd, env=env, capture_output=True, text=True)
    lines = [ln for ln in done.stdout.splitlines() if ln.startswith("{")]
    if done.returncode != 0 or not lines:
        tail = (done.stderr or done.stdout).strip().splitlines()[-3:]
        row = {"model": model, "batch": batch, "side": side, "error": " | ".join(tail)}
    else:
        row = json.loads(lines[-1])
    if label is not None and label != "nimble":
        row["variant"] = label
    return row


def parse_variant(text: str) -> tuple:
    """`label:VAR=value,VAR=value` → (label, {VAR: value}): nimble's first call again
    under these environment variables (NIMBLE_DEFER_BUILD=0, say)."""
    label, sep, assignments = text.partition(":")
    pairs = [a.partition("=") for a in assignments.split(",") if a]
    if not sep or not label or not pairs or any(not name or not eq for name, eq, _ in pairs):
        raise argparse.ArgumentTypeError(f"--variant {text!r}: expected LABEL:VAR=VALUE[,VAR=VALUE]")
    return label, {name: value for name, _, value in pairs}


def _phase_table(rows: list[dict]) -> str:
    """Seconds per phase (under the profiler), a column per side of each model and batch."""
    timed = [r for r in rows if "phases_s" in r]
    head = "| phase | " + " | ".join(f"{r['model']} {r['batch']} {r.get('variant', r['side'])}"
                                     for r in timed) + " |"
    out = [head, "|---|" + "---|" * len(timed)]
    out.append("| first call (profiled) | " + " | ".join(str(r["first_call_s"]) for r in timed) + " |")
    for label, _, _ in PHASES:
        out.append(f"| {label.strip()} | " + " | ".join(str(r["phases_s"][label]) for r in timed) + " |")
    return "\n".join(out)


def _table(rows: list[dict]) -> str:
    """nimble's first call over jax.jit's per model and batch, a pair of columns per
    nimble variant; medians where `--rounds` ran each more than once."""
    labels = list(dict.fromkeys(r.get("variant", "nimble") for r in rows if r["side"] == "nimble"))
    labels = labels or ["nimble"]
    head = "| model | batch | jax.jit s | " + " | ".join(
        f"{label} s | {label} / jax.jit" for label in labels) + " |"
    out = [head, "|---|---|---|" + "---|---|" * len(labels)]
    for model, batch in dict.fromkeys((r["model"], r["batch"]) for r in rows):
        mine = [r for r in rows if (r["model"], r["batch"]) == (model, batch)]
        jax_rows = [r for r in mine if r["side"] == "jax"]
        js = _median([r["first_call_s"] for r in jax_rows if "first_call_s" in r])
        cells = [f"{js or '—'}"]
        for label in labels:
            ours = [r for r in mine if r["side"] == "nimble" and r.get("variant", "nimble") == label]
            ns = _median([r["first_call_s"] for r in ours if "first_call_s" in r])
            errors = [r["error"] for r in ours + jax_rows if "error" in r]
            ratio = f"{ns / js:.2f}" if js and ns else (errors[0] if errors else "—")
            cells += [f"{ns or '—'}", ratio]
        out.append(f"| {model} | {batch} | " + " | ".join(cells) + " |")
    return "\n".join(out)


def _median(values: list):
    return round(statistics.median(values), 3) if values else None


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--models", default="mlp,bert,lstm,resnet50,mobilenet_v2,efficientnet_b0,"
                                         "inception_v3,nasnet_mobile")
    ap.add_argument("--batch", default="1,32", help="comma-separated batch sizes")
    ap.add_argument("--cold-handler", action="store_true",
                    help="also rebuild nimble's XLA FFI handler and copy kernels (their first use after install)")
    ap.add_argument("--phases", action="store_true",
                    help="run each first call under cProfile and report where it went")
    ap.add_argument("--variant", action="append", type=parse_variant, default=[],
                    metavar="LABEL:VAR=VALUE[,VAR=VALUE]",
                    help="also time nimble's first call under these environment variables "
                         "(repeatable), e.g. inline:NIMBLE_DEFER_BUILD=0")
    ap.add_argument("--rounds", type=int, default=1,
                    help="run everything this many times, alternating; the table gives medians")
    ap.add_argument("--json", default=None, help="write the rows here")
    ap.add_argument("--child", nargs=3, metavar=("MODEL", "BATCH", "SIDE"), help=argparse.SUPPRESS)
    opts = ap.parse_args(argv)
    if opts.child:
        model, batch, side = opts.child
        print(json.dumps(child(model, int(batch), side, opts.phases)), flush=True)
        return
    rows = []
    with tempfile.TemporaryDirectory(prefix="nimblejax-first-call-") as root:
        runs = [("jax", ("nimble", {})), ("nimble", ("nimble", {}))] + [("nimble", v) for v in opts.variant]
        for _ in range(opts.rounds):
            for model in opts.models.split(","):
                for batch in (int(b) for b in opts.batch.split(",")):
                    for side, variant in runs:
                        rows.append(run_one(model, batch, side, root, opts.cold_handler, opts.phases, variant))
                        print(json.dumps(rows[-1]), flush=True)
    print(_table(rows))
    if opts.phases:
        print(_phase_table(rows))
        for r in rows:
            if r.get("side") == "nimble" and r.get("profile_top"):
                print(f"\n{r['model']} at batch {r['batch']}, nimble: the most cumulative seconds")
                for where, seconds, calls in r["profile_top"][:15]:
                    print(f"  {seconds:7.3f} s  {calls:>6}  {where}")
    if opts.json:
        with open(opts.json, "w") as fh:
            json.dump({"rows": rows}, fh, indent=1)


if __name__ == "__main__":
    main()

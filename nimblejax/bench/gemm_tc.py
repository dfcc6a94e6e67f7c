"""TF32 tensor-core GEMM kernel (compiler/lowering/gemm_tc.py) against cuBLASLt and XLA.

    python -m nimblejax.bench.gemm_tc [--sweep] [--no-xla] [--json PATH]

For each case (M, N, K and what follows the product: nothing, a bias, a bias and the
tanh GELU, a residual, an SGD update `w - lr * x.T @ dy`), in one process on one GPU:
- `tc`: a one-task nimble plan of the function with the kernel forced on (the tile
  `choose_tile` picks), and `lt`: the same plan with `tc_gemm=False`, cuBLASLt with its
  algorithm autotuned as plans do (both with `split_k=False`: one GEMM task, not
  partial products summed by a second kernel, canonicalize/split_k.py). GPU µs per
  launch from CUDA events around a CUDA graph of REPEATS launches of the plan's tasks,
  median of 5 (as bench/gemm_small.py);
- `xla`: jax.jit of the same function: its kernels' GPU µs per call from JAX's profiler
  (CUPTI), median over CALLS calls (a jitted call cannot be launched back to back without
  host gaps, so events would time the host); `tc*` and `lt*` are the two nimble plans'
  kernels timed the same way (their graphs' copy kernels left out), a cross-check;
- `rule`: whether the planner's rule (gemm_tc.takes_tc) takes the case;
- the largest error of each nimble path against jax.jit, relative to the largest value.
`--sweep` also times the kernel at every tile of SWEEP_TILES on each shape (the plain
product, raw launches of the kernel on CuPy arrays, checked against a float64 product of
the TF32-rounded operands), to choose `choose_tile`.
"""
from __future__ import annotations

import argparse
import contextlib
import json
import statistics

import jax
import jax.numpy as jnp
import numpy as np

# (M, N, K): an MLP's SGD step at batch 32, the LSTM's step GEMMs at batch 32, BERT's and
# GPT's dense layers at batch 1 (128 tokens).
SHAPES = ((32, 128, 64), (32, 64, 128), (32, 128, 10), (64, 128, 64), (32, 1024, 256),
          (32, 1024, 512), (32, 2048, 512), (128, 768, 768), (128, 2304, 768),
          (128, 3072, 768), (128, 768, 3072))
BERT = ((128, 768, 768), (128, 2304, 768), (128, 3072, 768), (128, 768, 3072))
# Shapes at the edges of the rule (gemm_tc.measured_faster): fewer rows, one full wave of
# blocks, the most a block may read.
EDGES = ((16, 128, 64), (8, 256, 256), (16, 1024, 512), (96, 512, 256), (128, 768, 32),
         (64, 2048, 256), (128, 1024, 256), (32, 4096, 256), (32, 4096, 512))
CASES = tuple((s, "plain") for s in SHAPES + EDGES) + tuple(
    (s, e) for s in BERT for e in ("bias", "bias_gelu", "residual")) + (
    ((32, 128, 64), "bias_relu"), ((32, 1024, 256), "bias_gelu"), ((32, 2048, 512), "residual"),
    ((64, 128, 32), "sgd"), ((128, 768, 32), "sgd"))
REPEATS = 100
CALLS = 30
MARKER = "nimble_bench_marker"


def case_fn(kind: str):
    """The function of a case and how to make its arguments from (M, N, K)."""
    fns = {
        "plain": lambda a, b: a @ b,
        "bias": lambda a, b, bias: a @ b + bias,
        "bias_gelu": lambda a, b, bias: jax.nn.gelu(a @ b + bias, approximate=True),
        "bias_relu": lambda a, b, bias: jax.nn.relu(a @ b + bias),
        "residual": lambda a, b, r: a @ b + r,
        "sgd": lambda x, dy, w: w - 0.01 * (x.T @ dy),  # C (M x N) = x.T (M x K) @ dy (K x N)
    }
    return fns[kind]


def case_args(m: int, n: int, k: int, kind: str, seed: int = 0) -> tuple:
    rng = np.random.default_rng(seed)

    def rand(*shape, scale=1.0):
        return jnp.asarray(rng.standard_normal(shape) * scale, jnp.float32)

    if kind == "sgd":
        return rand(k, m), rand(k, n), rand(m, n)
    a, b = rand(m, k), rand(k, n, scale=k ** -0.5)
    extra = {"plain": (), "bias": (rand(n),), "bias_gelu": (rand(n),), "bias_relu": (rand(n),),
             "residual": (rand(m, n),)}[kind]
    return (a, b) + extra


@contextlib.contextmanager
def kernel_forced():
    """Plans made inside take the kernel wherever it computes the GEMM (bench only)."""
    from nimblejax.compiler.lowering import gemm_tc

    rule = gemm_tc.measured_faster
    gemm_tc.measured_faster = lambda call: True
    try:
        yield
    finally:
        gemm_tc.measured_faster = rule


def plan_us(exe, repeats: int = REPEATS) -> float:
    """GPU µs of one run of the plan's tasks (all on one stream here), from a CUDA graph
    of `repeats` runs back to back."""
    from nimblejax.bench.timing import cuda_event_us

    tasks = exe.plan.schedule.order
    streams = {exe.plan.schedule.stream[t] for t in tasks}
    assert len(streams) == 1, "a one-GEMM plan runs on one stream"
    s0 = exe.streams[streams.pop()]
    s0.begin_capture()
    try:
        for _ in range(repeats):
            for t in tasks:
                exe.launch_task(t)
    finally:
        graph = s0.end_capture()
    return cuda_event_us(lambda: graph.launch(s0), s0, calls=20) / repeats


def _nimble(fn, args, tc: bool):
    import nimblejax as nimble

    f = nimble.jit(fn, backend="cuda", tc_gemm=tc, split_k=False)  # one GEMM task either way
    with kernel_forced() if tc else contextlib.nullcontext():
        out = f(*args)
    return f, f.executables()[-1], out


def measure_case(shape, kind: str) -> dict:
    """One case's row (module docstring), without the XLA and CUPTI figures."""
    from nimblejax.compiler.lowering import gemm_tc

    m, n, k = shape
    fn, args = case_fn(kind), case_args(m, n, k, kind)
    want = np.asarray(jax.jit(fn)(*args), np.float64)
    row = {"shape": f"{m}x{n}x{k}", "case": kind}
    for path, tc in (("tc", True), ("lt", False)):
        f, exe, out = _nimble(fn, args, tc)
        row[f"{path}_tasks"] = [t.name for t in exe.plan.schedule.order]
        row[f"{path}_us"] = plan_us(exe)
        row[f"{path}_err"] = float(np.abs(np.asarray(out, np.float64) - want).max() / np.abs(want).max())
        row[f"_{path}_fn"] = f
        if tc:
            gemms = [t.gemm for t in exe.plan.tasks if t.gemm is not None]
            row["rule"] = bool(gemms) and all(gemm_tc.takes_tc(g) for g in gemms)
            row["tile"] = gemm_tc.choose_tile(gemms[0]).label if gemms else "-"
    row["_args"], row["_fn"] = args, fn
    return row


# ---- XLA's (and nimble's) kernels from JAX's profiler ------------------------------------
def profile_us(fns: list, calls: int = CALLS) -> list[float | None]:
    """Median GPU µs of kernels per call of each (fn, args), all in one profile: a marker
    kernel launched between two functions splits the trace."""
    import glob
    import gzip
    import os
    import tempfile

    import cupy

    marker = cupy.RawKernel(f'extern "C" __global__ void {MARKER}() {{}}', MARKER)
    for fn, args in fns:  # warm: compiled, XLA's command buffer recorded
        for _ in range(3):
            jax.block_until_ready(fn(*args))
    with tempfile.TemporaryDirectory() as log_dir:
        with jax.profiler.trace(log_dir, create_perfetto_trace=True):
            for fn, args in fns:
                marker((1,), (1,), ())
                cupy.cuda.Device().synchronize()
                for _ in range(calls):
                    out = fn(*args)
                jax.block_until_ready(out)
            marker((1,), (1,), ())
            cupy.cuda.Device().synchronize()
        path = glob.glob(os.path.join(log_dir, "**", "perfetto_trace.json.gz"), recursive=True)[0]
        with gzip.open(path) as fh:
            events = json.load(fh)
    return split_calls(gpu_kernels(events), len(fns), calls)


def gpu_kernels(events) -> list[tuple[float, str, float]]:
    """(start, name, µs) of every GPU kernel of a perfetto trace, in time order."""
    events = events["traceEvents"] if isinstance(events, dict) else events
    gpu = {e["pid"] for e in events if e.get("ph") == "M" and e.get("name") == "process_name"
           and "GPU" in str(e.get("args", {}).get("name", "")).upper()}
    return sorted((float(e["ts"]), e["name"], float(e["dur"])) for e in events
                  if e.get("ph") == "X" and e.get("pid") in gpu and "dur" in e)


def split_calls(kernels, functions: int, calls: int) -> list[float | None]:
    """Per function (between markers), the median over calls of its kernels' µs per call
    (copy kernels of nimble's graphs left out); None where calls do not split evenly."""
    segments: list[list[float]] = []
    for _, name, us in kernels:
        if name.startswith(MARKER):
            segments.append([])
        elif segments and not name.startswith("nimble_ffi") and \
                not name.lower().startswith(("memcpy", "memset")):
            segments[-1].append(us)
    out: list[float | None] = []
    for seg in segments[:functions]:
        per = len(seg) // calls
        if per == 0 or len(seg) % calls:
            out.append(None)
            continue
        out.append(statistics.median(sum(seg[i * per:(i + 1) * per]) for i in range(calls)))
    return out + [None] * (functions - len(out))


# ---- the tile sweep ---------------------------------------------------------------------------
SWEEP_TILES = (
    (32, 8, 32, 1, 1, 4, 4), (32, 16, 32, 1, 1, 4, 4), (32, 32, 32, 1, 2, 2, 4),
    (32, 32, 64, 1, 2, 4, 2), (32, 64, 32, 1, 2, 2, 3), (32, 64, 32, 1, 2, 4, 3),
    (64, 32, 32, 2, 1, 2, 3), (64, 64, 32, 2, 2, 1, 2), (64, 64, 32, 2, 2, 2, 2),
    (64, 64, 16, 2, 2, 2, 4), (128, 32, 32, 4, 1, 1, 2), (128, 32, 32, 4, 1, 2, 2),
    (64, 128, 16, 2, 4, 1, 3), (128, 64, 16, 4, 2, 1, 3), (16, 32, 32, 1, 2, 4, 4))


def sweep(shapes=SHAPES, tiles=SWEEP_TILES) -> list[dict]:
    """The plain product of each shape at every tile: raw launches on CuPy arrays."""
    import cupy

    from nimblejax.bench.timing import cuda_event_us
    from nimblejax.compiler.ir import Var
    from nimblejax.compiler.lowering import gemm_tc
    from nimblejax.compiler.lowering.task import GemmCall
    from nimblejax.runtime.compile import compile_kernels

    jobs = []
    for m, n, k in shapes:
        f32 = np.dtype("float32")
        call = GemmCall(1, m, n, k, False, False, "float32", "tf32",
                        a=Var((m, k), f32), b=Var((k, n), f32), c=Var((m, n), f32))
        for t in tiles:
            tile = gemm_tc.Tile(*t)
            if tile.bm < 2 * m and gemm_tc.smem_floats(call, tile) * 4 <= gemm_tc.SMEM_BYTES:
                jobs.append(((m, n, k), tile, gemm_tc.tc_matmul(call, tile)))
    functions = compile_kernels(k for _, _, k in jobs)
    rows, stream = [], cupy.cuda.Stream(non_blocking=True)
    rng = np.random.default_rng(1)
    for (m, n, k), tile, kernel in jobs:
        a = rng.standard_normal((m, k)).astype(np.float32)
        b = (rng.standard_normal((k, n)) / np.sqrt(k)).astype(np.float32)
        da, db, dc = cupy.asarray(a), cupy.asarray(b), cupy.full((m, n), np.nan, np.float32)
        fn = functions[kernel.name]
        with stream:
            fn(kernel.grid, kernel.block, (dc, da, db), stream=stream)
            stream.synchronize()
            want = tf32(a).astype(np.float64) @ tf32(b).astype(np.float64)
            err = float(np.abs(cupy.asnumpy(dc) - want).max() / np.abs(want).max())
            stream.begin_capture()
            for _ in range(REPEATS):
                fn(kernel.grid, kernel.block, (dc, da, db), stream=stream)
            graph = stream.end_capture()
        us = cuda_event_us(lambda: graph.launch(stream), stream, calls=20) / REPEATS
        rows.append({"shape": f"{m}x{n}x{k}", "tile": tile.label, "blocks": int(np.prod(kernel.grid)),
                     "us": us, "err": err})
    return rows


def tf32(x: np.ndarray) -> np.ndarray:
    """float32 values rounded as cvt.rna.tf32.f32 does (finite values)."""
    u = x.astype(np.float32).view(np.uint32).astype(np.uint64)
    return ((u + 0x1000) & 0xFFFFE000).astype(np.uint32).view(np.float32)


def main(argv=None) -> int:
    from nimblejax.bench.needs_gpu import require_gpu

    require_gpu(__file__)
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sweep", action="store_true", help="also time every tile of SWEEP_TILES")
    parser.add_argument("--no-xla", action="store_true", help="skip the profiler (XLA's column)")
    parser.add_argument("--json", default="", help="write the rows here too")
    opts = parser.parse_args(argv)
    import cupy

    props = cupy.cuda.runtime.getDeviceProperties(cupy.cuda.Device().id)
    print(f"# {props['name'].decode()}, float32 TF32, jax {jax.__version__}", flush=True)
    result: dict = {"device": props["name"].decode()}
    if opts.sweep:
        result["sweep"] = sweep()
        _write(opts.json, result)
        print(f"{'M x N x K':>14}  {'tile':<26} {'blocks':>6} {'µs':>7} {'rel err':>9}")
        for row in result["sweep"]:
            print(f"{row['shape']:>14}  {row['tile']:<26} {row['blocks']:6d} {row['us']:7.2f} "
                  f"{row['err']:9.2e}", flush=True)
    rows = []
    for shape, kind in CASES:
        rows.append(measure_case(shape, kind))
        r = rows[-1]
        print(f"# {r['shape']} {kind}: tc {r['tc_us']:.2f} lt {r['lt_us']:.2f} µs", flush=True)
    if not opts.no_xla:
        fns = [(r[key], r["_args"]) for r in rows for key in ("_fn", "_tc_fn", "_lt_fn")]
        fns[0::3] = [(jax.jit(fn), args) for fn, args in fns[0::3]]
        try:
            with kernel_forced():  # (a call that plans again plans as the first did)
                times = profile_us(fns)
        except Exception as e:  # no CUPTI here: the table without those columns
            print(f"# profiler failed: {type(e).__name__}: {e}")
            times = [None] * len(fns)
        for i, r in enumerate(rows):
            r["xla_us"], r["tc_cupti_us"], r["lt_cupti_us"] = times[3 * i: 3 * i + 3]
    print(f"{'M x N x K':>14} {'case':<10} {'rule':<5} {'tile':<26} {'tc':>6} {'lt':>6} {'xla':>6} "
          f"{'tc*':>6} {'lt*':>6}  {'tc err':>8} {'lt err':>8}")
    fmt = lambda v: f"{v:6.2f}" if isinstance(v, float) else f"{'-':>6}"  # noqa: E731
    for r in rows:
        print(f"{r['shape']:>14} {r['case']:<10} {str(r['rule']):<5} {r['tile']:<26} "
              f"{fmt(r['tc_us'])} {fmt(r['lt_us'])} {fmt(r.get('xla_us'))} {fmt(r.get('tc_cupti_us'))} "
              f"{fmt(r.get('lt_cupti_us'))}  {r['tc_err']:8.1e} {r['lt_err']:8.1e}", flush=True)
        if len(r["tc_tasks"]) != 1 or len(r["lt_tasks"]) != 1:
            print(f"{'':>15}tasks: {r['tc_tasks']} / {r['lt_tasks']}")
    result["cases"] = [{k: v for k, v in r.items() if not k.startswith("_")} for r in rows]
    _write(opts.json, result)
    return 0


def _write(path: str, result: dict) -> None:
    if path:
        with open(path, "w") as fh:
            json.dump(result, fh, indent=1)


if __name__ == "__main__":
    raise SystemExit(main())

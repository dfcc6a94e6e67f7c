"""Small-M GEMM kernel (compiler/lowering/gemm_small.py) against cuBLASLt, on the GPU.

    python -m nimblejax.bench.gemm_small [--dtype float32|bfloat16] [--precision default|highest]
                                         [--columns 8,16,32]

For each (M, N, K), a one-dot nimble plan is built twice, with the small-M kernel off
(`small_gemm=False`: the cuBLASLt call; the TF32 kernel of gemm_tc.py off too) and on. Two GPU times from CUDA events, medians:
- `task`: the dot alone, from a CUDA graph of REPEATS back-to-back launches of its task
  (no graph-launch or host cost; what one LSTM step's GEMM costs inside a plan);
- `plan`: the plan's own graph launched back to back (one dot plus a graph launch).
It also prints the largest error against jax.jit relative to the output's largest value.
`--columns` also times the kernel at each given block width (columns per block; the
planner's own choice is gemm_small.columns_per_block), to tune that choice.
"""
from __future__ import annotations

import argparse

import jax
import jax.numpy as jnp
import numpy as np

SHAPES = ((1, 2048, 512), (32, 2048, 512), (8, 1024, 1024))
REPEATS = 100


def task_us(exe, repeats: int = REPEATS) -> float:
    """GPU µs of the plan's single task, launched `repeats` times inside one CUDA graph."""
    from nimblejax.bench.timing import cuda_event_us

    (task,) = exe.plan.tasks
    s0 = exe.streams[exe.plan.schedule.stream[task]]
    s0.begin_capture()
    try:
        for _ in range(repeats):
            exe.launch_task(task)
    finally:
        graph = s0.end_capture()
    return cuda_event_us(lambda: graph.launch(s0), s0, calls=20) / repeats


def measure(m: int, n: int, k: int, dtype, precision: str, columns: tuple[int, ...] = ()) -> list[dict]:
    """One row per path: cuBLASLt, the kernel as planned, then at each of `columns`."""
    from nimblejax.compiler.lowering import gemm_small

    rng = np.random.default_rng(0)
    a = jnp.asarray(rng.standard_normal((m, k)), dtype)
    b = jnp.asarray(rng.standard_normal((k, n)) / np.sqrt(k), dtype)
    dot = lambda a, b: jnp.matmul(a, b, precision=None if precision == "default" else precision)  # noqa: E731
    want = np.asarray(jax.jit(dot)(a, b), np.float64)
    rows = [_row(dot, a, b, want, False, ""), _row(dot, a, b, want, True, "")]
    planned = gemm_small.columns_per_block
    try:
        for cols in columns:
            gemm_small.columns_per_block = lambda n, cols=cols: cols  # noqa: E731 (bench only)
            rows.append(_row(dot, a, b, want, True, f" [{cols} cols]"))
    finally:
        gemm_small.columns_per_block = planned
    return rows


def _row(dot, a, b, want: np.ndarray, small: bool, note: str) -> dict:
    import nimblejax as nimble
    from nimblejax.bench.timing import nimble_gpu_us

    f = nimble.jit(dot, backend="cuda", small_gemm=small, tc_gemm=False)  # against cuBLASLt
    got = np.asarray(f(a, b), np.float64)
    (exe,) = f.executables()
    (task,) = exe.plan.tasks
    m, k = a.shape
    return {"shape": f"{m}x{b.shape[1]}x{k}", "path": task.name + note, "task_us": task_us(exe),
            "plan_us": nimble_gpu_us(f),
            "rel_err": float(np.abs(got - want).max() / np.abs(want).max())}


def main(argv=None) -> int:
    from nimblejax.bench.needs_gpu import require_gpu

    require_gpu(__file__)
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dtype", default="float32", choices=("float32", "bfloat16"))
    parser.add_argument("--precision", default="default", choices=("default", "highest"))
    parser.add_argument("--columns", default="", help="also time these block widths, e.g. 8,16,32")
    opts = parser.parse_args(argv)
    columns = tuple(int(c) for c in opts.columns.split(",") if c)
    import cupy

    props = cupy.cuda.runtime.getDeviceProperties(cupy.cuda.Device().id)
    print(f"# {props['name'].decode()}, {opts.dtype}, precision={opts.precision}, "
          f"jax {jax.__version__}")
    print(f"{'M x N x K':>14}  {'path':<46} {'task µs':>8} {'plan µs':>8} {'rel err':>9}")
    for m, n, k in SHAPES:
        for row in measure(m, n, k, jnp.dtype(opts.dtype), opts.precision, columns):
            print(f"{row['shape']:>14}  {row['path']:<46} {row['task_us']:8.2f} "
                  f"{row['plan_us']:8.2f} {row['rel_err']:9.2e}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

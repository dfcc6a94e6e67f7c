"""Per-task GPU times of a compiled plan: where a model's GPU time goes.

Every task is launched on its planned stream (so it uses that stream's cuBLAS and cuDNN
handles), but serialized: each one waits for the previous one's end event. A spin
kernel holds the GPU first, so the launches queue up behind it and the tasks then run
back to back: the time between a task's two events is the task alone, not the host's
launch rate.

    from nimblejax.bench.profile import task_times, summarize
    rows = task_times(f.executables()[-1])      # one dict per task, µs
    print(summarize(rows))
"""
from __future__ import annotations

import re
import statistics
from collections import defaultdict

from nimblejax.compiler.kinds import TaskKind

SPIN_SOURCE = r'''
extern "C" __global__ void nimble_profile_spin(long long cycles) {
  long long start = clock64();
  while (clock64() - start < cycles) { }
}
'''


def task_family(task) -> str:
    """A coarse name to add tasks up by: kernel name without its hash, or the library."""
    if task.kind is TaskKind.GEMM:
        return "cublas gemm"
    if task.kind is TaskKind.CUDNN:
        c = task.conv
        if c.mode != "forward":
            return f"cudnn conv {c.mode.replace('_', ' ')}"
        return "cudnn conv depthwise" if c.groups > 1 and c.groups == c.x.shape[-1] else "cudnn conv"
    name = re.sub(r"_[0-9a-f]{4}$", "", task.kernel.name).removeprefix("nimble_")
    return name


def task_category(task) -> str:
    """gemm / conv / a kernel's template (fused, reduce, …): the first word of its name."""
    if task.kind in ("gemm", "cudnn"):
        return {"gemm": "cublas", "cudnn": "cudnn"}[task.kind]
    return task_family(task).split("_")[0]


def task_times(exe, repeats: int = 5, spin_ms: float = 50.0) -> list[dict]:
    """Median GPU µs of every launched task of executable `exe`, in launch order, on the
    GPU that holds its streams (a plan runs on every GPU it may be placed on)."""
    import cupy

    with cupy.cuda.Device(exe.device):
        return _task_times(exe, repeats, spin_ms)


def _task_times(exe, repeats: int, spin_ms: float) -> list[dict]:
    import cupy

    sched = exe.plan.schedule
    order = list(sched.order)
    spin = cupy.RawKernel(SPIN_SOURCE, "nimble_profile_spin")
    clock_khz = cupy.cuda.runtime.getDeviceProperties(cupy.cuda.Device().id)["clockRate"]
    cycles = int(spin_ms * clock_khz)
    samples: dict = defaultdict(list)
    for _ in range(repeats):
        events = [(cupy.cuda.Event(), cupy.cuda.Event()) for _ in order]
        s0 = exe.streams[0]
        spin((1,), (1,), (cupy.int64(cycles),), stream=s0)
        last = cupy.cuda.Event(disable_timing=True)
        last.record(s0)
        for task, (start, stop) in zip(order, events):
            stream = exe.streams[sched.stream[task]]
            stream.wait_event(last)
            start.record(stream)
            exe.launch_task(task)
            stop.record(stream)
            last = stop
        s0.wait_event(last)
        s0.synchronize()
        for task, (start, stop) in zip(order, events):
            samples[task].append(cupy.cuda.get_elapsed_time(start, stop) * 1e3)
    rows = []
    for task in order:
        row = {"task": task.name, "kind": task.kind, "family": task_family(task),
               "category": task_category(task), "us": statistics.median(samples[task]),
               "source": task.source, "out_shape": list(task.outputs[0].shape) if task.outputs else []}
        if task.kind is TaskKind.KERNEL:
            row.update(kernel=task.kernel.name, grid=task.kernel.grid[0], block=task.kernel.block[0])
        elif task.kind is TaskKind.GEMM:
            g = task.gemm
            row.update(gemm=f"{g.batch}x{g.m}x{g.n}x{g.k}")
        elif task.kind is TaskKind.CUDNN:
            c = task.conv
            row.update(conv=f"x{list(c.x.shape)} w{list(c.w.shape)} s{c.strides[0]} g{c.groups}")
        rows.append(row)
    return rows


def group(rows: list[dict], key: str) -> list[tuple[str, int, float]]:
    """(name, tasks, total µs) by `key`, largest total first."""
    totals: dict = defaultdict(lambda: [0, 0.0])
    for r in rows:
        totals[r[key]][0] += 1
        totals[r[key]][1] += r["us"]
    return sorted(((k, n, us) for k, (n, us) in totals.items()), key=lambda t: -t[2])


def summarize(rows: list[dict], top: int = 12) -> str:
    """A short text report: totals by category and family, and the slowest tasks."""
    total = sum(r["us"] for r in rows)
    lines = [f"{len(rows)} tasks, serial sum {total:.0f} µs"]
    lines.append("  by category: " + ", ".join(f"{k} {n}× {us:.0f} µs ({100 * us / total:.0f}%)"
                                                for k, n, us in group(rows, "category")))
    lines.append("  by family:")
    for k, n, us in group(rows, "family")[:top]:
        lines.append(f"    {us:9.1f} µs {100 * us / total:5.1f}%  {n:4d}×  {k}")
    lines.append("  slowest tasks:")
    for r in sorted(rows, key=lambda r: -r["us"])[:top]:
        what = r.get("kernel") or r.get("gemm") or r.get("conv") or r["task"]
        extra = f" grid {r['grid']}×{r['block']}" if "grid" in r else ""
        lines.append(f"    {r['us']:9.1f} µs  {what} -> {r['out_shape']}{extra}  ({r['source']})")
    return "\n".join(lines)

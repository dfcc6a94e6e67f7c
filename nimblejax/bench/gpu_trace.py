"""GPU activity from JAX's profiler (CUPTI), for the tracing tools in examples/gpu/
(trace_kernels.py, trace_call_gaps.py, trace_data_parallel.py): every kernel and copy
the GPUs ran while a function ran under `jax.profiler.trace`, read from the perfetto
trace it writes."""
from __future__ import annotations

import glob
import gzip
import json
import os
import tempfile
from typing import Callable, NamedTuple


class Activity(NamedTuple):
    """One kernel or copy on a GPU: start and duration in µs, its name, the GPU's
    process name in the trace, and its stream (the trace's thread id)."""

    start: float
    dur: float
    name: str
    gpu: str
    stream: int

    @property
    def end(self) -> float:
        return self.start + self.dur


def traced(run: Callable[[], object]) -> list[Activity]:
    """The GPU activity while `run()` runs under the profiler, sorted by start."""
    import jax.profiler

    with tempfile.TemporaryDirectory() as log_dir:
        with jax.profiler.trace(log_dir, create_perfetto_trace=True):
            run()
        return read(log_dir)


def read(log_dir: str) -> list[Activity]:
    """The GPU activity of the perfetto trace under `log_dir`, sorted by start."""
    path = glob.glob(os.path.join(log_dir, "**", "perfetto_trace.json.gz"), recursive=True)[0]
    with gzip.open(path) as fh:
        events = json.load(fh)
    events = events["traceEvents"] if isinstance(events, dict) else events
    names = {e["pid"]: str(e.get("args", {}).get("name", "")) for e in events
             if e.get("ph") == "M" and e.get("name") == "process_name"}
    gpus = {pid: n for pid, n in names.items() if "GPU" in n.upper()}
    return sorted(Activity(float(e["ts"]), float(e["dur"]), e["name"], gpus[e["pid"]], e.get("tid", 0))
                  for e in events if e.get("ph") == "X" and e.get("pid") in gpus and "dur" in e)


def union(intervals) -> list[tuple[float, float]]:
    """The union of (start, end) intervals, as disjoint intervals in order."""
    merged: list[list[float]] = []
    for a, b in sorted(intervals):
        if merged and a <= merged[-1][1]:
            merged[-1][1] = max(merged[-1][1], b)
        else:
            merged.append([a, b])
    return [(a, b) for a, b in merged]


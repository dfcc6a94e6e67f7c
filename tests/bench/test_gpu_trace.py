"""Reading GPU activity from a perfetto trace (bench/gpu_trace.py, used by the tracing
examples): only GPU processes' complete events, in order, with their GPU and stream."""
from __future__ import annotations

import gzip
import json
import os

from nimblejax.bench import gpu_trace


def write_trace(folder: str, events: list) -> None:
    path = os.path.join(folder, "plugins", "profile", "run")
    os.makedirs(path)
    with gzip.open(os.path.join(path, "perfetto_trace.json.gz"), "wt") as fh:
        json.dump({"traceEvents": events}, fh)


def test_read_keeps_the_gpus_kernels_in_order(tmp_path):
    write_trace(str(tmp_path), [
        {"ph": "M", "name": "process_name", "pid": 1, "args": {"name": "/host:CPU"}},
        {"ph": "M", "name": "process_name", "pid": 7, "args": {"name": "/device:GPU:0"}},
        {"ph": "X", "pid": 7, "tid": 3, "ts": 20.0, "dur": 4.0, "name": "nimble_b"},
        {"ph": "X", "pid": 7, "tid": 2, "ts": 10.0, "dur": 5.0, "name": "nimble_a"},
        {"ph": "X", "pid": 1, "tid": 1, "ts": 0.0, "dur": 50.0, "name": "host work"},
        {"ph": "i", "pid": 7, "ts": 12.0, "name": "an instant"},
    ])
    got = gpu_trace.read(str(tmp_path))
    assert [(a.start, a.end, a.name, a.gpu, a.stream) for a in got] == [
        (10.0, 15.0, "nimble_a", "/device:GPU:0", 2), (20.0, 24.0, "nimble_b", "/device:GPU:0", 3)]


def test_union_merges_overlapping_intervals():
    assert gpu_trace.union([(5, 8), (0, 3), (2, 4), (8, 9)]) == [(0, 4), (5, 9)]
    assert gpu_trace.union([]) == []

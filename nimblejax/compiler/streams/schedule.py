"""A launch schedule: tasks in launch order, their streams and event syncs.

``happens_before`` answers from vector clocks computed once: for each task,
per stream, the highest stream sequence number that has finished before the
task may start.  That is O(tasks x streams) memory and O(1) per query, which
the memory planner and race verifier need because they ask many times.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from types import MappingProxyType
from typing import Hashable, Iterable, Mapping

import networkx as nx
import numpy as np

from nimblejax.compiler.streams.assign import assign_streams

Task = Hashable

# The most streams a plan uses when Options.max_streams is not given. Nimble's matching
# gives one stream per chain, and an unrolled loop has a chain per iteration for the work
# off its carry's path (an RNN scan of T=256 steps: 258 chains). Beyond some number,
# more streams buy nothing: an H100 (compute capability 9.0) keeps at most 128 grids
# resident and has 32 hardware work queues, while each extra stream that runs a GEMM
# holds a cuBLAS workspace of its own (runtime/launch.py: 4 MiB a side stream). 64 keeps
# every plan of the measured model suite as it was (the most: Inception-v3 at batch 32,
# 54 streams, BENCHMARKS.md run E) and packs longer unrolls (assign.py `_pack`).
STREAM_CAP = 64


@dataclass(frozen=True)
class Schedule:
    """Tasks in ``order`` (a valid single-thread launch order), each on
    ``stream[task]``; a sync (u, v) means u records an event that v's
    stream waits on before v."""

    order: tuple
    stream: Mapping
    syncs: tuple
    num_streams: int
    _index: Mapping = field(init=False, repr=False, compare=False)
    _seq: tuple = field(init=False, repr=False, compare=False)
    _waits: Mapping = field(init=False, repr=False, compare=False)
    _clock: np.ndarray = field(init=False, repr=False, compare=False)
    _recorders: frozenset = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        index = _check_order(self.order, self.stream, self.num_streams)
        waits = _check_syncs(self.syncs, index)
        seq = _stream_sequence(self.order, self.stream, self.num_streams)
        clock = _vector_clocks(self.order, self.stream, seq, waits, index, self.num_streams)
        # Frozen dataclass: derived caches are set once, here, and never change.
        object.__setattr__(self, "stream", MappingProxyType(dict(self.stream)))
        object.__setattr__(self, "_index", MappingProxyType(index))
        object.__setattr__(self, "_seq", tuple(seq))
        object.__setattr__(self, "_waits", MappingProxyType(waits))
        object.__setattr__(self, "_clock", clock)
        object.__setattr__(self, "_recorders", frozenset(u for u, _ in self.syncs))

    @classmethod
    def from_parts(cls, order: Iterable[Task], stream: Mapping[Task, int],
                   syncs: Iterable[tuple[Task, Task]]) -> "Schedule":
        """Build any schedule (e.g. one with an event removed, for tests)."""
        order = tuple(order)
        num = 1 + max((stream[t] for t in order), default=-1)
        return cls(order, dict(stream), tuple((u, v) for u, v in syncs), num)

    def happens_before(self, u: Task, v: Task) -> bool:
        """True when u is guaranteed to complete before v starts."""
        iu, iv = self._index[u], self._index[v]
        if iu == iv:
            return False
        return int(self._clock[iv, self.stream[u]]) >= self._seq[iu]

    def waits(self, v: Task) -> tuple:
        """Tasks whose events v's stream waits on right before v."""
        return self._waits.get(v, ())

    def records(self, u: Task) -> bool:
        """Whether u records an event (some sync starts at u)."""
        return u in self._recorders

    def tasks_on(self, s: int) -> tuple:
        """Stream s's tasks in stream order."""
        return tuple(t for t in self.order if self.stream[t] == s)

    def stream_position(self, t: Task) -> int:
        """t's sequence number within its own stream."""
        return self._seq[self._index[t]]

    def vector_clock(self, t: Task) -> np.ndarray:
        """Per stream, the highest stream position finished before t starts (-1: none)."""
        return self._clock[self._index[t]]


def make_schedule(dag: nx.DiGraph, max_streams: int | None = None, weight=None) -> Schedule:
    """Nimble's assignment of `dag` on at most `max_streams` streams (None: STREAM_CAP);
    `weight(task)`: its estimated time (assign.py, step 4)."""
    a = assign_streams(dag, STREAM_CAP if max_streams is None else max_streams, weight=weight)
    return Schedule.from_parts(a.order, a.stream, a.syncs)


def critical_path(dag: nx.DiGraph) -> int:
    """Number of tasks on the longest path of ``dag`` (0 when empty)."""
    longest: dict = {}
    for v in nx.topological_sort(dag):
        longest[v] = 1 + max((longest[u] for u in dag.predecessors(v)), default=0)
    return max(longest.values(), default=0)


def _check_order(order: tuple, stream: Mapping, num_streams: int) -> dict:
    index = {t: i for i, t in enumerate(order)}
    if len(index) != len(order):
        raise ValueError("a task appears twice in the launch order")
    if set(stream) != set(index):
        raise ValueError("stream must map exactly the tasks in order")
    for t, s in stream.items():
        if not isinstance(s, (int, np.integer)) or not 0 <= s < num_streams:
            raise ValueError(f"task {t!r} has invalid stream {s!r} (num_streams={num_streams})")
    return index


def _check_syncs(syncs: tuple, index: Mapping) -> dict:
    waits: dict = {}
    for u, v in syncs:
        if u not in index or v not in index:
            raise ValueError(f"sync {(u, v)!r} names a task outside the schedule")
        # A wait on an event recorded later in launch order would wait on
        # nothing (CUDA waits on the latest record), so refuse it outright.
        if index[u] >= index[v]:
            raise ValueError(f"sync {(u, v)!r}: recorder must be launched before the waiter")
        waits.setdefault(v, []).append(u)
    return {v: tuple(us) for v, us in waits.items()}


def _stream_sequence(order: tuple, stream: Mapping, num_streams: int) -> list[int]:
    count = [0] * num_streams
    seq = []
    for t in order:
        s = stream[t]
        seq.append(count[s])
        count[s] += 1
    return seq


def _vector_clocks(order, stream, seq, waits, index, k) -> np.ndarray:
    """Row i: per stream, the highest sequence number finished before order[i]."""
    clock = np.full((len(order), k), -1, dtype=np.int32)
    last = [-1] * k
    for i, t in enumerate(order):
        row = clock[i]
        before = [index[u] for u in waits.get(t, ())]
        if last[stream[t]] >= 0:
            before.append(last[stream[t]])
        for j in before:
            np.maximum(row, clock[j], out=row)
            s = stream[order[j]]
            row[s] = max(row[s], seq[j])  # j itself has finished too
        last[stream[t]] = i
    return clock

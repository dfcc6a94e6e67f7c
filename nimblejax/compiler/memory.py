"""Arena memory plan: one allocation, every buffer at a fixed aligned offset.

Two buffers may share bytes only when one is finished with before the other
starts, *under the schedule's happens-before* rather than launch order: on
parallel streams launch order says nothing about execution order, so reuse
across streams is only legal through an event (or stream order).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Hashable, Iterable, Mapping

import numpy as np

from nimblejax.compiler.streams.schedule import Schedule

Buf = Hashable
Task = Hashable


def format_bytes(n: float) -> str:
    """A byte count in binary units, the one convention of every report: 512 B,
    1.5 KiB, 3.0 MiB, 1.2 GiB."""
    if n < 1024:
        return f"{int(n)} B"
    for unit in ("KiB", "MiB", "GiB"):
        n /= 1024
        if n < 1024 or unit == "GiB":
            return f"{n:.1f} {unit}"
    raise AssertionError("unreachable")


@dataclass(frozen=True)
class MemoryPlan:
    offsets: dict
    arena_bytes: int
    no_reuse_bytes: int
    peak_live_bytes: int
    alignment: int = 256

    def describe(self) -> str:
        return (f"arena {format_bytes(self.arena_bytes)} (no reuse {format_bytes(self.no_reuse_bytes)}, "
                f"single-stream peak {format_bytes(self.peak_live_bytes)})")


@dataclass(frozen=True)
class _Use:
    """Who touches one buffer."""

    writers: frozenset
    accessors: frozenset


def plan_memory(schedule: Schedule, sizes: Mapping[Buf, int],
                reads: Mapping[Task, Iterable[Buf]], writes: Mapping[Task, Iterable[Buf]],
                pinned: Iterable[Buf] = (), alignment: int = 256) -> MemoryPlan:
    """Place every buffer in one arena, first-fit, reusing memory only when safe.

    Buffer B may overlap an earlier-placed buffer E only if every access of E
    happens-before every *first* access of B (accesses of B with no other
    access of B before them -- normally just its producer).  Buffers written
    by no task count as written before everything.  Pinned buffers overlap
    nothing.  Buffers are placed pinned first, then by first write.
    """
    if not isinstance(alignment, int) or alignment < 1:
        raise ValueError(f"alignment must be a positive int, got {alignment!r}")
    pinned = frozenset(pinned)
    uses = _uses(schedule, sizes, reads, writes, pinned)
    aligned = {b: _align(sizes[b], alignment) for b in sizes}
    pos = {t: i for i, t in enumerate(schedule.order)}
    order = sorted(sizes, key=_placement_key(uses, pinned, pos, list(sizes)))
    offsets = _place(schedule, order, uses, aligned, pinned)
    return MemoryPlan(
        offsets=offsets,
        arena_bytes=max((offsets[b] + aligned[b] for b in sizes), default=0),
        no_reuse_bytes=sum(aligned.values()),
        peak_live_bytes=_single_stream_peak(uses, aligned, pos),
        alignment=alignment,
    )


def _uses(schedule, sizes, reads, writes, pinned) -> dict:
    writers: dict = {b: set() for b in sizes}
    accessors: dict = {b: set() for b in sizes}
    for table, is_write in ((reads, False), (writes, True)):
        for task, bufs in table.items():
            if task not in schedule.stream:
                raise ValueError(f"task {task!r} is not in the schedule")
            for b in bufs:
                if b not in sizes:
                    raise ValueError(f"task {task!r} touches buffer {b!r} with no size")
                accessors[b].add(task)
                if is_write:
                    writers[b].add(task)
    for b, n in sizes.items():
        if int(n) < 0:
            raise ValueError(f"buffer {b!r} has negative size {n}")
    if not pinned <= set(sizes):
        raise ValueError(f"pinned buffers without a size: {sorted(map(repr, pinned - set(sizes)))}")
    return {b: _Use(frozenset(writers[b]), frozenset(accessors[b])) for b in sizes}


def _align(n: int, alignment: int) -> int:
    return -(-int(n) // alignment) * alignment


def _placement_key(uses, pinned, pos, given):
    rank = {b: i for i, b in enumerate(given)}

    def key(b):
        u = uses[b]
        first_write = min((pos[t] for t in u.writers), default=-1)
        first_access = min((pos[t] for t in u.accessors), default=-1)
        return (b not in pinned, first_write, first_access, rank[b])
    return key


def _first_accesses(schedule: Schedule, use: _Use) -> list:
    acc = list(use.accessors)
    return [y for y in acc if not any(schedule.happens_before(x, y) for x in acc if x != y)]


@dataclass(frozen=True)
class _LastUses:
    """For buffers in placement order, the last access on each stream they
    touch, flattened: row r says buffer owner[r] is last touched on stream[r]
    at stream position seq[r].  Buffers touch few streams, so testing
    "finished before task y" costs O(rows), not O(buffers x streams)."""

    owner: np.ndarray
    stream: np.ndarray
    seq: np.ndarray
    cut: np.ndarray  # rows of the first i buffers: [0, cut[i])

    @classmethod
    def build(cls, schedule: Schedule, order: list, uses: dict) -> "_LastUses":
        owner, stream, seq, cut = [], [], [], [0]
        for i, b in enumerate(order):
            last: dict = {}
            for t in uses[b].accessors:
                s = schedule.stream[t]
                last[s] = max(last.get(s, -1), schedule.stream_position(t))
            for s, q in last.items():
                owner.append(i)
                stream.append(s)
                seq.append(q)
            cut.append(len(owner))
        return cls(*(np.asarray(x, dtype=np.int64) for x in (owner, stream, seq, cut)))

    def unfinished(self, i: int, clock: np.ndarray) -> np.ndarray:
        """Mask over buffers [0, i): some access not finished before a task with this clock."""
        c = self.cut[i]
        late = clock[self.stream[:c]] < self.seq[:c]
        mask = np.zeros(i, dtype=bool)
        mask[self.owner[:c][late]] = True
        return mask

    def touched(self, i: int) -> np.ndarray:
        mask = np.zeros(i, dtype=bool)
        mask[self.owner[:self.cut[i]]] = True
        return mask


def _busy(schedule, i: int, b, use: _Use, last: _LastUses) -> np.ndarray:
    """Mask over placed buffers [0, i) that b must not overlap."""
    if not use.writers:
        # Written before everything: only never-touched buffers are finished by then.
        return last.touched(i)
    busy = np.zeros(i, dtype=bool)
    for y in _first_accesses(schedule, use):
        busy |= last.unfinished(i, schedule.vector_clock(y))
    return busy


def _place(schedule: Schedule, order: list, uses: dict, aligned: dict, pinned) -> dict:
    n = len(order)
    last = _LastUses.build(schedule, order, uses)
    is_pinned = np.array([b in pinned for b in order], dtype=bool)
    start = np.zeros(n, dtype=np.int64)
    end = np.zeros(n, dtype=np.int64)
    offsets = {}
    for i, b in enumerate(order):
        if b in pinned:
            busy = np.ones(i, dtype=bool)
        else:
            busy = _busy(schedule, i, b, uses[b], last) | is_pinned[:i]
        busy &= end[:i] > start[:i]  # empty buffers occupy nothing
        offsets[b] = _first_fit(start[:i][busy], end[:i][busy], aligned[b])
        start[i], end[i] = offsets[b], offsets[b] + aligned[b]
    return offsets


def _first_fit(starts: np.ndarray, ends: np.ndarray, size: int) -> int:
    """Lowest offset where [offset, offset+size) misses every busy interval.

    All bounds are aligned already, so the answer is aligned too."""
    if len(starts) == 0:
        return 0
    by_start = np.argsort(starts, kind="stable")
    s, e = starts[by_start], ends[by_start]
    reach = np.maximum.accumulate(e)
    frontier = np.concatenate(([0], reach[:-1]))  # end of everything left of interval j
    fits = np.flatnonzero(s - frontier >= size)
    return int(frontier[fits[0]] if len(fits) else reach[-1])


def _single_stream_peak(uses: dict, aligned: dict, pos: dict) -> int:
    """Peak live bytes along the launch order: a lower bound on any valid
    arena, since buffers live at the same launch step can never share."""
    delta = np.zeros(len(pos) + 1, dtype=np.int64)
    for b, u in uses.items():
        if not u.accessors:
            continue
        first = min(pos[t] for t in u.accessors) if u.writers else 0
        delta[first] += aligned[b]
        delta[max(pos[t] for t in u.accessors) + 1] -= aligned[b]
    return int(np.cumsum(delta).max(initial=0))

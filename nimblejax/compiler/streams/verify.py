"""Race verifier: every two tasks whose memory overlaps, one of them writing,
must be ordered by the schedule's happens-before.

This is checked independently of how the memory plan was made, so it also
catches a missing event on a plain producer -> consumer edge (the same
buffer, two tasks).  One task touching two *different* buffers that overlap,
one written, is reported too: kernels are not written to work in place.  A sweep over byte intervals visits only buffer pairs
that actually overlap instead of all task pairs.
"""
from __future__ import annotations

from dataclasses import dataclass
from itertools import combinations
from typing import Hashable, Iterable, Iterator, Mapping

from nimblejax.compiler.streams.schedule import Schedule

READ, WRITE = "read", "write"


@dataclass(frozen=True)
class Violation:
    """Two unordered tasks touching overlapping bytes [start, stop), one writing."""

    task_a: Hashable
    buffer_a: Hashable
    access_a: str
    task_b: Hashable
    buffer_b: Hashable
    access_b: str
    start: int
    stop: int

    def __str__(self) -> str:
        if self.task_a == self.task_b:
            return (f"aliasing: task {self.task_a!r} {self.access_a}s {self.buffer_a!r} and "
                    f"{self.access_b}s {self.buffer_b!r}, which overlap in bytes "
                    f"[{self.start}, {self.stop})")
        return (f"race: task {self.task_a!r} {self.access_a}s {self.buffer_a!r} and task "
                f"{self.task_b!r} {self.access_b}s {self.buffer_b!r}; bytes "
                f"[{self.start}, {self.stop}) overlap and neither task happens-before the other")


@dataclass(frozen=True)
class _Span:
    start: int
    stop: int
    buf: Hashable
    writers: tuple
    readers: tuple


def verify(schedule: Schedule, memory_plan, sizes: Mapping, reads: Mapping[Hashable, Iterable],
           writes: Mapping[Hashable, Iterable]) -> list[Violation]:
    """All races of ``memory_plan`` under ``schedule``; empty when it is safe."""
    out: list[Violation] = []
    active: list[_Span] = []
    for span in _spans(memory_plan.offsets, sizes, reads, writes):
        active = [a for a in active if a.stop > span.start]
        out.extend(_races(schedule, span, span))
        for other in active:
            out.extend(_races(schedule, other, span))
        active.append(span)
    return out


def _spans(offsets: Mapping, sizes: Mapping, reads: Mapping, writes: Mapping) -> list[_Span]:
    """Byte ranges of accessed, non-empty buffers, by start offset."""
    mode: dict = {}
    for table, kind in ((reads, READ), (writes, WRITE)):
        for task, bufs in table.items():
            for b in bufs:
                per = mode.setdefault(b, {})
                # A task that reads and writes a buffer counts as a writer.
                per[task] = WRITE if kind == WRITE or per.get(task) == WRITE else READ
    spans = []
    for b, per in mode.items():
        if b not in offsets or b not in sizes:
            raise ValueError(f"buffer {b!r} is accessed but has no offset or size")
        if int(sizes[b]) > 0:
            w = tuple(t for t, m in per.items() if m == WRITE)
            r = tuple(t for t, m in per.items() if m == READ)
            spans.append(_Span(offsets[b], offsets[b] + int(sizes[b]), b, w, r))
    spans.sort(key=lambda s: s.start)
    return spans


def _races(schedule: Schedule, a: _Span, b: _Span) -> Iterator[Violation]:
    lo, hi = max(a.start, b.start), min(a.stop, b.stop)
    for (t1, m1), (t2, m2) in _conflicting_pairs(a, b):
        if t1 == t2 and a is b:
            continue  # one task touching one buffer twice
        if not (schedule.happens_before(t1, t2) or schedule.happens_before(t2, t1)):
            yield Violation(t1, a.buf, m1, t2, b.buf, m2, lo, hi)


def _conflicting_pairs(a: _Span, b: _Span) -> Iterator[tuple]:
    """Task pairs with at least one write; each unordered pair once when a is b."""
    if a is b:
        yield from combinations([(t, WRITE) for t in a.writers], 2)
        for w in a.writers:
            for r in a.readers:
                yield (w, WRITE), (r, READ)
        return
    for w in a.writers:
        for t, m in [(t, WRITE) for t in b.writers] + [(t, READ) for t in b.readers]:
            yield (w, WRITE), (t, m)
    for r in a.readers:
        for w in b.writers:
            yield (r, READ), (w, WRITE)

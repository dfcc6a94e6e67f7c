"""Segments: one plan launched as several CUDA graphs in a row, each handing back the
outputs it has finished, so that the XLA program around the call can start on them (an
all-reduce of the last layers' gradients) while the next graph computes
(`Options.segments`; runtime/ffi_runner.py launches them).

A segment is a consistent cut of the schedule: every task that happens before one of its
tasks (earlier on its stream, or through an event) is in it or in an earlier segment.
Run one after another, each joined into one stream before the next starts, the segments
order every pair of tasks at least as strictly as the plan's streams and events do. So
every reuse of arena bytes the memory plan made stays safe, and what a later segment
reads stays in the arena in between (one plan, one arena; the handler refuses a call
that interleaves the segments of two calls).

Where the cuts fall: an output is ready once every task writing its buffer has run; with
everything that happens before them, that is a cut of the schedule, whose cost is the
estimated GPU time of its tasks (compiler/costs.py). Between the cheapest output's cost
and the dearest one's, segment k of n ends at the union of the cuts of the outputs that
cost at most k/n of the way (a training step's loss is ready after the forward pass,
its last layers' gradients soon after, its first layers' last). A segment that would
finish no new output merges into the next (the last one into the one before it): each
segment hands back at least one output, and the next segment's call takes it as its
operand, which orders the calls in XLA's program.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import numpy as np

from nimblejax.compiler.costs import estimate_us


@dataclass(frozen=True)
class Segment:
    """`tasks` in launch order; `outputs`, indices into `plan.output_buffers`."""

    tasks: tuple
    outputs: tuple[int, ...]


def plan_segments(plan, n: int, cost: Callable = estimate_us) -> tuple[Segment, ...]:
    """`plan`'s tasks as at most `n` segments (one where it cannot be cut)."""
    order = plan.schedule.order
    everything = (Segment(order, tuple(range(len(plan.output_buffers)))),)
    if n <= 1 or len(plan.output_buffers) < 2:
        return everything
    per_stream = [plan.schedule.tasks_on(s) for s in range(plan.schedule.num_streams)]
    spent = _prefix_costs(per_stream, cost)
    writers: dict = {}
    for task in order:
        for buffer in plan.writes.get(task, ()):
            writers.setdefault(buffer, []).append(task)
    ready = [_ready_cut(plan.schedule, writers.get(plan.storage.get(a, a), ())) for a in plan.output_buffers]
    ready_cost = [_cost(spent, c) for c in ready]
    lo, hi = min(ready_cost), max(ready_cost)
    bounds = [_union([c for c, us in zip(ready, ready_cost) if us <= lo + (hi - lo) * k / n], len(per_stream))
              for k in range(1, n)]
    bounds.append(np.array([len(ts) for ts in per_stream]))
    segments = _cut(per_stream, bounds, ready, plan.schedule)
    return segments if len(segments) > 1 else everything


def _prefix_costs(per_stream: list, cost: Callable) -> list:
    """Per stream, the cost of its first i tasks, i = 0..len."""
    return [np.concatenate([[0.0], np.cumsum([cost(t) for t in ts])]) for ts in per_stream]


def _cost(spent: list, cut) -> float:
    return float(sum(spent[s][c] for s, c in enumerate(cut)))


def _ready_cut(sched, writers) -> np.ndarray:
    """Per stream, how many of its tasks must have run before an output is complete:
    every writer of its buffer and everything that happens before one."""
    cut = np.zeros(sched.num_streams, dtype=np.int64)
    for task in writers:
        np.maximum(cut, sched.vector_clock(task).astype(np.int64) + 1, out=cut)
        s = sched.stream[task]
        cut[s] = max(cut[s], sched.stream_position(task) + 1)
    return cut


def _union(cuts: list, num_streams: int) -> np.ndarray:
    out = np.zeros(num_streams, dtype=np.int64)
    for c in cuts:
        np.maximum(out, c, out=out)
    return out


def _cut(per_stream: list, bounds: list, ready: list, sched) -> tuple[Segment, ...]:
    """The segments between successive bounds, in launch order; those that finish no
    new output merged into the next (the last into the one before it)."""
    done = np.zeros(len(per_stream), dtype=np.int64)
    assigned: set = set()
    pending: set = set()  # tasks of segments merged forward
    segments: list = []
    for bound in bounds:
        tasks = pending | {t for s, ts in enumerate(per_stream) for t in ts[done[s]:bound[s]]}
        outs = tuple(j for j, c in enumerate(ready) if j not in assigned and np.all(c <= bound))
        done = np.maximum(done, bound)
        if not outs:
            pending = tasks
            continue
        assigned.update(outs)
        segments.append(Segment(tuple(t for t in sched.order if t in tasks), outs))
        pending = set()
    if pending and segments:
        last = segments.pop()
        tasks = set(last.tasks) | pending
        segments.append(Segment(tuple(t for t in sched.order if t in tasks), last.outputs))
    return tuple(segments)

"""A picture of a plan: its streams over time, one bar per task.

Each task is placed where the plan's streams and events let it start: after the task
before it on its own stream and after every task whose event its stream waits on, with
no other limit on how many streams run at once. The task durations are either measured
(`nimblejax.bench.profile.task_times` on a GPU: each task's GPU time alone) or, without a
GPU, estimated from the bytes a task moves and the arithmetic it does (`estimate_us`);
the title says which.

    from nimblejax.bench.timeline import draw_timeline
    plan = nimble.jit(f).plan(x)                    # jax.ShapeDtypeStruct arguments do
    draw_timeline(plan, "plan.png")                 # estimated times
    rows = task_times(f.executables()[-1])          # nimblejax.bench.profile, on a GPU
    draw_timeline(plan, "plan.png", task_us=[r["us"] for r in rows])   # measured times

or `python -m nimblejax.bench --models nasnet_mobile --batch 1 --timeline plan.png`.
matplotlib is only needed for the drawing (`pip install "nimblejax[bench]"`).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Mapping, Optional, Sequence, Union

from nimblejax.compiler.costs import estimate_us, throughput_bound_us


@dataclass(frozen=True)
class Slot:
    """One task on the timeline: µs from the start of the call. `index` is the task's
    place in the plan's launch order (task names repeat where kernels are shared)."""

    index: int
    task: str
    stream: int
    start: float
    end: float
    category: str


TaskTimes = Union[Sequence[float], Mapping]


def schedule_slots(plan, task_us: Optional[TaskTimes] = None) -> list[Slot]:
    """Every task of `plan` on its planned stream, in launch order. `task_us`: measured
    µs per task, in launch order (as `profile.task_times` returns them) or by Task;
    without it (or for a task it lacks) `estimate_us`."""
    from nimblejax.bench.profile import task_category

    sched = plan.schedule
    order = list(sched.order)
    if task_us is not None and not isinstance(task_us, Mapping):
        if len(task_us) != len(order):
            raise ValueError(f"task_us has {len(task_us)} times for {len(order)} tasks")
        task_us = dict(zip(order, task_us))
    free = [0.0] * sched.num_streams  # when each stream's last task ends
    end: dict = {}
    slots = []
    for i, task in enumerate(order):
        s = sched.stream[task]
        start = max([free[s]] + [end[u] for u in sched.waits(task)])
        us = task_us.get(task) if task_us else None
        dur = float(us) if us is not None else estimate_us(task)
        end[task] = free[s] = start + dur
        slots.append(Slot(i, task.name, s, start, start + dur, task_category(task)))
    return slots


@dataclass(frozen=True)
class Timeline:
    """What a drawing shows: the slots, and the title that says where the times come from."""

    slots: tuple
    title: str
    measured: bool

    @property
    def total_us(self) -> float:
        return max((s.end for s in self.slots), default=0.0)


@dataclass(frozen=True)
class Prediction:
    """What the plan's streams should give (the what-if of Nimble's paper, after
    Daydream): `us`, the GPU time of one call with the tasks placed by the streams and
    events (from the cost model, no less than its throughput bound: tasks that fill the
    GPU share it rather than overlap, `throughput_bound_us`); `one_stream_us`, every task
    one after another; `gain`, their ratio. From the cost model (`estimate_us`) or from
    measured per-task times (each task alone: the placement only)."""

    us: float
    one_stream_us: float
    measured: bool

    @property
    def gain(self) -> float:
        return self.one_stream_us / self.us if self.us else 1.0


def predict(plan, task_us: Optional[TaskTimes] = None) -> Prediction:
    """The plan's predicted GPU time per call, on its streams and on one."""
    slots = schedule_slots(plan, task_us)
    us = max((s.end for s in slots), default=0.0)
    if not task_us:
        us = max(us, throughput_bound_us(plan.schedule.order))
    return Prediction(us, sum(s.end - s.start for s in slots), bool(task_us))


def timeline(plan, task_us: Optional[TaskTimes] = None,
             title: Optional[str] = None) -> Timeline:
    """The data of `plan`'s picture (no drawing, no matplotlib)."""
    slots = tuple(schedule_slots(plan, task_us))
    measured = bool(task_us)
    how = ("measured per-task GPU times (each task alone)" if measured else
           "estimated task times (no GPU: a cost model, not a measurement)")
    total = max((s.end for s in slots), default=0.0)
    streams = plan.schedule.num_streams
    head = title or "nimblejax plan"
    full_title = (f"{head}: {len(slots)} tasks on {streams} stream{'s' * (streams != 1)}, "
                  f"{plan.num_events} events, {total:.0f} µs\n{how}, placed by the plan's "
                  f"streams and events")
    return Timeline(slots, full_title, measured)


def _pyplot():
    try:
        import matplotlib
    except ImportError:
        raise ImportError("drawing a timeline needs matplotlib, which is not installed: "
                          "pip install matplotlib (or the bench extra: pip install "
                          "\"nimblejax[bench]\")") from None
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def draw_timeline(plan, path: str, task_us: Optional[TaskTimes] = None,
                  title: Optional[str] = None) -> Timeline:
    """Draw `plan`'s streams over time into `path` (PNG) and return what was drawn.
    With `task_us` (measured µs per task, see schedule_slots) the bars are measured, else
    estimates; the title says which. Needs matplotlib (ImportError saying so)."""
    plt = _pyplot()
    tl = timeline(plan, task_us, title)
    slots = tl.slots
    streams = plan.schedule.num_streams
    categories = sorted({s.category for s in slots})
    cmap = plt.get_cmap("tab10")
    color = {c: cmap(i % 10) for i, c in enumerate(categories)}
    fig, ax = plt.subplots(figsize=(12, 1.2 + 0.45 * streams))
    for c in categories:
        mine = [s for s in slots if s.category == c]
        first = min(x.stream for x in mine)
        for stream in sorted({s.stream for s in mine}):
            bars = [(s.start, s.end - s.start) for s in mine if s.stream == stream]
            ax.broken_barh(bars, (stream - 0.4, 0.8), facecolors=color[c], edgecolor="white",
                           linewidth=0.3, label=c if stream == first else None)
    ax.set_ylim(streams - 0.5, -0.5)
    ax.set_yticks(range(streams))
    ax.set_yticklabels([f"stream {i}" for i in range(streams)])
    ax.set_xlim(0, tl.total_us * 1.01 if tl.total_us else 1.0)
    ax.set_xlabel("µs from the start of the call")
    ax.set_title(tl.title, fontsize="medium")
    ax.legend(fontsize="small", loc="upper left", bbox_to_anchor=(1.0, 1.0))
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return tl

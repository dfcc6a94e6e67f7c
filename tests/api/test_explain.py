"""nimblejax/explain.py: the report states the plan it was made from (tasks in launch
order, streams, events, arena offsets and sizes, totals) and runs nothing."""
from __future__ import annotations

import re

import jax
import jax.numpy as jnp
import numpy as np

import nimblejax as nimble
from tests.helpers.models import branchy_args, branchy_mlp
from nimblejax.compiler import printing

ARGS = branchy_args(np.random.default_rng(0))


def test_counts_are_the_plans():
    report = nimble.explain(branchy_mlp, *ARGS)
    plan = report.plan
    assert report.num_tasks == len(plan.tasks) > 0
    assert report.num_streams == plan.schedule.num_streams == 4  # four independent branches
    assert report.num_events == len(plan.schedule.syncs) == plan.num_events
    assert report.arena_bytes == plan.memory.arena_bytes


def test_one_line_per_task_in_launch_order_with_offsets_and_sizes():
    report = nimble.explain(branchy_mlp, *ARGS)
    plan = report.plan
    lines = str(report).splitlines()
    assert lines[0] == (f"nimblejax plan: {len(plan.graph.nodes)} equations → {len(plan.tasks)} tasks "
                        f"(+{len(plan.views)} views)")
    task_lines = lines[1:1 + len(plan.tasks)]
    for line, task in zip(task_lines, plan.tasks):
        assert re.match(rf"  s{plan.schedule.stream[task]}\b.*  {re.escape(task.name)}  ", line), line
        for v in plan.writes[task]:
            assert f"{v!r}@{plan.offset(v)}({printing.format_bytes(v.nbytes)})" in line
        for v in plan.reads[task]:
            assert f"{v!r}@{plan.offset(v)}" in line
    assert lines[-1].startswith(f"totals: {len(plan.tasks)} tasks, {plan.schedule.num_streams} streams, "
                                f"{plan.num_events} events, arena ")
    assert lines[-1].endswith(f"critical path {plan.critical_path} tasks")


def test_every_event_is_recorded_before_it_is_waited_on():
    text = str(nimble.explain(branchy_mlp, *ARGS))
    recorded, waited = set(), set()
    for line in text.splitlines():
        for e in re.findall(r"wait ((?:e\d+,?)+)", line):
            names = set(e.split(","))
            assert names <= recorded, line
            waited |= names
        recorded |= set(re.findall(r"record (e\d+)", line))
    assert recorded == waited and len(recorded) == nimble.explain(branchy_mlp, *ARGS).num_events


def test_byte_sizes_are_binary_units_only():
    x = np.ones((512, 512), np.float32)  # 1 MiB
    text = str(nimble.explain(lambda a: jnp.tanh(a) * 2.0, x))
    assert "(1.0 MiB)" in text
    units = set(re.findall(r"\d (B|KiB|MiB|GiB|kB|KB|MB|GB)\b", text))
    assert units and units <= {"B", "KiB", "MiB", "GiB"}, units


def test_a_nimble_function_is_explained_under_its_own_options():
    one = nimble.explain(nimble.jit(branchy_mlp, backend="interpret", max_streams=1), *ARGS)
    assert one.num_streams == 1 and one.num_events == 0 and " wait " not in str(one)


def test_explain_plans_without_running(monkeypatch):
    from nimblejax.runtime import interpret

    def run(*_, **__):
        raise AssertionError("explain ran the plan")

    monkeypatch.setattr(interpret, "run", run)
    traced = []

    def f(x):
        traced.append(1)
        return jnp.sin(x) * 2.0

    report = nimble.explain(f, np.ones(4, np.float32))
    assert len(traced) == 1 and report.num_tasks == 1


def test_control_flow_decisions_are_listed():
    def f(x):
        return jax.lax.fori_loop(0, 3, lambda i, c: c * 2.0 + 1.0, x)

    text = str(nimble.explain(f, np.ones(4, np.float32)))
    assert "control flow:" in text and "unrolled" in text


def test_totals_count_the_kernels_launched_after_a_task_on_their_stream():
    """The kernels that programmatic dependent launch can start early: a generated
    kernel launched right after another task on its stream (not first on it)."""
    report = nimble.explain(branchy_mlp, *ARGS)
    plan, sched = report.plan, report.plan.schedule
    want = sum(1 for s in range(sched.num_streams) for i, t in enumerate(sched.tasks_on(s))
               if i > 0 and t.kind.value == "kernel")
    kernels = sum(1 for t in plan.tasks if t.kind.value == "kernel")
    assert report.chained_kernels == (want, kernels)
    assert f", {want} of {kernels} kernels after a task on their stream, " in str(report).splitlines()[-1]
    one = nimble.explain(lambda x: x * 2.0, np.ones(4, np.float32))
    assert one.chained_kernels == (0, 1)  # first on its stream

"""The stream and memory planners inside the pipeline: explain shows streams and
events, and a plan with one event removed goes wrong under some interleaving."""
from __future__ import annotations

import dataclasses

import jax
import numpy as np

import nimblejax as nimble
from tests.helpers.models import inception_args, inception_block, branchy_args, branchy_mlp
from nimblejax.runtime import interpret
from nimblejax.compiler.streams import Schedule, verify


def test_explain_inception_block_shows_4_streams_and_minimum_events():
    args = inception_args(np.random.default_rng(0))
    report = nimble.explain(inception_block, *args)
    text = str(report)
    assert report.num_streams == 4
    # 4 independent chains join at the concatenate: 3 cross-stream edges are the minimum.
    assert report.num_events == 3
    assert "totals: " in text and "4 streams, 3 events" in text
    assert text.count(" wait ") == 1 and text.count(" record ") == 3


def test_explain_lines_name_kernels_streams_and_buffers():
    args = inception_args(np.random.default_rng(0))
    lines = str(nimble.explain(inception_block, *args)).splitlines()
    task_lines = [l for l in lines if l.startswith("  s")]
    assert len(task_lines) == report_tasks(args)
    assert all("<-" in l and "@" in l for l in task_lines)
    assert any("gemm_float32" in l for l in task_lines)
    assert any("nimble_concat" in l for l in task_lines)


def report_tasks(args) -> int:
    return nimble.explain(inception_block, *args).num_tasks


def test_max_streams_one_puts_everything_on_one_stream():
    args = branchy_args(np.random.default_rng(0))
    plan = nimble.jit(branchy_mlp, backend="interpret", max_streams=1).plan(*args)
    assert plan.schedule.num_streams == 1 and plan.num_events == 0
    assert plan.memory.arena_bytes <= nimble.jit(branchy_mlp, backend="interpret").plan(*args).memory.arena_bytes


def test_removing_an_event_gives_a_wrong_answer_under_some_interleaving():
    args = branchy_args(np.random.default_rng(0))
    f = nimble.jit(branchy_mlp, backend="interpret")
    plan = f.plan(*args)
    flat = [np.asarray(x) for x in jax.tree_util.tree_leaves(args)]
    want = np.asarray(jax.jit(branchy_mlp)(*args))
    assert plan.num_events > 0
    broken_sched = Schedule.from_parts(plan.schedule.order, plan.schedule.stream,
                                       plan.schedule.syncs[1:])
    broken = dataclasses.replace(plan, schedule=broken_sched)
    assert verify(broken.schedule, broken.memory, broken.sizes, broken.reads, broken.writes)
    wrong = 0
    for seed in range(40):
        got = interpret.run(broken, flat, seed=seed)[0]
        wrong += not np.allclose(got, want, rtol=2e-3, atol=2e-3, equal_nan=False)
    assert wrong > 0, "an interleaving should run a consumer before its producer"
    for seed in range(5):  # the intact plan is right under the same seeds
        np.testing.assert_allclose(interpret.run(plan, flat, seed=seed)[0], want, rtol=2e-3, atol=2e-3)

"""The plan's picture (nimblejax.bench.timeline) on the CPU: estimated task times, every
task on its planned stream, no overlap within a stream, dependencies respected."""
from __future__ import annotations


import jax
import jax.numpy as jnp
import pytest

import nimblejax as nimble
from nimblejax.bench import cli
from nimblejax.bench.models import MODELS
from nimblejax.bench.timeline import draw_timeline, estimate_us, predict, schedule_slots, timeline


def _plan(name="nasnet_mobile", batch=1):
    fn, args = MODELS[name].abstract(batch, tiny=True)
    return nimble.jit(fn, backend="interpret").plan(*args)


def _check_slots(plan, slots):
    sched = plan.schedule
    assert [s.task for s in slots] == [t.name for t in sched.order]
    assert [s.index for s in slots] == list(range(len(sched.order)))
    slot = dict(zip(sched.order, slots))  # task names repeat: key by the task itself
    for task in sched.order:
        assert slot[task].stream == sched.stream[task]  # on its planned stream
        assert slot[task].end > slot[task].start >= 0.0
    for s in range(sched.num_streams):  # one stream runs one task at a time
        mine = sorted((x for x in slots if x.stream == s), key=lambda x: x.start)
        for a, b in zip(mine, mine[1:]):
            assert a.end <= b.start + 1e-9, (a, b)
    for u, v in plan.dag.edges:  # a task starts after the tasks it depends on
        assert slot[v].start >= slot[u].end - 1e-9, (u.name, v.name)


def test_estimated_slots_follow_the_plan():
    plan = _plan()
    assert plan.schedule.num_streams > 1 and plan.dag.number_of_edges() > 0
    slots = schedule_slots(plan)
    _check_slots(plan, slots)
    # Streams really overlap in time: the total is shorter than the serial sum.
    total = max(s.end for s in slots)
    assert total < sum(s.end - s.start for s in slots)
    for s, task in zip(slots, plan.schedule.order):
        assert s.end - s.start == pytest.approx(estimate_us(task))


def test_predicted_time_and_the_gain_of_the_streams():
    wide = _plan()
    p = predict(wide)
    assert not p.measured and p.us == pytest.approx(timeline(wide).total_us)
    assert p.one_stream_us == pytest.approx(sum(estimate_us(t) for t in wide.tasks))
    assert p.gain > 1.0  # NASNet's cells run side by side
    chain = nimble.jit(lambda x: jnp.tanh(jnp.sin(x) @ x), backend="interpret").plan(
        jax.ShapeDtypeStruct((64, 64), jnp.float32))
    assert chain.schedule.num_streams == 1 and predict(chain).gain == pytest.approx(1.0)
    measured = predict(wide, [3.0] * len(wide.tasks))
    assert measured.measured and measured.one_stream_us == pytest.approx(3.0 * len(wide.tasks))


def test_tasks_that_fill_the_gpu_share_it_rather_than_overlap():
    """Eight independent 2048 x 2048 products run on several streams, but each moves 48
    MiB: the prediction is their summed work (costs.throughput_bound_us), not one of them."""
    from nimblejax.compiler import costs

    def branches(x):
        return [jnp.tanh(x * float(i)) @ x for i in range(8)]

    plan = nimble.jit(branches, backend="interpret").plan(jax.ShapeDtypeStruct((2048, 2048), jnp.float32))
    assert plan.schedule.num_streams > 1
    p = predict(plan)
    assert max(s.end for s in schedule_slots(plan)) < p.us == pytest.approx(costs.throughput_bound_us(plan.tasks))
    assert costs.throughput_bound_us(plan.tasks) == pytest.approx(sum(costs.work_us(t) for t in plan.tasks))
    tiny = nimble.jit(lambda x: [jnp.sin(x) + i for i in range(8)], backend="interpret").plan(
        jax.ShapeDtypeStruct((8,), jnp.float32))  # latency-bound tasks: the bound is far below
    assert costs.throughput_bound_us(tiny.tasks) < costs.LAUNCH_US


def test_plan_stats_carry_the_prediction():
    from nimblejax.bench.plans import plan_stats

    stats = plan_stats(_plan())
    assert stats["predicted_us"] == pytest.approx(predict(_plan()).us)
    assert stats["predicted_gain"] > 1.0


def test_measured_times_are_used_and_the_title_says_so():
    plan = _plan("lstm")
    task_us = [10.0 + i for i in range(len(plan.schedule.order))]  # as profile.task_times
    tl = timeline(plan, task_us, title="lstm")
    _check_slots(plan, tl.slots)
    assert tl.measured and "measured per-task GPU times" in tl.title
    assert [s.end - s.start for s in tl.slots] == pytest.approx(task_us)
    by_task = timeline(plan, dict(zip(plan.schedule.order, task_us)))
    assert by_task.slots == tl.slots
    with pytest.raises(ValueError, match="times for"):
        timeline(plan, task_us[:-1])
    est = timeline(plan)
    assert not est.measured and "estimated task times (no GPU" in est.title


def test_draws_a_png(tmp_path):
    pytest.importorskip("matplotlib")
    plan = _plan()
    path = tmp_path / "plan.png"
    tl = draw_timeline(plan, str(path), title="nasnet")
    assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert tl.title.startswith("nasnet: ") and "estimated" in tl.title
    _check_slots(plan, tl.slots)


def test_without_matplotlib_a_clear_error(no_matplotlib, tmp_path):
    plan = nimble.jit(lambda x: jnp.tanh(x) + 1, backend="interpret").plan(
        jax.ShapeDtypeStruct((8,), jnp.float32))
    with pytest.raises(ImportError, match=r"needs matplotlib.*pip install"):
        draw_timeline(plan, str(tmp_path / "p.png"))
    assert not (tmp_path / "p.png").exists()


def test_cli_timeline_without_a_gpu(monkeypatch, tmp_path, capsys):
    monkeypatch.setattr(cli, "gpu_available", lambda: False)
    path = tmp_path / "t.png"
    assert cli.main(["--tiny", "--models", "lstm", "--batch", "1", "--timeline", str(path)]) == 0
    out = capsys.readouterr().out
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        assert "no timeline: drawing a timeline needs matplotlib" in out
    else:
        assert f"wrote {path}" in out and path.read_bytes()[:4] == b"\x89PNG"


@pytest.mark.gpu
def test_measured_timeline_on_a_gpu(tmp_path, capsys):
    """On a GPU: the default run of one tiny model with --timeline draws measured times
    (per-task GPU times from nimblejax.bench.profile)."""
    from nimblejax.bench.profile import task_times

    fn, args = MODELS["lstm"].build(2, tiny=True)
    f = nimble.jit(fn)
    jax.block_until_ready(f(*args))
    exe = f.executables()[-1]
    tl = timeline(exe.plan, [r["us"] for r in task_times(exe, repeats=3)])
    assert tl.measured
    _check_slots(exe.plan, tl.slots)
    path = tmp_path / "t.png"
    assert cli.main(["--tiny", "--models", "lstm", "--batch", "2", "--budget", "0.05",
                     "--no-jax-cache", "--timeline", str(path)]) == 0
    out = capsys.readouterr().out
    if f"wrote {path}" in out:
        assert path.read_bytes()[:4] == b"\x89PNG"
    else:
        assert "needs matplotlib" in out

"""A plan cut into segments (compiler/segments.py) on the CPU: every task in exactly one
segment, nothing in a segment happening after a task of a later one, every output
handed back by exactly one segment, after its writers ran."""
from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import nimblejax as nimble
from nimblejax.compiler.segments import plan_segments
from tests.helpers.train_models import resnet_apply, resnet_init, tanh_mlp_loss as mlp_loss


def _mlp_plan(layers=6, width=64):
    r = np.random.default_rng(0)
    params = [(jnp.asarray(r.normal(size=(width, width)) * 0.1, jnp.float32), jnp.zeros(width, jnp.float32))
              for _ in range(layers)]
    x = jnp.asarray(r.normal(size=(8, width)), jnp.float32)
    return nimble.jit(jax.value_and_grad(mlp_loss), backend="interpret").plan(params, x)


def _resnet_plan():
    r = np.random.default_rng(0)
    params = resnet_init(r, width=8, blocks=2)
    x = jnp.asarray(r.normal(size=(2, 16, 16, 3)), jnp.float32)
    labels = jnp.asarray(r.integers(0, 10, 2), jnp.int32)

    def loss(p, x, labels):
        logits = resnet_apply(p, x)
        return -jnp.mean(jnp.take_along_axis(jax.nn.log_softmax(logits), labels[:, None], axis=1))

    return nimble.jit(jax.value_and_grad(loss), backend="interpret").plan(params, x, labels)


def _check(plan, segments):
    sched = plan.schedule
    where = {t: k for k, seg in enumerate(segments) for t in seg.tasks}
    assert sum(len(seg.tasks) for seg in segments) == len(where) == len(sched.order)
    for seg in segments:  # each segment's tasks in launch order
        assert list(seg.tasks) == [t for t in sched.order if t in set(seg.tasks)]
    for v in sched.order:  # a consistent cut: what happens before v is no later
        for u in sched.order:
            if sched.happens_before(u, v):
                assert where[u] <= where[v], (u.name, v.name)
    handed = [j for seg in segments for j in seg.outputs]
    assert sorted(handed) == list(range(len(plan.output_buffers)))
    assert all(seg.outputs for seg in segments)
    for k, seg in enumerate(segments):  # an output's writers ran by the end of its segment
        for j in seg.outputs:
            root = plan.storage.get(plan.output_buffers[j], plan.output_buffers[j])
            assert all(where[t] <= k for t in sched.order if root in plan.writes.get(t, ()))


@pytest.mark.parametrize("n", [2, 3, 4])
def test_a_training_step_cuts_into_n_segments(n):
    plan = _mlp_plan()
    segments = plan_segments(plan, n)
    assert len(segments) == n
    _check(plan, segments)
    # the loss (output 0) and the last layer's gradients come back first, the first
    # layer's last: the first layer's weight and bias are outputs 1 and 2
    assert 0 in segments[0].outputs and len(plan.output_buffers) - 1 in segments[0].outputs
    assert {1, 2} <= set(segments[-1].outputs)


def test_a_resnet_step_with_many_streams():
    plan = _resnet_plan()
    assert plan.schedule.num_streams > 1
    for n in (2, 3):
        segments = plan_segments(plan, n)
        assert len(segments) >= 2
        _check(plan, segments)


def test_one_segment_where_it_cannot_be_cut():
    plan = _mlp_plan()
    (whole,) = plan_segments(plan, 1)
    assert whole.tasks == plan.schedule.order and whole.outputs == tuple(range(len(plan.output_buffers)))
    r = np.random.default_rng(1)
    x = jnp.asarray(r.normal(size=(4, 8)), jnp.float32)
    one_output = nimble.jit(lambda x: jnp.tanh(x @ x.T), backend="interpret").plan(x)
    (whole,) = plan_segments(one_output, 4)
    assert whole.outputs == (0,)

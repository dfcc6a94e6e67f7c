"""A full train step (loss, value_and_grad, SGD with momentum) under the CPU plan
interpreter matches jax.jit."""
from __future__ import annotations

import jax
import numpy as np
import pytest

import nimblejax as nimble
from tests.helpers.models import assert_tree_close
from tests.helpers.train_models import TRAIN_MODELS, batch, make_train_step


@pytest.mark.parametrize("name", sorted(TRAIN_MODELS))
def test_train_step_matches_jax(name):
    init, apply = TRAIN_MODELS[name]
    rng = np.random.default_rng(0)
    params = init(rng, width=8, blocks=1)
    velocity = jax.tree_util.tree_map(lambda p: p * 0.0, params)
    x, labels = batch(rng, 4, size=8)
    step = make_train_step(apply)
    want = jax.jit(step)(params, velocity, x, labels)
    got = nimble.jit(step, backend="interpret", donate_argnums=(0, 1))(params, velocity, x, labels)
    assert_tree_close(got, want)


def test_batch_norm_statistics_fuse_with_their_producers():
    from tests.helpers.train_models import batch_norm

    rng = np.random.default_rng(0)
    # 72 elements a channel: under split.MIN_COLUMN, so each statistic is one kernel
    x = jax.numpy.asarray(rng.standard_normal((2, 6, 6, 16)), jax.numpy.float32)
    g = jax.numpy.ones((16,))
    plan = nimble.jit(batch_norm, backend="interpret").plan(x, g, g)
    # mean, variance (with x - mean fused in), and the normalization: 3 kernels.
    assert sum(t.kind == "kernel" for t in plan.tasks) <= 3

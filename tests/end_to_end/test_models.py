"""The core functions match jax.jit under backend="interpret", over many stream
interleavings, and the plans are race-free."""
from __future__ import annotations

import jax
import numpy as np
import pytest

import nimblejax as nimble
from tests.helpers.models import MODELS, assert_tree_close, model_args
from nimblejax.runtime import interpret
from nimblejax.compiler.streams import verify


@pytest.mark.parametrize("name", sorted(MODELS))
def test_matches_jax(name):
    fn, _, opts = MODELS[name]
    args = model_args(name)
    f = nimble.jit(fn, backend="interpret", **opts)
    want = jax.jit(fn, **opts)(*args)
    for _ in range(3):  # each call takes another interleaving
        assert_tree_close(f(*args), want)
    assert f.cache_size == 1


@pytest.mark.parametrize("name", sorted(MODELS))
def test_plan_is_race_free(name):
    fn, _, opts = MODELS[name]
    p = nimble.jit(fn, backend="interpret", **opts).plan(*model_args(name))
    assert verify(p.schedule, p.memory, p.sizes, p.reads, p.writes) == []


@pytest.mark.parametrize("name", ["branchy_mlp", "grad_mlp", "inception_block"])
def test_many_interleavings(name):
    fn, _, opts = MODELS[name]
    args = model_args(name)
    f = nimble.jit(fn, backend="interpret", **opts)
    plan = f.plan(*args)
    assert plan.schedule.num_streams > 1
    flat = [np.asarray(x) for x in jax.tree_util.tree_leaves(
        [a for i, a in enumerate(args) if i not in opts.get("static_argnums", ())])]
    want = jax.tree_util.tree_leaves(jax.jit(fn, **opts)(*args))
    orders = set()
    for seed in range(12):
        orders.add(tuple(id(t) for t in interpret.interleaving(plan.schedule, __import__("random").Random(seed))))
        got = interpret.run(plan, flat, seed=seed)
        for g, w in zip(got, want):
            np.testing.assert_allclose(g, np.asarray(w), rtol=2e-3, atol=2e-3)
    assert len(orders) > 1, "the seeds should exercise different interleavings"

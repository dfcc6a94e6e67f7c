"""Where a plan's outputs come from (`Plan.output_slots`) and how every runner assembles
them (`runtime.runner.assemble`): computed once in the plan, checked without a GPU."""
from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

import nimblejax as nimble
from nimblejax.runtime.runner import assemble
from tests.helpers import on_host


C = jnp.asarray([0, 1, 2], jnp.int32)  # a constant of the function


def fn(x, y):
    t = jnp.tanh(x) * y
    return x, t, 2.0, C, t, y + 1.0


def plan_of(f, *shapes):
    specs = [jax.ShapeDtypeStruct(s, jnp.float32) for s in shapes]
    return nimble.jit(f, backend="interpret").plan(*specs)


def test_each_kind_of_output_has_its_slot():
    plan = plan_of(fn, (4,), (4,))
    kinds = [s.kind for s in plan.output_slots]
    assert kinds == ["input", "buffer", "value", "value", "buffer", "buffer"]
    slots = plan.output_slots
    assert slots[0].index == 0
    assert slots[1].index == slots[4].index == 0  # one buffer returned twice
    assert slots[5].index == 1 and len(plan.output_buffers) == 2
    assert slots[2].value.dtype == np.float32 and float(slots[2].value) == 2.0
    assert slots[3].value.dtype == np.int32 and slots[3].value.tolist() == [0, 1, 2]


def test_assemble_takes_buffers_inputs_and_values_where_the_slots_say():
    plan = plan_of(fn, (4,), (4,))
    x, y = np.arange(4.0, dtype=np.float32), np.ones(4, np.float32)
    made = ["t", "y1"]
    outs = assemble(plan, made, [x, y].__getitem__, lambda v: ("value", v.tolist()))
    assert outs[0] is x and outs[1] == outs[4] == "t" and outs[5] == "y1"
    assert outs[2] == ("value", 2.0) and outs[3] == ("value", [0, 1, 2])


def test_every_output_kind_matches_jax_through_the_interpreter():
    r = np.random.default_rng(0)
    x, y = (on_host(r.normal(size=4), jnp.float32) for _ in range(2))
    got = nimble.jit(fn, backend="interpret")(x, y)
    want = jax.jit(fn)(x, y)
    for g, w in zip(got, want):
        assert np.asarray(g).dtype == np.asarray(w).dtype
        np.testing.assert_allclose(np.asarray(g), np.asarray(w), rtol=1e-6)

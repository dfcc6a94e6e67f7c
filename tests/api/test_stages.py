"""`nimble.jit(f).stages(*args)`: the program after each compiler pass, as objects one
can hold: in pass order, each printing the text NIMBLE_DEBUG=2 prints for that pass
and holding the record its pass made; abstract arguments need no GPU and no data."""
from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax import lax

import nimblejax as nimble
from nimblejax.compiler import pipeline, printing
from nimblejax.compiler.buffers import Buffers
from nimblejax.compiler.ir import Graph
from nimblejax.compiler.plan import Plan
from nimblejax.compiler.streams import Schedule


def block(w, x, k):
    """A dot, a convolution (im2col + GEMM on the CPU's options) and a softmax row."""
    h = jax.nn.relu(x @ w)
    c = lax.conv_general_dilated(h.reshape(2, 4, 4, 8), k, (1, 1), "SAME",
                                 dimension_numbers=("NHWC", "HWIO", "NHWC"))
    return jax.nn.softmax(c.reshape(32, -1), axis=-1), jnp.tanh(h)


SPECS = [jax.ShapeDtypeStruct(s, jnp.float32) for s in [(16, 8), (32, 16), (3, 3, 8, 4)]]


def test_stages_on_abstract_arguments_name_each_pass_in_order():
    stages = nimble.jit(block, backend="interpret").stages(*SPECS)
    assert tuple(stages) == pipeline.STAGES == (
        "trace", "canonicalize", "fuse", "lower", "buffers", "streams", "memory")
    assert repr(stages) == f"Stages({', '.join(pipeline.STAGES)})"
    values = [stages[n].value for n in stages]
    assert isinstance(values[0], Graph) and isinstance(values[1], Graph)
    assert isinstance(values[4], Buffers) and isinstance(values[5], Schedule)
    assert values[6] is stages.plan and isinstance(stages.plan, Plan)
    with pytest.raises(KeyError, match="the stages are trace, canonicalize"):
        stages["fusion"]


def test_each_stage_shows_what_its_pass_made():
    s = {n: st.text for n, st in nimble.jit(block, backend="interpret").stages(*SPECS).items()}
    here = f"{__file__}:"
    assert "= conv_general_dilated" in s["trace"] and here in s["trace"]  # the user's line
    assert "nimble_im2col" not in s["trace"]
    assert "= nimble_im2col" in s["canonicalize"] and "conv_general_dilated" not in s["canonicalize"]
    assert " gemm " in s["fuse"] and " row " in s["fuse"] and "epilogue relu" in s["fuse"]
    assert "GemmCall(" in s["lower"] and "nimble_row_softmax" in s["lower"]
    assert " after t" in s["buffers"] and "pinned: " in s["buffers"]
    assert " on " in s["streams"] and "critical path" in s["streams"]
    assert s["memory"].startswith("arena ") and "@" in s["memory"]


def test_stages_print_what_debug_2_prints(capsys):
    rng = np.random.default_rng(0)
    args = [rng.standard_normal(s.shape).astype(np.float32) for s in SPECS]
    nimble.jit(block, backend="interpret", debug=2).plan(*args)
    printed = capsys.readouterr().err
    stages = nimble.jit(block, backend="interpret").stages(*args)
    assert str(stages) == printed
    assert str(stages["lower"]) == printing.section("lower", stages["lower"].text)
    assert capsys.readouterr().err == ""  # holding the stages prints nothing


def test_the_plan_of_the_stages_runs_as_jax_does():
    rng = np.random.default_rng(1)
    args = [rng.standard_normal(s.shape).astype(np.float32) for s in SPECS]
    f = nimble.jit(block, backend="interpret")
    stages = f.stages(*args)
    assert [t.name for t in stages.plan.tasks] == [t.name for t in f.plan(*args).tasks]
    for got, want in zip(f(*args), jax.jit(block)(*args)):
        np.testing.assert_allclose(got, want, rtol=2e-3, atol=2e-3)


def test_stages_take_static_arguments_and_pytrees_as_a_call_does():
    def f(params, x, act):
        return act(x @ params["w"] + params["b"])

    g = nimble.jit(f, static_argnums=2, backend="interpret")
    params = {"w": jax.ShapeDtypeStruct((4, 3), jnp.float32), "b": jax.ShapeDtypeStruct((3,), jnp.float32)}
    stages = g.stages(params, jax.ShapeDtypeStruct((5, 4), jnp.float32), jnp.tanh)
    assert "= tanh" in stages["trace"].text and "= dot_general" in stages["trace"].text

"""Fused kernels that write a value besides their root's (compiler/fusion.py
`_fused_output_target`, lowering/codegen.py `elementwise_kernel`): where recomputing a
value would duplicate what is duplicated already (an unrolled recurrence: an LSTM's cell
state), one kernel that reads it writes it and the others read it back. Fusion
decisions on the plan; numbers against jax.jit under the CPU interpreter and with the
kernels run on the CPU (tests/helpers/kernel_emulator.py); NVRTC compiles them; the GPU
compares with jax.jit."""
from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import nimblejax as nimble
from nimblejax.bench.models import MODELS
from tests.helpers.libraries import assert_kernels_compile
from tests.helpers.models import (assert_cuda_matches_jax_twice, assert_emulated_matches_jax,
                                  assert_interpreted_matches_jax, assert_tree_close, rand)

r = np.random.default_rng(47)


def cell_steps(gates, c):
    """T steps of an LSTM cell's elementwise part: gates[t] holds the four gates'
    pre-activations (as the GEMMs leave them), c is the cell state."""
    hs = []
    for t in range(gates.shape[0]):
        i, f, g, o = jnp.split(gates[t], 4, axis=-1)
        c = jax.nn.sigmoid(f) * c + jax.nn.sigmoid(i) * jnp.tanh(g)
        hs.append(jax.nn.sigmoid(o) * jnp.tanh(c))
    return jnp.stack(hs), c


def recurrent(x, w, c):
    """The same with each step's gates read from the previous step's h (a GEMM between
    the cell's kernels, as in a real LSTM)."""
    h, hs = jnp.zeros_like(c), []
    for t in range(x.shape[0]):
        i, f, g, o = jnp.split(x[t] + h @ w, 4, axis=-1)
        c = jax.nn.sigmoid(f) * c + jax.nn.sigmoid(i) * jnp.tanh(g)
        h = jax.nn.sigmoid(o) * jnp.tanh(c)
        hs.append(h)
    return jnp.stack(hs), c


def cell_args(steps=12, batch=2, hidden=32):
    return rand(r, steps, batch, 4 * hidden), rand(r, batch, hidden)


def recurrent_args(steps=10, batch=2, hidden=32):
    return rand(r, steps, batch, 4 * hidden), rand(r, hidden, 4 * hidden) * 0.2, rand(r, batch, hidden)


CASES = {"cell_steps": (cell_steps, cell_args), "recurrent": (recurrent, recurrent_args)}


def plan_of(fn, *args):
    return nimble.jit(fn, backend="interpret").plan(*args)


def fused_tasks(plan):
    return [t for t in plan.tasks if t.kind == "kernel" and t.name.startswith("nimble_fused")]


def step_kernels(plan):
    """The cell's kernels: fused ones, or the recurrent GEMM's computing the cell
    (compiler/fusion_gemm_gates.py, where the tensor-core kernel takes the GEMM)."""
    return [t for t in plan.tasks if t.kind == "kernel" and (
        (t.name.startswith("nimble_fused") and "logistic" in t.name) or "_gates" in t.name)]


def test_a_recurrence_writes_its_state_from_the_step_kernels():
    args = recurrent_args()
    tasks = step_kernels(plan_of(recurrent, *args))
    # A kernel per step, and none of its own for the cell state: the state is written by
    # step kernels (two outputs) every other step; before, a step kernel recomputed up to
    # four steps of it and every fifth step had a kernel of its own. (The last step's h
    # has one more kernel: the stack reads it reshaped.)
    assert len(tasks) <= 11
    assert sum(len(t.outputs) == 2 for t in tasks) >= 4
    # No step kernel reads more than two steps' GEMM results.
    assert max(sum(v.shape == (2, 128) for v in t.inputs) for t in tasks) <= 2


def test_a_value_read_at_another_index_is_not_written_by_that_kernel():
    def transposed_reader(a, b):
        s = jnp.tanh(a) * b  # read by both kernels below, one of them through a transpose
        t = jnp.exp(s)
        return (s + 1.0).T * 2.0, t * s
    args = rand(r, 8, 16), rand(r, 8, 16)
    plan = plan_of(transposed_reader, *args)
    for t in fused_tasks(plan):
        assert len(t.outputs) == 1
    assert_tree_close(nimble.jit(transposed_reader, backend="interpret")(*args),
                      jax.jit(transposed_reader)(*args))


@pytest.mark.parametrize("name", sorted(CASES))
def test_interpreter_matches_jax(name):
    fn, make = CASES[name]
    assert_interpreted_matches_jax(fn, make())


@pytest.mark.parametrize("name", sorted(CASES))
def test_emulated_kernels_match_jax(name):
    fn, make = CASES[name]
    assert_emulated_matches_jax(fn, make())


def test_the_bench_lstm_has_one_cell_kernel_a_step():
    fn, args = MODELS["lstm"].build(1, rng=np.random.default_rng(0), tiny=True)
    plan = plan_of(fn, *args)
    steps = [t for t in plan.tasks if t.kind == "gemm" and t.gemm.m == 1]
    assert len(step_kernels(plan)) == len(steps) >= 4
    assert any(len(t.outputs) == 2 for t in step_kernels(plan))


def test_fused_output_kernels_compile():
    assert_kernels_compile({t.kernel.name: t.kernel.source for name, (fn, make) in CASES.items()
                            for t in fused_tasks(plan_of(fn, *make())) if len(t.outputs) > 1},
                           "nimble_fused_outputs")


@pytest.mark.gpu
@pytest.mark.parametrize("name", sorted(CASES))
def test_on_gpu_match_jax(name):
    fn, make = CASES[name]
    # Nothing orders cell_steps' kernels: each recomputes the state.
    two_outputs = (lambda plan: any(len(t.outputs) == 2 for t in fused_tasks(plan))) \
        if name == "recurrent" else None
    assert_cuda_matches_jax_twice(fn, make(), two_outputs)


@pytest.mark.gpu
@pytest.mark.parametrize("batch", [1, 32])
def test_bench_lstm_on_gpu_matches_jax(batch):
    fn, args = MODELS["lstm"].build(batch, rng=np.random.default_rng(0))
    f = nimble.jit(fn, backend="cuda")
    assert any(len(t.outputs) == 2 for t in step_kernels(f.plan(*args)))
    assert_tree_close(f(*args), jax.jit(fn)(*args))

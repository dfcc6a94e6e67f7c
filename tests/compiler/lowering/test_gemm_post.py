"""A GEMM's elementwise reader computed in the tensor-core GEMM kernel's epilogue
(compiler/fusion_gemm_post.py, lowering/gemm_post.py): which pairs merge, the kernels on
the CPU emulator against jax.jit, and (marked gpu) on the GPU."""
from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import nimblejax as nimble
from nimblejax.testing.nvrtc_check import available_compiler, compile_to_ptx
from tests.helpers import kernel_emulator as emu
from tests.helpers.models import assert_emulated_matches_jax, assert_tree_close, rand

r = np.random.default_rng(0)
needs_cxx = pytest.mark.skipif(emu.compiler() is None, reason="no host C++ compiler")


def sgd_step(p, x, y):
    """Two layers, tanh, squared loss, p - 0.01 * grad: the fori SGD loop's step."""
    def loss(p):
        h = jnp.tanh(x @ p[0])
        return jnp.mean((h @ p[1] - y) ** 2)
    g = jax.grad(loss)(p)
    return jax.tree_util.tree_map(lambda a, b: a - 0.01 * b, p, g)


def sgd_args():
    return ((rand(r, 64, 128, scale=0.1), rand(r, 128, 10, scale=0.1)), rand(r, 32, 64), rand(r, 32, 10))


def tanh_dense(x, w, b, s):
    return jnp.tanh(x @ w + b) * s - 0.5


def plan_of(fn, *args):
    return nimble.jit(fn, backend="interpret").plan(*args)


def test_the_sgd_step_is_its_gemms_and_nothing_else():
    plan = plan_of(sgd_step, *sgd_args())
    names = [t.name for t in plan.tasks]
    assert len(names) == 5 and all(n.startswith("nimble_gemm_tc_") for n in names), names
    assert sum("_then_" in n for n in names) == 3  # tanh, the loss gradient, tanh's backward
    # The merged task's inputs are its kernel's (the GEMM's result is not among them).
    for t in plan.tasks:
        assert set(t.inputs) == {v for v in t.kernel.params if v not in t.outputs}


def test_what_does_not_merge():
    x, w = rand(r, 32, 64), rand(r, 64, 128, scale=0.1)
    kept = {
        "the result is also returned": lambda x, w: (x @ w, jnp.tanh(x @ w)),
        "read through a strided slice": lambda x, w: jnp.tanh((x @ w)[:, ::2]),
        "read by two kernels": lambda x, w: (jnp.tanh(x @ w), jnp.sum(x @ w, axis=0)),
        "the option is off": None,
    }
    for why, fn in kept.items():
        plan = (nimble.jit(lambda x, w: jnp.tanh(x @ w), backend="interpret", tc_gemm=False).plan(x, w)
                if fn is None else plan_of(fn, x, w))
        assert not [t.name for t in plan.tasks if "_then_" in t.name], why


@needs_cxx
def test_the_sgd_step_on_the_emulator_matches_jax():
    (w0, w1), x, y = sgd_args()
    assert_emulated_matches_jax(lambda w0, w1, x, y: sgd_step((w0, w1), x, y), (w0, w1, x, y))


@needs_cxx
def test_a_post_group_reading_other_buffers_and_a_bias_epilogue():
    args = (rand(r, 32, 64), rand(r, 64, 96, scale=0.1), rand(r, 96), rand(r, 32, 96))
    plan = plan_of(tanh_dense, *args)
    (task,) = plan.tasks
    assert "_then_" in task.name and task.gemm.epilogue.bias
    assert_emulated_matches_jax(tanh_dense, args)


@needs_cxx
def test_a_result_with_a_leading_axis_of_one():
    """x of (1, 32, 64), as a model with a batch of one writes it: merged, indexed (0, row, col)."""
    fn = lambda x, w, s: jnp.tanh(x @ w) * s  # noqa: E731
    args = (rand(r, 1, 32, 64), rand(r, 64, 128, scale=0.1), rand(r, 1, 32, 128))
    assert [t.name for t in plan_of(fn, *args).tasks if "_then_" in t.name]
    assert_emulated_matches_jax(fn, args)


@pytest.mark.skipif(available_compiler() is None, reason="no NVRTC or nvcc")
def test_merged_kernels_compile_for_sm90():
    for fn, args in ((sgd_step, sgd_args()), (tanh_dense, (rand(r, 32, 64), rand(r, 64, 96), rand(r, 96),
                                                              rand(r, 32, 96)))):
        for t in plan_of(fn, *args).tasks:
            compile_to_ptx(t.kernel.source, t.kernel.name, fast=True)


@pytest.mark.gpu
def test_on_the_gpu_twice():
    for fn, args in ((sgd_step, sgd_args()), (tanh_dense, (rand(r, 32, 64), rand(r, 64, 96, scale=0.1),
                                                              rand(r, 96), rand(r, 32, 96)))):
        f = nimble.jit(fn, backend="cuda")
        assert any("_then_" in t.name for t in f.plan(*args).tasks)
        for _ in range(2):
            assert_tree_close(f(*args), jax.jit(fn)(*args))

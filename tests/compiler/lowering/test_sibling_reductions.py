"""Sibling column reductions in one kernel (compiler/fusion_siblings.py, the column
kernel of lowering/codegen.py): a batch norm's backward sums dy and dy·x over (N, H, W)
in one loop. Structure on the plan, numbers against jax.jit under the CPU interpreter and
with the kernels run on the CPU (tests/helpers/kernel_emulator.py), NVRTC compiles
them, and the GPU compares with jax.jit."""
from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import nimblejax as nimble
from tests.helpers import on_host
from tests.helpers import kernel_emulator as emu
from tests.helpers.libraries import assert_kernels_compile
from tests.helpers.models import assert_tree_close, rand

r = np.random.default_rng(11)


def bn_backward(dy, x, scale):
    """A ReLU'd gradient, its per-channel sums alone and times x, and dx."""
    g = dy * (x > 0)
    return jnp.sum(g, axis=(0, 1, 2)), jnp.sum(g * x, axis=(0, 1, 2)), g * scale


def three_sums(x, y):
    """Three sums of one buffer's expressions (and a max, another reducer)."""
    return (jnp.sum(x, axis=0), jnp.sum(x * y, axis=0), jnp.sum(jnp.tanh(x), axis=0),
            jnp.max(x, axis=0))


def int_sums(a, b):
    return jnp.sum(a, axis=(0, 1)), jnp.sum(a * b, axis=(0, 1))


def nhwc(*shape):
    return lambda: (rand(r, *shape), rand(r, *shape), rand(r, shape[-1]))


CASES = {
    "bn_small": (bn_backward, nhwc(2, 5, 5, 8)),
    "bn_split": (bn_backward, nhwc(8, 16, 16, 32)),  # long columns: split in two stages
    "three_sums": (three_sums, lambda: (rand(r, 100, 24), rand(r, 100, 24))),  # unsplit (split.MIN_COLUMN)
    "int_sums": (int_sums, lambda: (on_host(r.integers(-50, 50, (6, 7, 9)), jnp.int32),
                                    on_host(r.integers(-50, 50, (6, 7, 9)), jnp.int32))),
}


def plan_of(fn, *args):
    return nimble.jit(fn, backend="interpret").plan(*args)


def reduce_tasks(plan):
    return [t for t in plan.tasks if t.kind == "kernel" and t.kernel.name.startswith("nimble_reduce")]


def test_sums_of_one_gradient_are_one_kernel():
    fn, make = CASES["bn_small"]
    (task,) = reduce_tasks(plan_of(fn, *make()))
    assert len(task.outputs) == 2
    # Split in two stages: the first stages read dy together, the second stages each
    # read their own partial sums.
    fn, make = CASES["bn_split"]
    tasks = reduce_tasks(plan_of(fn, *make()))
    assert sorted(len(t.outputs) for t in tasks) == [1, 1, 2]


def test_three_sums_share_a_loop_and_another_reducer_does_not():
    fn, make = CASES["three_sums"]
    tasks = reduce_tasks(plan_of(fn, *make()))
    assert sorted(len(t.outputs) for t in tasks) == [1, 3]


def test_reductions_apart_stay_apart():
    x = rand(r, 64, 16)
    # Other axes, no common buffer, or a sum of the other sum: one kernel each.
    assert len(reduce_tasks(plan_of(lambda a: (jnp.sum(a, axis=0), jnp.sum(a, axis=1)), x))) == 2
    assert len(reduce_tasks(plan_of(lambda a, b: (jnp.sum(a, axis=0), jnp.sum(b, axis=0)), x, x + 1))) == 2
    chained = lambda a: jnp.sum(a * jnp.sum(a, axis=0), axis=0)  # noqa: E731
    assert all(len(t.outputs) == 1 for t in reduce_tasks(plan_of(chained, x)))
    # Row reductions (the innermost axis reduced) keep a kernel each.
    assert all(len(t.outputs) == 1 for t in
               reduce_tasks(plan_of(lambda a: (jnp.sum(a, axis=1), jnp.sum(a * a, axis=1)), x)))


def check(outs, fn, args) -> None:
    """Floats to the GPU tolerance, integers bit for bit (assert_tree_close)."""
    assert_tree_close([np.asarray(o) for o in outs], jax.tree_util.tree_leaves(jax.jit(fn)(*args)))


@pytest.mark.parametrize("name", sorted(CASES))
def test_interpreter_matches_jax(name):
    fn, make = CASES[name]
    args = make()
    check(nimble.jit(fn, backend="interpret")(*args), fn, args)


@pytest.mark.skipif(emu.compiler() is None, reason="no C++ compiler for the kernel emulator")
@pytest.mark.parametrize("name", sorted(CASES))
def test_emulated_kernels_match_jax(name):
    fn, make = CASES[name]
    args = make()
    plan = plan_of(fn, *args)
    outs, emulated = emu.run(plan, [np.asarray(a) for a in args])
    assert emulated >= len(reduce_tasks(plan))
    check(outs, fn, args)


def test_sibling_kernels_compile():
    assert_kernels_compile({t.kernel.name: t.kernel.source for fn, make in CASES.values()
                            for t in reduce_tasks(plan_of(fn, *make())) if len(t.outputs) > 1},
                           "nimble_siblings")


@pytest.mark.gpu
@pytest.mark.parametrize("name", sorted(CASES))
def test_cuda_matches_jax(name):
    fn, make = CASES[name]
    args = make()
    check(jax.tree_util.tree_leaves(nimble.jit(fn, backend="cuda")(*args)), fn, args)

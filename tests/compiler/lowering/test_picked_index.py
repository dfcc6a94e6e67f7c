"""A slice that picks one index of an axis (an unrolled loop's step t reading xs[t]) reads
that index from a kernel argument (KernelBuilder.hoist, Kernel.scalars): the steps'
kernels are one source, compiled once, and run with their own index."""
from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax import lax

import nimblejax as nimble
from tests.helpers import kernel_emulator as emu
from tests.helpers.models import assert_emulated_matches_jax


def steps(h, w, xs):
    """An unrolled recurrence whose every step reads one row of xs."""
    for t in range(xs.shape[0]):  # the product keeps each step a kernel of its own
        h = (jnp.tanh(h @ w) + xs[t]) * lax.slice_in_dim(xs, t, t + 1)[0]
    return h


def args():
    r = np.random.default_rng(5)
    return (jnp.asarray(r.standard_normal((2, 40)), jnp.float32),
            jnp.asarray(r.standard_normal((40, 40)) / 7, jnp.float32),
            jnp.asarray(r.standard_normal((6, 40)), jnp.float32))


def test_the_steps_share_one_source_and_differ_in_their_scalar():
    plan = nimble.jit(steps, backend="interpret").plan(*args())
    kernels = [t.kernel for t in plan.tasks if t.kernel is not None and "fused" in t.kernel.name]
    assert len(kernels) == 6, [t.name for t in plan.tasks]
    assert len({k.source for k in kernels}) == 1
    assert [k.scalars for k in kernels] == [(t, t) for t in range(6)]  # xs[t], slice_in_dim
    assert "const long long s0" in kernels[0].source and "s0 * 40" in kernels[0].source


def test_without_hoisting_the_index_is_a_literal():
    from nimblejax.compiler.lowering.codegen import KernelBuilder

    b = KernelBuilder()
    node = next(n for n in nimble.jit(steps, backend="interpret").plan(*args()).graph.nodes if n.name == "slice")
    assert b.picked_index(node, 0, 4) == "4" and b.scalar_values() == ()


@pytest.mark.skipif(emu.compiler() is None, reason="no C++ compiler for the kernel emulator")
def test_on_the_emulator_each_step_reads_its_own_row():
    assert_emulated_matches_jax(steps, args())


@pytest.mark.gpu
def test_on_the_gpu_each_step_reads_its_own_row():
    from tests.helpers import on_host

    a = [on_host(np.asarray(v), jnp.float32) for v in args()]
    np.testing.assert_allclose(np.asarray(nimble.jit(steps)(*a)), np.asarray(jax.jit(steps)(*a)), rtol=1e-5, atol=1e-5)

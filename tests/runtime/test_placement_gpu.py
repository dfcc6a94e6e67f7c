"""runtime/placement.py on the GPU (`defer_build=True`): the FFI runner's graph is built
after the lowering named its reserved plan ids, while XLA compiles; the calls then run
as they do with the graph built in the lowering: the direct call, the resident path's
views, a donated state fed back."""
from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import nimblejax as nimble

pytestmark = pytest.mark.gpu


@pytest.fixture
def finished(monkeypatch):
    """How many deferred placements were finished (FfiRunner.finish_placement)."""
    from nimblejax.runtime import ffi_runner

    count = [0]
    real = ffi_runner.FfiRunner.finish_placement

    def spy(self):
        count[0] += 1
        assert self.pending and self.id > 0  # ids reserved at the lowering, graph not built
        real(self)
        assert not self.pending and self.exes

    monkeypatch.setattr(ffi_runner.FfiRunner, "finish_placement", spy)
    return count


def rng_array(rng, *shape):
    return jnp.asarray(rng.standard_normal(shape), jnp.float32)


def test_a_direct_call_builds_while_xla_compiles(finished):
    def fn(x):
        return jnp.tanh(x) * 3.0 + jnp.sin(x)

    f = nimble.jit(fn, defer_build=True)
    rng = np.random.default_rng(0)
    for _ in range(3):
        x = rng_array(rng, 1024)
        np.testing.assert_allclose(np.asarray(f(x)), np.asarray(jax.jit(fn)(x)), rtol=1e-6, atol=1e-6)
    if getattr(f, "_library", None) is None:
        pytest.skip("the XLA FFI handler is not built on this machine")
    assert finished[0] == 1


def test_resident_calls_and_their_views_with_a_deferred_build(finished):
    def mlp(params, x):
        for w, b in params:
            x = jnp.tanh(x @ w + b)
        return x.sum(axis=0), x

    rng = np.random.default_rng(1)
    params = [(rng_array(rng, 64, 64) * 0.2, rng_array(rng, 64)) for _ in range(3)]
    f = nimble.jit(mlp, defer_build=True)
    for _ in range(4):  # params held from the second call on: a view of the plan
        x = rng_array(rng, 8, 64)
        got, want = f(params, x), jax.jit(mlp)(params, x)
        for g, w in zip(got, want):
            np.testing.assert_allclose(np.asarray(g), np.asarray(w), rtol=2e-3, atol=2e-3)
    if getattr(f, "_library", None) is None:
        pytest.skip("the XLA FFI handler is not built on this machine")
    assert finished[0] == 1


def test_a_donated_state_fed_back_with_a_deferred_build(finished):
    def step(state, x):  # full float32: under TF32 a last-bit difference in w, fed back,
        w, v = state     # moves a rounding of w's operand and an element by 1e-4
        g = jnp.tanh(jnp.dot(x, w, precision="highest")).sum(axis=0)
        v = 0.9 * v + g
        return (w - 0.01 * v[None, :], v)

    rng = np.random.default_rng(2)
    w0, v0 = rng_array(rng, 32, 32) * 0.3, jnp.zeros(32, jnp.float32)
    f = nimble.jit(step, donate_argnums=0, defer_build=True)
    g = jax.jit(step)
    state, ref = (jnp.array(w0), jnp.array(v0)), (w0, v0)
    for _ in range(5):
        x = rng_array(rng, 4, 32)
        state, ref = f(state, x), g(ref, x)
    for a, b in zip(state, ref):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-4, atol=1e-4)
    if getattr(f, "_library", None) is None:
        pytest.skip("the XLA FFI handler is not built on this machine")
    assert finished[0] >= 1

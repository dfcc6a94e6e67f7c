"""Typed PRNG keys as results of a nimble.jit function on the XLA call path: the
resident path (xla_path._make_resident) learns of them from the plan's own trace and
hands the call to the full path, which returns them as keys, call after call."""
from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

import nimblejax as nimble

rng = np.random.default_rng(3)


def step(params, seed, x):
    key = jax.random.split(jax.random.wrap_key_data(seed))[1]
    return key, jnp.tanh(params["w"] @ x) + jax.random.uniform(key, x.shape)


def test_a_key_result_comes_back_as_a_key_on_every_call():
    params = {"w": jnp.asarray(rng.standard_normal((8, 8)), jnp.float32)}  # the same object each call
    f, g = nimble.jit(step, backend="interpret"), jax.jit(step)
    for i in range(3):
        seed = jnp.asarray([i, 7], jnp.uint32)
        x = jnp.asarray(rng.standard_normal(8), jnp.float32)
        (key, y), (want_key, want_y) = f(params, seed, x), g(params, seed, x)
        assert key.dtype == want_key.dtype
        np.testing.assert_array_equal(jax.random.key_data(key), jax.random.key_data(want_key))
        np.testing.assert_allclose(np.asarray(y), np.asarray(want_y), rtol=1e-5, atol=1e-6)

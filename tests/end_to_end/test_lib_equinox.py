"""Programs written the way equinox's documentation shows them (issue 33), through
nimble.jit on the CPU interpreter against jax.jit on random inputs: an MLP, a CNN, a
multi-head attention layer, a training step with optax and an LSTM cell scanned. A
model is split into its arrays and the rest (`eqx.partition`), the arrays are the jitted
function's arguments, as `eqx.filter_jit` does. Each program is planned whole
(`fallback="error"`: nothing is left to XLA)."""
from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax import lax

import nimblejax as nimble
from tests.helpers.libraries import GPU_TOL, assert_kernels_compile, close, report_kernels

eqx = pytest.importorskip("equinox")
optax = pytest.importorskip("optax")


def key(r: np.random.Generator):
    return jax.random.key(int(r.integers(1 << 30)))


def split(model):
    params, static = eqx.partition(model, eqx.is_array)
    return params, static


# ---- the programs: each returns (function of (params, *inputs), params, inputs) ------
def mlp(r):
    params, static = split(eqx.nn.MLP(8, 3, width_size=16, depth=2, key=key(r)))

    def loss(params, x):
        model = eqx.combine(params, static)
        return jnp.mean(jax.vmap(model)(x) ** 2)

    return loss, params, (r.standard_normal((10, 8)).astype(np.float32),)


class CNN(eqx.Module):
    """The CNN of equinox's MNIST example, smaller."""

    layers: list

    def __init__(self, k):
        k1, k2 = jax.random.split(k)
        self.layers = [eqx.nn.Conv2d(1, 4, kernel_size=3, key=k1), eqx.nn.MaxPool2d(kernel_size=2),
                       jax.nn.relu, jnp.ravel, eqx.nn.Linear(4 * 9 * 9, 5, key=k2), jax.nn.log_softmax]

    def __call__(self, x):
        for layer in self.layers:
            x = layer(x)
        return x


def cnn(r):
    params, static = split(CNN(key(r)))

    def loss(params, x, y):
        model = eqx.combine(params, static)
        logp = jax.vmap(model)(x)
        return -jnp.mean(jnp.take_along_axis(logp, y[:, None], axis=1))

    x = r.standard_normal((4, 1, 12, 12)).astype(np.float32)
    return loss, params, (x, r.integers(0, 5, size=4).astype(np.int32))


def attention(r):
    params, static = split(eqx.nn.MultiheadAttention(num_heads=2, query_size=16, key=key(r)))

    def attend(params, q, kv):
        mha = eqx.combine(params, static)
        return mha(q, kv, kv)

    q, kv = (r.standard_normal((n, 16)).astype(np.float32) for n in (5, 7))
    return attend, params, (q, kv)


def train_step(r):
    """equinox's `make_step`: the loss's value and gradient, then optax's Adam update."""
    params, static = split(eqx.nn.MLP(6, 2, width_size=12, depth=2, key=key(r)))
    optim = optax.adam(1e-2)
    opt_state = optim.init(params)

    def step(params, opt_state, x, y):
        def loss(params):
            pred = jax.vmap(eqx.combine(params, static))(x)
            return jnp.mean((pred - y) ** 2)

        value, grads = jax.value_and_grad(loss)(params)
        updates, opt_state = optim.update(grads, opt_state, params)
        return eqx.apply_updates(params, updates), opt_state, value

    x = r.standard_normal((16, 6)).astype(np.float32)
    y = r.standard_normal((16, 2)).astype(np.float32)
    return step, params, (opt_state, x, y)


def lstm(r):
    params, static = split(eqx.nn.LSTMCell(4, 8, key=key(r)))

    def run(params, xs, h0):
        cell = eqx.combine(params, static)

        def step(carry, x):
            h, c = cell(x, carry)
            return (h, c), h

        (h, c), hs = lax.scan(step, (h0, jnp.zeros_like(h0)), xs)
        return hs, c

    xs = r.standard_normal((6, 4)).astype(np.float32)
    return run, params, (xs, r.standard_normal(8).astype(np.float32))


PROGRAMS = {"mlp": mlp, "cnn": cnn, "attention": attention, "train_step": train_step, "lstm": lstm}


# ---- interpreter -----------------------------------------------------------------------
@pytest.mark.parametrize("name", sorted(PROGRAMS))
def test_matches_jax_jit_planned_whole(name):
    fn, params, inputs = PROGRAMS[name](np.random.default_rng(sorted(PROGRAMS).index(name)))
    f = nimble.jit(fn, backend="interpret", fallback="error")  # nothing left to XLA
    close(f(params, *inputs), jax.jit(fn)(params, *inputs))


@pytest.mark.parametrize("name", ["attention", "cnn", "lstm"])
def test_gradient_matches(name):
    """Gradients through max pooling, attention's softmax and the scanned cell."""
    fn, params, inputs = PROGRAMS[name](np.random.default_rng(7))

    def loss(params, *inputs):
        return jnp.sum(jax.tree_util.tree_leaves(fn(params, *inputs))[0] ** 2)

    g = nimble.jit(jax.grad(loss), backend="interpret", fallback="error")
    close(g(params, *inputs), jax.jit(jax.grad(loss))(params, *inputs), tol=1e-4)


def test_train_step_fed_back_trains_like_jax_jit():
    """Three steps, each fed the previous step's parameters and optimizer state."""
    step, params, (opt_state, x, y) = train_step(np.random.default_rng(8))
    f, ref = nimble.jit(step, backend="interpret"), jax.jit(step)
    mine, theirs = (params, opt_state), (params, opt_state)
    for _ in range(3):
        *mine, loss = f(*mine, x, y)
        *theirs, want = ref(*theirs, x, y)
        close(loss, want)
    close(mine, theirs)


def test_generated_kernels_compile():
    kernels = {}
    for seed, name in enumerate(sorted(PROGRAMS)):
        fn, params, inputs = PROGRAMS[name](np.random.default_rng(seed))
        kernels.update(report_kernels(nimble.explain(nimble.jit(fn, backend="interpret"), params, *inputs)))
    assert_kernels_compile(kernels, "equinox")


# ---- GPU ---------------------------------------------------------------------------------
@pytest.mark.gpu
def test_gpu_programs_match_jax_jit():
    for seed, name in enumerate(sorted(PROGRAMS)):
        fn, params, inputs = PROGRAMS[name](np.random.default_rng(seed))
        close(nimble.jit(fn)(params, *inputs), jax.jit(fn)(params, *inputs), tol=GPU_TOL)

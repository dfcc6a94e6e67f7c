"""Programs written the way flax.nnx's documentation shows them (issue 33), through
nimble.jit on the CPU interpreter against jax.jit on random inputs: a model split
(`nnx.split`) into its graph definition and state, the state the jitted function's
argument, the model merged (`nnx.merge`) inside it; and a training step that returns the
new state, split again, as nnx's "functional API" does with jax.jit."""
from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import nimblejax as nimble
from tests.helpers.libraries import GPU_TOL, assert_kernels_compile, close, report_kernels

nnx = pytest.importorskip("flax.nnx")
optax = pytest.importorskip("optax")


class Model(nnx.Module):
    """Linear, BatchNorm, Dropout, Linear: parameters, batch statistics and an RNG
    stream in the state."""

    def __init__(self, din: int, dmid: int, dout: int, rngs: nnx.Rngs):
        self.linear = nnx.Linear(din, dmid, rngs=rngs)
        self.bn = nnx.BatchNorm(dmid, rngs=rngs)
        self.dropout = nnx.Dropout(0.2, rngs=rngs)
        self.out = nnx.Linear(dmid, dout, rngs=rngs)

    def __call__(self, x):
        return self.out(nnx.relu(self.dropout(self.bn(self.linear(x)))))


def model(seed: int):
    return Model(6, 16, 3, rngs=nnx.Rngs(params=seed, dropout=seed + 1))


def batch(seed: int):
    r = np.random.default_rng(seed)
    return r.standard_normal((8, 6)).astype(np.float32), r.standard_normal((8, 3)).astype(np.float32)


def test_split_merge_forward_in_eval_mode():
    m = model(0)
    m.eval()  # BatchNorm reads its running statistics, Dropout is off
    graphdef, state = nnx.split(m)

    def forward(state, x):
        return nnx.merge(graphdef, state)(x)

    x, _ = batch(1)
    f = nimble.jit(forward, backend="interpret", fallback="error")
    close(f(state, x), jax.jit(forward)(state, x))


def train_step_fn(graphdef):
    def train_step(state, x, y):
        """The loss's gradient and optax's SGD update, in nnx's functional style: the new
        state (batch statistics, RNG counts, parameters) comes back split."""
        model, optimizer = nnx.merge(graphdef, state)

        def loss_fn(model):
            return jnp.mean((model(x) - y) ** 2)

        loss, grads = nnx.value_and_grad(loss_fn)(model)
        optimizer.update(model, grads)
        return loss, nnx.state((model, optimizer))

    return train_step


def test_split_merge_training_step_fed_back():
    m = model(2)
    optimizer = nnx.Optimizer(m, optax.sgd(0.05, momentum=0.9), wrt=nnx.Param)
    graphdef, state = nnx.split((m, optimizer))
    step = train_step_fn(graphdef)
    f, ref = nimble.jit(step, backend="interpret", fallback="error"), jax.jit(step)
    mine = theirs = state
    for k in range(3):
        x, y = batch(10 + k)
        loss, mine = f(mine, x, y)
        want, theirs = ref(theirs, x, y)
        close(loss, want)
    close(mine, theirs)


def test_generated_kernels_compile():
    m = model(5)
    optimizer = nnx.Optimizer(m, optax.sgd(0.05, momentum=0.9), wrt=nnx.Param)
    graphdef, state = nnx.split((m, optimizer))
    report = nimble.explain(nimble.jit(train_step_fn(graphdef), backend="interpret"), state, *batch(6))
    assert_kernels_compile(report_kernels(report), "flax_nnx")


@pytest.mark.gpu
def test_gpu_split_merge_matches_jax_jit():
    m = model(3)
    optimizer = nnx.Optimizer(m, optax.sgd(0.05, momentum=0.9), wrt=nnx.Param)
    graphdef, state = nnx.split((m, optimizer))
    step = train_step_fn(graphdef)
    x, y = batch(4)
    close(nimble.jit(step)(state, x, y), jax.jit(step)(state, x, y), tol=GPU_TOL)

"""Reference functions shared by the interpreter tests and the GPU tests.

Each entry: name → (function, argument factory, options for nimble.jit). Inputs are
random (never zeros), drawn from a seeded generator.
"""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np

from tests.helpers import on_host


def rand(rng: np.random.Generator, *shape, dtype=jnp.float32, scale=1.0):
    return on_host(rng.standard_normal(shape) * scale, dtype)


def mlp(params, x):
    for w, b in params:
        x = jnp.tanh(x @ w + b)
    return x


def mlp_args(rng):
    sizes = [(16, 32), (32, 32), (32, 8)]
    params = [(rand(rng, i, o, scale=0.3), rand(rng, o, scale=0.1)) for i, o in sizes]
    return (params, rand(rng, 4, 16))


def softmax(x):
    return jax.nn.softmax(x, axis=-1)


def layer_norm(x, g, b, eps=1e-5):
    mean = jnp.mean(x, axis=-1, keepdims=True)
    var = jnp.mean((x - mean) ** 2, axis=-1, keepdims=True)
    return (x - mean) * jax.lax.rsqrt(var + eps) * g + b


def gelu_dense(x, w, b):
    return jax.nn.gelu(x @ w + b)


def attention(q, k, v):
    s = jnp.einsum("bqd,bkd->bqk", q, k) / np.sqrt(q.shape[-1])
    return jnp.einsum("bqk,bkd->bqd", jax.nn.softmax(s, axis=-1), v)


def nested(tree):
    a, (b, c) = tree["a"], tree["bc"]
    return {"sum": a + b, "pair": (jnp.sin(c), {"prod": a * b})}


def static_power(x, n):
    y = x
    for _ in range(n):
        y = y * x
    return y


def mlp_loss_grad(params, x, y):
    def loss(p):
        return jnp.mean((mlp(p, x) - y) ** 2)
    return jax.grad(loss)(params)


@jax.jit
def _inner(x):
    return jnp.exp(-x * x)


def calls_jitted(x):
    return jax.nn.relu(_inner(x) - 0.5) + x


def branchy_mlp(params, x):
    """The branchy MLP (bench/models/mlp.py): parallel branches of dense + bias + tanh, summed."""
    out = 0.0
    for branch in params:
        h = x
        for w, b in branch:
            h = jnp.tanh(h @ w + b)
        out = out + h
    return out


def branchy_args(rng, branches=4, layers=3, width=64, batch=2):
    params = [[(rand(rng, width, width, scale=1 / np.sqrt(width)), rand(rng, width, scale=0.1))
               for _ in range(layers)] for _ in range(branches)]
    return (params, rand(rng, batch, width))


def inception_block(params, x):
    """Four parallel branches of different depth joined by a concatenate."""
    outs = []
    for branch in params:
        h = x
        for w in branch:
            h = jax.nn.relu(h @ w)
        outs.append(h)
    return jnp.concatenate(outs, axis=-1)


def inception_args(rng, width=32):
    depths = (1, 2, 2, 3)
    params = [[rand(rng, width, width, scale=0.3) for _ in range(d)] for d in depths]
    return (params, rand(rng, 3, width))


MODELS = {
    "mlp": (mlp, mlp_args, {}),
    "softmax": (softmax, lambda r: (rand(r, 4, 33),), {}),
    "layer_norm": (layer_norm, lambda r: (rand(r, 4, 48), rand(r, 48), rand(r, 48)), {}),
    "gelu_dense": (gelu_dense, lambda r: (rand(r, 8, 16), rand(r, 16, 24, scale=0.3), rand(r, 24)), {}),
    "attention": (attention, lambda r: tuple(rand(r, 2, 5, 8) for _ in range(3)), {}),
    "nested": (nested, lambda r: ({"a": rand(r, 3, 4), "bc": (rand(r, 3, 4), rand(r, 2))},), {}),
    "static_argnums": (static_power, lambda r: (rand(r, 5), 3), {"static_argnums": (1,)}),
    "grad_mlp": (mlp_loss_grad, lambda r: mlp_args(r) + (rand(r, 4, 8),), {}),
    "calls_jitted": (calls_jitted, lambda r: (rand(r, 6, 7),), {}),
    "branchy_mlp": (branchy_mlp, branchy_args, {}),
    "inception_block": (inception_block, inception_args, {}),
}


def tolerance(dtype) -> dict:
    name = np.dtype(dtype).name
    if name in ("bfloat16", "float16"):
        return dict(rtol=2e-2, atol=2e-2)
    if name == "float32":
        return dict(rtol=2e-3, atol=2e-3)  # TF32 dots on the GPU
    return dict(rtol=0, atol=0)


HALVES = (jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float16))


def jax_reference(fn, *args):
    """jax.jit's values, or jax's op by op where the program computes a 16-bit float:
    XLA's fusions keep a bf16 sum in f32 (excess precision), so one element of
    `x + (y + bias)` can land a bf16 step away from the value rounded after each op,
    which jax's semantics, the interpreter and nimble's row kernels compute."""
    eqns = jax.make_jaxpr(fn)(*args).eqns
    if not any(v.aval.dtype in HALVES for e in eqns for v in e.outvars):
        return jax.jit(fn)(*args)
    with jax.disable_jit():
        return fn(*args)


def assert_tree_close(got, want) -> None:
    got_leaves, got_tree = jax.tree_util.tree_flatten(got)
    want_leaves, want_tree = jax.tree_util.tree_flatten(want)
    assert got_tree == want_tree, f"{got_tree} != {want_tree}"
    for g, w in zip(got_leaves, want_leaves):
        g, w = np.asarray(g), np.asarray(w)
        assert g.shape == w.shape and g.dtype == w.dtype, (g.shape, g.dtype, w.shape, w.dtype)
        tol = tolerance(w.dtype)
        finite = np.abs(w[np.isfinite(w)]) if w.dtype.kind == "f" else np.zeros(0)
        if w.dtype == np.float32 and finite.size:
            # TF32 GEMMs and convolutions err relative to the operands' scale, not to
            # each output element: near-zero outputs get the scale's absolute error
            # (the scale of the finite values: an inf must not make everything pass).
            tol["atol"] = tol["atol"] * max(1.0, float(np.max(finite)))
        np.testing.assert_allclose(g.astype(np.float64), w.astype(np.float64), **tol)


@functools.lru_cache(maxsize=None)
def model_args(name: str, seed: int = 0):
    return MODELS[name][1](np.random.default_rng(seed))


def assert_emulated_matches_jax(fn, args) -> None:
    """fn's plan with its generated kernels run on the CPU (kernel_emulator.py; at least
    one of them) gives jax.jit's values."""
    import nimblejax as nimble
    from tests.helpers import kernel_emulator as emu

    plan = nimble.jit(fn, backend="interpret").plan(*args)
    outs, emulated = emu.run(plan, [np.asarray(a) for a in args])
    assert emulated >= 1
    for got, want in zip(outs, jax.tree_util.tree_leaves(jax.jit(fn)(*args))):
        assert_tree_close(np.asarray(got), want)


def assert_interpreted_matches_jax(fn, args) -> None:
    """nimble.jit(fn) on the CPU interpreter against jax.jit."""
    import nimblejax as nimble

    assert_tree_close(nimble.jit(fn, backend="interpret")(*args), jax.jit(fn)(*args))


def assert_cuda_matches_jax_twice(fn, args, plan_holds=None, reference=None) -> None:
    """nimble.jit(fn) on the GPU against jax.jit (or `reference(fn, *args)`), called
    twice (the second call replays the same graph); `plan_holds(plan)`, if given, is
    asserted on its plan first."""
    import nimblejax as nimble

    f = nimble.jit(fn, backend="cuda")
    if plan_holds is not None:
        assert plan_holds(f.plan(*args))
    want = reference(fn, *args) if reference is not None else jax.jit(fn)(*args)
    for _ in range(2):
        assert_tree_close(f(*args), want)

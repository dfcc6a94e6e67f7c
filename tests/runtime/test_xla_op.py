"""The XLA FFI call path on the GPU: a nimble plan as a JAX operation."""
from __future__ import annotations

import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import nimblejax as nimble
from tests.helpers.models import branchy_args, branchy_mlp, rand

pytestmark = pytest.mark.gpu
r = np.random.default_rng(0)


def close(a, b, tol=2e-3):
    for x, y in zip(jax.tree_util.tree_leaves(a), jax.tree_util.tree_leaves(b)):
        np.testing.assert_allclose(np.asarray(x), np.asarray(y), rtol=tol, atol=tol)


def loss(p, x):
    return jnp.sum(branchy_mlp(p, x) ** 2)


@pytest.fixture(scope="module")
def model():
    return branchy_args(np.random.default_rng(1), branches=4, layers=3, width=64, batch=8)


def test_ffi_path_is_taken_and_matches_jax(model):
    f = nimble.jit(branchy_mlp, backend="cuda")
    close(f(*model), jax.jit(branchy_mlp)(*model))
    assert f.call_path == "xla"
    for _ in range(3):  # fresh inputs, no block in between
        x = rand(r, 8, 64)
        close(f(model[0], x), jax.jit(branchy_mlp)(model[0], x))


def test_grad_vmap_and_jit_inside_through_ffi(model):
    f = nimble.jit(branchy_mlp, backend="cuda")
    nl = lambda p, x: jnp.sum(f(p, x) ** 2)  # noqa: E731
    # TF32 dots (XLA's float32 default) on both sides: gradients agree to ~1e-2
    close(jax.grad(nl)(*model), jax.grad(loss)(*model), tol=2e-2)
    xs = rand(r, 3, 8, 64)
    close(jax.vmap(f, in_axes=(None, 0))(model[0], xs), jax.vmap(branchy_mlp, in_axes=(None, 0))(model[0], xs))
    outer = jax.jit(lambda p, x: jnp.tanh(f(p, x * 2.0)) + 1.0)
    close(outer(*model), jnp.tanh(branchy_mlp(model[0], model[1] * 2.0)) + 1.0)


def test_donated_training_state_fed_back(model):
    def step(p, x):
        g = jax.grad(loss)(p, x)
        return jax.tree_util.tree_map(lambda a, b: a - 1e-3 * b, p, g)

    f = nimble.jit(step, backend="cuda", donate_argnums=0)
    ref = jax.jit(step)
    p_n = jax.tree_util.tree_map(jnp.copy, model[0])
    p_j = model[0]
    for _ in range(4):
        x = rand(r, 8, 64)
        p_n, p_j = f(p_n, x), ref(p_j, x)
    close(p_n, p_j)
    # Donated state is passed (XLA writes the new state into its buffers).
    n = len(jax.tree_util.tree_leaves(p_n))
    assert [k[3] for k in f._resident_fns][-1] == (-1,) * (n + 1)


def test_state_fed_back_without_donation_stays_on_the_gpu(model):
    def step(p, x):
        return jax.tree_util.tree_map(lambda a: jnp.tanh(a + jnp.mean(x)), p), jnp.sum(x)

    f, ref = nimble.jit(step, backend="cuda"), jax.jit(step)
    p_n = p_j = model[0]
    for _ in range(4):
        x = rand(r, 8, 64)
        (p_n, s_n), (p_j, s_j) = f(p_n, x), ref(p_j, x)
        close((p_n, s_n), (p_j, s_j))
    n = len(jax.tree_util.tree_leaves(p_n))
    assert [k[3] for k in f._resident_fns][-1] == tuple(range(n)) + (-1,)


def test_steady_state_call_runs_no_nimble_python_and_no_sync(model):
    f = nimble.jit(branchy_mlp, backend="cuda")
    xs = [rand(r, 8, 64) for _ in range(10)]
    # Two calls make the steady state: the first passes every leaf, the second is the
    # first with the parameters resident (its jitted call is traced and lowered then).
    jax.block_until_ready(f(model[0], xs[0]))
    jax.block_until_ready(f(model[0], rand(r, 8, 64)))
    seen = []

    def profile(frame, event, arg):
        if event == "call":
            seen.append(frame.f_code.co_filename)
        elif event == "c_call" and "ynchronize" in getattr(arg, "__name__", ""):
            seen.append("SYNC:" + arg.__name__)

    sys.setprofile(profile)
    try:
        outs = [f(model[0], x) for x in xs]
    finally:
        sys.setprofile(None)
    jax.block_until_ready(outs)
    call = ("api.py", "xla_path.py")  # NimbleFunction.__call__ and the XLA path's _call_xla
    nimble_frames = [s for s in seen if "nimblejax" in s and not s.endswith(call)]
    assert nimble_frames == []
    assert not [s for s in seen if s.startswith("SYNC:")]
    # The call and its residency check, a few frames per call whatever the number of
    # leaves (no compiler or runtime Python)
    assert sum(s.endswith(call) for s in seen) <= 4 * len(xs)
    close(outs[-1], jax.jit(branchy_mlp)(model[0], xs[-1]))
    # The parameters stay resident: the steady-state call passes x alone.
    assert [k[3] for k in f._resident_fns][-1] == (-2,) * len(jax.tree_util.tree_leaves(model[0])) + (-1,)


def test_resident_parameters_changed_and_deleted_on_gpu(model):
    f = nimble.jit(branchy_mlp, backend="cuda")
    p = jax.tree_util.tree_map(jnp.copy, model[0])
    for _ in range(3):
        x = rand(r, 8, 64)
        close(f(p, x), jax.jit(branchy_mlp)(p, x))
    leaves, tree = jax.tree_util.tree_flatten(p)
    leaves[0] = leaves[0] * -2.0  # one parameter changes: seen at once
    p = jax.tree_util.tree_unflatten(tree, leaves)
    close(f(p, x), jax.jit(branchy_mlp)(p, x))
    x2 = rand(r, 8, 64)
    close(f(p, x2), jax.jit(branchy_mlp)(p, x2))
    leaves[1].delete()
    with pytest.raises(RuntimeError, match="deleted"):
        f(p, x2)


def test_integer_bool_and_passthrough_outputs():
    def g(x, i):
        return x * 2.0, i + 1, x > 0, x, jnp.arange(4)

    f = nimble.jit(g, backend="cuda")
    x, i = rand(r, 5, 3), jnp.arange(6, dtype=jnp.int32)
    close(f(x, i), g(x, i), tol=0)


def test_python_path_still_available(model):
    f = nimble.jit(branchy_mlp, backend="cuda", call_path="python")
    close(f(*model), jax.jit(branchy_mlp)(*model))
    assert f.call_path == "python"

"""The XLA call path's resident operands (xla_path.py `_call_xla`): a leaf that is the very
jax.Array of the previous call is not passed again, its data stays in the runner's
arena. The interpret backend keeps its operands as the GPU arena does, so a wrong
residency decision is a wrong answer here too. Every test runs on both residency checks:
the C extension (runtime/residency.c) and its pure-Python twin."""
from __future__ import annotations

import shutil
import threading

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import nimblejax as nimble
from nimblejax.runtime import residency
from tests.helpers import on_host


@pytest.fixture(autouse=True, params=["c", "python"])
def check(request, monkeypatch) -> str:
    """NIMBLE_RESIDENCY for the functions a test makes (read when they are decorated)."""
    if request.param == "c" and not (shutil.which("cc") or shutil.which("gcc")):
        pytest.skip("no C compiler for the residency extension")
    monkeypatch.setenv("NIMBLE_RESIDENCY", request.param)
    return request.param


def layer(p, x):
    return jnp.tanh(x @ p["w"] + p["b"]) * p["s"]


def params(seed: int) -> dict:
    r = np.random.default_rng(seed)
    return {"w": on_host(r.normal(size=(16, 16)), jnp.float32),
            "b": on_host(r.normal(size=16), jnp.float32),
            "s": on_host(r.normal(size=16), jnp.float32)}


def fresh_x(r) -> jax.Array:
    return on_host(r.normal(size=(4, 16)), jnp.float32)


P, H = -1, -2  # a leaf passed to JAX, a leaf held in the arena (runner.PASSED, HELD)


def masks(f) -> list:
    """The operand sources of the jitted calls made so far, in order of first use:
    P, H or the index of the previous call's result fed back."""
    return [key[3] for key in f._resident_fns]


def close(got, want) -> None:
    np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=1e-5, atol=1e-6)


def test_unchanged_parameters_are_not_passed_again():
    f, r, p = nimble.jit(layer, backend="interpret"), np.random.default_rng(0), params(1)
    for _ in range(4):
        x = fresh_x(r)
        close(f(p, x), layer(p, x))
    # (b, s, w, x): the first call passes everything, the others only x.
    assert masks(f) == [(P,) * 4, (H, H, H, P)]
    assert f.cache_size == 1


def test_a_changed_leaf_is_always_seen():
    f, r, p = nimble.jit(layer, backend="interpret"), np.random.default_rng(0), params(1)
    x = fresh_x(r)
    f(p, x)
    for name in ("w", "b", "s"):
        p = dict(p, **{name: p[name] * 2 + 1})  # a new object with new values
        close(f(p, x), layer(p, x))
    # Equal values in a new object are passed too (identity, not equality, decides).
    p = {k: jnp.array(v) for k, v in p.items()}
    close(f(p, x), layer(p, x))
    assert (P, P, P, H) in masks(f)


def test_numpy_leaves_are_never_resident():
    f, r = nimble.jit(layer, backend="interpret"), np.random.default_rng(0)
    p = {k: np.array(v) for k, v in params(2).items()}
    x = fresh_x(r)
    close(f(p, x), layer(p, x))
    p["w"] *= -1.5  # mutated in place: the same object with new data
    close(f(p, x), layer(p, x))
    assert all(m[:3] == (P, P, P) for m in masks(f))


def test_a_deleted_parameter_is_caught():
    f, r, p = nimble.jit(layer, backend="interpret"), np.random.default_rng(0), params(3)
    f(p, fresh_x(r))
    p["w"].delete()  # as a donation elsewhere would
    with pytest.raises(RuntimeError, match="deleted"):
        f(p, fresh_x(r))
    with pytest.raises(RuntimeError, match="deleted"):
        jax.jit(layer)(p, fresh_x(r))


def test_donated_state_is_always_passed():
    def step(state, x):
        return {k: v * 0.5 + jnp.sum(x) for k, v in state.items()}

    f = nimble.jit(step, donate_argnums=0, backend="interpret")
    r, x = np.random.default_rng(0), None
    state = params(4)
    want = params(4)
    for _ in range(3):
        x = fresh_x(r)
        want = jax.jit(step)(want, x)
        state = f(state, x)
        jax.tree_util.tree_map(close, state, want)
    # Never held nor fed back: XLA writes the new state into the donated buffers.
    assert masks(f) == [(P,) * 4]


def test_fed_back_results_are_copied_inside_the_arena():
    def step(state, x):
        new = {k: jnp.tanh(v + jnp.mean(x)) for k, v in state.items()}
        return new, jnp.sum(new["w"])

    f, r = nimble.jit(step, backend="interpret"), np.random.default_rng(1)
    state, want = params(7), params(7)
    for k in range(4):
        x = fresh_x(r)
        (state, loss), (want, want_loss) = f(state, x), jax.jit(step)(want, x)
        jax.tree_util.tree_map(close, (state, loss), (want, want_loss))
    assert masks(f)[-1] == (0, 1, 2, P)
    # Results swapped between positions, and the leaf the previous call read (held).
    older = state
    state, _ = f(state, fresh_x(r))
    swapped = {"b": state["s"], "s": state["b"], "w": older["w"]}
    x = fresh_x(r)
    close(f(swapped, x)[1], step(swapped, x)[1])
    assert masks(f)[-1] == (1, 0, H, P)
    close(f(older, x)[1], step(older, x)[1])  # results of three calls ago: passed


def test_a_new_signature_passes_everything_then_resides_again():
    f, r, p = nimble.jit(layer, backend="interpret"), np.random.default_rng(0), params(5)
    f(p, fresh_x(r))
    for rows in (4, 7, 7, 4, 4):
        x = on_host(r.normal(size=(rows, 16)), jnp.float32)
        close(f(p, x), layer(p, x))
    assert f.cache_size == 2


def test_transformations_take_the_full_path():
    f, r, p = nimble.jit(layer, backend="interpret"), np.random.default_rng(0), params(6)
    x = fresh_x(r)
    f(p, x)
    loss = lambda fn: lambda p, x: jnp.sum(fn(p, x) ** 2)  # noqa: E731
    got = jax.grad(loss(f))(p, x)
    jax.tree_util.tree_map(close, got, jax.grad(loss(layer))(p, x))
    close(jax.vmap(f, in_axes=(None, 0))(p, x[None]), jax.vmap(layer, in_axes=(None, 0))(p, x[None]))
    close(f(p, x), layer(p, x))  # and the top-level path still holds the right data


def test_two_threads_with_their_own_parameters():
    f = nimble.jit(layer, backend="interpret")
    errors: list = []

    def worker(seed: int) -> None:
        r, p = np.random.default_rng(seed), params(seed)
        try:
            for _ in range(12):
                x = fresh_x(r)
                close(f(p, x), layer(p, x))
        except AssertionError as e:  # pragma: no cover - reported below
            errors.append(e)

    threads = [threading.Thread(target=worker, args=(s,)) for s in (10, 11)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=300)
    assert not errors, errors[0]


def test_the_chosen_check_runs(check):
    f, r, p = nimble.jit(layer, backend="interpret"), np.random.default_rng(0), params(8)
    f(p, fresh_x(r))
    assert f.options.residency == check
    assert (f._steady is residency.steady_python) == (check == "python")


def test_a_change_of_matmul_precision_makes_another_call():
    f, r, p = nimble.jit(layer, backend="interpret"), np.random.default_rng(0), params(9)
    x = fresh_x(r)
    f(p, x)
    f(p, x)
    with jax.default_matmul_precision("highest"):
        close(f(p, x), layer(p, x))
        close(f(p, x), layer(p, x))
    jax.config.update("jax_default_matmul_precision", "bfloat16")
    try:
        close(f(p, x), layer(p, x))
    finally:
        jax.config.update("jax_default_matmul_precision", None)
    precisions = [key[4] for key in f._resident_fns]
    assert precisions == [None, None, "highest", "highest", "bfloat16"]
    # Back to the default: the record of the default precision's call is made again.
    f(p, x)
    assert f._resident.precision is None


def test_statics_scalars_and_keywords_stay_resident():
    def scaled(p, x, *, k, relu):
        y = layer(p, x) * k
        return jnp.maximum(y, 0) if relu else y

    f = nimble.jit(scaled, static_argnames="relu", backend="interpret")
    r, p = np.random.default_rng(0), params(10)
    for k, relu in ((0.5, True), (1.5, True), (2.5, False), (3.5, False)):
        x = fresh_x(r)
        close(f(p, x, k=k, relu=relu), scaled(p, x, k=k, relu=relu))
    # (b, s, w, x, k) after the statics changed: a Python float is never held.
    assert masks(f)[-1] == (H, H, H, P, P)
    assert f.cache_size == 2


@pytest.mark.gpu
def test_held_and_fed_back_on_the_gpu(check):
    f, r, p = nimble.jit(layer, backend="cuda"), np.random.default_rng(0), params(11)
    for _ in range(4):
        x = fresh_x(r)
        np.testing.assert_allclose(np.asarray(f(p, x)), np.asarray(layer(p, x)), rtol=2e-3, atol=2e-3)
    assert masks(f)[-1] == (H, H, H, P)
    assert (f._steady is residency.steady_python) == (check == "python")

    def step(state, x):
        new = {k: jnp.tanh(v + jnp.mean(x)) for k, v in state.items()}
        return new, jnp.sum(new["w"])

    g, state, want = nimble.jit(step, backend="cuda"), params(12), params(12)
    for _ in range(4):
        x = fresh_x(r)
        (state, loss), (want, want_loss) = g(state, x), jax.jit(step)(want, x)
        for a, b in zip(jax.tree_util.tree_leaves((state, loss)), jax.tree_util.tree_leaves((want, want_loss))):
            np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=2e-3, atol=2e-3)
    assert masks(g)[-1] == (0, 1, 2, P)


def test_few_leaves_take_jaxs_dispatch_directly():
    """A function of at most xla_path.DIRECT_MAX_LEAVES leaves is its jitted operation: no
    residency check runs per call."""
    from nimblejax import xla_path

    f, r = nimble.jit(lambda x: jnp.tanh(x) * 2.0, backend="interpret"), np.random.default_rng(3)
    for _ in range(3):
        x = fresh_x(r)
        close(f(x), jnp.tanh(x) * 2.0)
    assert xla_path.DIRECT_MAX_LEAVES >= 1 and f._entry is f._op_jit_fn and f._resident is None


def test_calls_with_nothing_resident_switch_to_jaxs_dispatch():
    """Two calls in a row with every leaf passed (fresh inputs, donated state): the
    residency check would save nothing, so later calls are the jitted operation."""
    f, r = nimble.jit(layer, backend="interpret"), np.random.default_rng(4)
    for k in range(4):
        p, x = params(20 + k), fresh_x(r)
        close(f(p, x), layer(p, x))
    assert f._entry is f._op_jit_fn and masks(f) == [(P,) * 4]

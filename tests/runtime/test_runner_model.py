"""The one runner model (runtime/runner.py): one call-spec cache for both call paths,
runners as strategies of one interface, chosen by runtime/choose.py. CPU only: the
interpreter's runner serves both paths."""
from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import nimblejax as nimble
from nimblejax.runtime import runner
from nimblejax.runtime.interpret_runner import InterpretRunner
from tests.helpers import on_host


def _f(x, w):
    return jnp.tanh(x @ w) + 1.0


def _args(seed: int, n: int = 8):
    r = np.random.default_rng(seed)
    return (on_host(r.standard_normal((n, 16)), jnp.float32),
            on_host(r.standard_normal((16, 4)), jnp.float32))


def test_the_direct_path_keeps_one_entry_per_call_spec_with_its_runner():
    f = nimble.jit(_f, backend="interpret", call_path="python")
    for seed, n in ((0, 8), (1, 8), (2, 3)):
        x, w = _args(seed, n)
        np.testing.assert_allclose(f(x, w), jax.jit(_f)(x, w), rtol=1e-5, atol=1e-5)
    assert f.call_path == "python" and f.cache_size == 2  # two shapes of x
    entries = list(f._specs.values())
    assert all(set(c.runners) == {runner.DIRECT} for c in entries)
    assert all(isinstance(r, InterpretRunner) for r in f.runners())
    assert {key[0][0] for key in f._specs} == {runner.DIRECT}
    assert f.executables() == []  # no GPU graph on the interpreter


def test_the_xla_path_fills_the_same_cache():
    f = nimble.jit(_f, backend="interpret")
    x, w = _args(0)
    np.testing.assert_allclose(f(x, w), jax.jit(_f)(x, w), rtol=1e-5, atol=1e-5)
    assert f.call_path == "xla" and f.cache_size == 1
    (entry,) = f._specs.values()
    assert set(entry.runners) <= {runner.OPERATION, runner.RESIDENT} and entry.runners
    assert all(isinstance(r, InterpretRunner) for r in f.runners())


def test_a_direct_call_under_another_matmul_precision_is_another_spec():
    f = nimble.jit(_f, backend="interpret", call_path="python")
    x, w = _args(3)
    f(x, w)
    with jax.default_matmul_precision("highest"):
        got = f(x, w)
        want = jax.jit(_f)(x, w)
    np.testing.assert_allclose(got, want, rtol=1e-6, atol=1e-6)
    assert f.cache_size == 2
    assert {key[0][3] for key in f._specs} == {None, "highest"}


def test_the_interpreters_runner_is_called_directly_and_hands_back_the_outputs():
    f = nimble.jit(lambda x: (x * 2.0, x), backend="interpret", call_path="python", output="numpy")
    x = np.arange(6, dtype=np.float32)
    plan = f.plan(x)
    run = InterpretRunner(plan, "numpy")
    doubled, same = run([x])
    assert isinstance(doubled, np.ndarray)
    np.testing.assert_array_equal(doubled, x * 2.0)
    np.testing.assert_array_equal(same, x)


def test_a_runner_says_which_way_it_does_not_run():
    class OnlyLowered(runner.Runner):
        pass

    with pytest.raises(NotImplementedError, match="only as a JAX operation"):
        OnlyLowered()([])
    with pytest.raises(NotImplementedError, match="only from Python"):
        OnlyLowered().emit()

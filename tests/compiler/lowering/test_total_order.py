"""Comparisons in XLA's total order (`eq_to`, `le_to`, `lt_to`: jnp.searchsorted, and so
jnp.interp, digitize and histogram): the generated kernels on the CPU emulator and on the
GPU (`gpu` marker) bit for bit against jax.jit, signed zeros and NaNs of both signs
included, and searchsorted through the interpreter."""
from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import nimblejax as nimble
from tests.helpers import kernel_emulator

SPECIAL = np.array([np.nan, -np.nan, -np.inf, np.inf, -0.0, 0.0, 1.0, -1.0, 3e-39, -3e-39, 2.5],
                   np.float32)
PRIMITIVES = [jax.lax.lt_to_p, jax.lax.le_to_p, jax.lax.eq_to_p]
DTYPES = [np.float32, jnp.bfloat16, jnp.float16, np.int32, np.uint8]


def _pairs(dtype):
    if np.issubdtype(dtype, np.integer):
        r = np.random.default_rng(0)
        info = np.iinfo(dtype)
        x = r.integers(info.min, info.max, 200, dtype=np.int64).astype(dtype)
        return x, np.concatenate([x[:100], x[100:][::-1]])  # equal pairs and others
    return np.repeat(SPECIAL, len(SPECIAL)).astype(dtype), np.tile(SPECIAL, len(SPECIAL)).astype(dtype)


def _fn(p):
    return lambda x, y: p.bind(x, y)


@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: np.dtype(d).name)
@pytest.mark.parametrize("p", PRIMITIVES, ids=lambda p: p.name)
def test_kernel_on_cpu_matches_jax_bit_for_bit(p, dtype):
    if kernel_emulator.compiler() is None:
        pytest.skip("no host C++ compiler")
    x, y = _pairs(dtype)
    plan = nimble.jit(_fn(p), backend="interpret").plan(x, y)
    got, ran = kernel_emulator.run(plan, [x, y])
    assert ran == 1
    np.testing.assert_array_equal(np.asarray(got[0]), np.asarray(jax.jit(_fn(p))(x, y)))


@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float16], ids=lambda d: np.dtype(d).name)
def test_a_fused_half_operand_compares_by_its_half_bits(dtype):
    """An operand computed in the kernel (in float) is compared as the half it rounds to."""
    if kernel_emulator.compiler() is None:
        pytest.skip("no host C++ compiler")
    # No NaNs, and no denormals (XLA on the CPU flushes them in arithmetic).
    finite = SPECIAL[~np.isnan(SPECIAL) & ((np.abs(SPECIAL) > 1e-30) | (SPECIAL == 0))]
    x, y = np.repeat(finite, len(finite)).astype(dtype), np.tile(finite, len(finite)).astype(dtype)
    fn = lambda x, y: jax.lax.lt_to_p.bind(x * 2, y * 2) | jax.lax.eq_to_p.bind(x, y * 1)  # noqa: E731
    plan = nimble.jit(fn, backend="interpret").plan(x, y)
    got, _ = kernel_emulator.run(plan, [x, y])
    np.testing.assert_array_equal(np.asarray(got[0]), np.asarray(jax.jit(fn)(x, y)))


def test_searchsorted_and_interp_on_the_interpreter():
    r = np.random.default_rng(1)
    grid = np.sort(r.standard_normal(40)).astype(np.float32)
    q = np.concatenate([r.standard_normal(30), grid[:5], [np.nan, -np.inf, np.inf]]).astype(np.float32)

    def f(grid, q):
        return (jnp.searchsorted(grid, q), jnp.searchsorted(grid, q, side="right"),
                jnp.interp(q, grid, jnp.tanh(grid)))

    got, want = nimble.jit(f, backend="interpret")(grid, q), jax.jit(f)(grid, q)
    np.testing.assert_array_equal(got[0], want[0])
    np.testing.assert_array_equal(got[1], want[1])
    np.testing.assert_allclose(got[2], want[2], rtol=1e-6, atol=1e-6)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: np.dtype(d).name)
def test_on_gpu_bit_for_bit(dtype):
    x, y = _pairs(dtype)
    for p in PRIMITIVES:
        got = nimble.jit(_fn(p), backend="cuda")(x, y)
        np.testing.assert_array_equal(np.asarray(got), np.asarray(jax.jit(_fn(p))(x, y)), err_msg=p.name)
    grid = np.sort(np.random.default_rng(2).standard_normal(300)).astype(np.float32)
    f = lambda g, q: jnp.searchsorted(g, q)  # noqa: E731
    q = np.random.default_rng(3).standard_normal(1000).astype(np.float32)
    np.testing.assert_array_equal(np.asarray(nimble.jit(f, backend="cuda")(grid, q)), np.asarray(jax.jit(f)(grid, q)))

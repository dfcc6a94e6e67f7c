"""Small dense linear algebra in the graph (compiler/lowering/rules_linalg.py):
cholesky, triangular_solve, lu and lu_pivots_to_permutation. The generated kernels run
on the CPU through the kernel emulator against jax.jit (LAPACK there), whole programs
through the interpreter, and (marked gpu) on the GPU against jax.jit (cuSOLVER/cuBLAS).
Pivots and permutations bit for bit; factors and solutions within float32 rounding."""
from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import nimblejax as nimble
from nimblejax.compiler.kinds import TaskKind
from nimblejax.compiler.lowering import rules_linalg
from tests.helpers import kernel_emulator

TRISOLVE = jax.lax.linalg.triangular_solve


def _spd(r, *shape):
    x = r.standard_normal(shape).astype(np.float32)
    return (x @ np.swapaxes(x, -1, -2) + shape[-1] * np.eye(shape[-1], dtype=np.float32))


def _tri(r, n, lower, unit_safe=False):
    a = r.standard_normal((n, n)).astype(np.float32) + (0 if unit_safe else 3 * n) * np.eye(n, dtype=np.float32)
    return np.tril(a) if lower else np.triu(a)


def _rng(seed: int) -> np.random.Generator:
    return np.random.default_rng(seed)


def _cases():
    """name → (function, argument maker from a Generator)."""
    return {
        "cholesky": (jnp.linalg.cholesky, lambda r: [_spd(r, 6, 6)]),
        "cholesky-batched": (jnp.linalg.cholesky, lambda r: [_spd(r, 3, 2, 5, 5)]),
        "cholesky-32": (jnp.linalg.cholesky, lambda r: [_spd(r, 32, 32)]),
        "cholesky-not-spd": (jnp.linalg.cholesky,  # one of two is not positive definite
                             lambda r: [np.stack([_spd(r, 4, 4), -_spd(r, 4, 4)])]),
        "cholesky-raw": (lambda a: jax.lax.linalg.cholesky_p.bind(a), lambda r: [_spd(r, 5, 5)]),
        "trisolve-left-lower": (lambda a, b: TRISOLVE(a, b, left_side=True, lower=True),
                                lambda r: [_tri(r, 7, True), r.standard_normal((7, 3)).astype(np.float32)]),
        "trisolve-left-upper-T": (lambda a, b: TRISOLVE(a, b, left_side=True, lower=False, transpose_a=True),
                                  lambda r: [_tri(r, 7, False), r.standard_normal((7, 130)).astype(np.float32)]),
        "trisolve-right-lower": (lambda a, b: TRISOLVE(a, b, left_side=False, lower=True),
                                 lambda r: [_tri(r, 5, True), r.standard_normal((4, 5)).astype(np.float32)]),
        "trisolve-right-upper-T-unit": (
            lambda a, b: TRISOLVE(a, b, left_side=False, lower=False, transpose_a=True, unit_diagonal=True),
            lambda r: [_tri(r, 5, False, unit_safe=True) * 0.3, r.standard_normal((2, 5)).astype(np.float32)]),
        "trisolve-batched": (lambda a, b: TRISOLVE(a, b, left_side=True, lower=True),
                             lambda r: [np.stack([_tri(r, 6, True) for _ in range(3)]),
                                        r.standard_normal((3, 6, 2)).astype(np.float32)]),
        "lu": (jax.lax.linalg.lu, lambda r: [r.standard_normal((6, 6)).astype(np.float32)]),
        "lu-tall-batched": (jax.lax.linalg.lu, lambda r: [r.standard_normal((2, 7, 4)).astype(np.float32)]),
        "lu-wide": (jax.lax.linalg.lu, lambda r: [r.standard_normal((4, 7)).astype(np.float32)]),
        "lu-singular": (jax.lax.linalg.lu,  # a zero column: a zero pivot, no scaling
                        lambda r: [r.standard_normal((5, 5)).astype(np.float32) * np.array([1, 1, 0, 1, 1], np.float32)]),
        "solve": (jnp.linalg.solve, lambda r: [r.standard_normal((8, 8)).astype(np.float32),
                                               r.standard_normal((8, 2)).astype(np.float32)]),
        "lu_solve": (lambda a, b: jax.scipy.linalg.lu_solve(jax.scipy.linalg.lu_factor(a), b),
                     lambda r: [r.standard_normal((6, 6)).astype(np.float32), r.standard_normal(6).astype(np.float32)]),
        "cho_solve": (lambda a, b: jax.scipy.linalg.cho_solve(jax.scipy.linalg.cho_factor(a), b),
                      lambda r: [_spd(r, 6, 6), r.standard_normal(6).astype(np.float32)]),
    }


CASES = _cases()


def _close(got, want, name):
    for g, w in zip(jax.tree_util.tree_leaves(got), jax.tree_util.tree_leaves(want)):
        g, w = np.asarray(g), np.asarray(w)
        if w.dtype.kind in "iu":  # pivots and permutations
            np.testing.assert_array_equal(g, w, err_msg=name)
        else:
            np.testing.assert_allclose(g, w, rtol=2e-4, atol=2e-5 * max(1.0, np.nanmax(np.abs(w))), err_msg=name)


@pytest.fixture(scope="module")
def emulated():
    """Every case's plan and one library of all their kernels (one compiler run)."""
    if kernel_emulator.compiler() is None:
        pytest.skip("no host C++ compiler")
    plans = {}
    for name, (fn, make) in CASES.items():
        args = make(_rng(sorted(CASES).index(name)))
        plans[name] = nimble.jit(fn, backend="interpret").plan(*args), args
    lib = kernel_emulator.build([k for p, _ in plans.values() for k in kernel_emulator.kernels(p)])
    return plans, lib


@pytest.mark.parametrize("name", sorted(CASES))
def test_kernels_on_cpu_match_jax(name, emulated):
    plans, lib = emulated
    plan, args = plans[name]
    assert all(t.kind in (TaskKind.KERNEL, TaskKind.VIEW) for t in plan.tasks), [t.kind for t in plan.tasks]
    got, ran = kernel_emulator.run(plan, args, lib)
    assert ran == sum(t.kind == TaskKind.KERNEL for t in plan.tasks)  # every kernel ran as C++
    _close(got, jax.jit(CASES[name][0])(*args), name)


def test_pivots_out_of_range_swap_nothing_as_in_xlas_gpu_kernel():
    """XLA's GPU kernel skips a pivot outside [0, m) (jax on the CPU clamps it instead:
    the contract is written out here). The graph's warm-up relies on it too: it runs
    before any operand is in place."""
    if kernel_emulator.compiler() is None:
        pytest.skip("no host C++ compiler")
    pivots = np.array([[2, -1, 9, 3], [7, 1, 2, 0]], np.int32)
    fn = lambda p: jax.lax.linalg.lu_pivots_to_permutation(p, 5)  # noqa: E731
    plan = nimble.jit(fn, backend="interpret").plan(pivots)
    got, _ = kernel_emulator.run(plan, [pivots], kernel_emulator.build(kernel_emulator.kernels(plan)))
    want = np.tile(np.arange(5, dtype=np.int32), (2, 1))
    for row, piv in zip(want, pivots):
        for i, j in enumerate(piv):
            if 0 <= j < 5:
                row[i], row[j] = row[j], row[i]
    np.testing.assert_array_equal(np.asarray(got[0]), want)


def test_not_positive_definite_is_all_nan_as_in_jax():
    fn, make = CASES["cholesky-not-spd"]
    args = make(_rng(1))
    want = np.asarray(jax.jit(fn)(*args))
    assert np.isnan(want[1][np.tril_indices(4)]).all() and not np.isnan(want[0]).any()  # the contract
    _close(nimble.jit(fn, backend="interpret")(*args), want, "interpreter")


def test_gradients_and_a_multivariate_normal_on_the_interpreter():
    """The Cholesky's JVP is two triangular solves; a log density holds all of them."""
    r = _rng(7)
    s, x = _spd(r, 5, 5), r.standard_normal((3, 5)).astype(np.float32)
    logpdf = lambda s, x: jax.scipy.stats.multivariate_normal.logpdf(x, jnp.zeros(5), s).sum()  # noqa: E731
    g = jax.grad(logpdf, argnums=(0, 1))
    _close(nimble.jit(g, backend="interpret")(s, x), jax.jit(g)(s, x), "grad logpdf")
    left = nimble.jit(g).partition(s, x).xla_steps()
    assert not [st for st in left if "no lowering rule" in (st.why or "")], [st.why for st in left]


def test_a_matrix_larger_than_the_kernels_take_is_left_to_xla():
    big = rules_linalg.MAX_DIM + 1
    s = _spd(_rng(3), big, big)

    def f(s):
        return jnp.tanh(jnp.linalg.cholesky(s) * 0.1) @ s

    text = str(nimble.explain(f, s))
    assert "xla cholesky (" in text and f"at most {rules_linalg.MAX_DIM}×{rules_linalg.MAX_DIM}" in text
    _close(nimble.jit(f, backend="interpret")(s), jax.jit(f)(s), "co-executed")
    with pytest.raises(nimble.UnsupportedPrimitiveError, match="'cholesky'.*at most"):
        nimble.jit(f, backend="interpret", fallback="error")(s)


@pytest.mark.gpu
@pytest.mark.parametrize("name", sorted(CASES))
def test_on_gpu_matches_jax(name):
    fn, make = CASES[name]
    args = make(_rng(sorted(CASES).index(name) + 100))
    f = nimble.jit(fn, backend="cuda")
    want = jax.jit(fn)(*args)
    _close(f(*args), want, name)
    _close(f(*[a.copy() for a in args]), want, name + " (second call)")


@pytest.mark.gpu
def test_multivariate_normal_gradient_on_gpu():
    r = _rng(8)
    s, x = _spd(r, 16, 16), r.standard_normal((32, 16)).astype(np.float32)
    logpdf = lambda s, x: jax.scipy.stats.multivariate_normal.logpdf(x, jnp.zeros(16), s).sum()  # noqa: E731
    g = jax.value_and_grad(logpdf, argnums=(0, 1))
    got, want = nimble.jit(g, backend="cuda")(s, x), jax.jit(g)(s, x)
    for a, b in zip(jax.tree_util.tree_leaves(got), jax.tree_util.tree_leaves(want)):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=2e-3, atol=2e-3)

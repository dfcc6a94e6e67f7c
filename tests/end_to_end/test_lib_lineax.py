"""Programs written the way lineax's documentation shows them (issue 33), through
nimble.jit on the CPU interpreter against jax.jit on random inputs: a linear solve by LU
(`lx.LU()`) and by `AutoLinearSolver`. Where lineax's primitives are left to XLA
(co-execution), `explain` names them."""
from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import nimblejax as nimble
from tests.helpers.libraries import assert_kernels_compile, close, left_to_xla, report_kernels

lx = pytest.importorskip("lineax")
pytestmark = pytest.mark.filterwarnings("ignore:nimblejax. .* nimble region")


def lu_solve(a, b):
    operator = lx.MatrixLinearOperator(jnp.tanh(a @ a) + 3.0 * jnp.eye(a.shape[0]))
    x = lx.linear_solve(operator, b, solver=lx.LU()).value
    return jnp.tanh(a @ x)


def auto_solve(a, b):
    """Well posed by default: a square operator is solved by LU."""
    operator = lx.MatrixLinearOperator(a @ a.T + jnp.eye(a.shape[0]))
    sol = lx.linear_solve(operator, 2.0 * b, solver=lx.AutoLinearSolver(well_posed=True))
    return jnp.sum(sol.value ** 2), sol.value


def spd_solve(a, b):
    """AutoLinearSolver picks Cholesky for an operator tagged positive definite."""
    operator = lx.MatrixLinearOperator(a @ a.T + jnp.eye(a.shape[0]), lx.positive_semidefinite_tag)
    return lx.linear_solve(operator, b, solver=lx.AutoLinearSolver(well_posed=True)).value


def system(seed: int, n: int = 6):
    r = np.random.default_rng(seed)
    return r.standard_normal((n, n)).astype(np.float32), r.standard_normal(n).astype(np.float32)


PROGRAMS = {"lu": lu_solve, "auto": auto_solve, "auto_spd": spd_solve}
# What is left to XLA, named by `explain`: equinox's host-callback checks only (the 6×6
# factorizations and solves are nimble's kernels, lowering/rules_linalg.py).
LEFT_TO_XLA = {"lu": {"pure_callback"}, "auto": {"pure_callback"}, "auto_spd": {"pure_callback"}}


@pytest.mark.parametrize("name", sorted(PROGRAMS))
def test_solve_matches_jax_jit(name):
    a, b = system(sorted(PROGRAMS).index(name))
    fn = PROGRAMS[name]
    f = nimble.jit(fn, backend="interpret")
    close(f(a, b), jax.jit(fn)(a, b), tol=1e-4)
    report = nimble.explain(f, a, b)
    assert left_to_xla(report) == LEFT_TO_XLA[name]
    assert any(r.steps for r in report.regions)  # the operator's arithmetic: nimble's


def test_fallback_error_names_the_factorization():
    """A system larger than nimble's kernels take (lowering/rules_linalg.py) is XLA's."""
    from nimblejax.compiler.lowering.rules_linalg import MAX_DIM

    a, b = system(6, n=MAX_DIM + 1)
    with pytest.raises(nimble.UnsupportedPrimitiveError, match="'lu'.*lineax"):
        nimble.jit(lu_solve, backend="interpret", fallback="error")(a, b)


def test_solve_gradient_matches_jax_jit():
    a, b = system(5)
    loss = lambda a, b: jnp.sum(lu_solve(a, b) ** 2)  # noqa: E731
    g = nimble.jit(jax.grad(loss, argnums=(0, 1)), backend="interpret")
    close(g(a, b), jax.jit(jax.grad(loss, argnums=(0, 1)))(a, b), tol=1e-4)


def test_generated_kernels_compile():
    kernels = {}
    for seed, name in enumerate(sorted(PROGRAMS)):
        a, b = system(seed)
        kernels.update(report_kernels(nimble.explain(nimble.jit(PROGRAMS[name], backend="interpret"), a, b)))
    assert_kernels_compile(kernels, "lineax")


@pytest.mark.gpu
def test_gpu_solves_match_jax_jit():
    for seed, name in enumerate(sorted(PROGRAMS)):
        a, b = system(seed)
        close(nimble.jit(PROGRAMS[name])(a, b), jax.jit(PROGRAMS[name])(a, b), tol=1e-4)

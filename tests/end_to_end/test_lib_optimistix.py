"""Programs written the way optimistix's documentation shows them (issue 33), through
nimble.jit on the CPU interpreter against jax.jit on random inputs: a Newton root find
and a BFGS minimisation. Their loops have run-time trip counts and hold equinox's own
primitives: co-execution runs the loops under XLA around nimble-planned bodies, and
equinox's primitives are inlined through their JAX implementations."""
from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import nimblejax as nimble
from tests.helpers.libraries import (assert_kernels_compile, close, inlined,  # noqa: F401
                                     no_host_callbacks, report_kernels, while_tasks)

optx = pytest.importorskip("optimistix")
pytestmark = pytest.mark.filterwarnings("ignore:nimblejax. .* nimble region")


def newton_root(y0, b):
    solver = optx.Newton(rtol=1e-6, atol=1e-6)
    return optx.root_find(lambda y, args: jnp.tanh(y) + y - args, solver, y0, args=b).value


def bfgs_minimise(y0, target):
    """A smooth, strongly convex bowl around `target`: the minimiser is known."""
    def loss(y, args):
        d = y - args
        return jnp.sum(d ** 2) + 0.1 * jnp.sum(jnp.log(jnp.cosh(d))) + 0.05 * jnp.sum(d[1:] * d[:-1])

    sol = optx.minimise(loss, optx.BFGS(rtol=1e-6, atol=1e-6), y0, args=target, max_steps=64)
    return sol.value, sol.stats["num_steps"]


def vectors(seed: int, n: int = 5):
    r = np.random.default_rng(seed)
    return r.standard_normal(n).astype(np.float32), r.standard_normal(n).astype(np.float32)


def test_newton_root_find_matches_jax_jit():
    y0, b = vectors(1)
    f = nimble.jit(newton_root, backend="interpret")
    got = f(y0, b)
    close(got, jax.jit(newton_root)(y0, b))
    np.testing.assert_allclose(np.tanh(got) + got, b, atol=1e-5)  # a root indeed
    report = nimble.explain(f, y0, b)
    # lineax's LU is nimble's kernel (lowering/rules_linalg.py), so the Newton loop is a
    # WHILE task of a region; only equinox's host-callback check is left to XLA.
    assert "xla while" not in str(report) and "xla lu" not in str(report)
    assert report.regions
    # The gradient by optimistix's implicit-function rule, kept around the partition.
    loss = lambda fn: lambda b: jnp.sum(fn(y0, b) ** 2)  # noqa: E731
    close(jax.grad(loss(f))(b), jax.jit(jax.grad(loss(newton_root)))(b), tol=1e-4)


def test_bfgs_minimise_matches_jax_jit():
    y0, target = vectors(2)
    f = nimble.jit(bfgs_minimise, backend="interpret")
    (got, steps), (want, want_steps) = f(y0, target), jax.jit(bfgs_minimise)(y0, target)
    close(got, want)
    assert int(steps) == int(want_steps) > 2
    np.testing.assert_allclose(got, target, atol=1e-4)  # the minimiser
    report = nimble.explain(f, y0, target)
    assert "xla while" not in str(report) and while_tasks(report) == 1  # callbacks to XLA
    assert "unvmap_any" in inlined(report)


def test_without_host_callbacks_bfgs_is_one_plan(no_host_callbacks):
    """EQX_ON_ERROR=nan: no host callback checks the result, so nothing is left to XLA
    and the minimisation's loop is a WHILE task."""
    y0, target = vectors(4)
    f = nimble.jit(bfgs_minimise, backend="interpret", fallback="error")
    (got, steps), (want, want_steps) = f(y0, target), jax.jit(bfgs_minimise)(y0, target)
    close(got, want)
    assert int(steps) == int(want_steps)
    assert any(d.choice == "while task" for d in nimble.explain(f, y0, target).plan.control)


def test_generated_kernels_compile():
    kernels = {}
    for fn in (newton_root, bfgs_minimise):
        kernels.update(report_kernels(nimble.explain(nimble.jit(fn, backend="interpret"), *vectors(6))))
    assert_kernels_compile(kernels, "optimistix")


@pytest.mark.gpu
def test_gpu_solves_match_jax_jit():
    y0, b = vectors(3)
    close(nimble.jit(newton_root)(y0, b), jax.jit(newton_root)(y0, b), tol=1e-4)
    got, want = nimble.jit(bfgs_minimise)(y0, b), jax.jit(bfgs_minimise)(y0, b)
    close(got[0], want[0], tol=1e-4)


@pytest.mark.gpu
def test_gpu_bfgs_planned_whole_matches_jax_jit(no_host_callbacks):
    y0, target = vectors(5)
    got = nimble.jit(bfgs_minimise, fallback="error")(y0, target)
    close(got[0], jax.jit(bfgs_minimise)(y0, target)[0], tol=1e-4)

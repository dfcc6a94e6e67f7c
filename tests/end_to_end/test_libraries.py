"""Programs written the way equinox, diffrax and optimistix document them, through
nimble.jit, against jax.jit on random inputs (issue 33). Their loops have run-time trip
counts and hold equinox's own primitives: co-execution runs the loops under XLA around
nimble-planned bodies, and equinox's primitives are inlined through their JAX
implementations (compiler/trace.py: library_impl). Test-only dependencies: skipped
where they are not installed."""
from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import nimblejax as nimble

eqx = pytest.importorskip("equinox")
pytestmark = pytest.mark.filterwarnings("ignore:nimblejax. .* nimble region")


def close(got, want, tol=1e-5):
    for g, w in zip(jax.tree_util.tree_leaves(got), jax.tree_util.tree_leaves(want)):
        np.testing.assert_allclose(np.asarray(g), np.asarray(w), rtol=tol, atol=tol)


def inlined(report) -> set[str]:
    """Library primitives a co-execution report says were inlined."""
    return {d.primitive for plan in report.plans.values() for d in plan.control
            if d.choice == "inlined"}


def tsit5(y0, k):
    diffrax = pytest.importorskip("diffrax")
    term = diffrax.ODETerm(lambda t, y, args: -args @ y + jnp.sin(y))
    sol = diffrax.diffeqsolve(term, diffrax.Tsit5(), t0=0.0, t1=1.0, dt0=0.05, y0=y0, args=k,
                              saveat=diffrax.SaveAt(ts=jnp.linspace(0.0, 1.0, 5)))
    return sol.ys


def newton_root(y0, b):
    optx = pytest.importorskip("optimistix")
    solver = optx.Newton(rtol=1e-6, atol=1e-6)
    return optx.root_find(lambda y, args: jnp.tanh(y) + y - args, solver, y0, args=b).value


def test_diffrax_tsit5_constant_step_matches_jax_jit():
    pytest.importorskip("diffrax")
    r = np.random.default_rng(0)
    y0 = r.standard_normal(6).astype(np.float32)
    k = (0.3 * r.standard_normal((6, 6)) + np.eye(6)).astype(np.float32)
    f = nimble.jit(tsit5, backend="interpret")
    close(f(y0, k), jax.jit(tsit5)(y0, k), tol=1e-5)
    report = nimble.explain(f, y0, k)
    assert "xla while" in str(report) and len(report.regions) >= 2
    assert {"unvmap_any", "select_if_vmap"} <= inlined(report)


def test_optimistix_newton_root_find_matches_jax_jit():
    pytest.importorskip("optimistix")
    r = np.random.default_rng(1)
    y0, b = r.standard_normal(5).astype(np.float32), r.standard_normal(5).astype(np.float32)
    f = nimble.jit(newton_root, backend="interpret")
    got = f(y0, b)
    close(got, jax.jit(newton_root)(y0, b), tol=1e-5)
    np.testing.assert_allclose(np.tanh(got) + got, b, atol=1e-5)  # a root indeed
    report = nimble.explain(f, y0, b)
    assert "xla while" in str(report) and "xla lu" in str(report)  # lineax's LU: XLA's
    assert report.regions
    # The gradient by optimistix's implicit-function rule, kept around the partition.
    loss = lambda fn: lambda b: jnp.sum(fn(y0, b) ** 2)  # noqa: E731
    close(jax.grad(loss(f))(b), jax.jit(jax.grad(loss(newton_root)))(b), tol=1e-4)


def test_equinox_mlp_is_one_plan_and_its_gradient_matches():
    r = np.random.default_rng(2)
    mlp = eqx.nn.MLP(8, 3, width_size=16, depth=2, key=jax.random.key(int(r.integers(1 << 30))))
    params, static = eqx.partition(mlp, eqx.is_array)
    x = r.standard_normal((10, 8)).astype(np.float32)

    def loss(params, x):
        model = eqx.combine(params, static)
        return jnp.mean(jax.vmap(model)(x) ** 2)

    f = nimble.jit(loss, backend="interpret", fallback="error")  # nothing left to XLA
    close(f(params, x), jax.jit(loss)(params, x))
    g = nimble.jit(jax.grad(loss), backend="interpret", fallback="error")
    close(g(params, x), jax.jit(jax.grad(loss))(params, x), tol=1e-5)


@pytest.mark.gpu
def test_gpu_library_programs_match_jax_jit():
    pytest.importorskip("diffrax")
    pytest.importorskip("optimistix")
    r = np.random.default_rng(3)
    y0 = r.standard_normal(6).astype(np.float32)
    k = (0.3 * r.standard_normal((6, 6)) + np.eye(6)).astype(np.float32)
    close(nimble.jit(tsit5)(y0, k), jax.jit(tsit5)(y0, k), tol=1e-4)
    b = r.standard_normal(6).astype(np.float32)
    close(nimble.jit(newton_root)(y0, b), jax.jit(newton_root)(y0, b), tol=1e-4)

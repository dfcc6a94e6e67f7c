"""Programs written the way diffrax's documentation shows them (issue 33), through
nimble.jit on the CPU interpreter against jax.jit on random inputs: Tsit5 with a constant
step and with a PID step-size controller. The solve's loop has a run-time trip count and
holds equinox's own primitives: those are inlined through their JAX implementations
(compiler/trace.py: library_impl); what nimble cannot take (the loop itself under
loops="unroll", eqx.error_if's host callback) runs under XLA beside nimble regions."""
from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import nimblejax as nimble
from tests.helpers.libraries import (assert_kernels_compile, close, inlined,  # noqa: F401
                                     no_host_callbacks, report_kernels, while_tasks)

diffrax = pytest.importorskip("diffrax")
pytestmark = pytest.mark.filterwarnings("ignore:nimblejax. .* nimble region")


def vector_field(t, y, args):
    return -args @ y + jnp.sin(y)


def tsit5(y0, k):
    term = diffrax.ODETerm(vector_field)
    sol = diffrax.diffeqsolve(term, diffrax.Tsit5(), t0=0.0, t1=1.0, dt0=0.05, y0=y0, args=k,
                              saveat=diffrax.SaveAt(ts=jnp.linspace(0.0, 1.0, 5)))
    return sol.ys


def tsit5_pid(y0, k):
    term = diffrax.ODETerm(vector_field)
    controller = diffrax.PIDController(rtol=1e-5, atol=1e-5)
    sol = diffrax.diffeqsolve(term, diffrax.Tsit5(), t0=0.0, t1=1.0, dt0=0.1, y0=y0, args=k,
                              saveat=diffrax.SaveAt(ts=jnp.linspace(0.0, 1.0, 5)),
                              stepsize_controller=controller)
    return sol.ys, sol.stats["num_accepted_steps"], sol.stats["num_rejected_steps"]


def ode_args(seed: int, n: int = 6):
    r = np.random.default_rng(seed)
    y0 = r.standard_normal(n).astype(np.float32)
    return y0, (0.3 * r.standard_normal((n, n)) + np.eye(n)).astype(np.float32)


@pytest.mark.long
def test_tsit5_constant_step_matches_jax_jit():
    y0, k = ode_args(0)
    f = nimble.jit(tsit5, backend="interpret")
    close(f(y0, k), jax.jit(tsit5)(y0, k))
    report = nimble.explain(f, y0, k)
    # equinox's error checks (host callbacks) go to XLA; the solve's loop, free of
    # them, is a WHILE task inside a nimble region (loops="graph", the default).
    assert "xla while" not in str(report) and "pure_callback" in str(report)
    assert while_tasks(report) == 1 and "unvmap_any" in inlined(report)


def test_tsit5_pid_controller_matches_jax_jit():
    y0, k = ode_args(1)
    f = nimble.jit(tsit5_pid, backend="interpret")
    (ys, accepted, rejected), (want, want_acc, want_rej) = f(y0, k), jax.jit(tsit5_pid)(y0, k)
    close(ys, want)
    assert (int(accepted), int(rejected)) == (int(want_acc), int(want_rej))  # the same steps
    assert int(accepted) > 2
    report = nimble.explain(f, y0, k)
    # The solve's loop is a WHILE task in a region; eqx.error_if's check of the final
    # step (a host callback) goes to XLA.
    assert "xla while" not in str(report) and while_tasks(report) == 1
    assert "'pure_callback'" in str(report)
    assert {"unvmap_any", "unvmap_max"} <= inlined(report)


@pytest.mark.long
def test_gradient_through_the_pid_solve_matches_jax_jit():
    """diffrax differentiates a solve by default (RecursiveCheckpointAdjoint): its
    backward pass scatters literal updates (x.at[i].add(1.0)) into the checkpoints."""
    y0, k = ode_args(3)
    loss = lambda y0, k: jnp.sum(tsit5_pid(y0, k)[0] ** 2)  # noqa: E731
    grad = jax.grad(loss, argnums=(0, 1))
    close(nimble.jit(grad, backend="interpret")(y0, k), jax.jit(grad)(y0, k), tol=1e-4)


def test_vmapped_solve_matches_jax_jit():
    y0, k = ode_args(4)
    ys = np.stack([y0, 0.5 * y0, -y0])
    solve = jax.vmap(tsit5, in_axes=(0, None))
    close(nimble.jit(solve, backend="interpret")(ys, k), jax.jit(solve)(ys, k))


def test_without_host_callbacks_the_whole_solve_is_one_plan(no_host_callbacks):
    """EQX_ON_ERROR=nan (equinox's switch: a failed check gives NaN, no host callback):
    nothing is left to XLA, and each run-time loop of the solve is a WHILE task."""
    y0, k = ode_args(5)
    f = nimble.jit(tsit5_pid, backend="interpret", fallback="error")
    (ys, accepted, _), (want, want_acc, _) = f(y0, k), jax.jit(tsit5_pid)(y0, k)
    close(ys, want)
    assert int(accepted) == int(want_acc)
    report = nimble.explain(f, y0, k)
    assert any(d.choice == "while task" for d in report.plan.control)


def test_generated_kernels_compile(no_host_callbacks):
    """The solves planned whole, their step plans' kernels too."""
    y0, k = ode_args(7)
    kernels = {}
    for fn in (tsit5, tsit5_pid):
        kernels.update(report_kernels(nimble.explain(nimble.jit(fn, backend="interpret"), y0, k)))
    assert_kernels_compile(kernels, "diffrax")


@pytest.mark.gpu
def test_gpu_solves_match_jax_jit():
    y0, k = ode_args(2)
    close(nimble.jit(tsit5)(y0, k), jax.jit(tsit5)(y0, k), tol=1e-4)
    (ys, accepted, _), (want, want_acc, _) = nimble.jit(tsit5_pid)(y0, k), jax.jit(tsit5_pid)(y0, k)
    close(ys, want, tol=1e-4)
    assert abs(int(accepted) - int(want_acc)) <= 1  # another rounding may move one step
    grad = jax.grad(lambda y0, k: jnp.sum(tsit5(y0, k) ** 2), argnums=(0, 1))
    close(nimble.jit(grad)(y0, k), jax.jit(grad)(y0, k), tol=1e-3)


@pytest.mark.gpu
def test_gpu_solve_planned_whole_matches_jax_jit(no_host_callbacks):
    """The PID solve as one CUDA graph, its loops conditional WHILE nodes."""
    y0, k = ode_args(6)
    f = nimble.jit(tsit5_pid, fallback="error")
    (ys, accepted, _), (want, want_acc, _) = f(y0, k), jax.jit(tsit5_pid)(y0, k)
    close(ys, want, tol=1e-4)
    assert abs(int(accepted) - int(want_acc)) <= 1

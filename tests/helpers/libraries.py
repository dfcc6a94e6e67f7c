"""Shared by the library tests (tests/end_to_end/test_lib_*.py): agreement with jax.jit,
what a co-execution report says, and equinox's checks without host callbacks."""
from __future__ import annotations

import re

import jax
import numpy as np
import pytest


# float32 dots run TF32-like on the GPU (jax's default precision) in both jax.jit and
# nimble, with different GEMM algorithms: ~1e-3 relative apart, as docs/design.md says.
GPU_TOL = 2e-3


def close(got, want, tol: float = 1e-5) -> None:
    """The same tree, shapes and dtypes; floats within `tol` (relative and absolute),
    integers, booleans and PRNG keys bit for bit."""
    got_leaves, got_tree = jax.tree_util.tree_flatten(got)
    want_leaves, want_tree = jax.tree_util.tree_flatten(want)
    assert got_tree == want_tree, f"{got_tree} != {want_tree}"
    for g, w in zip(got_leaves, want_leaves):
        if jax.dtypes.issubdtype(getattr(w, "dtype", None), jax.dtypes.prng_key):
            g, w = jax.random.key_data(g), jax.random.key_data(w)
        g, w = np.asarray(g), np.asarray(w)
        assert g.shape == w.shape and g.dtype == w.dtype, (g.shape, g.dtype, w.shape, w.dtype)
        if np.issubdtype(w.dtype, np.inexact):
            np.testing.assert_allclose(g, w, rtol=tol, atol=tol)
        else:
            np.testing.assert_array_equal(g, w)


def inlined(report) -> set[str]:
    """Library primitives a co-execution report says were inlined."""
    return {d.primitive for plan in report.plans.values() for d in plan.control
            if d.choice == "inlined"}


def left_to_xla(report) -> set[str]:
    """The primitives a co-execution report says nimble has no rule for."""
    return set(re.findall(r"no lowering rule for primitive '(\w+)'", str(report)))


@pytest.fixture
def no_host_callbacks(monkeypatch):
    """equinox's checks as EQX_ON_ERROR=nan makes them: a failed check gives NaN, with no
    host callback (eqx.error_if's pure_callback), so nimble can plan a solve whole.
    equinox reads the variable at import; a check reads its module global. JAX's traces
    of equinox's jitted helpers made with callbacks are dropped before and after."""
    errors = pytest.importorskip("equinox._errors")
    jax.clear_caches()
    monkeypatch.setattr(errors, "EQX_ON_ERROR", "nan")
    yield
    monkeypatch.undo()
    jax.clear_caches()


def plan_kernels(plan) -> dict[str, str]:
    """Every generated kernel of `plan` (name → CUDA C), the plans of its WHILE and SWITCH
    tasks included."""
    found: dict[str, str] = {}
    for task in plan.tasks:
        if task.kernel is not None:
            found.update((k.name, k.source) for k in task.kernel.launches)
        control = getattr(task, "control", None)
        subs = [control.step] if hasattr(control, "step") else list(getattr(control, "branches", ()))
        for sub in subs:
            found.update(plan_kernels(sub))
    return found


def report_kernels(report) -> dict[str, str]:
    """Every generated kernel of what `nimble.explain` reports: one plan, or each region's
    of a co-executed function (nested bodies' regions included)."""
    plans = list(report.plans.values()) if hasattr(report, "plans") else [report.plan]
    found: dict[str, str] = {}
    for plan in plans:
        found.update(plan_kernels(plan))
    return found


def assert_kernels_compile(kernels: dict[str, str], name: str) -> None:
    """`kernels` compile for sm_90 in one NVRTC (or nvcc) run, each an entry of the PTX:
    a codegen bug is caught without a GPU."""
    from nimblejax.testing.nvrtc_check import available_compiler, compile_to_ptx

    if available_compiler() is None:
        pytest.skip("no NVRTC or nvcc")
    assert kernels
    ptx = compile_to_ptx("\n".join(kernels.values()), f"{name}.cu", arch="sm_90", fast=True)
    missing = [k for k in kernels if f".entry {k}(" not in ptx]
    assert not missing, missing


def while_tasks(report) -> int:
    """WHILE tasks in a co-execution report's region plans (a loop nimble planned inside
    a region, beside what went to XLA)."""
    return sum([t.kind.value for t in p.tasks].count("while") for p in report.plans.values())

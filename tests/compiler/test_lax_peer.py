"""JAX's own lax op records as a peer suite.

`lax_test_util.lax_ops()` is the table JAX's lax tests run: for each op its arity, the
dtypes it is tested at, the random-input factory and the tolerance. Every (op, dtype)
record runs through nimble.jit on small shapes (3, 4), and, for ops of several
operands, with the last operand broadcast from (4,) inside the function (a fused
broadcast), and is compared with jax.jit at the record's tolerance (JAX's default
tolerance table where the record has none). Complex dtypes must raise nimblejax's
NotImplementedError naming the way out; anything else unsupported is a failure.

The interpreter runs JAX, not the generated kernels, so two host checks stand in for
the GPU here: the special functions' C blocks (rules_special.py, compiled in double by
kernel_emulator.compile_library) and every integer kernel of the suite (run on the CPU by
tests/helpers/kernel_emulator.py) are compared with JAX.
Every kernel the suite generates is compiled for sm_90 with NVRTC.
"""
from __future__ import annotations

import ctypes
from dataclasses import dataclass
from typing import Callable

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax import lax

from tests.helpers import on_host
from tests.helpers import kernel_emulator
import nimblejax as nimble
from nimblejax.options import Options

lax_test_util = pytest.importorskip("jax._src.internal_test_util.lax_test_util")
jtu = pytest.importorskip("jax._src.test_util")


@dataclass(frozen=True)
class Case:
    op: str
    dtype: np.dtype
    fn: Callable
    shapes: tuple
    rng_factory: Callable
    tol: object

    @property
    def id(self) -> str:
        return f"{self.op}-{self.dtype.name}-{'x'.join(map(str, self.shapes[-1]))}"


def _broadcast_last(op: Callable) -> Callable:
    return lambda *a: op(*a[:-1], lax.broadcast_in_dim(a[-1], a[0].shape, (a[0].ndim - 1,)))


def peer_cases() -> list[Case]:
    cases = []
    for r in lax_test_util.lax_ops():
        op = getattr(lax, r.op)
        for dtype in map(np.dtype, r.dtypes):
            cases.append(Case(r.op, dtype, op, ((3, 4),) * r.nargs, r.rng_factory, r.tol))
            if r.nargs > 1:
                shapes = ((3, 4),) * (r.nargs - 1) + ((4,),)
                cases.append(Case(r.op, dtype, _broadcast_last(op), shapes, r.rng_factory, r.tol))
    return cases


def _is_complex(case: Case, args) -> bool:
    outs = jax.tree_util.tree_leaves(jax.eval_shape(case.fn, *args))
    return any(jnp.issubdtype(v.dtype, jnp.complexfloating) for v in list(args) + outs)


def _args(case: Case, seed: int):
    make = case.rng_factory(np.random.RandomState(seed))
    return tuple(jnp.asarray(make(s, case.dtype)) for s in case.shapes)


def _close(got, want, case: Case) -> bool:
    got, want = np.asarray(got), np.asarray(want)
    if got.shape != want.shape or got.dtype != want.dtype:
        return False
    if not jnp.issubdtype(want.dtype, jnp.inexact):
        return np.array_equal(got, want)
    tol = jtu.tolerance(want.dtype, case.tol)
    return bool(np.allclose(got.astype(np.float64), want.astype(np.float64), atol=tol, rtol=tol,
                            equal_nan=True))


def run_peer_suite(backend: str, kernels: "dict[str, str] | None" = None) -> dict[str, list[str]]:
    """Each case by nimble against jax.jit; the kernels of the plans that ran go into
    `kernels` (name -> source), where given. The interpreter is called on the Python
    path: the XLA call path would compile a program per case around its callback."""
    report: dict[str, list[str]] = {"passed": [], "wrong": [], "complex": [], "unsupported": []}
    ran = []  # (case, args, nimble's result)
    path = "python" if backend == "interpret" else "auto"
    for seed, case in enumerate(peer_cases()):
        args = _args(case, seed)
        f = nimble.jit(case.fn, backend=backend, fallback="error",  # nimble's own rules
                       options=Options(call_path=path))
        if _is_complex(case, args):
            with pytest.raises(NotImplementedError, match='backend="jax"'):
                f(*args)
            report["complex"].append(case.id)
            continue
        try:
            ran.append((case, args, f(*args)))
        except NotImplementedError as e:
            report["unsupported"].append(f"{case.id}: {e}")
            continue
        if kernels is not None:  # from the plan that ran (f.plan would plan again)
            kernels.update((t.kernel.name, t.kernel.source)
                           for r in f.runners() for t in r.plan.tasks if t.kernel)
    for (case, _, got), want in zip(ran, _references([(c.fn, a) for c, a, _ in ran])):
        report["passed" if _close(got, want, case) else "wrong"].append(case.id)
    return report


def _references(calls: list) -> list:
    """jax.jit's result of each (fn, args), all in one program: one XLA compile for the
    suite instead of one per case (each op's code is the same in both)."""
    fns = [fn for fn, _ in calls]
    return jax.jit(lambda arg_lists: [fn(*a) for fn, a in zip(fns, arg_lists)])(
        [a for _, a in calls])


def _check(report: dict[str, list[str]]) -> None:
    records = len(lax_test_util.lax_ops())
    print(f"\nlax peer suite: {records} records, {sum(map(len, report.values()))} cases: "
          f"{len(report['passed'])} passed, {len(report['wrong'])} wrong, "
          f"{len(report['complex'])} complex (NotImplementedError, as required), "
          f"{len(report['unsupported'])} other unsupported")
    assert not report["wrong"], report["wrong"]
    assert not report["unsupported"], report["unsupported"]
    assert len(report["passed"]) > 200


@pytest.mark.long
def test_lax_peer_suite_interpret():
    """The suite under the interpreter; every kernel its cases' plans generate compiles
    for sm_90 (where NVRTC or nvcc is here)."""
    from nimblejax.testing.nvrtc_check import available_compiler, compile_to_ptx

    kernels: dict[str, str] = {}
    _check(run_peer_suite("interpret", kernels))
    if available_compiler() is None:
        return
    assert len(kernels) > 200
    ptx = compile_to_ptx("\n".join(kernels.values()), "nimble_lax_peer.cu", arch="sm_90", fast=True)
    missing = [name for name in kernels if f".entry {name}(" not in ptx]
    assert not missing, missing


@pytest.mark.gpu
def test_lax_peer_suite_gpu():
    _check(run_peer_suite("cuda"))


# ---- the special functions' C blocks on the host ------------------------------------
SPECIAL_OPS = {"digamma": lax.digamma, "bessel_i0e": lax.bessel_i0e,
               "bessel_i1e": lax.bessel_i1e, "igamma": lax.igamma, "igammac": lax.igammac,
               "igamma_grad_a": lambda a, x: jax.grad(lambda a: lax.igamma(a, x).sum())(a),
               "regularized_incomplete_beta": lax.betainc, "zeta": lax.zeta,
               "polygamma": lax.polygamma}
# Inputs in and beyond the domains of JAX's records (the lax_ops() factories).
SPECIAL_INPUTS = {
    "digamma": lambda r, n: [np.concatenate([r.rand(n) * 2 + 1, r.randn(n) * 5,
                                             r.rand(n) * 1e-3, r.rand(n) * 100])],
    "bessel_i0e": lambda r, n: [np.concatenate([r.randn(n) * 3, r.randn(n) * 60])],
    "bessel_i1e": lambda r, n: [np.concatenate([r.randn(n) * 3, r.randn(n) * 60])],
    # (Below a = 0.5 JAX's float32 igamma errs by more than 1e-6; SciPy agrees with ours.)
    "igamma": lambda r, n: [np.concatenate([r.rand(n) * 2 + 1, r.rand(2 * n) * 4.5 + 0.5]),
                            np.concatenate([r.rand(n) * 2 + 1, r.rand(2 * n) * 5])],
    "regularized_incomplete_beta": lambda r, n: [r.rand(3 * n) for _ in range(3)],
    # q > 0: for q < 0 the terms of XLA's float32 sum cancel (ours agree with SciPy).
    "zeta": lambda r, n: [np.concatenate([r.rand(n) * 2 + 1, r.rand(2 * n) * 30 + 1]),
                          np.concatenate([r.rand(n) * 5 + 0.01, r.rand(n) * 0.1, r.rand(n) * 100])],
    "polygamma": lambda r, n: [r.randint(0, 4, 3 * n).astype(np.float64),
                               np.concatenate([r.rand(n) * 10 + 0.01, r.rand(n) * 1000,
                                               r.rand(n) * 10 - 5])],
}
SPECIAL_INPUTS["igammac"] = SPECIAL_INPUTS["igamma_grad_a"] = SPECIAL_INPUTS["igamma"]
# betainc: the lax_ops() record's float32 tolerance. igamma_grad_a has no record; JAX's
# float32 result errs by up to 6e-6 there (ours agrees with SciPy's igamma differenced
# in double to 1e-8). polygamma: XLA's float32 m! = exp(lgamma(m + 1)) errs by up to
# 9e-7 (3! is 6.0000052), ours is exact (it agrees with SciPy).
SPECIAL_TOL = {"regularized_incomplete_beta": 2e-5, "igamma_grad_a": 2e-5, "polygamma": 2e-6}


def host_source(names: tuple[str, ...], block: str, fn_name: str) -> str:
    """A special function's C block (rules_special.BLOCKS) as a C function of doubles."""
    params = ", ".join(f"double {n}" for n in names)
    return f"double {fn_name}({params}) {{\n  double r;\n  {{{block}}}\n  return r;\n}}\n"


@pytest.fixture(scope="module")
def host_specials():
    from nimblejax.compiler.lowering.rules_special import BLOCKS

    if kernel_emulator.compiler() is None:
        pytest.skip("no host C++ compiler")
    lib = kernel_emulator.compile_library("#include <math.h>\n" + "".join(
        'extern "C" ' + host_source(*BLOCKS[p], f"f_{p}") for p in BLOCKS), flags=("-O2",))
    fns = {}
    for p, (names, _) in BLOCKS.items():
        fn = getattr(lib, f"f_{p}")
        fn.restype, fn.argtypes = ctypes.c_double, [ctypes.c_double] * len(names)
        fns[p] = fn
    return fns


@pytest.mark.parametrize("dtype", [np.float32, np.float16, jnp.bfloat16], ids=str)
@pytest.mark.parametrize("prim", sorted(SPECIAL_OPS))
def test_special_c_blocks_match_jax_on_host(host_specials, prim, dtype):
    """The C each special-function rule emits, compiled for the host in double and
    rounded as the rule rounds, against JAX's float32 (or upcast half) algorithms."""
    if prim.startswith("igamma") and dtype != np.float32:
        pytest.skip("JAX's records test igamma at float32 only")
    args = [a.astype(dtype) for a in SPECIAL_INPUTS[prim](np.random.RandomState(0), 300)]
    want = np.asarray(jax.jit(SPECIAL_OPS[prim])(*args)).astype(np.float64)
    fn = host_specials[prim]
    got = np.array([fn(*map(float, t)) for t in zip(*args)])
    with np.errstate(over="ignore"):
        got = got.astype(np.float32).astype(dtype).astype(np.float64)
    tol = SPECIAL_TOL.get(prim, 1e-6) if dtype == np.float32 else jtu.default_tolerance()[
        np.dtype(dtype)]
    np.testing.assert_allclose(got, want, atol=tol, rtol=tol, equal_nan=True)


def test_special_c_blocks_edge_values(host_specials):
    """Domain edges (zeros, infinities, NaN, poles) give what JAX gives."""
    inf, nan = np.inf, np.nan
    cases = {
        "digamma": [(0.0,), (-1.0,), (-0.5,), (-2.5,), (inf,), (-inf,), (nan,), (1e-30,)],
        "bessel_i0e": [(0.0,), (inf,), (-inf,), (nan,), (1e30,)],
        "bessel_i1e": [(0.0,), (inf,), (-inf,), (-3.0,), (1e30,)],
        "igamma": [(1.0, 0.0), (0.0, 1.0), (-1.0, 1.0), (2.0, inf), (inf, 1.0), (2.0, -1.0)],
        "igammac": [(1.0, 0.0), (0.0, 1.0), (-1.0, 1.0), (2.0, inf), (inf, 1.0), (2.0, -1.0)],
        "igamma_grad_a": [(1.0, 0.0), (0.0, 1.0), (-1.0, 1.0), (2.0, inf), (2.0, -1.0)],
        "regularized_incomplete_beta": [(0.0, 1.0, 0.5), (1.0, 0.0, 0.5), (-1.0, 1.0, 0.5),
                                        (2.0, 1.0, 0.5), (1.0, 1.0, 0.0), (1.0, 1.0, 1.0),
                                        (1.0, 1.0, 1.5)],
        # The pole x = 1 (inf, q NaN too), integer q <= 0 (inf for an even x, else NaN),
        # negative q: NaN for x not an integer, below -10 XLA's sum (not zeta's value),
        # x < 1 (NaN), NaN and inf operands, float32 overflow and underflow.
        "zeta": [(1.0, 2.0), (1.0, nan), (1.0, -1.0), (1.0, -0.5), (2.0, 0.0), (2.0, -0.0),
                 (2.0, -1.0), (3.0, -1.0), (4.0, -3.0), (5.0, 0.0), (2.0, -inf), (3.0, -inf),
                 (2.0, -0.5), (3.0, -0.5), (2.0, -1.5), (2.5, -0.5), (1.5, -3.5), (4.0, -12.25),
                 (2.0, -20.5), (3.0, -20.5), (0.5, 2.0), (0.0, 1.0), (-1.0, 2.0), (-inf, 2.0),
                 (0.5, -1.0), (inf, 2.0), (inf, 1.0), (inf, 0.5), (2.0, inf), (nan, 2.0),
                 (2.0, nan), (nan, -1.0), (2.0, 1e-30), (40.0, 0.1), (50.0, 0.5), (200.0, 1.0),
                 (2.0, 1e10), (2.0, 1e30), (1.0001, 1.0)],
        # m not a natural number (NaN), m = 0 (digamma: NaN at its poles), poles of
        # zeta(m + 1, x) at integer x <= 0 (inf for odd m, NaN for even m).
        "polygamma": [(0.5, 1.0), (-1.0, 1.0), (nan, 1.0), (inf, 1.0), (-inf, 1.0), (0.0, 0.0),
                      (0.0, -2.0), (-0.0, 1.5), (0.0, -2.5), (1.0, 0.0), (2.0, 0.0), (3.0, -2.0),
                      (1.0, -0.5), (2.0, -1.5), (3.0, -2.5), (1.0, nan), (1.0, inf), (2.0, -inf),
                      (1.0, 1e-30), (2.0, 1e10), (3.0, 0.01), (1.0, -20.5)],
    }
    for prim, points in cases.items():
        cols = [np.array(c, np.float32) for c in zip(*points)]
        want = np.asarray(jax.jit(SPECIAL_OPS[prim])(*cols)).astype(np.float64)
        got = np.array([host_specials[prim](*map(float, t)) for t in zip(*cols)])
        with np.errstate(over="ignore"):  # zeta(2, 1e-30) = 1e60: inf in float32, as JAX's
            got = got.astype(np.float32).astype(np.float64)
        np.testing.assert_allclose(got, want, rtol=1e-6, atol=1e-6, equal_nan=True,
                                   err_msg=prim)


# Once left to XLA by co-execution (they had no rule): planned whole now.
WHOLE = {
    "polygamma": lambda x: lax.polygamma(jnp.ones_like(x), jnp.abs(x) + 1.0),
    "zeta": lambda x: lax.zeta(jnp.abs(x) + 2.0, jnp.full_like(x, 1.5)),
    "reduce_xor": lambda x: (jnp.bitwise_xor.reduce((x * 1e4).astype(jnp.int32), axis=1),
                             jnp.logical_xor.reduce(x > 0.0, axis=0)),
}


@pytest.mark.parametrize("name", sorted(WHOLE))
def test_planned_whole_and_kernels_match_jax(name):
    """No equation is left to XLA (nimble.explain reports one plan, not a partition); the
    interpreter matches jax.jit, and so do the plan's kernels run on the host."""
    from nimblejax.report import Report

    f = WHOLE[name]
    x = on_host(np.random.default_rng(3).standard_normal((8, 33)), jnp.float32)
    want = jax.tree_util.tree_leaves(jax.jit(f)(x))
    report = nimble.explain(f, x)
    assert isinstance(report, Report), str(report)
    assert name in {e.name for t in report.plan.tasks for e in t.eqns}
    got = jax.tree_util.tree_leaves(nimble.jit(f, backend="interpret")(x))
    runs = [got]
    if kernel_emulator.compiler() is not None:
        plan = nimble.jit(f, backend="interpret").plan(x)
        emulated, ran = kernel_emulator.run(plan, (x,), kernel_emulator.build(
            kernel_emulator.kernels(plan)))
        assert ran, name
        runs.append(emulated)
    for leaves in runs:
        for g, w in zip(leaves, want):
            g, w = np.asarray(g), np.asarray(w)
            assert g.dtype == w.dtype and g.shape == w.shape
            if w.dtype == np.float32:
                np.testing.assert_allclose(g, w, rtol=1e-5, atol=1e-6)
            else:
                np.testing.assert_array_equal(g, w)  # bit for bit


# ---- the integer kernels on the host ------------------------------------------------
# Integer and bool kernels run on the CPU (tests/helpers/kernel_emulator.py), all in one library:
# the kernels' integer semantics (wrap-around at 8, 16 and 32 bits, shifts, bit counts,
# division corners) are checked bit for bit against JAX without a GPU.
def _integer_cases():
    """The peer suite's integer cases (JAX draws their inputs: popcount and clz only of
    non-negative numbers), then records_special's full-range integer records."""
    from tests.helpers.records_special import INTEGER_RECORDS

    for seed, case in enumerate(peer_cases()):
        if not jnp.issubdtype(case.dtype, jnp.inexact):
            yield case.id, case.fn, _args(case, seed)
    for r in INTEGER_RECORDS:
        yield r.id, r.fn, r.args(np.random.default_rng(1))


def test_integer_kernels_run_on_host():
    if kernel_emulator.compiler() is None:
        pytest.skip("no host C++ compiler")
    cases = [(case_id, fn, args, nimble.jit(fn, backend="interpret").plan(*args))
             for case_id, fn, args in _integer_cases()]
    lib = kernel_emulator.build([k for *_, plan in cases for k in kernel_emulator.kernels(plan)])
    ran = []
    wants = _references([(fn, args) for _, fn, args, _ in cases])
    for (case_id, fn, args, plan), want in zip(cases, wants):
        got, emulated = kernel_emulator.run(plan, args, lib)
        want = jax.tree_util.tree_leaves(want)
        assert len(got) == len(want), case_id
        for g, w in zip(got, want):
            g, w = np.asarray(g), np.asarray(w)
            ok = g.dtype == w.dtype and np.array_equal(g, w)
            assert ok, (case_id, g.ravel()[:8], w.ravel()[:8])
        if emulated:
            ran.append(case_id)
    assert len(ran) > 150, ran

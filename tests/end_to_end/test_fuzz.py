"""Differential fuzzer: random small programs (tests/helpers/fuzz_programs.py) run by nimble and
by jax.jit must agree.

- CI (`test_fuzz_interpret`): the interpret backend plans each program, race-verifies
  the plan (NIMBLE_DEBUG=1, conftest) and runs it in random stream interleavings over a
  NaN-filled arena; every kernel of the plans is compiled with NVRTC where a compiler
  is available (skipped otherwise); and where a C++ compiler is, the plans' loop kernels
  themselves run on the CPU (tests/helpers/kernel_emulator.py; GEMMs and large
  cooperative launches go through JAX there). Both take many programs' kernels at once
  (LaterChecks).
  Deterministic (derandomized) and bounded: FUZZ_CI_EXAMPLES programs, about 50 s of
  one core.
- GPU (`test_fuzz_gpu`, marker `gpu`): the cuda backend runs the generated kernels
  themselves. NIMBLE_FUZZ_EXAMPLES sets the count (default 300) and NIMBLE_FUZZ_SEED
  a seed (default: derandomized); it prints one summary line for the record.

Every bug found here becomes a named test in tests/test_fuzz_regressions.py.
"""
from __future__ import annotations

import os
import warnings

import jax
import numpy as np
import pytest
from hypothesis import HealthCheck, given, seed, settings

from tests.helpers import kernel_emulator
import nimblejax as nimble
from tests.helpers.fuzz_programs import programs
from tests.helpers.fuzz_values import Program
from nimblejax.testing.nvrtc_check import KernelCompileError, available_compiler, compile_to_ptx

FUZZ_CI_EXAMPLES = 150
GPU_EXAMPLES = int(os.environ.get("NIMBLE_FUZZ_EXAMPLES", "300"))
HEALTH = [HealthCheck.too_slow, HealthCheck.data_too_large, HealthCheck.filter_too_much]


def tolerance(dtype, tf32: bool, halves: bool = False) -> dict:
    name = np.dtype(dtype).name
    if name in ("bfloat16", "float16") or (name == "float32" and halves):
        return dict(rtol=5e-2, atol=5e-2)
    if name == "float32":
        return dict(rtol=2e-2, atol=2e-2) if tf32 else dict(rtol=1e-4, atol=1e-4)
    return dict(rtol=0, atol=0)  # ints and bools: bit-exact


def assert_same(got, want, tf32: bool = False, halves: bool = False) -> None:
    got_leaves, got_tree = jax.tree_util.tree_flatten(got)
    want_leaves, want_tree = jax.tree_util.tree_flatten(want)
    assert got_tree == want_tree, f"{got_tree} != {want_tree}"
    for i, (g, w) in enumerate(zip(got_leaves, want_leaves)):
        g, w = np.asarray(g), np.asarray(w)
        assert (g.shape, g.dtype) == (w.shape, w.dtype), f"output {i}: {g.shape} {g.dtype} != {w.shape} {w.dtype}"
        tol = tolerance(w.dtype, tf32, halves)
        finite = np.isfinite(w.astype(np.float64)) if w.size else w
        if tol["atol"] and np.any(finite):
            # Errors scale with the values an output is made of, not with each element.
            tol["atol"] *= max(1.0, float(np.max(np.abs(w.astype(np.float64)[finite]))))
        np.testing.assert_allclose(g.astype(np.float64), w.astype(np.float64), equal_nan=True,
                                   err_msg=f"output {i}", **tol)


def check_program(p: Program, backend: str, later: "LaterChecks | None" = None) -> None:
    """`p` by nimble against jax.jit; its plan handed to `later` (its kernels compiled
    and run on the CPU with other programs')."""
    f = p.function()
    args = p.args()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # jnp's promotion warnings
        want = jax.jit(f)(*args)
        nf = nimble.jit(f, backend=backend, max_streams=p.max_streams)
        for _ in range(2):  # a second call: another interleaving, and the cached plan
            assert_same(nf(*args), want, p.tf32, p.halves)
        if later is not None:
            later.add(p, nf.plan(*args), args, want)


def grouped(entries: list, named) -> list[tuple[dict, list]]:
    """`entries` in runs whose kernels (`named(entry)`: name -> kernel) go into one
    translation unit: a name met again with another source (its 4-digit hash alike)
    starts the next run. (name -> kernel of the run, the run's entries)."""
    groups: list[tuple[dict, list]] = []
    for entry in entries:
        kernels = named(entry)
        if not groups or any(groups[-1][0].get(n, k).source != k.source for n, k in kernels.items()):
            groups.append(({}, []))
        groups[-1][0].update(kernels)
        groups[-1][1].append(entry)
    return groups


class LaterChecks:
    """The checks of many programs' kernels done together, PER_UNIT programs at a time:
    each NVRTC call costs about 80 ms before its first kernel (the headers) and each g++
    build about 0.1 s, about as much as a program's kernels themselves (150 programs one
    by one: NVRTC 18 s, 98 builds 19 s). With `compile`, every kernel of the plans is
    compiled by NVRTC; with `emulate`, the plans' loop kernels run on the CPU
    (tests/helpers/kernel_emulator.py) and the outputs are compared with jax.jit's. A
    failure names its program (a unit that does not compile is compiled again program
    by program to find it)."""

    PER_UNIT = 40

    def __init__(self, compile: bool, emulate: bool) -> None:
        self.compile, self.emulate = compile, emulate
        self.programs: list[tuple] = []  # (program, plan, args, jax.jit's outputs)

    def add(self, p: Program, plan, args, want) -> None:
        self.programs.append((p, plan, args, want))
        if len(self.programs) >= self.PER_UNIT:
            self.check()

    def check(self) -> None:
        programs, self.programs = self.programs, []
        if self.compile:
            self._compile(programs)
        if self.emulate:
            self._emulate(programs)

    @staticmethod
    def _compile(programs: list) -> None:
        def kernels(entry):
            return {t.kernel.name: t.kernel for t in entry[1].tasks if t.kernel}

        def ptx(named: dict) -> None:
            compile_to_ptx("\n".join(k.source for k in named.values()), "fuzz.cu", arch="sm_90", fast=True)

        try:
            for named, _ in grouped(programs, kernels):
                if named:
                    ptx(named)
        except KernelCompileError:
            for entry in programs:
                try:
                    ptx(kernels(entry))
                except KernelCompileError as e:
                    raise AssertionError(f"the kernels of this program do not compile:{entry[0]!r}") from e
            raise

    @staticmethod
    def _emulate(programs: list) -> None:
        launches = lambda entry: {k.name: k for k in kernel_emulator.kernels(entry[1])}  # noqa: E731
        for named, members in grouped(programs, launches):
            lib = kernel_emulator.build(list(named.values())) if named else None
            for p, plan, args, want in members:
                outs, _ = kernel_emulator.run(plan, args, lib=lib)
                want_leaves = jax.tree_util.tree_leaves(want)
                try:
                    assert_same([np.asarray(o).reshape(np.shape(w)) for o, w in zip(outs, want_leaves)],
                                [np.asarray(w) for w in want_leaves], p.tf32, p.halves)
                except AssertionError as e:
                    raise AssertionError(f"this program's kernels, run on the CPU, differ:{p!r}") from e


HAVE_NVRTC = available_compiler() is not None
HAVE_CXX = kernel_emulator.compiler() is not None


@pytest.mark.long
def test_fuzz_interpret():
    later = LaterChecks(compile=HAVE_NVRTC, emulate=HAVE_CXX)

    @settings(max_examples=FUZZ_CI_EXAMPLES, derandomize=True, deadline=None,
              suppress_health_check=HEALTH, database=None)
    @given(programs())
    def run(p: Program):
        check_program(p, "interpret", later)

    run()
    later.check()


def _gpu_settings(fn):
    fixed = os.environ.get("NIMBLE_FUZZ_SEED")
    fn = settings(max_examples=GPU_EXAMPLES, derandomize=fixed is None, deadline=None,
                  suppress_health_check=HEALTH, database=None)(fn)
    return seed(int(fixed))(fn) if fixed else fn


GPU_RUNS = {"examples": 0, "failures": 0}


@pytest.mark.gpu
def test_fuzz_gpu():
    @_gpu_settings
    @given(programs(max_ops=10))
    def run(p: Program):
        GPU_RUNS["examples"] += 1
        try:
            check_program(p, "cuda")
        except Exception:
            GPU_RUNS["failures"] += 1
            raise

    try:
        run()
    finally:
        # One line for the record (the shrinking phase reruns failing programs).
        print(f"\nnimble fuzz (cuda, {jax.devices()[0].device_kind}): "
              f"{GPU_RUNS['examples']} programs run, {GPU_RUNS['failures']} failing runs "
              f"(max_examples={GPU_EXAMPLES}, seed={os.environ.get('NIMBLE_FUZZ_SEED', 'derandomized')})")

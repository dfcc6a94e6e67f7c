"""Bugs the differential fuzzer (tests/end_to_end/test_fuzz.py) led to, each as the minimal program,
compared with jax.jit. Each test says what was wrong.

The interpreter evaluates a task's equations with JAX, so a bug inside a generated
kernel shows only where the kernel runs: `check` also runs the plan's loop kernels on
the CPU (tests/helpers/kernel_emulator.py) and, with the `gpu` marker, on the cuda backend.
"""
from __future__ import annotations


import jax
import numpy as np
import pytest
from jax import lax

from tests.helpers import kernel_emulator
import nimblejax as nimble
from tests.helpers.fuzz_values import make_args
from nimblejax.testing.nvrtc_check import available_compiler, compile_to_ptx
from tests.end_to_end.test_fuzz import assert_same


def check(f, specs, backend: str, seed: int = 0) -> None:
    args = make_args(specs, seed)
    nf = nimble.jit(f, backend=backend)
    assert_same(nf(*args), jax.jit(f)(*args))
    if backend != "interpret":
        return
    plan = nf.plan(*args)
    kernels = [t.kernel.source for t in plan.tasks if t.kernel]
    if kernels and available_compiler() is not None:
        compile_to_ptx("\n".join(kernels), "regression.cu", arch="sm_90", fast=True)
    if kernel_emulator.compiler() is not None:  # the kernels themselves, on the CPU
        outs, _ = kernel_emulator.run(plan, args)
        want = jax.tree_util.tree_leaves(jax.jit(f)(*args))
        assert_same([np.asarray(o).reshape(np.shape(w)) for o, w in zip(outs, want)], want)


def window_high_padding(x):
    # reduce_window on an axis with window 1, stride 1 and no low padding but high
    # padding: the kernel took the output index as the operand index on that axis
    # (no bounds check), so the two padded rows read past the operand's end instead of
    # holding the identity (-inf). Found reviewing the kernels the fuzzer drives
    # (rules_window._window_positions ignored `hi`); the GPU variant shows it.
    return lax.reduce_window(x, -np.inf, lax.max, (1, 2), (1, 1), ((0, 2), (0, 0)))


WINDOW_SPECS = [((3, 4), "float32")]


def test_window_high_padding_interpret():
    check(window_high_padding, WINDOW_SPECS, "interpret")


@pytest.mark.skipif(kernel_emulator.compiler() is None, reason="no C++ compiler")
def test_window_high_padding_emulated():
    """Without a GPU: the kernel itself, run on the CPU (tests/helpers/kernel_emulator.py)."""
    args = make_args(WINDOW_SPECS, 0)
    plan = nimble.jit(window_high_padding, backend="interpret").plan(*args)
    outs, emulated = kernel_emulator.run(plan, args)
    assert emulated == 1
    assert_same(outs[0], jax.jit(window_high_padding)(*args))


@pytest.mark.gpu
def test_window_high_padding_gpu():
    check(window_high_padding, WINDOW_SPECS, "cuda")


def bf16_long_cumsum(x):
    # Found by the fuzzer (emulated kernels): `lax.cumsum(a0.reshape((9600,)))` in bfloat16.
    # The scan kernel (lowering/rules_kernels.py `cumulative`) rounds its running sum to
    # bfloat16 after every step, so a long scan drifts (last element -34.0 where jax.jit
    # gives -24.25 and the float32 sum is -24.03). XLA scans as a tree (associative_scan)
    # with float32 excess precision. Fixed: the accumulator stays in float and only what
    # is stored is rounded.
    return lax.cumsum(x, axis=0)


CUMSUM_SPECS = [((9600,), "bfloat16")]


@pytest.mark.skipif(kernel_emulator.compiler() is None, reason="no C++ compiler")
def test_bf16_long_cumsum_emulated():
    check(bf16_long_cumsum, CUMSUM_SPECS, "interpret", seed=2)


@pytest.mark.gpu
def test_bf16_long_cumsum_gpu():
    check(bf16_long_cumsum, CUMSUM_SPECS, "cuda", seed=2)

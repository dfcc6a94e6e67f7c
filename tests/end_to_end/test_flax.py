"""flax.linen / optax programs (tests/helpers/flax_programs.py) under nimble.jit against
jax.jit: the plan interpreter on the CPU, the GPU under `-m gpu`."""
from __future__ import annotations

import jax
import numpy as np
import pytest

import nimblejax as nimble
from tests.helpers.models import assert_tree_close

flax_programs = pytest.importorskip("tests.helpers.flax_programs",
                                    reason="flax and optax are test extras")
PROGRAMS = flax_programs.PROGRAMS


def _data(tree):
    """Typed PRNG keys compare by their key data."""
    return jax.tree_util.tree_map(
        lambda a: jax.random.key_data(a) if jax.dtypes.issubdtype(a.dtype, jax.dtypes.prng_key) else a,
        tree)


def check(name: str, backend: str) -> None:
    fn, args = PROGRAMS[name]()
    want = jax.jit(fn)(*args)
    got = nimble.jit(fn, backend=backend)(*args)
    assert_tree_close(_data(got), _data(want))


# The interpreter compiles each of its 1200 equations: tens of seconds on 2 cores.
LONG = {"inception_sgd_step"}


@pytest.mark.parametrize("name", [pytest.param(n, marks=pytest.mark.long) if n in LONG else n
                                  for n in sorted(PROGRAMS)])
def test_program_interpret(name):
    check(name, "interpret")


# Programs whose gradients amplify TF32 rounding: BatchNorm over 4 images of 16x16 makes
# near-cancelling sums, so at JAX's default matmul precision (TF32 on this GPU) jax.jit and
# nimble each land a few percent from the exact result, in different directions. Measured
# on an H100 (jax 0.11.2): against the step at "highest" precision, jax.jit's default run is
# off by up to 3.0% of a leaf's scale and nimble's by up to 5.8%; at "highest" both agree
# with the exact step within 1.5e-5. So these are compared exactly at "highest" and, at the
# default precision, by their distance from the exact result (TF32 noise, not a wrong kernel).
TF32_AMPLIFIED = {"inception_sgd_step"}


def _worst_error(got, want) -> float:
    """The largest error of any leaf, relative to that leaf's largest magnitude."""
    worst = 0.0
    for g, w in zip(jax.tree_util.tree_leaves(got), jax.tree_util.tree_leaves(want)):
        g, w = np.asarray(g, np.float64), np.asarray(w, np.float64)
        worst = max(worst, float(np.max(np.abs(g - w)) / max(np.max(np.abs(w)), 1e-30)))
    return worst


@pytest.mark.gpu
@pytest.mark.parametrize("name", sorted(PROGRAMS))
def test_program_cuda(name):
    if name not in TF32_AMPLIFIED:
        check(name, "cuda")
        return
    fn, args = PROGRAMS[name]()
    with jax.default_matmul_precision("highest"):
        exact = jax.jit(fn)(*args)
        assert_tree_close(nimble.jit(fn, backend="cuda")(*args), exact)
    jax_error = _worst_error(jax.jit(fn)(*args), exact)
    nimble_error = _worst_error(nimble.jit(fn, backend="cuda")(*args), exact)
    # A wrong kernel errs by O(1); TF32 noise by a few times jax.jit's own TF32 error,
    # depending on the algorithms cuBLASLt picks for the plan's buffers (their offsets
    # change with the plan): 6.3x for the Inception SGD step on an H100 once horizontal
    # fusion packed its updates, which are exact under "highest" (above) and in f32 on
    # the CPU kernel emulator.
    assert nimble_error <= max(8 * jax_error, 1e-4), (nimble_error, jax_error)

"""Operands broadcast along size-1 axes without a broadcast_in_dim: newer JAX traces
`x + y[:1]` (f32[16,64] + f32[1,64]) as one `add`. Every kernel must read index 0 on
those axes (codegen.KernelBuilder.value); the kernels run on the CPU emulator and, marked
`gpu`, on the GPU, against jax.jit."""
from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import nimblejax as nimble
from tests.helpers import kernel_emulator as emu
from tests.helpers.models import assert_tree_close, rand

r = np.random.default_rng(11)

PROGRAMS = {
    "elementwise": lambda x, y: jnp.tanh(x + y[:1]),
    "column": lambda x, y: x * y[:, :1] - 1.0,
    "reduction": lambda x, y: jnp.sum(x * y[:, :1], axis=1),
    "row_kernel": lambda x, y: jax.nn.softmax(x + y[:1], axis=-1),
}


def args():
    return rand(r, 16, 64), rand(r, 16, 64)


@pytest.mark.skipif(emu.compiler() is None, reason="no C++ compiler for the kernel emulator")
@pytest.mark.parametrize("name", sorted(PROGRAMS))
def test_emulated_kernels_read_index_zero_on_size_one_axes(name):
    fn, (x, y) = PROGRAMS[name], args()
    outs, emulated = emu.run(nimble.jit(fn, backend="interpret").plan(x, y), [np.asarray(x), np.asarray(y)])
    assert emulated >= 1
    assert_tree_close(np.asarray(outs[0]), jax.jit(fn)(x, y))


@pytest.mark.gpu
@pytest.mark.parametrize("name", sorted(PROGRAMS))
def test_cuda_matches_jax(name):
    fn, (x, y) = PROGRAMS[name], args()
    assert_tree_close(nimble.jit(fn, backend="cuda")(x, y), jax.jit(fn)(x, y))

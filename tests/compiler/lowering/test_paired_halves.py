"""Loop kernels over half types move neighbouring elements in pairs (lowering/codegen.py
`_paired_loop`): a half input read at the element's own offset is loaded two elements at
a time and the output stored two at a time. The kernels run on the CPU
(tests/helpers/kernel_emulator.py) give the same bits as the element-at-a-time kernels
and jax.jit's values; NVRTC compiles them; the GPU compares with jax.jit."""
from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import nimblejax as nimble
from nimblejax.compiler.lowering import codegen
from tests.helpers import kernel_emulator as emu
from tests.helpers.libraries import assert_kernels_compile
from tests.helpers.models import assert_cuda_matches_jax_twice, assert_emulated_matches_jax, rand

r = np.random.default_rng(11)
HALVES = [jnp.bfloat16, jnp.float16]


def gelu_bias(x, b):  # x read at its own offset, b through a broadcast
    return jax.nn.gelu(x + b, approximate=False)


def swish_residual(x, y, s):  # two inputs at their own offset, a scalar
    return jax.nn.sigmoid(x * s) * x + y


def args_for(fn, rows: int, width: int, dtype):
    x = rand(r, rows, width, dtype=dtype, scale=2.0)
    if fn is gelu_bias:
        return x, rand(r, width, dtype=dtype)
    return x, rand(r, rows, width, dtype=dtype), jnp.asarray(0.75, dtype)


def plan_of(fn, args):
    return nimble.jit(fn, backend="interpret").plan(*args)


def sources(plan) -> list[str]:
    return [t.kernel.source for t in plan.tasks if t.kernel is not None]


# (rows, width): whole blocks of pairs; a tail of pairs an element at a time
SHAPES = [(64, 2048), (67, 2050)]


@pytest.mark.parametrize("dtype", HALVES, ids=["bf16", "f16"])
@pytest.mark.parametrize("fn", [gelu_bias, swish_residual])
@pytest.mark.parametrize("shape", SHAPES, ids=["blocks", "tail"])
def test_emulated_paired_kernels_give_the_bits_of_single_elements(fn, dtype, shape, monkeypatch):
    args = args_for(fn, *shape, dtype)
    paired = plan_of(fn, args)
    text = "\n".join(sources(paired))
    pair = "__nv_bfloat162" if dtype == jnp.bfloat16 else "__half2"
    assert f"*reinterpret_cast<const {pair}*>" in text and f"*reinterpret_cast<{pair}*>(out0" in text
    got, _ = emu.run(paired, [np.asarray(a) for a in args])
    monkeypatch.setattr(codegen, "PAIR_HALVES", False)
    single = plan_of(fn, args)
    assert "reinterpret_cast" not in "\n".join(sources(single))
    want, _ = emu.run(single, [np.asarray(a) for a in args])
    for g, w in zip(got, want):
        np.testing.assert_array_equal(np.asarray(g).view(np.uint16), np.asarray(w).view(np.uint16))


@pytest.mark.parametrize("dtype", HALVES, ids=["bf16", "f16"])
def test_emulated_paired_kernels_match_jax(dtype):
    assert_emulated_matches_jax(gelu_bias, args_for(gelu_bias, 67, 2050, dtype))


def test_odd_sizes_and_float32_stay_an_element_at_a_time():
    odd = args_for(gelu_bias, 65, 2049, jnp.bfloat16)
    assert "reinterpret_cast" not in "\n".join(sources(plan_of(gelu_bias, odd)))
    f32 = args_for(gelu_bias, 64, 2048, jnp.float32)
    assert "reinterpret_cast" not in "\n".join(sources(plan_of(gelu_bias, f32)))
    assert_emulated_matches_jax(gelu_bias, odd)


def test_paired_kernels_compile():
    kernels = {}
    for dtype in HALVES:
        for fn in (gelu_bias, swish_residual):
            for t in plan_of(fn, args_for(fn, 67, 2050, dtype)).tasks:
                if t.kernel is not None:
                    kernels[t.kernel.name] = t.kernel.source
    assert_kernels_compile(kernels, "paired_halves")


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", HALVES, ids=["bf16", "f16"])
@pytest.mark.parametrize("shape", SHAPES, ids=["blocks", "tail"])
def test_paired_kernels_on_the_gpu_match_jax(shape, dtype):
    args = args_for(swish_residual, *shape, dtype)
    assert_cuda_matches_jax_twice(swish_residual, args)
    args = args_for(gelu_bias, *shape, dtype)
    assert_cuda_matches_jax_twice(gelu_bias, args)

"""The tiled-transpose template (lowering/transpose.py): which fused groups get it, that
its source compiles, and that results stay exact (CPU plan interpreter; GPU: marked)."""
from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import nimblejax as nimble
from tests.helpers import on_host
from tests.helpers.models import rand
from nimblejax.compiler.lowering.transpose import batched_2d
from nimblejax.testing.nvrtc_check import available_compiler, compile_to_ptx

HWIO_TO_OHWI = (3, 0, 1, 2)
NHWC_TO_NCHW = (0, 3, 1, 2)
NCHW_TO_NHWC = (0, 2, 3, 1)


def perm(p):
    return lambda x: jnp.transpose(x, p)


# name → (function, argument shapes, dtype); every one of these gets the tiled kernel.
TILED = {
    "hwio_to_ohwi": (perm(HWIO_TO_OHWI), [(3, 3, 64, 48)], jnp.float32),
    "nhwc_to_nchw": (perm(NHWC_TO_NCHW), [(2, 8, 8, 64)], jnp.float32),
    "nchw_to_nhwc": (perm(NCHW_TO_NHWC), [(2, 64, 8, 8)], jnp.float32),
    "matrix_T": (lambda x: x.T, [(100, 37)], jnp.float32),
    "astype_bf16": (lambda w: jnp.transpose(w, HWIO_TO_OHWI).astype(jnp.bfloat16),
                    [(3, 3, 32, 40)], jnp.float32),
    "times_two": (lambda w: jnp.transpose(w, HWIO_TO_OHWI) * 2.0, [(3, 3, 32, 40)], jnp.float32),
    # (ops that round exactly like XLA's: the GPU test asks for equal bits)
    "scalar_arg": (lambda x, s: jnp.maximum(x.T * s, 0.5), [(48, 64), ()], jnp.float32),
    "reshape_around": (lambda x: jnp.transpose(x.reshape(4, 8, 32), (2, 0, 1)).reshape(32, 32),
                       [(32, 32)], jnp.float32),
}
# These keep the elementwise template.
ELEMENTWISE = {
    "no_permutation": (lambda x: x * 2.0, [(64, 48)], jnp.float32),
    "innermost_unchanged": (perm((1, 0, 2)), [(64, 48, 32)], jnp.float32),
    "broadcast_second_input": (lambda x, b: x.T + b[None, :], [(64, 48), (64,)], jnp.float32),
    "not_a_batched_2d_transpose": (perm((2, 1, 0)), [(16, 16, 16)], jnp.float32),
    "tiny_inner_extent": (lambda x: x.T, [(1000, 3)], jnp.float32),
}
# Odd sizes and other dtypes (the GPU runs them; the CPU checks plans and compiles).
MORE = {
    "odd_hwio": (perm(HWIO_TO_OHWI), [(3, 5, 7, 33)], jnp.float32),
    "odd_nhwc": (perm(NHWC_TO_NCHW), [(3, 5, 7, 33)], jnp.float32),
    "tall_T": (lambda x: x.T, [(1000, 37)], jnp.float32),
    "bf16_T": (lambda x: x.T, [(129, 65)], jnp.bfloat16),
    "f16_nchw": (perm(NCHW_TO_NHWC), [(2, 40, 5, 7)], jnp.float16),
    "int8_T": (lambda x: x.T, [(33, 100)], jnp.int8),
    "bool_not_T": (lambda x: jnp.logical_not(x.T), [(70, 20)], jnp.bool_),
    "resnet_weight": (perm(HWIO_TO_OHWI), [(3, 3, 512, 512)], jnp.float32),
}


def make_args(shapes, dtype, seed=0):
    rng = np.random.default_rng(seed)
    if dtype == jnp.bool_:
        return [jnp.asarray(rng.standard_normal(s) > 0) for s in shapes]
    if jnp.issubdtype(dtype, jnp.integer):
        return [on_host(rng.integers(-100, 100, s), dtype) for s in shapes]
    return [rand(rng, *s, dtype=dtype) for s in shapes]


def kernel_tasks(fn, *args):
    plan = nimble.jit(fn, backend="interpret").plan(*args)
    return [t for t in plan.tasks if t.kind == "kernel"]


# ---- applicability --------------------------------------------------------------------
@pytest.mark.parametrize("name", sorted(TILED) + sorted(MORE))
def test_permuting_group_gets_the_tiled_kernel(name):
    fn, shapes, dtype = {**TILED, **MORE}[name]
    ks = kernel_tasks(fn, *make_args(shapes, dtype))
    assert len(ks) == 1 and ks[0].name.startswith("nimble_transpose_"), [k.name for k in ks]
    assert ks[0].kernel.block == (32, 8, 1)


@pytest.mark.parametrize("name", sorted(ELEMENTWISE))
def test_other_groups_keep_the_elementwise_kernel(name):
    fn, shapes, dtype = ELEMENTWISE[name]
    ks = kernel_tasks(fn, *make_args(shapes, dtype))
    assert ks and all(k.name.startswith("nimble_fused_") for k in ks), [k.name for k in ks]


def test_names_grid_and_params_of_the_resnet_weight_transpose():
    w = jax.ShapeDtypeStruct((3, 3, 512, 512), jnp.float32)
    (task,) = kernel_tasks(perm(HWIO_TO_OHWI), w)
    k = task.kernel
    assert k.name.startswith("nimble_transpose_f32_")
    assert k.grid == (4608 // 32, 512 // 32, 1)
    assert [v.shape for v in k.params] == [(512, 3, 3, 512), (3, 3, 512, 512)]  # out, in
    assert "__shared__ float tile[32][33];" in k.source and "if (" not in k.source  # no tails
    (fused,) = kernel_tasks(TILED["times_two"][0], jax.ShapeDtypeStruct((3, 3, 32, 40), jnp.float32))
    assert fused.name.startswith("nimble_transpose_mul_f32_")


def test_batched_2d_collapses_axes():
    assert batched_2d((3, 3, 512, 512), HWIO_TO_OHWI) == (1, 4608, 512)
    assert batched_2d((2, 8, 8, 64), NHWC_TO_NCHW) == (2, 64, 64)
    assert batched_2d((2, 64, 8, 8), NCHW_TO_NHWC) == (2, 64, 64)
    assert batched_2d((1, 5, 1, 7), (3, 1, 2, 0)) == (1, 5, 7)  # unit axes dropped
    assert batched_2d((16, 16, 16), (2, 1, 0)) is None
    assert batched_2d((4, 5, 6), (1, 0, 2)) is None
    assert batched_2d((4, 5), (0, 1)) is None


def test_offsets_go_64_bit_past_2_to_the_31_elements():
    (task,) = kernel_tasks(lambda x: x.T, jax.ShapeDtypeStruct((65536, 32768), jnp.float32))
    assert "(long long)" in task.kernel.source and task.kernel.grid == (2048, 1024, 1)


# ---- compiles, and plans stay right ----------------------------------------------------
@pytest.mark.skipif(available_compiler() is None, reason="no NVRTC or nvcc")
def test_tiled_kernels_compile():
    sources = {}
    for fn, shapes, dtype in [*TILED.values(), *MORE.values()]:
        for t in kernel_tasks(fn, *make_args(shapes, dtype)):
            sources[t.kernel.name] = t.kernel.source
    big = jax.ShapeDtypeStruct((65536, 32768), jnp.float32)
    sources.update((t.kernel.name, t.kernel.source) for t in kernel_tasks(lambda x: x.T, big))
    ptx = compile_to_ptx("\n".join(sources.values()), "nimble_transposes.cu", arch="sm_90", fast=True)
    assert all(f".entry {name}(" in ptx for name in sources)


@pytest.mark.parametrize("name", sorted(TILED) + sorted(ELEMENTWISE) + sorted(MORE))
def test_interpreter_matches_jax(name):
    fn, shapes, dtype = {**TILED, **ELEMENTWISE, **MORE}[name]
    args = make_args(shapes, dtype)
    np.testing.assert_array_equal(nimble.jit(fn, backend="interpret")(*args), jax.jit(fn)(*args))


# ---- on the GPU ----------------------------------------------------------------------
@pytest.mark.gpu
@pytest.mark.parametrize("name", sorted(TILED) + sorted(ELEMENTWISE) + sorted(MORE))
def test_gpu_matches_jax_exactly(name):
    fn, shapes, dtype = {**TILED, **ELEMENTWISE, **MORE}[name]
    args = make_args(shapes, dtype, seed=1)
    want = jax.jit(fn)(*args)
    f = nimble.jit(fn)
    for _ in range(2):
        got = f(*args)
        assert got.dtype == want.dtype and got.shape == want.shape
        np.testing.assert_array_equal(np.asarray(got), np.asarray(want))

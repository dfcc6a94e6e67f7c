"""Split-K as partial products summed by the GEMM's reader (compiler/canonicalize/
split_k.py): which dots split and into how many slices, the plan they make (one batched
GEMM, its sum inside the reading kernel), and the numbers against jax.jit on random
inputs under the CPU interpreter and (marked `gpu`) on the GPU."""
from __future__ import annotations

import importlib

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import nimblejax as nimble
from tests.helpers import kernel_emulator as emu
from tests.helpers.models import assert_emulated_matches_jax, rand

split_k = importlib.import_module("nimblejax.compiler.canonicalize.split_k")

BACKENDS = ["interpret", pytest.param("cuda", marks=pytest.mark.gpu)]
# cuda: TF32 GEMMs on both sides (jax.jit's default precision on the GPU).
TOL = {"interpret": 2e-5, "cuda": 2e-2}


def dense(x, w, b):
    return x @ w + b


def ffn_layernorm(x, w1, b1, w2, b2):
    """BERT's feed-forward block: GELU(x W1 + b1) W2 + b2 + x, then LayerNorm."""
    h = jax.nn.gelu(x @ w1 + b1, approximate=False)
    y = h @ w2 + b2 + x
    mean = y.mean(-1, keepdims=True)
    var = ((y - mean) ** 2).mean(-1, keepdims=True)
    return (y - mean) * jax.lax.rsqrt(var + 1e-5)


def ffn_args(seed, rows=128, d=768, f=3072):
    rng = np.random.default_rng(seed)
    return (rand(rng, 1, rows, d), rand(rng, d, f, scale=d ** -0.5), rand(rng, f),
            rand(rng, f, d, scale=f ** -0.5), rand(rng, d))


def gemms(fn, *args, **options):
    plan = nimble.jit(fn, backend="interpret", **options).plan(*args)
    return plan, [t.gemm for t in plan.tasks if t.gemm is not None]


def check(fn, args, backend):
    got = nimble.jit(fn, backend=backend)(*args)
    want = jax.jit(fn)(*args)
    scale = float(jnp.max(jnp.abs(want)))
    np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=TOL[backend],
                               atol=TOL[backend] * scale)


@pytest.mark.parametrize("m,n,k,s", [
    (128, 768, 768, 4),     # BERT's attention projections at batch 1
    (128, 3072, 768, 4),    # its first feed-forward GEMM: 24 tiles, 4 slices fill 96 SMs
    (128, 768, 3072, 8),    # its second: K = 3072 in 8 slices of 384
    (128, 512, 512, 2),     # GPT's: slices of at least MIN_SLICE_K
    (4096, 512, 512, 1),    # 128 tiles fill the GPU already
    (1024, 768, 768, 1),    # 48 tiles (BERT's layers at batch 8): left whole
    (1024, 512, 512, 1),    # 32 tiles: measured slower split
    (32, 768, 512, 1),      # too few rows for a short K: the tensor-core kernel's GEMM
    (32, 768, 3072, 8),     # few rows but a K beyond the tensor-core kernel: cuBLASLt's
    (12, 768, 3072, 1),     # fewer than 16 rows whatever K
    (128, 768, 256, 1),     # too short a K
    (64, 64, 16384, 1),     # too long a K: a filter gradient's, with its update in the epilogue
])
def test_the_split_factor_follows_tiles_rows_and_k(m, n, k, s):
    rng = np.random.default_rng(m + n + k)
    args = (rand(rng, 1, m, k), rand(rng, k, n), rand(rng, n))
    _, made = gemms(dense, *args)
    assert [(g.batch, g.m, g.n, g.k) for g in made] == [(s, m, n, k // s)]


@pytest.mark.parametrize("backend", BACKENDS)
def test_a_dense_layer_split_in_k_matches_jax(backend):
    rng = np.random.default_rng(1)
    args = (rand(rng, 1, 128, 3072), rand(rng, 3072, 768, scale=3072 ** -0.5), rand(rng, 768))
    assert [g.batch for g in gemms(dense, *args)[1]] == [8]
    check(dense, args, backend)


@pytest.mark.parametrize("backend", BACKENDS)
def test_the_sum_of_partial_products_runs_in_the_kernels_that_read_it(backend):
    """Two GEMMs and two kernels: the sum, the bias and GELU in one elementwise kernel;
    the sum, the bias, the residual and the LayerNorm in one row kernel."""
    args = ffn_args(2)
    plan, made = gemms(ffn_layernorm, *args)
    assert [(g.batch, g.k) for g in made] == [(4, 192), (8, 384)]
    kernels = [t.name for t in plan.tasks if t.gemm is None]
    assert len(plan.tasks) == 4 and len(kernels) == 2, [t.name for t in plan.tasks]
    assert "erf" in kernels[0] and "layernorm" in kernels[1], kernels
    check(ffn_layernorm, args, backend)


def conv_bn_relu(x, w, scale, shift):
    """A convolution and an inference batch norm, as ResNet's blocks: its GEMM (conv_path.py)
    has a batch axis of size 1 and is read through a reshape by the scale's `mul`."""
    y = jax.lax.conv_general_dilated(x, w, (1, 1), "SAME", dimension_numbers=("NHWC", "HWIO", "NHWC"))
    return jax.nn.relu(y * scale + shift)


def conv_args(seed, size=7, channels=512):
    rng = np.random.default_rng(seed)
    return (rand(rng, 1, size, size, channels), rand(rng, 3, 3, channels, channels, scale=(9 * channels) ** -0.5),
            rand(rng, channels), rand(rng, channels))


@pytest.mark.parametrize("backend", BACKENDS)
def test_a_convolution_read_by_a_batch_norm_splits_and_sums_in_its_kernel(backend):
    """ResNet-50's last stage at batch 1: 49 x 512 over K = 4608 in 8 slices, the sum in
    the batch norm's kernel (one GEMM task, one kernel after the im2col)."""
    args = conv_args(6)
    plan, made = gemms(conv_bn_relu, *args)
    assert [(g.batch, g.m, g.n, g.k) for g in made] == [(8, 49, 512, 576)]
    after = [t.name for t in plan.tasks if t.gemm is None and "im2col" not in t.name]
    assert len(after) == 1 and "max" in after[0], after
    check(conv_bn_relu, args, backend)


def bottleneck_end(x, w, scale, shift, shortcut):
    """ResNet's block end at batch 1: a 3 x 3 convolution of 256 channels on 14 x 14
    (196 x 256 over K = 2304), its batch norm, the shortcut added, relu."""
    y = jax.lax.conv_general_dilated(x, w, (1, 1), "SAME", dimension_numbers=("NHWC", "HWIO", "NHWC"))
    return jax.nn.relu(y * scale + shift + shortcut)


@pytest.mark.skipif(emu.compiler() is None, reason="needs g++")
def test_the_generated_kernel_summing_a_convolutions_slices_matches_jax():
    """The emulated kernels (the im2col, the batch norm's kernel adding 8 slices of 288)
    against jax.jit."""
    rng = np.random.default_rng(8)
    args = (rand(rng, 1, 14, 14, 256), rand(rng, 3, 3, 256, 256, scale=2304 ** -0.5),
            rand(rng, 256), rand(rng, 256), rand(rng, 1, 14, 14, 256))
    assert [(g.batch, g.m, g.k) for g in gemms(bottleneck_end, *args)[1]] == [(8, 196, 288)]
    assert_emulated_matches_jax(bottleneck_end, args)


@pytest.mark.parametrize("fn", [
    lambda x, w, b: jnp.tanh(x @ w) + b,            # a reader that is not an add or a mul
    lambda x, w, b: (x @ w, b),                     # the dot is a result of the function
    lambda x, w, b: ((x @ w).reshape(-1), b),       # ... through a reshape
    lambda x, w, b: jnp.tanh((x @ w).reshape(-1)),  # a reshape read by a tanh
])
def test_a_dot_read_by_anything_but_adds_and_muls_stays_one_gemm(fn):
    rng = np.random.default_rng(3)
    args = (rand(rng, 1, 128, 768), rand(rng, 768, 768), rand(rng, 768))
    assert [g.batch for g in gemms(fn, *args)[1]] == [1]


def test_half_precision_dots_and_the_option_off_stay_one_gemm():
    rng = np.random.default_rng(4)
    x, w, b = rand(rng, 1, 128, 768), rand(rng, 768, 768), rand(rng, 768)
    half = tuple(a.astype(jnp.bfloat16) for a in (x, w, b))
    assert [g.batch for g in gemms(dense, *half)[1]] == [1]
    assert [g.batch for g in gemms(dense, x, w, b, split_k=False)[1]] == [1]


def test_the_environment_turns_it_off(monkeypatch):
    from nimblejax import options

    monkeypatch.setenv("NIMBLE_SPLIT_K", "0")
    assert options.from_env().split_k is False
    monkeypatch.setenv("NIMBLE_SPLIT_K", "1")
    assert options.from_env().split_k is True


@pytest.mark.parametrize("backend", BACKENDS)
def test_a_transposed_weight_two_leading_axes_and_the_precision_are_kept(backend):
    """x @ w.T (the weight's contracting axis last), lhs rows over two axes, and
    "highest" precision: the GEMM stays float32 (not TF32)."""
    rng = np.random.default_rng(5)
    x, wt, b = rand(rng, 2, 64, 3072), rand(rng, 768, 3072, scale=3072 ** -0.5), rand(rng, 768)

    def highest(x, wt, b):
        return jax.lax.dot_general(x, wt, (((2,), (1,)), ((), ())),
                                   precision=jax.lax.Precision.HIGHEST) + b

    made = gemms(highest, x, wt, b)[1]
    assert [(g.batch, g.m, g.n, g.k, g.compute) for g in made] == [(8, 128, 768, 384, "f32")]
    check(highest, (x, wt, b), backend)

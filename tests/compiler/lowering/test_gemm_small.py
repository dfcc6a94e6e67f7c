"""The small-M GEMM kernel (compiler/lowering/gemm_small.py): which dots take it (the
LSTM's recurrent steps; not the merged input projection, the MLP's or BERT's GEMMs), the
kernel itself run on the CPU (tests/helpers/kernel_emulator.py) against numpy for odd
sizes and layouts, NVRTC compiles it, and the GPU compares with jax.jit."""
from __future__ import annotations

import jax
import jax.numpy as jnp
from jax import lax
import numpy as np
import pytest

import nimblejax as nimble
from nimblejax.compiler.lowering.gemm_small import SMALL_M_MAX
from nimblejax.bench import gemm_small as gemm_small_bench
from nimblejax.bench.models import MODELS, lstm
from nimblejax.compiler.ir import Var
from nimblejax.compiler.lowering.gemm_small import small_m_matmul
from nimblejax.testing.nvrtc_check import available_compiler, compile_to_ptx
from tests.helpers import kernel_emulator as emu
from tests.helpers.models import assert_tree_close, rand

r = np.random.default_rng(0)
SMALL = "nimble_gemm_small_m"
needs_cxx = pytest.mark.skipif(emu.compiler() is None, reason="no host C++ compiler")


def plan_of(fn, *args, **opts):
    return nimble.jit(fn, backend="interpret", **opts).plan(*args)


def small_tasks(plan) -> list:
    return [t for t in plan.tasks if t.name.startswith(SMALL)]


def gemm_tasks(plan) -> list:
    """Library GEMMs, or the TF32 tensor-core kernels computing them (gemm_tc.py)."""
    return [t for t in plan.tasks if t.gemm is not None]


def matmul(a, b):
    return a @ b


# ---- which dots take the kernel -------------------------------------------------------
def test_lstm_recurrent_dots_are_small_m_kernels_and_the_input_projection_is_cublaslt():
    fn, args = MODELS["lstm"].abstract(8)
    plan = plan_of(fn, *args)
    small = small_tasks(plan)
    assert len(small) == 32 and all(t.kind == "kernel" for t in small)
    assert all(t.name.startswith("nimble_gemm_small_m8_f32_") for t in small)
    (merged,) = gemm_tasks(plan)  # the 32 steps' x_t @ W_ih as one GEMM
    assert (merged.gemm.m, merged.gemm.n, merged.gemm.k) == (256, 2048, 512)


def test_batch_32_keeps_the_small_m_kernel_off_where_it_is_slower():
    """(Its 32 recurrent 32x2048x512 GEMMs are gemm_tc.py's TF32 kernel, measured faster
    than cuBLASLt there; the merged input projection is cuBLASLt's.)"""
    fn, args = MODELS["lstm"].abstract(32)
    plan = plan_of(fn, *args)
    assert not small_tasks(plan) and len(gemm_tasks(plan)) == 33
    assert sum(t.kind == "gemm" for t in gemm_tasks(plan)) == 1


def test_lstm_plan_with_small_gemm_off_is_all_cublaslt():
    fn, args = MODELS["lstm"].abstract(32)
    plan = plan_of(fn, *args, small_gemm=False, tc_gemm=False)
    assert not small_tasks(plan) and len(gemm_tasks(plan)) == 33
    assert all(t.kind == "gemm" for t in gemm_tasks(plan))


def test_lstm_numbers_match_jax():
    cfg = lstm.Config(steps=3, hidden=512, features=24)
    fn, args = MODELS["lstm"].build(4, jnp.float32, np.random.default_rng(3), config=cfg)
    plan = plan_of(fn, *args)
    assert len(small_tasks(plan)) == 3
    assert_tree_close(nimble.jit(fn, backend="interpret")(*args), jax.jit(fn)(*args))


@pytest.mark.parametrize("m,k,n", [(256, 256, 256), (128, 768, 768), (33, 512, 2048),
                                   (32, 256, 1024), (32, 2048, 256)])
def test_other_sizes_keep_the_library(m, k, n):
    """The branchy MLP's 256x256, BERT's M=128, M past 32, K*N < 2**19, N < 512: a GEMM
    (cuBLASLt's, or the TF32 kernel of gemm_tc.py where it takes it), not this kernel."""
    args = (rand(r, m, k), rand(r, k, n))
    plan = plan_of(matmul, *args)
    assert not small_tasks(plan) and len(gemm_tasks(plan)) == 1


def test_bench_mlp_and_bert_keep_the_library():
    for name in ("mlp", "bert"):
        fn, args = MODELS[name].abstract(1)
        assert not small_tasks(plan_of(fn, *args)), name


def test_transposed_b_keeps_the_library_and_transposed_a_takes_the_kernel():
    h, w = rand(r, 8, 512), rand(r, 2048, 512)
    h_wt = lambda h, w: lax.dot_general(h, w, (((1,), (1,)), ((), ())))  # noqa: E731
    (g,) = plan_of(h_wt, h, w).tasks
    assert g.gemm.trans_b
    ht, w2 = rand(r, 512, 8), rand(r, 512, 2048)
    f = lambda ht, w: lax.dot_general(ht, w, (((0,), (0,)), ((), ())))  # noqa: E731
    plan = plan_of(f, ht, w2)
    (t,) = small_tasks(plan)
    assert "A stored (512, 8)" in t.kernel.source
    assert_tree_close(nimble.jit(f, backend="interpret")(ht, w2), jax.jit(f)(ht, w2))


@pytest.mark.parametrize("m,n,k", gemm_small_bench.SHAPES)
def test_bench_shapes_are_one_task_either_way(m, n, k):
    """nimblejax/bench/gemm_small.py times each shape's one task, kernel off and on."""
    args = (rand(r, m, k), rand(r, k, n))
    # (against cuBLASLt: the TF32 kernel of gemm_tc.py off)
    (off,), (on,) = (plan_of(matmul, *args, small_gemm=s, tc_gemm=False).tasks for s in (False, True))
    from nimblejax.compiler.lowering.gemm_small import SMALL_M_MAX

    assert off.kind == "gemm"
    assert on.name.startswith(f"{SMALL}{m}_f32_") if m <= SMALL_M_MAX else on.kind == "gemm"


def test_bias_and_activation_after_a_small_dot_are_kernels_not_an_epilogue():
    f = lambda h, w, b: jax.nn.relu(h @ w + b)  # noqa: E731
    args = (rand(r, 4, 512), rand(r, 512, 2048), rand(r, 2048))
    plan = plan_of(f, *args)
    assert len(small_tasks(plan)) == 1 and not gemm_tasks(plan)
    assert len(plan.tasks) == 2  # the dot, then one fused bias + relu kernel
    assert_tree_close(nimble.jit(f, backend="interpret")(*args), jax.jit(f)(*args))
    # With the kernel off, cuBLASLt takes them as its epilogue again.
    (g,) = plan_of(f, *args, small_gemm=False).tasks
    assert g.gemm.label == "bias+relu"


# ---- the kernel itself, run on the CPU --------------------------------------------------
def _kernel(m: int, n: int, k: int, trans_a: bool, dtype, out_dtype=None):
    a_shape = (k, m) if trans_a else (m, k)
    a, b = Var(a_shape, np.dtype(dtype)), Var((k, n), np.dtype(dtype))
    out = Var((m, n), np.dtype(out_dtype or dtype))
    return small_m_matmul(out, a, b, m, n, k, trans_a)


def _emulate(m: int, n: int, k: int, trans_a: bool, dtype=jnp.float32, out_dtype=None):
    kernel = _kernel(m, n, k, trans_a, dtype, out_dtype)
    a = np.asarray(rand(r, *((k, m) if trans_a else (m, k)), dtype=dtype))
    b = np.asarray(rand(r, k, n, dtype=dtype))
    c = np.full((m, n), np.nan, np.dtype(out_dtype or dtype))
    emu.launch(kernel, [c, a, b])
    a64 = a.astype(np.float64)
    want = (a64.T if trans_a else a64) @ b.astype(np.float64)
    return kernel, c.astype(np.float64), want


@needs_cxx
@pytest.mark.parametrize("trans_a", [False, True], ids=["A", "At"])
@pytest.mark.parametrize("m,n,k", [(1, 40, 64), (7, 100, 37), (32, 48, 130), (3, 1000, 6),
                                   (5, 520, 1001), (4, 64, 1536), (2, 40, 2101)])
def test_emulated_kernel_matches_numpy(m, n, k, trans_a):
    """N not a multiple of the block's columns, K not a multiple of the chunk or of 4,
    chunks left empty (K = 6), chunks of several stages of B (K = 1536, 2101), every row
    count up to 32."""
    kernel, got, want = _emulate(m, n, k, trans_a)
    assert kernel.name.startswith(f"nimble_gemm_small_m{m}_f32_")
    assert ("float4" in kernel.source) == (not trans_a and k % 4 == 0)
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5 * np.sqrt(k))


@needs_cxx
@pytest.mark.parametrize("trans_a,k", [(False, 96), (False, 99), (True, 96)], ids=["A", "A-odd", "At"])
@pytest.mark.parametrize("dtype,out_dtype", [(jnp.bfloat16, None), (jnp.float16, None),
                                             (jnp.bfloat16, jnp.float32)])
def test_emulated_half_kernels_round_once_at_the_store(dtype, out_dtype, trans_a, k):
    """Four halves per 8-byte load where A is row-major and K % 4 == 0, else one by one."""
    kernel, got, want = _emulate(6, 72, k, trans_a, dtype, out_dtype)
    assert ("uint2" in kernel.source) == (not trans_a and k % 4 == 0)
    rel = 1e-5 if out_dtype == jnp.float32 else 1e-2  # one rounding of the f32 sum
    np.testing.assert_allclose(got, want, rtol=rel, atol=rel * np.abs(want).max())


@needs_cxx
def test_emulated_plan_with_the_kernel_matches_jax():
    """A plan whose dot takes the rule, its kernel emulated in the arena (bounds checked)."""
    f = lambda h, w, b: jnp.tanh(h @ w + b)  # noqa: E731
    args = (rand(r, 3, 1030), rand(r, 1030, 512, scale=0.05), rand(r, 512))
    plan = plan_of(f, *args)
    assert len(small_tasks(plan)) == 1
    outs, emulated = emu.run(plan, [np.asarray(a) for a in args])
    assert emulated == len(plan.tasks) == 2
    assert_tree_close(np.asarray(outs[0]), jax.jit(f)(*args))


# ---- NVRTC compiles it ------------------------------------------------------------------
@pytest.mark.skipif(available_compiler() is None, reason="no NVRTC or nvcc")
def test_kernels_compile_for_sm90():
    kernels = [_kernel(32, 2048, 512, False, jnp.float32), _kernel(1, 2048, 512, False, jnp.float32),
               _kernel(8, 1024, 1024, True, jnp.float32), _kernel(7, 1000, 1001, False, jnp.float32),
               _kernel(32, 2048, 512, False, jnp.bfloat16),
               _kernel(16, 2048, 512, False, jnp.bfloat16, jnp.float32),
               _kernel(4, 4096, 256, True, jnp.float16)]
    ptx = compile_to_ptx("\n".join(k.source for k in kernels), "small_m.cu", arch="sm_90", fast=True)
    assert all(f".entry {k.name}(" in ptx for k in kernels)


# ---- on the GPU ----------------------------------------------------------------------------
@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16], ids=["f32", "bf16"])
@pytest.mark.parametrize("m,n,k", [(1, 2048, 512), (32, 2048, 512), (8, 1024, 1024), (7, 1000, 1001)])
def test_small_m_kernel_matches_jax_on_the_gpu(m, n, k, dtype):
    a, b = rand(r, m, k, dtype=dtype), rand(r, k, n, dtype=dtype, scale=k ** -0.5)
    f = nimble.jit(matmul, backend="cuda", small_gemm=True)
    assert len(small_tasks(f.plan(a, b))) == (1 if m <= SMALL_M_MAX else 0)
    want = np.asarray(jax.jit(matmul)(a, b)).astype(np.float64)
    scale = np.abs(want).max()
    # jax.jit runs TF32 (float32) or bf16 products with f32 sums; the kernel full f32.
    tol = 2e-2 if dtype == jnp.bfloat16 else 3e-3
    for _ in range(2):  # the captured graph, twice
        got = np.asarray(f(a, b)).astype(np.float64)
        np.testing.assert_allclose(got, want, rtol=tol, atol=tol * scale)
    highest = lambda a, b: jnp.matmul(a, b, precision="highest")  # noqa: E731
    if dtype == jnp.float32:
        np.testing.assert_allclose(np.asarray(nimble.jit(highest, backend="cuda")(a, b)),
                                   np.asarray(jax.jit(highest)(a, b)), rtol=1e-5, atol=1e-5 * scale)


@pytest.mark.gpu
def test_lstm_matches_jax_on_the_gpu():
    cfg = lstm.Config(steps=4, hidden=512, features=64)
    for batch in (1, 8, 32):
        fn, args = MODELS["lstm"].build(batch, jnp.float32, np.random.default_rng(5), config=cfg)
        f = nimble.jit(fn, backend="cuda")
        assert len(small_tasks(f.plan(*args))) == (4 if batch <= 8 else 0)
        assert_tree_close(f(*args), jax.jit(fn)(*args))

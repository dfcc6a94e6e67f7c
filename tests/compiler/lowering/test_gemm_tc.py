"""The TF32 tensor-core GEMM kernel (compiler/lowering/gemm_tc.py): the kernel run on the
CPU (tests/helpers/kernel_emulator.py: a warp-collective mma, TF32 rounding, cp.async as
a copy) against numpy for every layout, epilogue and tile, odd sizes; which GEMMs the
planner gives it; NVRTC compiles it; on the GPU, against jax.jit."""
from __future__ import annotations

import jax
import jax.numpy as jnp
from jax import lax
import numpy as np
import pytest

import nimblejax as nimble
from nimblejax.bench import gemm_tc as bench
from nimblejax.compiler.ir import Var
from nimblejax.compiler.lowering import gemm_tc
from nimblejax.compiler.lowering.task import Epilogue, GemmCall
from nimblejax.testing.nvrtc_check import available_compiler, compile_to_ptx
from tests.helpers import kernel_emulator as emu
from tests.helpers.models import assert_emulated_matches_jax, assert_tree_close, rand

r = np.random.default_rng(0)
TC = "nimble_gemm_tc_"
F32 = np.dtype("float32")
needs_cxx = pytest.mark.skipif(emu.compiler() is None, reason="no host C++ compiler")
TILES = tuple(gemm_tc.Tile(*t) for t in bench.SWEEP_TILES)


def plan_of(fn, *args, **opts):
    return nimble.jit(fn, backend="interpret", **opts).plan(*args)


def tc_tasks(plan) -> list:
    return [t for t in plan.tasks if t.name.startswith(TC)]


def gemm_call(m, n, k, ta=False, tb=False, ep=Epilogue(), alpha=1.0, batch=1,
              lda=None, ldb=None, ldc=None) -> GemmCall:
    """A GemmCall with operands whose shapes hold its layouts (leading dimensions
    padded rows; batch strides those of the padded matrices)."""
    lds = {"lda": lda, "ldb": ldb, "ldc": ldc}
    call = GemmCall(batch, m, n, k, ta, tb, "float32", "tf32", alpha=alpha,
                    beta=1.0 if ep.residual else 0.0, epilogue=ep, **lds)
    shapes = {w: (batch, call.stored(w)[0], call.layout(w)[0]) for w in "abc"}
    strides = {f"stride_{w}": shapes[w][1] * shapes[w][2] for w in "abc"
               if batch > 1 and lds[f"ld{w}"] is not None}
    return GemmCall(batch, m, n, k, ta, tb, "float32", "tf32", alpha=alpha,
                    beta=1.0 if ep.residual else 0.0, epilogue=ep, **lds, **strides,
                    a=Var(shapes["a"], F32), b=Var(shapes["b"], F32), c=Var(shapes["c"], F32),
                    bias=Var((n,), F32) if ep.bias else None,
                    residual=Var((batch, m, n), F32) if ep.residual else None)


def reference(call: GemmCall, a, b, bias, res) -> np.ndarray:
    """What cuBLASLt computes, in float64 from TF32-rounded operands."""
    m, n, k = call.m, call.n, call.k
    a = bench.tf32(a).astype(np.float64)[:, :, : (m if call.trans_a else k)]
    b = bench.tf32(b).astype(np.float64)[:, :, : (k if call.trans_b else n)]
    a = a.transpose(0, 2, 1) if call.trans_a else a
    b = b.transpose(0, 2, 1) if call.trans_b else b
    out = call.alpha * (a @ b)
    if res is not None:
        out = out + res
    if bias is not None:
        out = out + bias
    if call.epilogue.activation == "relu":
        out = np.maximum(out, 0.0)
    elif call.epilogue.activation == "gelu_tanh":
        out = 0.5 * out * (1 + np.tanh(np.sqrt(2 / np.pi) * (out + 0.044715 * out ** 3)))
    return out


def emulate(call: GemmCall, tile=None):
    """The kernel run on the CPU over random operands (a few exact TF32 ties among A's
    values): (kernel, C as written, the reference, C's padding columns as written)."""
    kernel = gemm_tc.tc_matmul(call, tile)
    a = r.standard_normal(call.a.shape).astype(np.float32)
    a.flat[::7] = (np.float32(1.0) + np.float32(2.0 ** -11)) * np.sign(a.flat[::7])  # ties: away
    b = (r.standard_normal(call.b.shape) / np.sqrt(call.k)).astype(np.float32)
    c = np.full(call.c.shape, np.nan, np.float32)
    bias = r.standard_normal(call.n).astype(np.float32) if call.epilogue.bias else None
    res = r.standard_normal((call.batch, call.m, call.n)).astype(np.float32) \
        if call.epilogue.residual else None
    emu.launch(kernel, [c, a, b] + [x for x in (bias, res) if x is not None])
    return kernel, c[:, :, : call.n].astype(np.float64), reference(call, a, b, bias, res), c[:, :, call.n:]


def assert_kernel_matches(call: GemmCall, tile=None) -> None:
    kernel, got, want, padding = emulate(call, tile)
    assert kernel.name.startswith(TC)
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5 * np.sqrt(call.k) * np.abs(want).max())
    assert np.isnan(padding).all(), "wrote past N into the leading dimension's padding"


# ---- the kernel on the CPU ------------------------------------------------------------------
@needs_cxx
@pytest.mark.parametrize("ta,tb", [(False, False), (False, True), (True, False), (True, True)],
                         ids=["NN", "NT", "TN", "TT"])
@pytest.mark.parametrize("m,n,k", [(32, 64, 64), (37, 50, 45), (20, 130, 10), (70, 24, 33)])
def test_every_layout_at_odd_sizes(m, n, k, ta, tb):
    """M, N, K not multiples of the tiles; K = 10 and M = 37 copy 4 bytes at a time."""
    assert_kernel_matches(gemm_call(m, n, k, ta, tb))


@needs_cxx
@pytest.mark.parametrize("ep,alpha", [(Epilogue(bias=True), 1.0),
                                      (Epilogue(bias=True, activation="relu"), 1.0),
                                      (Epilogue(bias=True, activation="gelu_tanh"), 1.0),
                                      (Epilogue(activation="gelu_tanh"), 0.5),
                                      (Epilogue(residual=True), 1.0),
                                      (Epilogue(residual=True), -0.01),
                                      (Epilogue(residual=True, bias=True, activation="relu"), 2.0)],
                         ids=["bias", "bias+relu", "bias+gelu", "scale+gelu", "residual",
                              "sgd", "all"])
@pytest.mark.parametrize("n", [48, 45], ids=["pairs", "odd-n"])
def test_every_epilogue(ep, alpha, n):
    """In cuBLASLt's order: alpha, residual, bias, activation; odd N writes one column
    at a time."""
    call = gemm_call(40, n, 24, tb=True, ep=ep, alpha=alpha)
    assert_kernel_matches(call)
    assert ("float2" in gemm_tc.tc_matmul(call).source) == (n % 2 == 0)


@needs_cxx
@pytest.mark.parametrize("tile", TILES, ids=[t.label.replace(" ", "_") for t in TILES])
def test_every_tile(tile):
    """Every tile the benchmark sweeps (split K in the block, stage counts, warps)."""
    m, n = min(tile.bm + 3, 70), tile.bn + 5
    assert_kernel_matches(gemm_call(m, n, 3 * tile.bk + 8, ta=True, ep=Epilogue(bias=True)), tile)


@needs_cxx
def test_batches_and_leading_dimensions():
    """Batch strides and leading dimensions (operands and C read and written in place)."""
    assert_kernel_matches(gemm_call(20, 24, 36, tb=True, batch=3, ep=Epilogue(bias=True)))
    call = gemm_call(33, 40, 20, lda=28, ldb=44, ldc=52, batch=2)
    assert_kernel_matches(call)
    assert call.strided and "nimble_cp_async16" in gemm_tc.tc_matmul(call).source
    odd = gemm_call(18, 40, 20, ta=True, lda=21)  # an odd leading dimension: 4-byte copies
    source = gemm_tc.tc_matmul(odd).source
    assert "nimble_cp_async4(&As" in source and "nimble_cp_async16(&Bs" in source
    assert_kernel_matches(odd)


def test_tiles_fit_static_shared_memory_and_are_named():
    for tile in TILES:
        for ta, tb in ((False, False), (True, True)):
            call = gemm_call(128, 768, 768, ta, tb)
            assert gemm_tc.smem_floats(call, tile) * 4 <= gemm_tc.SMEM_BYTES, tile
    kernel = gemm_tc.tc_matmul(gemm_call(128, 768, 768, ep=Epilogue(bias=True, activation="gelu_tanh")))
    assert kernel.name.startswith("nimble_gemm_tc_128x768x768_nn_bias_gelu_tanh_")


def test_what_qualifies():
    assert gemm_tc.qualifies(gemm_call(32, 64, 64))
    call = gemm_call(32, 64, 64)
    from dataclasses import replace

    assert not gemm_tc.qualifies(replace(call, compute="f32"))  # precision HIGHEST
    assert not gemm_tc.qualifies(replace(call, dtype="bfloat16", compute="f32_from_half"))
    assert not gemm_tc.qualifies(replace(call, beta=1.0))  # C read back without a residual


# ---- which GEMMs take it ---------------------------------------------------------------------
def relu_dense(x, w, b):
    return jax.nn.relu(x @ w + b)


@needs_cxx
@pytest.mark.parametrize("m,k,n", [(32, 64, 128), (37, 45, 50)])
def test_a_dense_layer_is_one_kernel_and_matches_jax(m, k, n):
    args = (rand(r, m, k), rand(r, k, n, scale=k ** -0.5), rand(r, n))
    with bench.kernel_forced():
        plan = plan_of(relu_dense, *args)
        (task,) = plan.tasks
        assert task.name.startswith(TC) and task.kind == "kernel"
        assert task.gemm.label == "bias+relu"  # the GemmCall it computes
        assert set(task.inputs) == {v for v in task.kernel.params if v not in task.outputs}
        assert_emulated_matches_jax(relu_dense, args)


@needs_cxx
def test_sgd_update_and_transposed_operands_match_jax():
    f = lambda x, dy, w: w - 0.01 * (x.T @ dy)  # noqa: E731
    args = (rand(r, 24, 40), rand(r, 24, 36), rand(r, 40, 36))
    with bench.kernel_forced():
        (task,) = plan_of(f, *args).tasks
        assert task.name.startswith(TC) and task.gemm.trans_a and task.gemm.alpha == np.float32(-0.01)
        assert_emulated_matches_jax(f, args)


def test_the_option_turns_it_off_and_highest_precision_keeps_cublaslt():
    args = (rand(r, 32, 64), rand(r, 64, 128), rand(r, 128))
    with bench.kernel_forced():
        assert tc_tasks(plan_of(relu_dense, *args))
        (g,) = plan_of(relu_dense, *args, tc_gemm=False).tasks
        assert g.kind == "gemm" and g.gemm.label == "bias+relu"
        highest = lambda x, w: jnp.matmul(x, w, precision="highest")  # noqa: E731
        (g,) = plan_of(highest, *args[:2]).tasks
        assert g.kind == "gemm" and g.gemm.compute == "f32"
    # The variable and its validation: tests/api/test_options.py.


def test_attention_still_fuses_its_gemms():
    """attention.py looks for the GemmCall a task computes, library or kernel."""
    q = k = v = rand(r, 1, 16, 2, 8)
    f = lambda q, k, v: jax.nn.dot_product_attention(q, k, v, is_causal=True)  # noqa: E731
    with bench.kernel_forced():
        plan = plan_of(f, q, k, v)
    assert not tc_tasks(plan) and any("attention" in t.name for t in plan.tasks)


TAKEN = {(32, 128, 64): "half", (32, 64, 128): "half", (32, 128, 10): "half", (64, 128, 64): "half",
         (32, 1024, 256): "half", (32, 1024, 512): "half", (32, 2048, 512): "half",
         (16, 1024, 512): "half", (128, 768, 32): 32, (64, 2048, 256): 32, (32, 4096, 512): 32}
LEFT = ((128, 768, 768), (128, 2304, 768), (128, 3072, 768), (128, 768, 3072), (8, 256, 256))


@pytest.mark.parametrize("shape", list(TAKEN) + list(LEFT), ids=str)
def test_the_rule_takes_the_measured_wins_and_its_tiles(shape):
    """The SGD step's and the LSTM's GEMMs (16 x 32 tiles where they make one wave, else
    32 x 32); not BERT's at batch 1, nor fewer than 16 rows (module docstring's
    measurements)."""
    call = gemm_call(*shape)
    assert gemm_tc.takes_tc(call) == (shape in TAKEN)
    if shape in TAKEN:
        want = gemm_tc.HALF if TAKEN[shape] == "half" else gemm_tc.TILES[TAKEN[shape]]
        assert gemm_tc.choose_tile(call) == want
        assert not gemm_tc.takes_tc(gemm_call(*shape, batch=2))  # batched: not measured
    x, w = rand(r, shape[0], shape[2]), rand(r, shape[2], shape[1])
    (task,) = plan_of(lambda x, w: x @ w, x, w).tasks
    assert task.name.startswith(TC) == (shape in TAKEN) and task.gemm.m == shape[0]


@pytest.mark.parametrize("shape,kind", bench.CASES, ids=[f"{s[0]}x{s[1]}x{s[2]}-{k}" for s, k in bench.CASES])
def test_bench_cases_are_one_task_either_way(shape, kind):
    """nimblejax/bench/gemm_tc.py times each case's one task, kernel forced on and off
    (split-K summed by a reader off: canonicalize/split_k.py would make two tasks)."""
    m, n, k = shape
    args = jax.tree_util.tree_map(lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype),
                                  bench.case_args(m, n, k, kind))
    fn = bench.case_fn(kind)
    with bench.kernel_forced():
        (on,) = plan_of(fn, *args, split_k=False).tasks
    (off,) = plan_of(fn, *args, tc_gemm=False, split_k=False).tasks
    assert on.name.startswith(TC) and off.kind == "gemm" and on.gemm == off.gemm


# ---- NVRTC compiles it ------------------------------------------------------------------
@pytest.mark.skipif(available_compiler() is None, reason="no NVRTC or nvcc")
def test_kernels_compile_for_sm90():
    """Several kernels in one source, as runtime/compile.py builds modules: the PTX
    helpers are defined once."""
    calls = [gemm_call(128, 768, 768, ep=Epilogue(bias=True, activation="gelu_tanh")),
             gemm_call(32, 128, 10, ta=True, tb=True, ep=Epilogue(residual=True), alpha=-0.1),
             gemm_call(20, 24, 36, tb=True, batch=3, lda=40)]
    kernels = [gemm_tc.tc_matmul(c) for c in calls] + \
        [gemm_tc.tc_matmul(gemm_call(128, 768, 768, ta=True), t) for t in TILES]
    ptx = compile_to_ptx("\n".join(k.source for k in kernels), "gemm_tc.cu", arch="sm_90")
    assert all(f".entry {k.name}(" in ptx for k in kernels)
    assert "mma.sync.aligned.m16n8k8.row.col.f32.tf32.tf32.f32" in ptx and "cvt.rna.tf32.f32" in ptx


# ---- on the GPU ----------------------------------------------------------------------------
GPU_FUNCTIONS = {
    "relu_dense": (relu_dense, lambda: (rand(r, 37, 45), rand(r, 45, 50, scale=0.15), rand(r, 50))),
    "gelu": (lambda x, w, b: jax.nn.gelu(x @ w + b, approximate=True),
             lambda: (rand(r, 128, 768), rand(r, 768, 768, scale=0.036), rand(r, 768))),
    "residual": (lambda x, w, h: x @ w + h,
                 lambda: (rand(r, 32, 512), rand(r, 512, 1024, scale=0.044), rand(r, 32, 1024))),
    "sgd": (lambda x, dy, w: w - 0.01 * (x.T @ dy),
            lambda: (rand(r, 32, 64), rand(r, 32, 128), rand(r, 64, 128))),
    "wt": (lambda x, w: lax.dot_general(x, w, (((1,), (1,)), ((), ()))),
           lambda: (rand(r, 64, 100), rand(r, 130, 100, scale=0.1))),
    "batched": (lambda a, b: jnp.einsum("bij,bjk->bik", a, b),
                lambda: (rand(r, 3, 40, 24), rand(r, 3, 24, 36))),
}


@pytest.mark.gpu
@pytest.mark.parametrize("name", list(GPU_FUNCTIONS))
def test_kernel_matches_jax_on_the_gpu(name):
    fn, make = GPU_FUNCTIONS[name]
    args = make()
    f = nimble.jit(fn, backend="cuda")
    with bench.kernel_forced():
        assert len(tc_tasks(f.plan(*args))) == 1
        for _ in range(2):  # the captured graph, twice
            assert_tree_close(f(*args), jax.jit(fn)(*args))


@pytest.mark.gpu
@pytest.mark.parametrize("tile", TILES, ids=[t.label.replace(" ", "_") for t in TILES])
def test_every_tile_on_the_gpu(tile):
    import cupy

    from nimblejax.runtime.compile import compile_kernels

    for call in (gemm_call(tile.bm + 3, tile.bn + 5, 5 * tile.bk + 8, ta=True, ep=Epilogue(bias=True)),
                 gemm_call(2 * tile.bm + 1, 2 * tile.bn + 2, 100, tb=True, ep=Epilogue(residual=True),
                           alpha=-0.5)):
        kernel = gemm_tc.tc_matmul(call, tile)
        fn = compile_kernels([kernel])[kernel.name]
        a = r.standard_normal(call.a.shape).astype(np.float32)
        b = r.standard_normal(call.b.shape).astype(np.float32)
        extra = [r.standard_normal(v.shape).astype(np.float32) for v in (call.bias, call.residual)
                 if v is not None]
        c = cupy.full(call.c.shape, np.nan, np.float32)
        fn(kernel.grid, kernel.block, tuple([c] + [cupy.asarray(x) for x in [a, b] + extra]))
        bias, res = (extra[0], None) if call.epilogue.bias else (None, extra[0])
        want = reference(call, a, b, bias, res)
        np.testing.assert_allclose(cupy.asnumpy(c).astype(np.float64), want, rtol=1e-4,
                                   atol=1e-5 * np.sqrt(call.k) * np.abs(want).max())

"""GEMM epilogues (compiler/epilogue.py): which bias adds, residual adds, scales and
activations a GEMM task computes, asserted on the plan; numbers against jax.jit under the
CPU interpreter; and, marked `gpu`, each epilogue on cuBLASLt against jax.jit."""
from __future__ import annotations

from collections import Counter

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import nimblejax as nimble
from tests.helpers.models import assert_tree_close, rand
from nimblejax.compiler.ir import Var
from nimblejax.compiler.lowering.task import Epilogue
from tests.helpers import jit_init

r = np.random.default_rng(0)
DTYPES = [jnp.float32, jnp.bfloat16]


def plan_of(fn, *args, **options):
    return nimble.jit(fn, backend="interpret", **options).plan(*args)


def gemms_and_kernels(fn, *args, **options):
    """The GEMM tasks (library calls, or gemm_tc.py's kernels computing them) and the
    other kernels."""
    plan = plan_of(fn, *args, **options)
    return ([t for t in plan.tasks if t.gemm is not None],
            [t for t in plan.tasks if t.kind == "kernel" and t.gemm is None])


def assert_matches_jax(fn, *args, **options):
    assert_tree_close(nimble.jit(fn, backend="interpret", **options)(*args), jax.jit(fn)(*args))


def dense_args(dtype=jnp.float32, m=8, k=16, n=24):
    return rand(r, m, k, dtype=dtype), rand(r, k, n, dtype=dtype, scale=0.3), rand(r, n, dtype=dtype)


def relu_dense(x, w, b):
    return jax.nn.relu(x @ w + b)


def gelu_tanh_dense(x, w, b):
    return jax.nn.gelu(x @ w + b, approximate=True)


def gelu_erf_dense(x, w, b):
    return jax.nn.gelu(x @ w + b, approximate=False)


# ---- structure ----------------------------------------------------------------------------
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("fn,label", [(relu_dense, "bias+relu"), (gelu_tanh_dense, "bias+gelu_tanh"),
                                      (lambda x, w, b: x @ w + b, "bias")])
def test_dense_layer_is_one_gemm_and_no_kernel(fn, label, dtype):
    args = dense_args(dtype)
    plan = plan_of(fn, *args)
    (g,) = plan.tasks
    assert g.kind == "gemm" and g.gemm.label == label and g.name.endswith(f"[{label}]")
    assert g.gemm.bias is plan.graph.inputs[2]
    assert_matches_jax(fn, *args)


@pytest.mark.parametrize("dtype", DTYPES)
def test_erf_gelu_is_not_cublaslts_gelu_only_the_bias_is_fused(dtype):
    args = dense_args(dtype)
    (g,), (k,) = gemms_and_kernels(gelu_erf_dense, *args)
    assert g.gemm.label == "bias" and "erf" in k.name and k.inputs == g.outputs
    assert_matches_jax(gelu_erf_dense, *args)


def test_the_task_reads_the_bias_vector_and_keeps_the_fused_equations():
    x, w, b = dense_args()
    plan = plan_of(relu_dense, x, w, b)
    (g,) = plan.tasks
    bias = plan.graph.inputs[2]
    assert g.gemm.bias is bias and bias in plan.reads[g]
    assert [e.name for e in g.eqns] == ["dot_general", "broadcast_in_dim", "add", "max"]
    assert g.gemm.c is g.outputs[0] is plan.graph.outputs[0]


def test_pre_activation_that_is_an_output_or_read_elsewhere_is_written():
    x, w, b = dense_args()
    for fn in (lambda x, w, b: (x @ w + b, jax.nn.relu(x @ w + b)),
               lambda x, w, b: jax.nn.relu(x @ w + b) * (x @ w + b),
               lambda x, w, b: (jax.nn.gelu(x @ w + b), x @ w + b)):
        (g,), ks = gemms_and_kernels(fn, x, w, b)
        assert g.gemm.label == "bias" and len(ks) == 1
        assert_matches_jax(fn, x, w, b)


def test_product_that_is_an_output_gets_no_epilogue():
    x, w, b = dense_args()
    fn = lambda x, w, b: (x @ w, jax.nn.relu(x @ w + b))  # noqa: E731
    (g,), (k,) = gemms_and_kernels(fn, x, w, b)
    assert g.gemm.epilogue == Epilogue() and g.gemm.alpha == 1.0 and g.name == "gemm_float32_1x8x24x16"
    assert_matches_jax(fn, x, w, b)


def test_plain_cublas_plans_have_no_epilogues():
    args = dense_args()
    (g,), (k,) = gemms_and_kernels(relu_dense, *args, gemm="cublas")
    assert not g.gemm.epilogue and g.gemm.bias is None and k.inputs[0] is g.outputs[0]
    assert_matches_jax(relu_dense, *args, gemm="cublas")


def test_cublas_launcher_refuses_a_plan_with_epilogues():
    from nimblejax.runtime.launch import _no_epilogues

    plan = plan_of(relu_dense, *dense_args())
    with pytest.raises(ValueError, match="only cuBLASLt"):
        _no_epilogues([t for t in plan.tasks if t.kind == "gemm"])
    _no_epilogues([t for t in plan_of(relu_dense, *dense_args(), gemm="cublas").tasks
                   if t.kind == "gemm"])


@pytest.mark.parametrize("dtype", DTYPES)
def test_flax_dense(dtype):
    x = rand(r, 2, 3, 16)
    for act, label in ((nn.relu, "bias+relu"), (nn.gelu, "bias+gelu_tanh")):
        m = nn.Dense(24, dtype=dtype)
        p = jit_init(m, jax.random.PRNGKey(0), x)
        fn = lambda p, x: act(m.apply(p, x))  # noqa: E731
        (g,), ks = gemms_and_kernels(fn, p, x)
        assert g.gemm.label == label and g.gemm.m == 6
        # bf16: only the converts of x, w and b to bf16 (one launch: they read only
        # inputs, so horizontal fusion packs them); nothing reads the GEMM's output.
        assert sum(len(k.outputs) for k in ks) == (0 if dtype == jnp.float32 else 3)
        assert all(g.outputs[0] not in k.inputs for k in ks)
        assert_matches_jax(fn, p, x)


def test_scale_is_alpha_before_the_bias():
    x, w, b = dense_args()
    cases = [(lambda x, w, b: (x @ w) * 0.125 + b, "scale+bias", 0.125),
             (lambda x, w, b: jax.nn.relu(0.5 * (x @ w) + b), "scale+bias+relu", 0.5),
             (lambda x, w, b: (x @ w) / 4.0, "scale", 0.25)]
    for fn, label, alpha in cases:
        (g,), ks = gemms_and_kernels(fn, x, w, b)
        assert (g.gemm.label, g.gemm.alpha, len(ks)) == (label, alpha, 0)
        assert_matches_jax(fn, x, w, b)
    fn = lambda x, w, b: (x @ w + b) * 2.0  # noqa: E731  (would scale the bias too)
    (g,), (k,) = gemms_and_kernels(fn, x, w, b)
    assert g.gemm.label == "bias"
    assert_matches_jax(fn, x, w, b)


def test_residual_that_is_written_anyway_is_read_as_c():
    x, w, b = dense_args()
    res = rand(r, 8, 24)
    fn = lambda x, w, b, res: jax.nn.relu(x @ w + b + res)  # noqa: E731
    (g,), ks = gemms_and_kernels(fn, x, w, b, res)
    assert (g.gemm.label, g.gemm.beta, len(ks)) == ("residual+bias+relu", 1.0, 0)
    assert_matches_jax(fn, x, w, b, res)
    # Computed only for the add, the residual would cost a write: it stays in the kernel.
    fn = lambda x, w, b, y: x @ w + b + jnp.tanh(y)  # noqa: E731
    (g,), (k,) = gemms_and_kernels(fn, x, w, b, res)
    assert g.gemm.label == "bias" and not g.gemm.epilogue.residual
    assert_matches_jax(fn, x, w, b, res)


def test_sgd_update_of_a_weight_is_its_gradient_gemms_residual():
    w, x, d, b = rand(r, 16, 24), rand(r, 8, 16), rand(r, 8, 24), rand(r, 24)
    fn = lambda w, x, d: w - 0.01 * (x.T @ d)  # noqa: E731
    (g,), ks = gemms_and_kernels(fn, w, x, d)
    assert (g.gemm.label, g.gemm.alpha, g.gemm.beta, len(ks)) == ("scale+residual", -np.float32(0.01), 1.0, 0)
    assert g.gemm.residual is not None
    assert_matches_jax(fn, w, x, d)
    fn = lambda w, x, d: jax.nn.relu(w - x.T @ d)  # noqa: E731
    (g,), ks = gemms_and_kernels(fn, w, x, d)
    assert (g.gemm.label, g.gemm.alpha, len(ks)) == ("scale+residual+relu", -1.0, 0)
    assert_matches_jax(fn, w, x, d)
    # Not the same form: a bias before the subtraction (cuBLASLt would not negate it),
    # and the product as the minuend (that would need beta = -1). (With the tensor-core
    # kernel the subtraction is its post group instead: fusion_gemm_post.py.)
    for fn in (lambda w, x, d: w - (x.T @ d + b), lambda w, x, d: (x.T @ d) - w):
        (g,), (k,) = gemms_and_kernels(fn, w, x, d, tc_gemm=False)
        assert not g.gemm.epilogue.residual and g.gemm.alpha == 1.0
        assert_matches_jax(fn, w, x, d)


def test_fed_back_sgd_steps_update_each_weight_in_its_gemm():
    def step(p, x, y):
        def loss(p):
            return jnp.mean((jnp.tanh(x @ p[0]) @ p[1] - y) ** 2)
        g = jax.grad(loss)(p)
        return jax.tree_util.tree_map(lambda a, b: a - 0.05 * b, p, g)

    p = (rand(r, 16, 32, scale=0.2), rand(r, 32, 4, scale=0.2))
    x, y = rand(r, 8, 16), rand(r, 8, 4)
    gemms, _ = gemms_and_kernels(step, p, x, y)
    updates = [g for g in gemms if g.gemm.epilogue.residual]
    assert len(updates) == 2 and all(g.gemm.alpha == -np.float32(0.05) for g in updates)
    assert_matches_jax(step, p, x, y)


def test_sum_of_two_products_is_one_gemm_reading_the_other_and_never_in_place():
    a, b2, c, d = rand(r, 8, 5), rand(r, 5, 24), rand(r, 8, 16), rand(r, 16, 24)
    fn = lambda a, b2, c, d: a @ b2 + c @ d  # noqa: E731
    plan = plan_of(fn, a, b2, c, d)
    first, second = plan.tasks
    assert (first.gemm.label, second.gemm.label) == ("", "residual")
    res, out = second.gemm.residual, second.gemm.c
    assert res is first.outputs[0] and res in plan.reads[second]
    # The residual's last reader is the GEMM that writes out: their bytes must not overlap.
    lo, hi = sorted([(plan.offset(res), res.nbytes), (plan.offset(out), out.nbytes)])
    assert lo[0] + lo[1] <= hi[0]
    assert_matches_jax(fn, a, b2, c, d)


def test_batched_bias_is_one_vector_for_every_batch_entry():
    a, c, b = rand(r, 3, 4, 5), rand(r, 3, 5, 6), rand(r, 6)
    fn = lambda a, c, b: jax.nn.relu(jnp.einsum("bij,bjk->bik", a, c) + b)  # noqa: E731
    (g,), ks = gemms_and_kernels(fn, a, c, b)
    assert (g.gemm.batch, g.gemm.label, len(ks)) == (3, "bias+relu", 0)
    assert_matches_jax(fn, a, c, b)


def test_values_that_are_not_a_row_vector_are_not_a_bias():
    x, w, _ = dense_args()
    for fn, other in ((lambda x, w, v: x @ w + v[:, None], rand(r, 8)),  # one value per row
                      (lambda x, w, v: jnp.einsum("bij,bjk->bik", x.reshape(2, 4, 16), w[None].repeat(2, 0))
                       + v[:, None, None], rand(r, 2))):  # one value per batch entry
        (g,), ks = gemms_and_kernels(fn, x, w, other)
        assert not g.gemm.epilogue and g.outputs[0] in ks[-1].inputs
        assert_matches_jax(fn, x, w, other)


def test_bias_forms_jax_numpy_emits():
    x, w, b = dense_args()
    forms = [lambda x, w, b: b + x @ w,
             lambda x, w, b: x @ w + jnp.broadcast_to(b, (8, 24)),
             lambda x, w, b: x @ w + b.reshape(1, 24),
             lambda x, w, b: jax.nn.relu((x @ w).reshape(2, 4, 24) + b)]  # a view in between
    for fn in forms:
        plan = plan_of(fn, x, w, b)
        (g,) = plan.tasks
        assert g.gemm.epilogue.bias and g.gemm.bias is plan.graph.inputs[2]
        assert_matches_jax(fn, x, w, b)


def test_one_broadcast_bias_serves_several_gemms():
    """An RNN adds one broadcast bias at every step: each step's GEMM reads the vector,
    and the broadcast needs no kernel. (The steps depend on each other, so merge_dots
    does not make one GEMM of them.)"""
    xs, w, b = rand(r, 3, 4, 16), rand(r, 16, 16), rand(r, 16)

    def steps(xs, w, b):
        bb = jnp.broadcast_to(b, (4, 16))
        h, hs = xs[0], []
        for x in xs:
            h = jnp.tanh((h + x) @ w + bb)
            hs.append(h)
        return hs

    plan = plan_of(steps, xs, w, b)
    gemms = [t for t in plan.tasks if t.kind == "gemm"]
    bias = plan.graph.inputs[2]
    assert len(gemms) == 3 and all(t.gemm.bias is bias for t in gemms)
    assert all(bias not in t.inputs for t in plan.tasks if t.kind == "kernel")
    assert_matches_jax(steps, xs, w, b)


def test_bias_vector_is_written_when_its_layout_is_also_inlined_elsewhere():
    """The reshape of tanh(b) feeds the GEMM's bias add and a kernel: the kernel
    recomputes it, and tanh(b), which the GEMM reads, is still written."""
    x, w, b = dense_args()

    def fn(x, w, b):
        cb = jnp.tanh(b).reshape(1, 24)
        return x @ w + cb, cb * 2.0

    plan = plan_of(fn, x, w, b)
    (g,) = [t for t in plan.tasks if t.kind == "gemm"]
    assert g.gemm.label == "bias" and any(g.gemm.bias in t.outputs for t in plan.tasks)
    assert_matches_jax(fn, x, w, b)


def test_equality_includes_the_epilogue_so_algorithm_caches_differ():
    x, w, b = dense_args()
    (plain,), _ = gemms_and_kernels(lambda x, w: x @ w, x, w)
    (biased,), _ = gemms_and_kernels(lambda x, w, b: x @ w + b, x, w, b)
    assert plain.gemm != biased.gemm and plain.gemm.m == biased.gemm.m
    (again,), _ = gemms_and_kernels(lambda x, w, b: x @ w + b, x, w, b)
    assert again.gemm == biased.gemm and hash(again.gemm) == hash(biased.gemm)


def _programs():
    from tests.helpers.models import MODELS as TEST_MODELS, model_args
    from nimblejax.bench.models import MODELS

    for name in ("bert", "lstm", "mlp"):
        fn, args = MODELS[name].build(2, jnp.float32, np.random.default_rng(1), tiny=True)
        yield name, fn, args, {}
    for name, (fn, _, opts) in TEST_MODELS.items():
        yield name, fn, model_args(name), opts


def test_every_task_reads_values_written_before_it():
    """Each task's equations read only its inputs or earlier equations, and each input
    is an argument, a constant, or written by a task (or view) before it."""
    for name, fn, args, opts in _programs():
        plan = plan_of(fn, *args, **opts)
        written = set(plan.graph.inputs) | set(plan.graph.consts) | {v for t in plan.views for v in t.outputs}
        for t in plan.tasks:  # launch order is a topological order
            assert set(t.inputs) <= written | {v for u in plan.views for v in u.outputs}, (name, t.name)
            known = set(t.inputs)
            for e in t.eqns:
                assert all(a in known for a in e.inputs if isinstance(a, Var)), (name, t.name, e)
                known |= set(e.outputs)
            assert set(t.outputs) <= known, (name, t.name)
            written |= set(t.outputs)


def test_bert_gemms_take_bias_scale_and_residual():
    from nimblejax.bench.models import MODELS

    from nimblejax.bench.models.bert import Config

    # 80 keys at "highest" precision: attention stays two GEMMs and a softmax (neither of
    # lowering/attention.py's kernels: rows longer than MAX_ROW, products in float32)
    cfg = Config(layers=2, hidden=64, heads=4, ffn=128, seq=80)
    fn, args = MODELS["bert"].build(2, jnp.float32, np.random.default_rng(1), config=cfg)
    with jax.default_matmul_precision("highest"):
        labels = Counter(t.gemm.label for t in plan_of(fn, *args).tasks if t.kind == "gemm")
    # Per layer (2): q, k, v, ffn_in with their bias; scores scaled; attn_out and ffn_out
    # add the bias and the residual stream; the probabilities times v plain.
    assert labels == {"bias": 8, "scale": 2, "": 2, "residual+bias": 4}
    assert_tree_close(nimble.jit(fn, backend="interpret")(*args), jax.jit(fn)(*args))


# ---- reports ------------------------------------------------------------------------------
def test_explain_and_the_pass_printing_show_the_epilogue(capsys):
    args = dense_args()
    text = str(nimble.explain(gelu_tanh_dense, *args))
    assert "gemm_float32_1x8x24x16[bias+gelu_tanh]" in text
    nimble.jit(gelu_tanh_dense, backend="interpret", debug=2).plan(*args)
    err = capsys.readouterr().err
    fuse = err.split("=== nimblejax after fuse ===")[1].split("===")[0]
    assert "epilogue bias+gelu_tanh" in fuse
    lower = err.split("=== nimblejax after lower ===")[1].split("===")[0]
    assert "[bias+gelu_tanh]" in lower and "activation='gelu_tanh'" in lower


# ---- generated code ---------------------------------------------------------------------------
def test_kernels_next_to_epilogue_gemms_compile():
    """Code generation is unchanged around epilogues: the kernels left after them (the erf
    GELU reading the GEMM's output, bf16 converts) compile with NVRTC."""
    from nimblejax.testing.nvrtc_check import available_compiler, compile_to_ptx

    if available_compiler() is None:
        pytest.skip("no NVRTC or nvcc")
    kernels = {}
    for dtype in DTYPES:
        for fn in (gelu_erf_dense, lambda x, w, b: (x @ w + b, jax.nn.relu(x @ w + b))):
            plan = plan_of(fn, *dense_args(dtype))
            kernels.update((k.name, k.source) for t in plan.tasks if t.kernel for k in t.kernel.launches)
    assert len(kernels) >= 3
    ptx = compile_to_ptx("\n".join(kernels.values()), "nimble_epilogue.cu", arch="sm_90", fast=True)
    assert all(f".entry {name}(" in ptx for name in kernels)


# ---- GPU: each epilogue on cuBLASLt against jax.jit ---------------------------------------
# (jax.jit precision, dtype) → tolerance; f32 HIGHEST is checked tightly, except cuBLASLt's
# GELU, whose tanh may be a fast approximation (1e-3 of the output's scale, see
# tests/runtime/libs/test_cublaslt_numerics.py::test_epilogues).
GPU_CASES = [("default", jnp.float32), ("highest", jnp.float32), ("default", jnp.bfloat16)]
GPU_EPILOGUES = {  # x @ w is batched where x and w have a batch axis
    "bias": lambda p, x, w, b, res: jnp.matmul(x, w, precision=p) + b,
    "bias+relu": lambda p, x, w, b, res: jax.nn.relu(jnp.matmul(x, w, precision=p) + b),
    "bias+gelu_tanh": lambda p, x, w, b, res: jax.nn.gelu(jnp.matmul(x, w, precision=p) + b),
    "scale+bias": lambda p, x, w, b, res: jnp.matmul(x, w, precision=p) * 0.125 + b,
    "scale": lambda p, x, w, b, res: jnp.matmul(x, w, precision=p) / 8.0,
    "residual": lambda p, x, w, b, res: jnp.matmul(x, w, precision=p) + res,
    "scale+residual": lambda p, x, w, b, res: res - 0.5 * jnp.matmul(x, w, precision=p),
    "residual+bias+relu": lambda p, x, w, b, res: jax.nn.relu(jnp.matmul(x, w, precision=p) + b + res),
    "residual+bias+gelu_tanh": lambda p, x, w, b, res: jax.nn.gelu(res + jnp.matmul(x, w, precision=p) + b),
}


def _gpu_tolerance(precision: str, dtype, label: str, want: np.ndarray) -> dict:
    scale = float(np.max(np.abs(want)))
    if dtype == jnp.bfloat16:
        return dict(rtol=2e-2, atol=2e-2 * scale)
    if precision == "default":  # TF32 on both sides
        return dict(rtol=2e-3, atol=2e-3 * scale)
    return dict(rtol=1e-5, atol=(1e-3 if "gelu" in label else 1e-5) * scale)


def _gpu_case(label: str, precision: str, dtype, batch: int):
    rng = np.random.default_rng(7)
    lead = (batch,) if batch > 1 else ()
    x = rand(rng, *lead, 96, 64, dtype=dtype)
    w = rand(rng, *lead, 64, 40, dtype=dtype, scale=0.2)
    b, res = rand(rng, 40, dtype=dtype), rand(rng, *lead, 96, 40, dtype=dtype)
    fn = lambda x, w, b, res: GPU_EPILOGUES[label](precision, x, w, b, res)  # noqa: E731
    return fn, (x, w, b, res)


@pytest.mark.parametrize("batch", [1, 3])
@pytest.mark.parametrize("precision,dtype", GPU_CASES, ids=lambda c: str(c))
@pytest.mark.parametrize("label", sorted(GPU_EPILOGUES))
def test_gpu_cases_plan_one_gemm_with_their_epilogue(label, precision, dtype, batch):
    """The GPU test's premise, on the CPU: each case is one GEMM task with that epilogue."""
    fn, args = _gpu_case(label, precision, dtype, batch)
    plan = plan_of(fn, *args)
    (g,) = plan.tasks
    assert (g.gemm.label, g.gemm.batch) == (label, batch)
    assert g.gemm.compute == ("f32" if precision == "highest" else "tf32") or dtype == jnp.bfloat16
    assert_matches_jax(fn, *args)


@pytest.mark.gpu
@pytest.mark.parametrize("batch", [1, 3])
@pytest.mark.parametrize("precision,dtype", GPU_CASES, ids=lambda c: str(c))
@pytest.mark.parametrize("label", sorted(GPU_EPILOGUES))
def test_epilogue_matches_jax_on_the_gpu(label, precision, dtype, batch):
    fn, (x, w, b, res) = _gpu_case(label, precision, dtype, batch)
    f = nimble.jit(fn, backend="cuda")
    # (a library GEMM, or gemm_tc.py's kernel computing it)
    (g,) = [t for t in f.plan(x, w, b, res).tasks if t.gemm is not None]
    assert (g.gemm.label, g.gemm.batch) == (label, batch)
    want = np.asarray(jax.jit(fn)(x, w, b, res)).astype(np.float64)
    for _ in range(2):  # the captured graph, twice
        got = np.asarray(f(x, w, b, res)).astype(np.float64)
        np.testing.assert_allclose(got, want, **_gpu_tolerance(precision, dtype, label, want))


@pytest.mark.gpu
def test_gemm_option_cublas_runs_the_same_function_without_epilogues():
    args = dense_args()
    want = jax.jit(relu_dense)(*args)
    for gemm in ("lt", "cublas"):
        assert_tree_close(nimble.jit(relu_dense, backend="cuda", gemm=gemm)(*args), want)


@pytest.mark.gpu
def test_bench_models_with_epilogues_match_jax_on_the_gpu():
    from nimblejax.bench.models import MODELS

    for name in ("bert", "lstm", "mlp"):
        fn, args = MODELS[name].build(2, jnp.float32, np.random.default_rng(1), tiny=True)
        assert_tree_close(nimble.jit(fn, backend="cuda")(*args), jax.jit(fn)(*args))

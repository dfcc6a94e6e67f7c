"""Transposes folded into GEMMs (compiler/canonicalize/dot.py, compiler/epilogue.py):
operands read in place and results written through a transpose, with a leading dimension
and one batch stride (GemmCall's lda/stride_a, ...).

The CPU interpreter evaluates a GEMM task's equations with JAX, so it cannot see a wrong
stride. Here a plan runs over the interpreter's arena with every GEMM task computed from
the bytes the way cuBLASLt reads them: the column-major descriptors `lt_layouts` hands
it (leading dimensions, batch strides, the operand swap), then the epilogue. Every
other task runs as in the interpreter. Results are compared with jax.jit on random
inputs; the `gpu` tests run the same programs on cuda.
"""
from __future__ import annotations

import math
import random

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import nimblejax as nimble
from nimblejax.bench.models import MODELS, bert
from nimblejax.compiler.canonicalize.dot import (contiguous_strides, matrix_layout,
                                                 operand_layouts, output_layout)
from nimblejax.runtime import interpret
from nimblejax.runtime.libs.cublaslt import LtLayout, lt_layouts

BACKENDS = ["interpret", pytest.param("cuda", marks=pytest.mark.gpu)]
# cuda: TF32 GEMMs on both sides (jax.jit's default precision on the GPU).
TOL = {"interpret": 1e-4, "cuda": 2e-2}


# ---- a plan run with GEMMs read from the arena as cuBLASLt reads them ----------------
def _flat(arena: interpret.Arena, var, elements: int) -> np.ndarray:
    """`elements` of var's dtype from the start of var's buffer: a view into the arena."""
    off = arena.plan.offset(var)
    assert elements <= var.size, "a GEMM layout reaches past its operand's buffer"
    return arena.bytes[off: off + elements * var.dtype.itemsize].view(var.dtype)


def _index(lay: LtLayout) -> np.ndarray:
    """Element offsets of a batch of column-major (rows x cols) matrices."""
    b, i, j = np.meshgrid(np.arange(lay.batch), np.arange(lay.rows), np.arange(lay.cols),
                          indexing="ij")
    return b * lay.stride + i + j * lay.ld


def _op(x: np.ndarray, trans: int) -> np.ndarray:
    return np.swapaxes(x, -1, -2) if trans else x


def emulate_gemm(task, arena: interpret.Arena) -> None:
    call = task.gemm
    p = lt_layouts(call)
    ext = {w: call.extent(w) for w in "abc"}
    a = _flat(arena, call.a, ext["a"]).astype(np.float64)
    b = _flat(arena, call.b, ext["b"]).astype(np.float64)
    # cuBLASLt's A is our B, its B our A (column_major_gemm's swap).
    d = call.alpha * (_op(b[_index(p.a)], p.trans_a) @ _op(a[_index(p.b)], p.trans_b))
    out = _flat(arena, call.c, ext["c"])
    at = _index(p.c)
    if call.beta:
        src = _flat(arena, call.residual, ext["c"]) if call.residual is not None else out
        d = d + call.beta * src[at].astype(np.float64)
    if call.bias is not None:  # along D's rows: our n
        d = d + _flat(arena, call.bias, call.n).astype(np.float64)[None, :, None]
    if call.epilogue.activation == "relu":
        d = np.maximum(d, 0.0)
    elif call.epilogue.activation == "gelu_tanh":
        d = 0.5 * d * (1.0 + np.tanh(math.sqrt(2.0 / math.pi) * (d + 0.044715 * d**3)))
    assert len(np.unique(at)) == at.size, "two elements of C written to one address"
    out[at] = d.astype(out.dtype)


def run_emulating_gemms(plan, args, seed: int = 0) -> list[np.ndarray]:
    arena = interpret.loaded(plan, args)
    with jax.default_device(interpret.device()):
        for task in interpret.interleaving(plan.schedule, random.Random(seed)):
            # cuBLASLt's, or gemm_tc.py's kernel for it (not one that also computes its
            # reader, fusion_gemm_post.py: the interpreter runs that one's equations).
            if task.gemm is not None and task.outputs == (task.gemm.c,):
                emulate_gemm(task, arena)
            else:
                interpret.execute(task, arena)
    return interpret.outputs(plan, arena, args)


def check(fn, args, backend: str = "interpret") -> object:
    """fn under nimble (GEMMs emulated from their strides on the CPU, or on cuda) against
    jax.jit; returns the plan."""
    jitted = nimble.jit(fn, backend="interpret", small_gemm=False)
    plan = jitted.plan(*args)
    want = [np.asarray(w) for w in jax.tree_util.tree_leaves(jax.jit(fn)(*args))]
    if backend == "interpret":
        got = run_emulating_gemms(plan, [np.asarray(a) for a in jax.tree_util.tree_leaves(args)])
    else:
        got = jax.tree_util.tree_leaves(nimble.jit(fn, backend=backend)(*args))
    assert len(got) == len(want)
    for g, w in zip(got, want):
        np.testing.assert_allclose(np.asarray(g).reshape(w.shape), w, rtol=TOL[backend],
                                   atol=TOL[backend])
    return plan


def rand(rng, *shape) -> np.ndarray:
    return rng.normal(size=shape).astype(np.float32)


def transposes(plan) -> int:
    """Transposes computed by kernels: not a GEMM's, nor a fused attention kernel's (it
    reads its operands through its GEMMs' strides, lowering/attention.py)."""
    return sum(e.name == "transpose" for t in plan.tasks
               if t.gemm is None and not t.name.startswith("nimble_attention") for e in t.eqns)


def gemm_calls(plan) -> list:
    """The GEMMs of a plan: library calls, or gemm_tc.py's kernels computing them."""
    return [t.gemm for t in plan.tasks if t.gemm is not None]


# ---- layouts ----------------------------------------------------------------------------
def test_bert_heads_have_one_batch_stride_at_batch_1_only():
    # q (B, S, H, D) batched over (b, h), rows s, cols d: at B = 1 the batch is the heads
    # alone (stride D), rows step H*D; at B = 2 the batch strides are S*H*D and D.
    shape = (1, 128, 12, 64)
    lay = matrix_layout(shape, contiguous_strides(shape), (0, 2), (1,), (3,))
    assert (lay.trans, lay.ld, lay.stride) == (False, 768, 64)
    shape = (2, 128, 12, 64)
    assert matrix_layout(shape, contiguous_strides(shape), (0, 2), (1,), (3,)) is None


def test_output_through_a_transpose_moving_rows_is_written_swapped():
    # BERT's p·v as jnp.einsum emits it: dot(v, p) -> (b, h, d, q), then (b, q, h, d).
    (node,) = [n for n in _trace_attention_out(1).nodes if n.name == "dot_general"][-1:]
    lay = output_layout(node, (0, 3, 1, 2))
    # d has unit stride there: C^T = (q x d) rows, ld H*D, heads D apart.
    assert (lay.trans, lay.ld, lay.stride) == (True, 4 * 8, 8)
    assert output_layout(_last_dot(_trace_attention_out(2)), (0, 3, 1, 2)) is None


def _trace_attention_out(batch: int):
    from tests.helpers.graphs import trace

    fn = lambda p, v: jnp.einsum("bhqk,bkhd->bqhd", p, v)  # noqa: E731
    return trace(fn, np.zeros((batch, 4, 16, 16), np.float32), np.zeros((batch, 16, 4, 8), np.float32))


def _last_dot(graph):
    return [n for n in graph.nodes if n.name == "dot_general"][-1]


def test_dot_reads_a_transposed_batch_in_place():
    from tests.helpers.graphs import trace

    g = trace(lambda a, b: jnp.einsum("kbm,bnk->bmn", a, b),
              np.zeros((5, 3, 4), np.float32), np.zeros((3, 6, 5), np.float32))
    la, lb = operand_layouts(_last_dot(g))
    assert (la.trans, la.ld, la.stride) == (True, 12, 4)
    assert (lb.trans, lb.ld, lb.stride) == (True, 5, 30)


# ---- programs ----------------------------------------------------------------------------
def bert_tiny(batch: int, seed: int):
    # 72 keys: attention stays two GEMMs and a softmax (longer than lowering/attention.py's
    # MAX_ROW, and no multiple of attention_tc.py's 16 queries a block)
    cfg = bert.Config(layers=2, hidden=32, heads=4, ffn=64, seq=72)
    return MODELS["bert"].build(batch, config=cfg, rng=np.random.default_rng(seed))


@pytest.mark.parametrize("backend", BACKENDS)
def test_bert_batch_1_runs_without_head_transposes(backend):
    fn, (params, x) = bert_tiny(1, 0)
    plan = check(fn, (params, x), backend)
    assert transposes(plan) == 0
    # Per layer: q·kᵀ reads q and k in place, p·v writes (S, H, D) for the next dense.
    assert sum(g.strided for g in gemm_calls(plan)) == 2 * 2


@pytest.mark.parametrize("backend", BACKENDS)
def test_bert_batch_2_keeps_the_head_transposes_it_cannot_fold(backend):
    # A batch over (b, h) of a (B, S, H, D) array has two strides: q, k, v and the
    # attention output are transposed (k and v keeping their innermost axis); p is read
    # as it is (transposed by the GEMM).
    fn, (params, x) = bert_tiny(2, 1)
    plan = check(fn, (params, x), backend)
    assert transposes(plan) == 2 * 4
    assert not any(g.strided for g in gemm_calls(plan))


EINSUMS = [
    # (spec, lhs shape, rhs shape): operands read in place, outputs written through
    # transposes (swapped or not), batch strides of one or more axes.
    ("bqhd,bkhd->bhqk", (1, 16, 4, 8), (1, 12, 4, 8)),
    ("bhqk,bkhd->bqhd", (1, 4, 16, 12), (1, 12, 4, 8)),
    ("kbm,bnk->bmn", (5, 3, 4), (3, 6, 5)),
    ("bmk,bkn->mbn", (3, 5, 4), (3, 4, 6)),
    ("bmk,bnk->bnm", (3, 5, 4), (3, 6, 4)),
    ("mk,kn->nm", (5, 4), (4, 6)),
    ("abmk,abkn->bamn", (2, 3, 5, 4), (2, 3, 4, 6)),
    ("akb,kn->abn", (5, 3, 4), (3, 6)),
]


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("spec,ls,rs", EINSUMS, ids=[e[0] for e in EINSUMS])
def test_einsum_layouts_match_jax(spec, ls, rs, backend):
    rng = np.random.default_rng(abs(hash(spec)) % 2**32)
    fn = lambda a, b: jnp.tanh(jnp.einsum(spec, a, b))  # noqa: E731
    check(fn, (rand(rng, *ls), rand(rng, *rs)), backend)


@pytest.mark.parametrize("backend", BACKENDS)
def test_output_transpose_after_bias_and_relu_is_written_in_place(backend):
    # bias along n, then relu, then a transpose keeping n innermost: (b, m, n) written as
    # (m, b, n), ldc b*n, batch stride n. One GEMM, no kernel.
    rng = np.random.default_rng(3)
    fn = lambda x, w, b: jnp.transpose(jax.nn.relu(x @ w + b), (1, 0, 2))  # noqa: E731
    args = (rand(rng, 3, 5, 8), rand(rng, 3, 8, 6), rand(rng, 6))
    plan = check(fn, args, backend)
    (call,) = gemm_calls(plan)
    assert call.label == "bias+relu+strided" and (call.ldc, call.stride_c) == (18, 6)
    assert len(plan.tasks) == 1


def test_output_transpose_merging_batch_and_rows_stays_a_kernel():
    # (b, m, n) of a flattened x @ w: rows (b, m) step 6 and 18 in (m, b, n): no one run.
    rng = np.random.default_rng(4)
    fn = lambda x, w: jnp.transpose(x @ w, (1, 0, 2))  # noqa: E731
    plan = check(fn, (rand(rng, 3, 5, 8), rand(rng, 8, 6)))
    assert transposes(plan) == 1 and not gemm_calls(plan)[0].strided


def test_bias_before_a_swapping_transpose_stays_out_of_the_gemm():
    # Written swapped (C^T), cuBLASLt's bias would run along m: the bias add and the
    # transpose stay a kernel; the GEMM writes its plain result.
    rng = np.random.default_rng(5)
    fn = lambda x, w, b: jnp.swapaxes(x @ w + b, 1, 2)  # noqa: E731
    plan = check(fn, (rand(rng, 3, 5, 8), rand(rng, 3, 8, 6), rand(rng, 6)))
    (call,) = gemm_calls(plan)
    assert call.label == "bias" and transposes(plan) == 1
    fn = lambda x, w: jnp.swapaxes(x @ w, 1, 2)  # noqa: E731
    plan = check(fn, (rand(rng, 3, 5, 8), rand(rng, 3, 8, 6)))
    assert transposes(plan) == 0 and [(g.m, g.n) for g in gemm_calls(plan)] == [(6, 5)]


@pytest.mark.parametrize("backend", BACKENDS)
def test_steps_after_a_written_transpose_read_the_residual_with_its_layout(backend):
    # An SGD step: each weight gradient is (dᵀ x)ᵀ, written swapped; its update
    # w - lr * grad is the same GEMM (alpha -lr, w read as C). Written with strides (a
    # batched transpose), the GEMM takes nothing after the transpose.
    def step(p, x, y):
        def loss(p):
            return jnp.mean((jnp.tanh(x @ p[0]) @ p[1] - y) ** 2)
        g = jax.grad(loss)(p)
        return jax.tree_util.tree_map(lambda a, b: a - 0.05 * b, p, g)

    rng = np.random.default_rng(8)
    args = ((rand(rng, 16, 32) * 0.2, rand(rng, 32, 4) * 0.2), rand(rng, 8, 16), rand(rng, 8, 4))
    plan = check(step, args, backend)
    updates = [c for c in gemm_calls(plan) if c.epilogue.residual]
    assert len(updates) == 2 and all(c.alpha == -np.float32(0.05) for c in updates)
    fn = lambda x, w, r: jax.nn.relu(r - 2.0 * jnp.transpose(x @ w, (1, 0, 2)))  # noqa: E731
    plan = check(fn, (rand(rng, 3, 5, 8), rand(rng, 3, 8, 6), rand(rng, 5, 3, 6)), backend)
    (call,) = gemm_calls(plan)
    assert call.label == "strided" and len(plan.tasks) == 2
    fn = lambda x, w, r: jax.nn.relu(r - 2.0 * jnp.swapaxes(x @ w, 1, 2))  # noqa: E731
    plan = check(fn, (rand(rng, 3, 5, 8), rand(rng, 3, 8, 6), rand(rng, 3, 6, 5)), backend)
    (call,) = gemm_calls(plan)
    assert call.label == "scale+residual+relu" and len(plan.tasks) == 1
    # A bias after the transpose is not the GEMM's (it would run along the wrong axis).
    fn = lambda x, w, b: jnp.swapaxes(x @ w, 1, 2) + b  # noqa: E731
    plan = check(fn, (rand(rng, 3, 5, 8), rand(rng, 3, 8, 6), rand(rng, 5)), backend)
    assert not gemm_calls(plan)[0].epilogue.bias


def test_lt_descriptors_carry_leading_dimensions_and_batch_strides():
    # q·kᵀ of BERT at batch 1 (12 heads of 128 x 64, rows 768 apart, heads 64 apart).
    from nimblejax.compiler.lowering.task import GemmCall

    call = GemmCall(12, 128, 128, 64, False, True, "float32", "tf32",
                    lda=768, stride_a=64, ldb=768, stride_b=64)
    p = lt_layouts(call)
    assert p.a == LtLayout(0, 64, 128, 768, 12, 64)  # our B (n x k), read as k x n
    assert p.b == LtLayout(0, 64, 128, 768, 12, 64)  # our A
    assert p.c == LtLayout(0, 128, 128, 128, 12, 128 * 128)
    assert call.extent("a") == 11 * 64 + 127 * 768 + 64 == 128 * 768
    assert call.label == "strided" and "lda=768" in repr(call) and "ldc" not in repr(call)
    with pytest.raises(ValueError, match="ldb=32"):
        GemmCall(1, 4, 4, 64, False, True, "float32", "tf32", ldb=32)


@pytest.mark.parametrize("backend", BACKENDS)
def test_bfloat16_heads_read_in_place(backend):
    rng = np.random.default_rng(6)
    fn = lambda q, k: jnp.einsum("bqhd,bkhd->bhqk", q, k)  # noqa: E731
    q, k = (jnp.asarray(rand(rng, 1, 16, 4, 8), jnp.bfloat16) for _ in range(2))
    plan = nimble.jit(fn, backend="interpret").plan(q, k)
    assert transposes(plan) == 0 and gemm_calls(plan)[0].dtype == "bfloat16"
    want = np.asarray(jax.jit(fn)(q, k), np.float32)
    got = (run_emulating_gemms(plan, [np.asarray(q), np.asarray(k)])[0] if backend == "interpret"
           else nimble.jit(fn, backend=backend)(q, k))
    np.testing.assert_allclose(np.asarray(got, np.float32), want, rtol=2e-2, atol=5e-2)


@pytest.mark.gpu
def test_bert_batch_1_on_plain_cublas_reads_heads_in_place():
    # gemm="cublas": no epilogues, so p·v's output transpose stays a kernel; the strided
    # reads go through cublasGemmStridedBatchedEx's ld and stride arguments.
    fn, (params, x) = bert_tiny(1, 2)
    plan = nimble.jit(fn, backend="interpret", gemm="cublas").plan(params, x)
    assert any(g.strided for g in gemm_calls(plan))
    got = nimble.jit(fn, backend="cuda", gemm="cublas")(params, x)
    np.testing.assert_allclose(np.asarray(got), np.asarray(jax.jit(fn)(params, x)),
                               rtol=2e-2, atol=2e-2)


@pytest.mark.gpu
def test_full_size_bert_batch_1_matches_jax_on_gpu():
    fn, (params, x) = MODELS["bert"].build(1, rng=np.random.default_rng(3))
    plan = nimble.jit(fn, backend="cuda").plan(params, x)
    assert transposes(plan) == 0
    got = np.asarray(nimble.jit(fn, backend="cuda")(params, x))
    want = np.asarray(jax.jit(fn)(params, x))
    # TF32 on both sides through 12 layers; a wrong stride would be off by O(1).
    np.testing.assert_allclose(got, want, rtol=5e-2, atol=5e-2)
    assert np.mean(np.abs(got - want)) < 5e-3


def handwritten_attention(x, wq, wk, wv):
    # Explicit head transposes, as attention is often written without einsum.
    b, s, d = x.shape
    q, k, v = ((x @ w).reshape(b, s, 4, d // 4).transpose(0, 2, 1, 3) for w in (wq, wk, wv))
    p = jax.nn.softmax(q @ k.swapaxes(-1, -2) / 2.0, axis=-1)
    return jnp.tanh((p @ v).transpose(0, 2, 1, 3).reshape(b, s, d))


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("batch", [1, 2])
def test_explicit_head_transposes_fold_into_the_gemms_at_batch_1(batch, backend):
    rng = np.random.default_rng(7 + batch)
    args = (rand(rng, batch, 16, 32),) + tuple(rand(rng, 32, 32) * 0.2 for _ in range(3))
    plan = check(handwritten_attention, args, backend)
    # Batch 1: q, k (through two transposes) and v are read in place, the output written
    # through its transpose. Batch 2: (b, h) has two strides; q, k, v and the output
    # are transposed, each keeping its innermost axis.
    assert transposes(plan) == (0 if batch == 1 else 4)
    if batch == 1:  # jnp.matmul's squeezes of the batch of one became views, too
        assert [t.name.split("_")[1] for t in plan.tasks
                if t.kind == "kernel" and t.gemm is None] == ["row", "fused"]


def test_a_transpose_read_by_another_node_is_not_folded():
    rng = np.random.default_rng(9)
    fn = lambda a, b: (a.T @ b, jnp.tanh(a.T))  # noqa: E731
    plan = check(fn, (rand(rng, 6, 5), rand(rng, 6, 4)))
    assert transposes(plan) == 1
    fn = lambda a, b: a.T @ b  # noqa: E731
    plan = check(fn, (rand(rng, 6, 5), rand(rng, 6, 4)))
    assert transposes(plan) == 0 and gemm_calls(plan)[0].trans_a

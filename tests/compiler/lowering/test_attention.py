"""Attention as one kernel (compiler/lowering/attention.py): which programs get it, and
that it computes what jax.jit does, on the CPU (the interpreter, the kernel emulator,
NVRTC) and on the GPU."""
from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import nimblejax as nimble
from nimblejax.bench.models import MODELS
from tests.helpers import kernel_emulator as emu
from tests.helpers.libraries import assert_kernels_compile
from tests.helpers.models import (assert_cuda_matches_jax_twice, assert_emulated_matches_jax,
                                  assert_interpreted_matches_jax, rand)

r = np.random.default_rng(53)
needs_emulator = pytest.mark.skipif(emu.compiler() is None, reason="no host C++ compiler")


def causal(q, k, v):
    """jax.nn.dot_product_attention's own form (its XLA implementation)."""
    return jax.nn.dot_product_attention(q, k, v, is_causal=True)


def einsum_softmax(q, k, v):
    """BERT's form: einsums, a scale and jax.nn.softmax, heads in the middle."""
    s = jnp.einsum("bqhd,bkhd->bhqk", q, k) / math.sqrt(q.shape[-1])
    return jnp.einsum("bhqk,bkhd->bqhd", jax.nn.softmax(s, axis=-1), v)


def masked(q, k, v, bias):
    """An additive mask read inside the softmax (a row input besides the scores)."""
    s = jnp.einsum("bqhd,bkhd->bhqk", q, k) * 0.3 + bias
    return jnp.einsum("bhqk,bkhd->bqhd", jax.nn.softmax(s, axis=-1), v)


def weights_returned(q, k, v):
    """The probabilities are a result too: they must reach memory, so no fusion."""
    p = jax.nn.softmax(jnp.einsum("bqhd,bkhd->bhqk", q, k), axis=-1)
    return jnp.einsum("bhqk,bkhd->bqhd", p, v), p


def scores_read_twice(q, k, v):
    s = jnp.einsum("bqhd,bkhd->bhqk", q, k)
    return jnp.einsum("bhqk,bkhd->bqhd", jax.nn.softmax(s, axis=-1), v), jnp.sum(s)


def qkv(batch=1, seq=16, heads=2, size=8):
    return tuple(rand(r, batch, seq, heads, size) for _ in range(3))


CASES = {
    "causal": (causal, lambda: qkv()),
    "causal_batch2": (causal, lambda: qkv(batch=2, seq=24)),
    "einsum_softmax": (einsum_softmax, lambda: qkv(seq=40, heads=3)),
    "masked": (masked, lambda: qkv(batch=2) + (rand(r, 2, 1, 16, 16),)),
}
# Rows longer than MAX_ROW: the tensor-core kernel (attention_tc.py), with the
# probabilities as the second GEMM's A (batch 1) or its B read transposed (batch 2, as
# BERT at batch 32 has it), an additive mask that the scores' GEMM takes as its
# residual, a length no multiple of the key chunk, keys in several chunks.
TC_CASES = {
    "tc_einsum_softmax": (einsum_softmax, lambda: qkv(seq=128, heads=2, size=16)),
    "tc_einsum_softmax_batch2": (einsum_softmax, lambda: qkv(batch=2, seq=96, heads=2, size=16)),
    "tc_causal": (causal, lambda: qkv(seq=96, heads=1, size=32)),
    "tc_masked": (masked, lambda: qkv(batch=2, seq=80, heads=2, size=16) + (rand(r, 2, 1, 80, 80),)),
    "tc_long": (causal, lambda: qkv(seq=256, heads=1, size=64)),  # keys in chunks of 64
}
UNFUSED = {"weights_returned": weights_returned, "scores_read_twice": scores_read_twice}


def plan_of(fn, *args):
    return nimble.jit(fn, backend="interpret").plan(*args)


def attention_tasks(plan):
    return [t for t in plan.tasks if t.kind == "kernel" and t.name.startswith("nimble_attention")]


@pytest.mark.parametrize("name", sorted(CASES | TC_CASES))
def test_attention_is_one_kernel_and_no_gemm(name):
    fn, make = (CASES | TC_CASES)[name]
    plan = plan_of(fn, *make())
    assert len(attention_tasks(plan)) == 1
    assert not [t for t in plan.tasks if t.kind == "gemm"]
    on_tensor_cores = attention_tasks(plan)[0].name.startswith("nimble_attention_tc_")
    assert on_tensor_cores == (name in TC_CASES)


@pytest.mark.parametrize("name", sorted(UNFUSED))
def test_scores_or_probabilities_read_elsewhere_keep_the_gemms(name):
    plan = plan_of(UNFUSED[name], *qkv())
    assert not attention_tasks(plan)
    assert len([t for t in plan.tasks if t.kind == "gemm"]) == 2


@pytest.mark.parametrize("name", sorted(CASES))
def test_interpreter_matches_jax(name):
    fn, make = CASES[name]
    assert_interpreted_matches_jax(fn, make())


@pytest.mark.parametrize("name", sorted(CASES | TC_CASES))
def test_emulated_kernel_matches_jax(name):
    fn, make = (CASES | TC_CASES)[name]
    assert_emulated_matches_jax(fn, make())


def test_highest_precision_keeps_the_gemms():
    """The tensor-core kernel computes in TF32, as JAX's default precision does; under
    "highest" the GEMMs compute in float32 and the rows stay theirs."""
    with jax.default_matmul_precision("highest"):
        plan = plan_of(einsum_softmax, *TC_CASES["tc_einsum_softmax"][1]())
    assert not attention_tasks(plan)
    assert len([t for t in plan.tasks if t.kind == "gemm"]) == 2


def test_the_bench_gpt_has_one_attention_kernel_a_layer():
    fn, args = MODELS["gpt"].abstract(1, tiny=True)
    plan = plan_of(fn, *args)
    assert len(attention_tasks(plan)) == MODELS["gpt"].config(tiny=True).layers


def test_attention_kernels_compile():
    assert_kernels_compile({t.kernel.name: t.kernel.source for fn, make in (CASES | TC_CASES).values()
                            for t in attention_tasks(plan_of(fn, *make()))}, "nimble_attention")


@pytest.mark.gpu
@pytest.mark.parametrize("name", sorted(CASES | TC_CASES))
def test_on_gpu_matches_jax(name):
    fn, make = (CASES | TC_CASES)[name]
    assert_cuda_matches_jax_twice(fn, make(), lambda plan: len(attention_tasks(plan)) == 1)


@pytest.mark.parametrize("model,batch,fused", [("gpt", 1, True), ("gpt", 8, False), ("bert", 1, True),
                                               ("bert", 32, False)])
def test_the_bench_transformers_take_the_tensor_core_kernel_at_batch_1(model, batch, fused):
    """Rows of 128 keys exceed MAX_ROW: at batch 1 each layer's attention is one
    tensor-core kernel; at batch 8 and 32 (past attention_tc.MAX_MACS) the GEMMs stay."""
    fn, args = MODELS[model].abstract(batch)
    tasks = attention_tasks(plan_of(fn, *args))
    assert len(tasks) == (MODELS[model].config().layers if fused else 0)
    assert all(t.name.startswith("nimble_attention_tc_") for t in tasks)


@pytest.mark.gpu
def test_measured_win_size_on_gpu_matches_jax():
    """1x64x12x64, the largest size measured faster fused (attention.py)."""
    assert_cuda_matches_jax_twice(causal, qkv(seq=64, heads=12, size=64),
                                  lambda plan: len(attention_tasks(plan)) == 1)


@pytest.mark.gpu
@pytest.mark.parametrize("model,batch,fused", [("gpt", 1, True), ("bert", 1, True), ("bert", 32, False)])
def test_bench_transformers_on_gpu_match_jax(model, batch, fused):
    fn, args = MODELS[model].build(batch, rng=np.random.default_rng(0))
    assert_cuda_matches_jax_twice(fn, args, lambda plan: bool(attention_tasks(plan)) == fused)


@pytest.mark.gpu
def test_bench_bert_at_batch_32_on_tensor_cores_matches_jax(monkeypatch):
    """The kernel past MAX_MACS (where it is slower, not wrong): 3072 blocks, the
    probabilities as the values GEMM's B read transposed."""
    from nimblejax.compiler.lowering import attention_tc

    monkeypatch.setattr(attention_tc, "MAX_MACS", 1 << 40)
    fn, args = MODELS["bert"].build(32, rng=np.random.default_rng(0))
    assert_cuda_matches_jax_twice(fn, args, lambda plan: len(attention_tasks(plan)) == 12)


# ---- random shapes: both kernels, every form ---------------------------------------------
FORMS = {"plain": einsum_softmax, "causal": causal, "scaled": lambda q, k, v: jnp.einsum(
    "bhqk,bkhd->bqhd", jax.nn.softmax(jnp.einsum("bqhd,bkhd->bhqk", q, k) * 0.125, axis=-1), v) * 2.0}


@st.composite
def attention_programs(draw, max_seq: int, max_head: int):
    """(fn, args): a form, and q, k, v of (batch, queries, heads, head size), with an
    additive mask where one is drawn (the scores GEMM's residual)."""
    seed = draw(st.integers(0, 2 ** 16))
    batch, heads = draw(st.integers(1, 2)), draw(st.integers(1, 3))
    seq = draw(st.sampled_from([s for s in (16, 24, 48, 64, 80, 112, 128, 144, 208, 256) if s <= max_seq]))
    head = draw(st.sampled_from([h for h in (8, 16, 24, 32, 64, 128) if h <= max_head]))
    rng = np.random.default_rng(seed)
    args = tuple(rand(rng, batch, seq, heads, head) for _ in range(3))
    if draw(st.booleans()):
        return masked, args + (rand(rng, batch, 1, seq, seq),)
    return FORMS[draw(st.sampled_from(sorted(FORMS)))], args


@needs_emulator
@settings(max_examples=4, derandomize=True, deadline=None, database=None)
@given(attention_programs(max_seq=96, max_head=32))
def test_random_attention_on_the_emulator_matches_jax(program):
    """Four drawn programs (derandomized): the FMA kernel three times, the tensor-core
    kernel once (a masked one, whose scores GEMM has a residual the FMA kernel takes not)."""
    fn, args = program
    assert_emulated_matches_jax(fn, args)


@pytest.mark.gpu
@settings(max_examples=40, derandomize=True, deadline=None, database=None)
@given(attention_programs(max_seq=256, max_head=128))
def test_random_attention_on_gpu_matches_jax(program):
    fn, args = program
    assert_cuda_matches_jax_twice(fn, args)

"""Merged dots (compiler/canonicalize/merge_dots.py): independent dot_generals sharing an
operand become one GEMM. Structure on the plan (GEMM counts and sizes), numbers against
jax.jit on random inputs under the CPU interpreter, and (marked `gpu`) on the GPU."""
from __future__ import annotations

import importlib

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax import lax

import nimblejax as nimble
from nimblejax.bench.models import MODELS, lstm
from nimblejax.compiler.ir import Graph
from tests.helpers import jit_init

md = importlib.import_module("nimblejax.compiler.canonicalize.merge_dots")

BACKENDS = ["interpret", pytest.param("cuda", marks=pytest.mark.gpu)]
# cuda: TF32 GEMMs on both sides (jax.jit's default precision on the GPU).
TOL = {"interpret": 1e-5, "cuda": 2e-2}


def rand(rng, *shape, dtype=np.float32):
    return rng.normal(size=shape).astype(dtype)


def gemms(fn, *args):
    # Every dot as its GemmCall: small-M dots would be generated kernels otherwise
    # (lowering/gemm_small.py); merging is decided before that.
    plan = nimble.jit(fn, backend="interpret", small_gemm=False).plan(*args)
    return [t.gemm for t in plan.tasks if t.gemm is not None]  # (gemm_tc.py's kernels too)


def check(fn, args, backend="interpret"):
    got = nimble.jit(fn, backend=backend)(*args)
    want = jax.jit(fn)(*args)
    for g, w in zip(jax.tree_util.tree_leaves(got), jax.tree_util.tree_leaves(want)):
        w = np.asarray(w)
        assert np.asarray(g).shape == w.shape and np.asarray(g).dtype == w.dtype
        np.testing.assert_allclose(np.asarray(g), w, rtol=TOL[backend], atol=TOL[backend])


# ---- the unrolled LSTM: input projections of all steps, one GEMM ---------------------
def bench_lstm(steps: int, batch: int, hidden: int = 32, features: int = 16):
    cfg = lstm.Config(steps=steps, hidden=hidden, features=features)
    return MODELS["lstm"].build(batch, config=cfg, rng=np.random.default_rng(steps))


def test_bench_lstm_input_projections_are_one_gemm():
    fn, (p, x) = bench_lstm(steps=8, batch=4)
    made = gemms(fn, p, x)
    # One (batch*steps) x 4H GEMM of every step's input, then the 8 recurrent ones.
    assert len(made) == 8 + 1
    assert sorted((g.m, g.n, g.k) for g in made)[-1] == (4 * 8, 4 * 32, 16)
    assert sum(g.m == 4 for g in made) == 8


@pytest.mark.parametrize("backend", BACKENDS)
def test_bench_lstm_matches_jax(backend):
    fn, (p, x) = bench_lstm(steps=8, batch=4)
    check(fn, (p, x), backend)


@pytest.mark.gpu
def test_bench_lstm_full_size_matches_jax_on_gpu():
    fn, (p, x) = MODELS["lstm"].build(32, rng=np.random.default_rng(0))
    assert len(gemms(fn, p, x)) == lstm.FULL.steps + 1
    check(fn, (p, x), "cuda")


def scan_lstm(w_ih, w_hh, b, xs):
    """An LSTM as a lax.scan over time-major xs: the scan's per-step slices tile xs."""
    hd = w_hh.shape[0]

    def step(carry, x):
        h, c = carry
        z = x @ w_ih + h @ w_hh + b
        i, f, g, o = jnp.split(z, 4, axis=-1)
        c = jax.nn.sigmoid(f) * c + jax.nn.sigmoid(i) * jnp.tanh(g)
        h = jax.nn.sigmoid(o) * jnp.tanh(c)
        return (h, c), h

    zeros = jnp.zeros((xs.shape[1], hd), xs.dtype)
    return lax.scan(step, (zeros, zeros), xs)


@pytest.mark.parametrize("backend", BACKENDS)
def test_scan_lstm_input_projections_are_one_gemm(backend):
    rng = np.random.default_rng(2)
    args = (rand(rng, 16, 64) * 0.3, rand(rng, 16, 64) * 0.3, rand(rng, 64), rand(rng, 5, 3, 16))
    made = gemms(scan_lstm, *args)
    assert len(made) == 5 + 1 and max(g.m for g in made) == 5 * 3
    check(scan_lstm, args, backend)


def test_constant_dynamic_slices_tile_their_array_too():
    rng = np.random.default_rng(16)

    def fn(x, w):
        steps = [lax.dynamic_index_in_dim(x, t, axis=1, keepdims=False) for t in range(5)]
        return [jnp.tanh(s @ w) for s in steps]

    args = (rand(rng, 4, 5, 16), rand(rng, 16, 32))
    plan = nimble.jit(fn, backend="interpret").plan(*args)
    assert [(t.gemm.m, t.gemm.n, t.gemm.k) for t in plan.tasks if t.gemm] == [(4 * 5, 32, 16)]
    assert not any("concat" in t.name for t in plan.tasks)  # x read whole, not copied
    check(fn, args)


@pytest.mark.parametrize("backend", BACKENDS)
def test_flax_lstm_cell_gates_merge_across_steps_and_gates(backend):
    nn = pytest.importorskip("flax.linen")
    rng = np.random.default_rng(3)
    rnn = nn.RNN(nn.LSTMCell(32))
    xs = rand(rng, 4, 6, 16)
    params = jit_init(rnn, jax.random.PRNGKey(0), xs)
    params = jax.tree_util.tree_map(lambda a: rand(rng, *a.shape) * 0.3, params)
    fn = lambda p, x: rnn.apply(p, x)  # noqa: E731
    plan = nimble.jit(fn, backend="interpret").plan(params, xs)
    made = [t.gemm for t in plan.tasks if t.gemm]
    # Four gates of eight dots each step (4 on x_t, 4 on h): one input GEMM of every
    # step and gate, then one GEMM of the four recurrent gates per step after the first.
    assert sorted((g.m, g.n) for g in made)[-1] == (6 * 4, 4 * 32)
    assert len(made) == 1 + 6
    # Concatenates: the four input weights, the four recurrent ones (each made once for
    # all steps), and the scan's stacked outputs; x is read whole, its steps not copied.
    assert sum("concat" in t.name for t in plan.tasks) == 3
    check(fn, (params, xs), backend)


# ---- Q/K/V: one LHS, three weights --------------------------------------------------
def qkv(x, wq, wk, wv):
    q, k, v = x @ wq, x @ wk, x @ wv
    return jnp.tanh(q) * jax.nn.sigmoid(k) + v


@pytest.mark.parametrize("backend", BACKENDS)
def test_qkv_projections_of_many_rows_are_one_gemm(backend):
    rng = np.random.default_rng(4)
    args = (rand(rng, 8, 256, 64),) + tuple(rand(rng, 64, 64) * 0.1 for _ in range(3))
    made = gemms(qkv, *args)
    assert [(g.m, g.n, g.k) for g in made] == [(8 * 256, 3 * 64, 64)]
    check(qkv, args, backend)


def test_qkv_of_few_rows_keeps_three_gemms_rather_than_concatenating_weights():
    # Concatenating 12 MB of weights costs a copy per call: at 4 rows of x, two GEMM
    # launches and two reads of x save less.
    rng = np.random.default_rng(5)
    args = (rand(rng, 4, 1024),) + tuple(rand(rng, 1024, 1024) for _ in range(3))
    assert len(gemms(qkv, *args)) == 3


def test_qkv_with_constant_weights_concatenates_them_at_plan_time():
    rng = np.random.default_rng(6)
    ws = [rand(rng, 1024, 1024) * 0.03 for _ in range(3)]
    fn = lambda x: qkv(x, *ws)  # noqa: E731
    x = rand(rng, 4, 1024)
    plan = nimble.jit(fn, backend="interpret").plan(x)
    # One dot (here the small-M kernel, lowering/gemm_small.py, at 4 rows).
    assert [g.kind for g in plan.groups].count("gemm") == 1
    assert not any("concat" in t.name for t in plan.tasks)
    check(fn, (x,))


def attention(x, wq, wk, wv, wo, bq, bk, bv):
    b, s, d = x.shape
    q, k, v = ((x @ w + bias).reshape(b, s, 4, d // 4)
               for w, bias in ((wq, bq), (wk, bk), (wv, bv)))
    p = jax.nn.softmax(jnp.einsum("bqhd,bkhd->bhqk", q, k) / 4.0, axis=-1)
    return jnp.einsum("bhqk,bkhd->bqhd", p, v).reshape(b, s, d) @ wo


def attention_args(rng):
    return ((rand(rng, 8, 256, 64),) + tuple(rand(rng, 64, 64) * 0.1 for _ in range(4))
            + tuple(rand(rng, 64) for _ in range(3)))


@pytest.mark.parametrize("backend", BACKENDS)
def test_attention_block_qkv_is_one_gemm(backend, monkeypatch):
    # As BERT's: the bias add reads each projection, the head transposes read that. The
    # attention's own two GEMMs stay GEMMs (not lowering/attention_tc.py's kernel).
    from nimblejax.compiler.lowering import attention_tc

    monkeypatch.setattr(attention_tc, "MAX_MACS", 0)
    args = attention_args(np.random.default_rng(7))
    made = gemms(attention, *args)
    assert (8 * 256, 3 * 64, 64) in [(g.m, g.n, g.k) for g in made] and len(made) == 4
    check(attention, args, backend)


def test_head_transposes_keep_the_innermost_axis_so_all_three_projections_merge(monkeypatch):
    # Without a bias, the head transposes read slices of the merged result. K's is taken
    # as (b, h, s, d) with kᵀ read transposed by the GEMM (canonicalize/dot.py), so it
    # keeps its innermost axis, is an elementwise kernel and inlines its slice: K merges
    # with Q and V. (The attention's GEMMs stay GEMMs, as in the test above.)
    from nimblejax.compiler.lowering import attention_tc

    monkeypatch.setattr(attention_tc, "MAX_MACS", 0)

    def fn(x, wq, wk, wv, wo):
        b, s, d = x.shape
        q, k, v = ((x @ w).reshape(b, s, 4, d // 4) for w in (wq, wk, wv))
        p = jax.nn.softmax(jnp.einsum("bqhd,bkhd->bhqk", q, k) / 4.0, axis=-1)
        return jnp.einsum("bhqk,bkhd->bqhd", p, v).reshape(b, s, d) @ wo

    args = attention_args(np.random.default_rng(14))[:5]
    made = gemms(fn, *args)
    assert len(made) == 4 and (8 * 256, 3 * 64, 64) in [(g.m, g.n, g.k) for g in made]
    check(fn, args)


def test_dependent_dots_are_not_merged():
    # Sizes at which two independent ones would merge (4 MB of w read once, not twice).
    rng = np.random.default_rng(8)
    w = rand(rng, 1024, 1024) * 0.03
    fn = lambda x, w: jnp.tanh(jnp.tanh(x @ w) @ w)  # noqa: E731
    args = (rand(rng, 64, 1024), w)
    assert len(gemms(fn, *args)) == 2
    check(fn, args)


def test_different_precision_or_result_dtype_is_not_merged():
    rng = np.random.default_rng(9)
    x, w1, w2 = rand(rng, 2048, 64), rand(rng, 64, 64), rand(rng, 64, 64)

    def precision(x, w1, w2):
        return jnp.tanh(jnp.dot(x, w1, precision=lax.Precision.HIGHEST)) + jnp.tanh(x @ w2)

    def result_dtype(x, w1, w2):
        x, w1, w2 = (a.astype(jnp.bfloat16) for a in (x, w1, w2))
        y1 = lax.dot(x, w1, preferred_element_type=jnp.float32)
        return jnp.tanh(y1) + jnp.tanh(x @ w2).astype(jnp.float32)

    assert len(gemms(precision, x, w1, w2)) == 2
    assert len(gemms(result_dtype, x, w1, w2)) == 2
    check(precision, (x, w1, w2))


def test_dot_feeding_a_gemm_or_the_output_is_not_merged():
    # Its slice of a merged result would be a copy kernel of its own.
    rng = np.random.default_rng(10)
    fn = lambda x, w1, w2, w3: ((x @ w1) @ w3, x @ w2)  # noqa: E731
    args = (rand(rng, 2048, 64),) + tuple(rand(rng, 64, 64) * 0.1 for _ in range(3))
    assert len(gemms(fn, *args)) == 3
    check(fn, args)


def test_slices_that_do_not_tile_their_array_are_not_read_whole():
    rng = np.random.default_rng(11)
    fn = lambda x, w: sum(jnp.tanh(x[:, t] @ w) for t in range(3))  # noqa: E731
    args = (rand(rng, 4, 5, 16), rand(rng, 16, 32))  # 3 of 5 steps
    made = gemms(fn, *args)
    assert all(g.m != 4 * 5 for g in made)
    check(fn, args)


def test_two_merges_never_make_a_cycle():
    # a1 feeds b1 and b2 feeds a2: merging {a1, a2} puts b2 above b1, so {b1, b2} must
    # then stay apart (and the merged graph still orders each value after its inputs).
    rng = np.random.default_rng(12)

    def fn(x, y, w, u):
        a1 = jnp.tanh(x @ w)
        b2 = jnp.tanh(y @ u)
        a2 = jnp.tanh(b2 @ w)
        b1 = jnp.tanh(a1 @ u)
        return a2 + b1

    args = (rand(rng, 64, 1024), rand(rng, 64, 1024), rand(rng, 1024, 1024) * 0.03,
            rand(rng, 1024, 1024) * 0.03)
    made = gemms(fn, *args)
    assert 2 < len(made) < 4  # one pair merged (A or B), never both
    check(fn, args)


def test_merged_plans_kernels_compile():
    from nimblejax.testing.nvrtc_check import available_compiler, compile_to_ptx

    if available_compiler() is None:
        pytest.skip("no NVRTC or nvcc")
    rng = np.random.default_rng(15)
    fn, (p, x) = bench_lstm(steps=8, batch=4)
    plans = [nimble.jit(fn, backend="interpret").plan(p, x),
             nimble.jit(attention, backend="interpret").plan(*attention_args(rng))]
    kernels = {k.name: k.source for plan in plans for t in plan.tasks if t.kernel
               for k in t.kernel.launches}
    ptx = compile_to_ptx("\n".join(kernels.values()), "merged.cu", arch="sm_90", fast=True)
    assert all(f".entry {name}(" in ptx for name in kernels)


def test_merged_plans_kernels_run_right_on_the_cpu(monkeypatch):
    # The generated kernels themselves (the strided slices of merged results inlined into
    # the gate and bias kernels, the concatenate) compiled as C++ and run on the CPU. The
    # attention's GEMMs stay GEMMs, as above (attention_tc.py's kernel on 512 blocks would
    # be a minute of emulated threads; test_attention.py runs it on small shapes).
    from nimblejax.compiler.lowering import attention_tc
    from tests.helpers import kernel_emulator
    from tests.helpers.models import assert_tree_close
    if kernel_emulator.compiler() is None:
        pytest.skip("no C++ compiler")
    monkeypatch.setattr(attention_tc, "MAX_MACS", 0)
    rng = np.random.default_rng(17)
    fn, (p, x) = bench_lstm(steps=8, batch=4)
    args = [scan_lstm, (rand(rng, 16, 64) * 0.3, rand(rng, 16, 64) * 0.3, rand(rng, 64),
                        rand(rng, 5, 3, 16))]
    cases = [(fn, (p, x)), (attention, attention_args(rng)), tuple(args),
             (qkv, (rand(rng, 8, 256, 64),) + tuple(rand(rng, 64, 64) * 0.1 for _ in range(3)))]
    for f, a in cases:
        plan = nimble.jit(f, backend="interpret").plan(*a)
        outs, emulated = kernel_emulator.run(plan, jax.tree_util.tree_leaves(a))
        assert emulated > 0
        want = jax.tree_util.tree_leaves(jax.jit(f)(*a))
        for o, w in zip(outs, want):  # (TF32 GEMM kernels, gemm_tc.py, run here too)
            assert_tree_close(np.asarray(o).reshape(np.shape(w)), w)


def test_merge_dots_leaves_a_graph_without_shared_dots_unchanged():
    from nimblejax.compiler.trace import make_graph

    graph, _ = make_graph(lambda x, w: jnp.tanh(x @ w), [jax.ShapeDtypeStruct((8, 4), np.float32),
                                                         jax.ShapeDtypeStruct((4, 4), np.float32)])
    merged = md.merge_dots(graph)
    assert isinstance(merged, Graph) and merged.nodes == graph.nodes


def test_matrix_vector_products_sharing_the_matrix_match_jax():
    # The vectors have no free axis to concatenate along: left as they are.
    rng = np.random.default_rng(13)
    fn = lambda a, u, v: jnp.tanh(a @ u) + jnp.tanh(a @ v)  # noqa: E731
    args = (rand(rng, 64, 64), rand(rng, 64), rand(rng, 64))
    assert len(gemms(fn, *args)) == 2
    check(fn, args)


# ---- the cost rule on the benchmark models ------------------------------------------
def bench_gemms(name: str, batch: int) -> int:
    from nimblejax.bench.plans import abstract_model

    fn, args = abstract_model(MODELS[name], batch, jnp.float32, tiny=False)
    return len(gemms(fn, *args))


def test_bert_qkv_projections_stay_three_gemms_at_batch_1_and_32():
    # 12 layers of (Q, K, V, two attention einsums, attn_out, ffn_in, ffn_out). At batch
    # 32 each projection is 4096x768x768, which fills the GPU and is compute bound: a
    # merge would save nothing and the weight concatenate costs 14 MB of traffic a call.
    # At batch 1 (128 rows) it saves a launch and two reads of x, about 5 MB: too little.
    # (At batch 1 the two attention einsums are one kernel: lowering/attention_tc.py.)
    assert bench_gemms("bert", 32) == 12 * 8
    assert bench_gemms("bert", 1) == 12 * 6


def test_saving_weighs_gemm_size_against_the_concatenate():
    # The rule on BERT's Q/K/V shapes: nothing saved at batch 32 (filled, compute bound),
    # a launch plus two reads of x at batch 1, both below the 18 MB concatenate.
    from nimblejax.compiler.trace import make_graph

    def shapes(rows):
        spec = [jax.ShapeDtypeStruct((rows, 768), np.float32)] + \
            [jax.ShapeDtypeStruct((768, 768), np.float32)] * 3
        graph, _ = make_graph(lambda x, a, b, c: (x @ a, x @ b, x @ c), spec)
        dots = [n for n in graph.nodes if n.name == "dot_general"]
        return [md._concat_member(d, 0) for d in dots], graph.inputs[0]

    for rows, saved in ((4096, 0), (128, md.LAUNCH_BYTES + 2 * 128 * 768 * 4)):
        ms, x = shapes(rows)
        assert md._saving(0, ms) == saved
        cost = md.LAUNCH_BYTES + 2 * 3 * 768 * 768 * 4
        assert not md._worth_concatenating(0, ms, 1, {}, {})
        # Shared by enough merges (an unrolled loop's steps) it pays at batch 1 only.
        assert md._worth_concatenating(0, ms, 4, {}, {}) == (saved * 4 >= cost) == (rows == 128)
    assert md.fills_gpu(1, 4096, 768) and not md.fills_gpu(1, 128, 2304)


def test_branchy_mlp_first_layers_stay_parallel_gemms():
    # One x, eight 256x256 weights: a concatenate would cost more than the reads of x
    # it saves, and the eight GEMMs run side by side on the streams anyway.
    assert bench_gemms("mlp", 32) == 8 * 6

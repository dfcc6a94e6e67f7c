"""Row kernels with a prologue and several outputs (compiler/fusion_rows.py,
lowering/rows.py): the elementwise producers of a row kernel's input (residual add, scale,
mask, bias, converts) are computed in the row kernel, and such a value read outside the
group too (pre-LN's residual stream) is written by the row kernel as another output
instead of by an elementwise kernel of its own. Fusion decisions on the plan, numbers
against jax.jit under the CPU interpreter and with the kernels run on the CPU
(tests/helpers/kernel_emulator.py), NVRTC compiles them, and the GPU compares with
jax.jit."""
from __future__ import annotations

import zlib

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import nimblejax as nimble
from nimblejax.compiler import fusion_rows
from nimblejax.options import Options
from nimblejax.testing.nvrtc_check import available_compiler, compile_to_ptx
from tests.helpers import kernel_emulator as emu
from tests.helpers.models import assert_cuda_matches_jax_twice, assert_tree_close, jax_reference, layer_norm, rand

r = np.random.default_rng(31)


@pytest.fixture(autouse=True)
def _seeded(request):
    """Each test draws the same numbers whichever order xdist runs the tests in."""
    global r
    r = np.random.default_rng(zlib.crc32(request.node.nodeid.encode()))


def plan_of(fn, *args, **options):
    return nimble.jit(fn, backend="interpret", options=Options(**options)).plan(*args)


def row_groups(plan):
    return [g for g in plan.groups if g.kind == "row"]


def kernel_names(plan) -> list[str]:
    return [t.name for t in plan.tasks if t.kind == "kernel"]


def check_numbers(fn, *args, **options) -> None:
    got = nimble.jit(fn, backend="interpret", options=Options(**options))(*args)
    assert_tree_close(got, jax_reference(fn, *args))


def check_emulated(fn, *args) -> None:
    """The row kernels themselves, compiled for and run on the CPU, against jax."""
    outs, emulated = emu.run(plan_of(fn, *args), [np.asarray(a) for a in args])
    assert emulated >= 1
    for got, want in zip(outs, jax.tree_util.tree_leaves(jax_reference(fn, *args))):
        assert_tree_close(np.asarray(got), want)


# ---- the programs -------------------------------------------------------------------------
def ln_of_sum(x, y, g, b):  # post-LN: LN(x + attn_out)
    return layer_norm(x + y, g, b)


def ln_and_residual(x, y, g, b):  # the residual stream is returned too
    h = x + y
    return layer_norm(h, g, b), h


def residual_read_by_gemm(x, y, g, b, w):  # ... or read by the next GEMM
    h = x + y
    return layer_norm(h, g, b), h @ w


def gemm_before_layer_norm(x, y, g, b, w):  # a reader that comes first in the graph
    h = x + y
    return h @ w, layer_norm(h, g, b)


def scaled_masked_softmax(s, mask):  # attention: scores * scale + mask
    return jax.nn.softmax(s * 0.125 + mask, axis=-1)


def logsumexp_and_its_input(x, y):  # one value per row, and the row input
    z = x * 1.5 + y
    return jax.nn.logsumexp(z, axis=-1), z


def softmax_with_row_bias(x, a, b):  # a per-row value, written in a pass of its own
    bias = a * b
    return jax.nn.softmax(x + bias, axis=-1), bias


def logsumexp_with_row_bias(x, a, b):  # ... written where the one value per row is
    bias = a - b
    return jax.nn.logsumexp(x * bias, axis=-1), bias


def bias_residual_convert_ln(x, y, bias, g, b):  # bf16 residual stream, f32 LayerNorm
    h = x + (y + bias)
    return layer_norm(h.astype(jnp.float32), g, b), h


def pre_ln_block(x, w1, w2, g1, b1, g2, b2):
    """A GPT-style pre-LN block at a size where the residual stream is worth writing
    (fusion_costs.worth_writing): each LayerNorm writes the residual it normalizes."""
    h = x + jax.nn.gelu(layer_norm(x, g1, b1) @ w1) @ w2
    h2 = h + jnp.tanh(layer_norm(h, g2, b2) @ w1) @ w2
    return h2 + x


def ln_args(rows: int, n: int, dtype=jnp.float32) -> tuple:
    return (rand(r, rows, n, dtype=dtype, scale=2.0), rand(r, rows, n, dtype=dtype),
            rand(r, n), rand(r, n))


def pre_ln_args(rows: int, d: int, f: int) -> tuple:
    return (rand(r, rows, d), rand(r, d, f, scale=d ** -0.5), rand(r, f, d, scale=f ** -0.5),
            rand(r, d), rand(r, d), rand(r, d), rand(r, d))


# name → (function, arguments): small enough for the kernel emulator
CASES = {
    "ln_of_sum": (ln_of_sum, lambda: ln_args(24, 96)),
    "ln_and_residual": (ln_and_residual, lambda: ln_args(13, 200)),
    "residual_read_by_gemm": (residual_read_by_gemm,
                              lambda: ln_args(16, 64) + (rand(r, 64, 32, scale=0.2),)),
    "gemm_before_layer_norm": (gemm_before_layer_norm,
                               lambda: ln_args(16, 64) + (rand(r, 64, 32, scale=0.2),)),
    "scaled_masked_softmax": (scaled_masked_softmax,
                              lambda: (rand(r, 2, 3, 16, 16, scale=3.0), rand(r, 1, 1, 16, 16))),
    "logsumexp_and_its_input": (logsumexp_and_its_input, lambda: (rand(r, 13, 32), rand(r, 13, 32))),
    "softmax_with_row_bias": (softmax_with_row_bias,
                              lambda: (rand(r, 10, 70), rand(r, 10, 1), rand(r, 10, 1))),
    "logsumexp_with_row_bias": (logsumexp_with_row_bias,
                                lambda: (rand(r, 11, 50), rand(r, 11, 1), rand(r, 11, 1))),
    "bias_residual_convert_ln": (bias_residual_convert_ln,
                                 lambda: (rand(r, 12, 80, dtype=jnp.bfloat16),
                                          rand(r, 12, 80, dtype=jnp.bfloat16),
                                          rand(r, 80, dtype=jnp.bfloat16), rand(r, 80), rand(r, 80))),
}


# ---- fusion decisions -----------------------------------------------------------------------
def test_layer_norm_of_a_sum_is_one_row_group_named_after_its_prologue():
    args = ln_args(24, 96)
    plan = plan_of(ln_of_sum, *args)
    assert [g.kind for g in plan.groups] == ["row"]
    assert kernel_names(plan)[0].startswith("nimble_row_add_layernorm_f32_"), kernel_names(plan)
    check_numbers(ln_of_sum, *args)


def test_large_sum_kept_for_later_is_a_second_output_of_the_row_group():
    """2**20 elements: fusion_costs.worth_writing writes the residual sum. Before, that was an
    elementwise kernel of its own and the LayerNorm read it back."""
    args = ln_args(2048, 512)
    plan = plan_of(ln_and_residual, *args)
    (row,) = row_groups(plan)
    assert len(plan.tasks) == 1 and len(row.outputs) == 2
    assert row.extra_outputs == (plan.graph.outputs[1],)  # h, after the root's value
    check_numbers(ln_and_residual, *args)


def test_residual_read_by_a_gemm_is_written_by_the_layer_norm():
    fn, make = CASES["residual_read_by_gemm"]
    args = make()
    plan = plan_of(fn, *args)
    assert [g.kind for g in plan.groups] == ["row", "gemm"]
    row, gemm = plan.groups
    assert row.extra_outputs and row.extra_outputs[0] in gemm.inputs
    assert not any(n.startswith("nimble_fused") for n in kernel_names(plan))
    check_numbers(fn, *args)


def test_a_reader_earlier_in_the_graph_runs_after_the_row_kernel():
    """The GEMM comes first in the graph, but reads what the row kernel writes."""
    fn, make = CASES["gemm_before_layer_norm"]
    args = make()
    plan = plan_of(fn, *args)
    assert [g.kind for g in plan.groups] == ["row", "gemm"]
    assert [t.gemm is not None for t in plan.tasks] == [False, True]  # the row kernel, the GEMM
    check_numbers(fn, *args)


def test_scaled_masked_softmax_is_one_row_group():
    fn, make = CASES["scaled_masked_softmax"]
    args = make()
    plan = plan_of(fn, *args)
    assert [g.kind for g in plan.groups] == ["row"]
    assert kernel_names(plan)[0].startswith("nimble_row_mul_add_softmax_f32_"), kernel_names(plan)
    check_numbers(fn, *args)


def test_pre_ln_blocks_have_no_elementwise_kernel_before_their_layer_norms():
    args = pre_ln_args(2048, 512, 256)
    plan = plan_of(pre_ln_block, *args, gemm="cublas")  # no GEMM epilogue takes the adds
    rows = row_groups(plan)
    assert len(rows) == 2 and [len(g.extra_outputs) for g in rows] == [0, 1]
    made = {v: g for g in plan.groups for v in g.outputs}
    for g in rows:  # each LayerNorm reads the GEMM outputs, not a written residual sum
        assert all(made[v].kind in ("gemm", "row") for v in g.inputs if v in made), g
    check_numbers(pre_ln_block, *args, gemm="cublas")


def test_no_cycle_when_another_reader_feeds_the_row_group():
    """h is read by a cumsum kernel whose result the LayerNorm reads: the LayerNorm can't
    write h (the cumsum would wait for it, it for the cumsum): h keeps its own kernel."""
    def f(x, y, g, b):
        h = x + y
        return layer_norm(h + jnp.cumsum(h, axis=-1), g, b), h
    args = ln_args(16, 48)
    plan = plan_of(f, *args)
    (row,) = row_groups(plan)
    assert not row.extra_outputs
    assert sum(n.startswith("nimble_fused_add") for n in kernel_names(plan)) == 1, kernel_names(plan)
    check_numbers(f, *args)


def test_no_cycle_through_a_reader_recomputed_in_the_row_group_and_elsewhere():
    """u = 2h is recomputed in the LayerNorm's kernel and in tanh(u)'s, whose GEMM the
    LayerNorm reads: writing h from the LayerNorm would make tanh(u)'s kernel wait for it
    (a flax encoder's Adam step had this shape: the forward LayerNorm's mean)."""
    def f(x, y, g, b, w):
        h = x + y
        u = h * 2.0
        return layer_norm(u + jnp.tanh(u) @ w, g, b), h
    args = ln_args(16, 48) + (rand(r, 48, 48, scale=0.2),)
    plan = plan_of(f, *args)
    (row,) = row_groups(plan)
    assert not row.extra_outputs
    check_numbers(f, *args)


def test_a_reduction_above_a_written_value_does_not_join():
    """z = x - max(x) is written (an output) by the softmax's kernel in its first pass;
    the max it depends on must then be a kernel of its own, not one of the passes."""
    def f(x):
        z = x - jnp.max(x, axis=-1, keepdims=True)
        e = jnp.exp(z)
        return e / jnp.sum(e, axis=-1, keepdims=True), z
    x = rand(r, 16, 40, scale=3.0)
    plan = plan_of(f, x)
    for g in row_groups(plan):
        reduced = {n for n in g.nodes if n.name.startswith("reduce_")}
        assert not g.extra_outputs or all(n.name != "reduce_max" for n in reduced)
    check_numbers(f, x)
    check_emulated(f, x)


def test_a_row_kernel_writes_at_most_max_row_outputs_values():
    """More prologue values read outside than a row kernel writes: the rest keep their
    kernels (the six partial sums, each also read by a reduction of its own, which
    cannot write them: fusion._fused_output_target)."""
    def f(x, *ys):
        hs = []
        h = x
        for y in ys:
            h = h + y
            hs.append(jnp.sum(h, axis=0))  # a reader outside the group
        return (layer_norm(h, jnp.ones(h.shape[-1]), 0.5), *hs)
    args = tuple(rand(r, 2048, 512) for _ in range(7))
    plan = plan_of(f, *args)
    (row,) = row_groups(plan)
    assert len(row.extra_outputs) == fusion_rows.MAX_ROW_OUTPUTS == 4
    # the other two: one kernel writes both (the second sum's, writing the first beside it)
    rest = [t for t in plan.tasks if t.kind == "kernel" and t.kernel.name.startswith("nimble_fused_add")]
    assert sum(len(t.outputs) for t in rest) == 2
    check_numbers(f, *args)


def pre_ln_encoder(cfg):
    """BERT's layers (nimblejax/bench/models) rearranged GPT-style: x + f(LN(x))."""
    from nimblejax.bench.models import bert, layers as L

    def forward(ctx, x):
        for i in range(cfg.layers):
            with ctx.scope(f"layer{i}"):
                x = x + bert.attention(cfg, ctx, L.layer_norm(ctx, x))
                ff = L.gelu(L.dense(ctx, L.layer_norm(ctx, x), cfg.ffn, name="ffn_in"))
                x = x + L.dense(ctx, ff, cfg.hidden, name="ffn_out")
        return L.layer_norm(ctx, x)

    x = jax.ShapeDtypeStruct((8, cfg.seq, cfg.hidden), jnp.float32)
    params = L.init_params(L.param_specs(forward, x)[0], r, jnp.float32)
    return L.bind(forward), (params, rand(r, *x.shape))


# Residual sums read past the next LayerNorm: 3 of the 4 (the last feeds only the final
# LayerNorm); under cuBLASLt the first is the attention GEMM's residual epilogue (x is an
# argument, written anyway).
@pytest.mark.parametrize("gemm, written", [("lt", 2), ("cublas", 3)])
def test_pre_ln_encoder_writes_its_residual_stream_from_the_layer_norms(gemm, written):
    from nimblejax.bench.models.bert import Config

    fn, args = pre_ln_encoder(Config(layers=2, hidden=256, heads=4, ffn=512, seq=512))
    plan = plan_of(fn, *args, gemm=gemm)
    assert sum(len(g.extra_outputs) for g in row_groups(plan)) == written
    stream = [t.name for t in plan.tasks if t.name.startswith("nimble_fused")
              and t.outputs[0].shape == (8, 512, 256)]
    assert not stream, stream  # no elementwise kernel writes the residual stream
    check_numbers(fn, *args, gemm=gemm)


def test_explain_shows_the_prologue_and_both_outputs():
    args = ln_args(2048, 512)
    report = nimble.explain(ln_and_residual, *args)
    (line,) = [ln for ln in str(report).splitlines() if "nimble_row_" in ln]
    assert "nimble_row_add_layernorm_f32_" in line
    written = line.split("<-")[0]
    assert written.count("f32[2048, 512]@") == 2, line  # the LayerNorm and the sum
    assert report.num_tasks == 1


@pytest.mark.parametrize("name", sorted(CASES))
def test_interpreter_matches_jax(name):
    fn, make = CASES[name]
    args = make()
    assert row_groups(plan_of(fn, *args))
    check_numbers(fn, *args)


def test_two_outputs_per_row_kernel_where_the_value_is_an_output():
    expect = {"ln_and_residual": 2, "logsumexp_with_row_bias": 2, "logsumexp_and_its_input": 2, "softmax_with_row_bias": 2,
              "bias_residual_convert_ln": 2, "residual_read_by_gemm": 2, "gemm_before_layer_norm": 2}
    for name, n in expect.items():
        fn, make = CASES[name]
        (row,) = row_groups(plan_of(fn, *make()))
        assert len(row.outputs) == n, name


# ---- random programs ------------------------------------------------------------------------
PROLOGUES = {
    "add": lambda x, y: x + y,
    "scale_add": lambda x, y: x * 0.5 + y,
    "sub_tanh": lambda x, y: jnp.tanh(x - y),
    "bias_row": lambda x, y: x + y[0],  # a broadcast row (a bias)
}
NORMS = {
    "softmax": lambda h, g: jax.nn.softmax(h, axis=-1),
    "log_softmax": lambda h, g: jax.nn.log_softmax(h, axis=-1),
    "layer_norm": lambda h, g: layer_norm(h, g, -g),
    "rms_norm": lambda h, g: h * jax.lax.rsqrt(jnp.mean(h * h, -1, keepdims=True) + 1e-6) * g,
    "logsumexp": lambda h, g: jax.nn.logsumexp(h, axis=-1),
}
READERS = {  # what else reads the prologue's value h
    "none": lambda h, w: (),
    "output": lambda h, w: (h,),
    "gemm": lambda h, w: (h @ w,),
    "elementwise": lambda h, w: (jnp.exp(-h * h),),
    "feeds_back": None,  # h + cumsum(h) is the row input: no cycle allowed
}


def random_program(k: int):
    rng = np.random.default_rng(1000 + k)
    pro, norm, reader = (sorted(d)[rng.integers(len(d))] for d in (PROLOGUES, NORMS, READERS))
    rows, n = [(7, 33), (16, 64), (40, 128), (5, 300)][rng.integers(4)]

    def f(x, y, g, w):
        h = PROLOGUES[pro](x, y)
        if reader == "feeds_back":
            return NORMS[norm](h + jnp.cumsum(h, axis=-1), g), h
        return (NORMS[norm](h, g), *READERS[reader](h, w))
    args = (rand(rng, rows, n, scale=2.0), rand(rng, rows, n), rand(rng, n), rand(rng, n, 8, scale=0.3))
    return f, args, (pro, norm, reader)


@pytest.mark.parametrize("k", range(24))
def test_random_programs_match_jax(k):
    fn, args, (pro, norm, reader) = random_program(k)
    plan = plan_of(fn, *args)
    (row,) = row_groups(plan)
    if reader in ("output", "gemm"):  # a value written anyway: the row kernel writes it
        assert len(row.outputs) == 2, (pro, norm, reader)
    if reader == "feeds_back":
        assert not row.extra_outputs
    check_numbers(fn, *args)
    check_emulated(fn, *args)


# ---- the kernels themselves, run on the CPU ---------------------------------------------------
@pytest.mark.parametrize("name", sorted(CASES))
def test_emulated_kernels_match_jax(name):
    fn, make = CASES[name]
    check_emulated(fn, *make())


def test_emulated_long_rows_write_the_second_output_from_global_memory():
    """Rows too long to keep in registers (rows.MAX_SLOTS): each pass reads global memory."""
    args = ln_args(2, 12000)
    (task,) = plan_of(ln_and_residual, *args).tasks
    assert "row0[" not in task.kernel.source and len(task.outputs) == 2
    check_emulated(ln_and_residual, *args)


# ---- NVRTC -------------------------------------------------------------------------------------
def sources() -> dict[str, str]:
    found = {}
    programs = ([(fn, make()) for fn, make in CASES.values()] + [(ln_and_residual, ln_args(2, 12000))]
                + [random_program(k)[:2] for k in range(24)])
    for fn, args in programs:
        for t in plan_of(fn, *args).tasks:
            if t.name.startswith("nimble_row_"):
                found[t.name] = t.kernel.source
    return found


@pytest.mark.skipif(available_compiler() is None, reason="no NVRTC or nvcc")
def test_row_prologue_kernels_compile():
    found = sources()
    assert len(found) >= len(CASES)
    ptx = compile_to_ptx("\n".join(found.values()), "nimble_row_prologue.cu", arch="sm_90", fast=True)
    missing = [name for name in found if f".entry {name}(" not in ptx]
    assert not missing, missing


# ---- GPU ------------------------------------------------------------------------------------------
@pytest.mark.gpu
@pytest.mark.parametrize("name", sorted(CASES))
def test_on_gpu_match_jax(name):
    fn, make = CASES[name]
    assert_cuda_matches_jax_twice(fn, make(), lambda plan: any(
        t.name.startswith("nimble_row_") for t in plan.tasks), reference=jax_reference)


@pytest.mark.gpu
@pytest.mark.parametrize("rows, n", [(4096, 768), (16, 12000), (1000, 7)])
def test_residual_stream_on_gpu_match_jax(rows, n):
    args = ln_args(rows, n)
    f = nimble.jit(ln_and_residual, backend="cuda")
    assert any(len(g.outputs) == 2 for g in row_groups(f.plan(*args)))
    assert_tree_close(f(*args), jax.jit(ln_and_residual)(*args))


@pytest.mark.gpu
def test_pre_ln_block_on_gpu_match_jax():
    args = pre_ln_args(4096, 768, 1024)
    for gemm in ("lt", "cublas"):
        f = nimble.jit(pre_ln_block, backend="cuda", options=Options(gemm=gemm))
        assert_tree_close(f(*args), jax.jit(pre_ln_block)(*args))

"""Row kernels (compiler/fusion_rows.py, lowering/rows.py): softmax, log_softmax,
logsumexp, LayerNorm and RMSNorm each become one kernel. Structure on the plan, numbers
against jax.jit under the CPU interpreter and with the kernels themselves run on the CPU
(tests/helpers/kernel_emulator.py), NVRTC compiles them, and the GPU compares with jax.jit."""
from __future__ import annotations

import zlib

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from tests.helpers import on_host
from tests.helpers import kernel_emulator as emu
import nimblejax as nimble
from tests.helpers.models import assert_tree_close, jax_reference, layer_norm, rand
from nimblejax.compiler.canonicalize import split
from nimblejax.compiler.lowering import rows
from nimblejax.testing.nvrtc_check import available_compiler, compile_to_ptx

r = np.random.default_rng(0)


def softmax(x):
    return jax.nn.softmax(x, axis=-1)


def log_softmax(x):
    return jax.nn.log_softmax(x, axis=-1)


def logsumexp(x):
    return jax.nn.logsumexp(x, axis=-1)


def jnp_layer_norm(x):  # mean of (x - mean)^2, as jnp.var computes it
    m = jnp.mean(x, -1, keepdims=True)
    return (x - m) / jnp.sqrt(jnp.var(x, -1, keepdims=True) + 1e-6)


def flax_layer_norm(x, scale, bias):  # mean of squares minus squared mean
    return nn.LayerNorm().apply({"params": {"scale": scale, "bias": bias}}, x)


def flax_rms_norm(x, scale):
    return nn.RMSNorm().apply({"params": {"scale": scale}}, x)


def pattern_args(name: str, rows: int, n: int, dtype=jnp.float32) -> tuple:
    """The pattern's arguments, drawn from a generator of their own (the same numbers
    whichever tests ran before in the worker)."""
    g = np.random.default_rng(zlib.crc32(f"{name} {rows} {n} {jnp.dtype(dtype).name}".encode()))
    x = rand(g, rows, n, dtype=dtype, scale=3.0)
    if name in ("layer_norm", "flax_layer_norm"):
        return x, rand(g, n), rand(g, n)
    if name == "flax_rms_norm":
        return x, rand(g, n)
    return (x,)


# name → (function, the pattern its kernel is named after)
PATTERNS = {
    "softmax": (softmax, "softmax"),
    "log_softmax": (log_softmax, "logsoftmax"),
    "logsumexp": (logsumexp, "logsumexp"),
    "layer_norm": (layer_norm, "layernorm"),
    "jnp_layer_norm": (jnp_layer_norm, "layernorm"),
    "flax_layer_norm": (flax_layer_norm, "layernorm"),
    "flax_rms_norm": (flax_rms_norm, "rmsnorm"),
}


def plan_of(fn, *args):
    return nimble.jit(fn, backend="interpret").plan(*args)


def kernel_names(plan) -> list[str]:
    return [t.name for t in plan.tasks if t.kind == "kernel"]


def check_numbers(fn, *args) -> None:
    assert_tree_close(nimble.jit(fn, backend="interpret")(*args), jax.jit(fn)(*args))


def check_emulated(fn, *args) -> None:
    """The row kernels themselves, compiled for and run on the CPU, against jax (op by op
    where the program computes a 16-bit float: helpers.models.jax_reference)."""
    plan = plan_of(fn, *args)
    outs, emulated = emu.run(plan, [np.asarray(a) for a in args])
    assert emulated >= 1
    want = jax.tree_util.tree_leaves(jax_reference(fn, *args))
    for got, w in zip(outs, want):
        assert_tree_close(np.asarray(got), w)


# ---- structure ------------------------------------------------------------------------
@pytest.mark.parametrize("name", sorted(PATTERNS))
def test_each_pattern_is_one_row_kernel(name):
    fn, pattern = PATTERNS[name]
    args = pattern_args(name, 16, 96)
    plan = plan_of(fn, *args)
    assert len(plan.tasks) == 1, kernel_names(plan)
    assert plan.groups[-1].kind == "row"
    assert plan.tasks[0].name.startswith(f"nimble_row_{pattern}_f32_"), plan.tasks[0].name
    check_numbers(fn, *args)


@pytest.mark.parametrize("n", [1, 7, 1000, 4096])
def test_rows_of_any_length_are_one_kernel(n):
    x = rand(r, 12, n)
    (kernel,) = kernel_names(plan_of(softmax, x))
    # Rows of one element: the reductions are reshapes (canonicalize/reductions.py), the
    # rest one elementwise kernel.
    assert kernel.startswith("nimble_row_softmax" if n > 1 else "nimble_fused_"), kernel
    check_numbers(softmax, x)


def test_long_rows_loop_over_the_row():
    x = rand(r, 4, 50000)
    # Few long rows: split.py cuts the reductions in two stages first; the row kernel
    # takes the last stage and writes all 50000 outputs of each row (a block-stride loop).
    plan = plan_of(softmax, x)
    row = [t for t in plan.tasks if t.name.startswith("nimble_row_")]
    assert len(row) == 1 and "then 50000 output(s) per row" in row[0].kernel.source
    assert row[0].kernel.block == (1024, 1, 1)
    check_numbers(softmax, x)


def test_long_rows_unsplit_are_one_kernel(monkeypatch):
    monkeypatch.setattr(split, "MIN_REDUCED", 1 << 30)
    x = rand(r, 4, 50000)
    plan = plan_of(softmax, x)
    assert len(plan.tasks) == 1 and plan.tasks[0].kernel.grid == (4, 1, 1)
    check_numbers(softmax, x)
    check_emulated(softmax, x)


def test_attention_softmax_over_batch_and_heads_is_one_kernel():
    x = rand(r, 2, 4, 16, 16)
    plan = plan_of(softmax, x)
    assert len(plan.tasks) == 1 and plan.tasks[0].name.startswith("nimble_row_softmax")
    check_numbers(softmax, x)


def test_attention_probabilities_read_transposed_by_the_next_gemm():
    """BERT's attention: the second einsum reads the probabilities transposed (dot.py's
    GEMM layout); the softmax is one row kernel's passes (here, at 32 keys, inside the
    attention kernel: lowering/attention.py)."""
    def attention(q, k, v):
        p = jax.nn.softmax(jnp.einsum("bqhd,bkhd->bhqk", q, k) * 0.125, axis=-1)
        return jnp.einsum("bhqk,bkhd->bqhd", p, v)
    args = tuple(rand(r, 1, 32, 4, 16) for _ in range(3))
    plan = plan_of(attention, *args)
    names = kernel_names(plan)
    assert sum("_softmax_" in k for k in names) == 1, names
    assert not any(k.startswith("nimble_reduce") for k in names), names
    check_numbers(attention, *args)


def test_not_applied_when_reducing_a_leading_axis():
    f = lambda x: jax.nn.softmax(x, axis=0)  # noqa: E731
    x = rand(r, 64, 12)
    plan = plan_of(f, x)
    assert not any(g.kind == "row" for g in plan.groups)
    assert len(kernel_names(plan)) >= 2
    check_numbers(f, x)


def test_a_reduction_read_in_another_row_is_not_joined():
    """x - max of the reversed rows: a register of one row would be the wrong value."""
    f = lambda x: x - jnp.max(x, axis=-1, keepdims=True)[::-1]  # noqa: E731
    x = rand(r, 8, 32)
    assert not any(g.kind == "row" for g in plan_of(f, x).groups)
    check_numbers(f, x)
    check_emulated(f, x)


def test_a_reduction_that_is_an_output_is_written_by_the_row_kernel():
    f = lambda x: (softmax(x), jnp.max(x, axis=-1))  # noqa: E731
    x = rand(r, 8, 32)
    plan = plan_of(f, x)
    (g,) = plan.groups
    assert g.kind == "row" and len(kernel_names(plan)) == 1 and len(g.outputs) == 2
    check_numbers(f, x)
    check_emulated(f, x)
    x = rand(r, 5, 300)  # rows longer than a block's threads: the max written once a row
    check_numbers(f, x)
    check_emulated(f, x)


def test_a_while_step_with_its_convergence_measure_is_one_kernel():
    """Newton's step: the next iterate, max |step| (both carried) and the test on them."""
    def step(x, a, k):
        nx = 0.5 * (x + a / x)
        err = jnp.max(jnp.abs(nx - x))
        return nx, err, k + 1, (err > 1e-6) & (k + 1 < 100)

    a = np.abs(rand(r, 256)) * 50 + 0.5
    args = (a * 0.7 + 1.0, a, np.int32(3))
    plan = plan_of(step, *args)
    (row,) = [g for g in plan.groups if g.kind == "row"]
    # One row kernel writes the iterate, the measure, the test and the counter (placed
    # before the reduction joined, fusion walks backwards; fusion._late_row_outputs
    # gives it to the row kernel once the row group is known).
    assert len(row.outputs) == 4 and len(kernel_names(plan)) == 1
    check_numbers(step, *args)
    check_emulated(step, *args)


def test_few_rows_of_much_work_keep_their_separate_kernels():
    """One row of 2**19: a row kernel would be one block for the whole array."""
    f = lambda x: x - jnp.mean(x, axis=-1, keepdims=True)  # noqa: E731
    x = rand(r, 1, 1 << 19)
    assert not any(g.kind == "row" for g in plan_of(f, x).groups)
    check_numbers(f, x)


def test_residual_add_before_layer_norm_is_fused_into_it():
    f = lambda x, y, g, b: layer_norm(x + y, g, b)  # noqa: E731
    args = (rand(r, 16, 64), rand(r, 16, 64), rand(r, 64), rand(r, 64))
    plan = plan_of(f, *args)
    assert len(plan.tasks) == 1 and plan.tasks[0].name.startswith("nimble_row_add_layernorm")
    check_numbers(f, *args)
    check_emulated(f, *args)


def test_gradients_through_row_kernels():
    def loss(x, g, b):
        return jnp.sum(softmax(layer_norm(x, g, b)) * jnp.arange(x.shape[-1], dtype=x.dtype))
    args = (rand(r, 8, 48), rand(r, 48), rand(r, 48))
    grad = jax.grad(loss, argnums=(0, 1, 2))
    assert any(g.kind == "row" for g in plan_of(grad, *args).groups)
    check_numbers(grad, *args)


def test_cross_entropy_is_one_row_kernel_after_its_label_gather():
    import optax

    f = optax.softmax_cross_entropy_with_integer_labels
    args = (rand(r, 16, 40), on_host(r.integers(0, 40, 16), jnp.int32))
    plan = plan_of(f, *args)
    assert [k.startswith("nimble_row_logsumexp") for k in kernel_names(plan)][-1]
    check_numbers(f, *args)


# ---- the kernels themselves, run on the CPU ----------------------------------------------
@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16], ids=["f32", "bf16"])
@pytest.mark.parametrize("name", sorted(PATTERNS))
def test_emulated_row_kernels_match_jax(name, dtype):
    fn, _ = PATTERNS[name]
    check_emulated(fn, *pattern_args(name, 9, 200, dtype))


def test_emulated_row_kernel_rooted_at_a_reduction():
    f = lambda x: jnp.sum(jnp.exp(x - jnp.max(x, -1, keepdims=True)), -1)  # noqa: E731
    x = rand(r, 10, 70)
    plan = plan_of(f, x)
    assert len(plan.tasks) == 1 and plan.groups[0].kind == "row"
    check_emulated(f, x)


def test_emulated_integer_and_bool_rows_are_exact():
    def f(x):
        centred = x - jnp.min(x, -1, keepdims=True) + jnp.sum(x, -1, keepdims=True)
        return centred, jnp.any(x > 5, -1, keepdims=True) & (x < 0)
    x = on_host(r.integers(-9, 9, (12, 33)), jnp.int32)
    plan = plan_of(f, x)
    assert sum(g.kind == "row" for g in plan.groups) == 2
    outs, emulated = emu.run(plan, [np.asarray(x)])
    assert emulated == 2
    for got, want in zip(outs, jax.jit(f)(x)):
        np.testing.assert_array_equal(got, want)


def test_emulated_row_inputs_kept_in_registers_up_to_a_budget():
    """Six rows summed, then softmax: with 8 elements per thread, four inputs fit the
    register budget (rows.CACHED_REGISTERS) and the other two are read again each pass."""
    f = lambda *xs: softmax(sum(xs))  # noqa: E731
    args = tuple(rand(r, 256, 1024) for _ in range(6))
    source = plan_of(f, *args).tasks[0].kernel.source
    assert "row3[8]" in source and "row4[" not in source
    check_emulated(f, *args)


@pytest.mark.parametrize("name", ["flax_layer_norm", "jnp_layer_norm", "layer_norm", "softmax",
                                  "log_softmax", "flax_rms_norm"])
def test_emulated_row_values_computed_once_give_the_same_bits(name, monkeypatch):
    """LayerNorm's mean, variance and rsqrt (softmax's sum in bfloat16) come out of the
    passes' loops (rows.hoist_row_values), and a value of the element that two passes
    read from a reduction is kept in registers by the first (rows.reused_values:
    softmax's exp(x - max), LayerNorm's x - mean): the kernel's bytes are those of
    computing them at every element in every pass."""
    fn, _ = PATTERNS[name]
    args = pattern_args(name, 9, 300, jnp.bfloat16)
    hoisted = plan_of(fn, *args)
    source = next(t.kernel.source for t in hoisted.tasks if t.name.startswith("nimble_row_"))
    last_loop = source.rindex("for (int j = 0;")
    assert "sqrtf" not in source[last_loop:] and ("sqrtf" in source or name.endswith("softmax"))
    if name == "softmax":  # the last pass divides the kept exponentials
        assert "expf" not in source[last_loop:] and "row1[j] = " in source
    outs, _ = emu.run(hoisted, [np.asarray(a) for a in args])
    monkeypatch.setattr(rows, "hoist_row_values", lambda *a: None)
    monkeypatch.setattr(rows, "reused_values", lambda *a: frozenset())
    inline = plan_of(fn, *args)
    assert next(t.kernel.source for t in inline.tasks if t.name.startswith("nimble_row_")) != source
    want, _ = emu.run(inline, [np.asarray(a) for a in args])
    for got, w in zip(outs, want):
        np.testing.assert_array_equal(np.asarray(got).view(np.uint16), np.asarray(w).view(np.uint16))


@pytest.mark.parametrize("n", [1, 7, 1000, 4096])
def test_emulated_rows_of_any_length(n):
    check_emulated(log_softmax, rand(r, 5, n, scale=3.0))


# ---- NVRTC ------------------------------------------------------------------------------
def row_kernel_sources() -> dict[str, str]:
    cases = [(PATTERNS[n][0], pattern_args(n, 6, width, dtype))
             for n in sorted(PATTERNS) for width in (7, 200, 5000)
             for dtype in (jnp.float32, jnp.bfloat16, jnp.float16)]
    cases.append((softmax, (rand(r, 4, 50000),)))
    sources = {}
    for fn, args in cases:
        for t in plan_of(fn, *args).tasks:
            if t.name.startswith("nimble_row_"):
                sources[t.name] = t.kernel.source
    return sources


@pytest.mark.skipif(available_compiler() is None, reason="no NVRTC or nvcc")
def test_row_kernels_compile():
    sources = row_kernel_sources()
    assert len(sources) >= 30
    ptx = compile_to_ptx("\n".join(sources.values()), "nimble_rows.cu", arch="sm_90", fast=True)
    missing = [name for name in sources if f".entry {name}(" not in ptx]
    assert not missing, missing


# ---- GPU ----------------------------------------------------------------------------------
@pytest.mark.gpu
@pytest.mark.parametrize("shape", [(64, 7), (384, 768), (8, 4096), (3, 50000), (2, 4, 128, 128)])
@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16], ids=["f32", "bf16"])
@pytest.mark.parametrize("name", ["softmax", "log_softmax", "flax_layer_norm", "flax_rms_norm"])
def test_row_kernels_on_gpu_match_jax(name, dtype, shape):
    fn, _ = PATTERNS[name]
    rows, n = int(np.prod(shape[:-1])), shape[-1]
    args = pattern_args(name, rows, n, dtype)
    args = (args[0].reshape(shape),) + args[1:]
    f = nimble.jit(fn, backend="cuda")
    assert any(t.name.startswith("nimble_row_") for t in f.plan(*args).tasks)
    assert_tree_close(f(*args), jax.jit(fn)(*args))
    assert_tree_close(f(*args), jax.jit(fn)(*args))  # a second call: the same graph again

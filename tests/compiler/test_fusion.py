"""Fusion targets, asserted on the plan."""
from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

import nimblejax as nimble
from tests.helpers import on_host
from tests.helpers.models import (assert_tree_close, gelu_dense, layer_norm, mlp, mlp_args, rand,
                                  softmax)


def kernels(fn, *args, **options):
    plan = nimble.jit(fn, backend="interpret", **options).plan(*args)
    return [t for t in plan.tasks if t.kind == "kernel"], [t for t in plan.tasks if t.kind == "gemm"]


r = np.random.default_rng(0)


def test_softmax_at_most_3_kernels():
    ks, gs = kernels(softmax, rand(r, 8, 128))
    assert len(ks) <= 3 and not gs


def test_layer_norm_at_most_3_kernels():
    ks, _ = kernels(layer_norm, rand(r, 8, 64), rand(r, 64), rand(r, 64))
    assert len(ks) <= 3


def test_jax_nn_layer_norm_style_at_most_3_kernels():
    def ln(x):
        m = jnp.mean(x, -1, keepdims=True)
        return (x - m) / jnp.sqrt(jnp.var(x, -1, keepdims=True) + 1e-6)
    ks, _ = kernels(ln, rand(r, 8, 64))
    assert len(ks) <= 3


def test_gelu_dense_is_one_gemm_with_its_epilogue():
    args = rand(r, 8, 16), rand(r, 16, 24), rand(r, 24)
    ks, gs = kernels(gelu_dense, *args)
    assert (len(gs), len(ks)) == (1, 0) and gs[0].gemm.label == "bias+gelu_tanh"
    ks, gs = kernels(gelu_dense, *args, gemm="cublas")  # no epilogues: one fused kernel
    assert (len(gs), len(ks)) == (1, 1)


def test_mlp_bias_and_activation_fuse_after_each_gemm():
    params, x = mlp_args(r)
    ks, gs = kernels(mlp, params, x)
    assert len(gs) == len(params) and len(ks) == len(params)


def test_reshape_of_a_buffer_is_a_view():
    # (a vector product of 1200: past canonicalize/small_dots.py's MAX_MACS, a GEMM)
    plan = nimble.jit(lambda a, b, c: (a @ b).reshape(-1) @ c, backend="interpret").plan(
        rand(r, 30, 5), rand(r, 5, 40), rand(r, 1200))
    assert [t.kind for t in plan.views] == ["view"]
    assert sum(t.kind == "kernel" and t.gemm is None for t in plan.tasks) == 0  # (GEMMs may be)


def test_generated_kernel_names_are_readable():
    ks, _ = kernels(lambda x: jnp.tanh(x) + 1.0, rand(r, 4))
    assert ks[0].name.startswith("nimble_fused_tanh_add_f32_")


def test_long_column_reduction_is_split_in_two_stages():
    x = rand(r, 64, 32, 32, 16)  # batch-norm statistics: 65536 elements into 16 outputs
    f = lambda a: jnp.mean(jnp.square(a - 1.0), axis=(0, 1, 2))  # noqa: E731
    plan = nimble.jit(f, backend="interpret").plan(x)
    reductions = [t for t in plan.tasks if t.name.startswith("nimble_reduce")]
    assert len(reductions) == 2
    np.testing.assert_allclose(nimble.jit(f, backend="interpret")(x), f(x), rtol=1e-5)


def test_global_average_pool_is_split_over_its_middle_axes():
    x = rand(r, 2, 56, 56, 24)  # NHWC mean over H, W: the channels stay innermost
    f = lambda a: jnp.mean(a * 0.5 + 1.0, axis=(1, 2))  # noqa: E731
    plan = nimble.jit(f, backend="interpret").plan(x)
    reductions = [t for t in plan.tasks if t.name.startswith("nimble_reduce")]
    assert len(reductions) == 2
    first = reductions[0].outputs[0].shape
    assert first[0] == 2 and first[-1] == 24 and first[1] > 1  # [N, chunks, C]
    # Both stages read whole warps of neighbouring channels.
    assert all("tx = threadIdx.x % 32" in t.kernel.source for t in reductions)
    np.testing.assert_allclose(nimble.jit(f, backend="interpret")(x), f(x), rtol=1e-5)


def test_long_row_reduction_is_split_in_two_stages():
    x = rand(r, 4, 65536)
    plan = nimble.jit(lambda a: jnp.max(a, axis=-1), backend="interpret").plan(x)
    assert sum(t.name.startswith("nimble_reduce") for t in plan.tasks) == 2
    np.testing.assert_array_equal(nimble.jit(lambda a: jnp.max(a, axis=-1), backend="interpret")(x),
                                  jnp.max(x, axis=-1))


def test_large_residual_is_written_once_not_recomputed_downstream():
    """relu(a * s + b) feeding (through a reshape) a GEMM and the next residual add is
    written once and read back, not recomputed from the buffers it reads (ResNet's
    bottleneck blocks)."""
    x, y = rand(r, 64, 16, 1024), rand(r, 64, 16, 1024)
    w = rand(r, 1024, 1024)

    def block(x, y, w):
        h = jax.nn.relu(x * 0.5 + y)
        return jax.nn.relu((h.reshape(-1, 1024) @ w).reshape(h.shape) + h)

    def last_kernel_inputs(*args):  # plain cuBLAS, K whole: the residual add is a kernel
        plan = nimble.jit(block, backend="interpret", gemm="cublas", split_k=False).plan(*args)
        return len([t for t in plan.tasks if t.kind == "kernel"][-1].inputs)

    assert last_kernel_inputs(x, y, w) == 2  # the GEMM's output and h
    # Small too: h is written in its own shape for the GEMM, which reads it through the
    # reshape (a view: fusion._gemm_operand_views), so the last kernel reads it back
    # rather than recomputing it from x and y.
    small = (x[:4], y[:4], w)
    assert last_kernel_inputs(*small) == 2
    assert_tree_close(nimble.jit(block, backend="interpret")(x, y, w), jax.jit(block)(x, y, w))
    # cuBLASLt reads h, written for the GEMM anyway, as its residual: no kernel after it.
    ks, gs = kernels(block, *small, split_k=False)
    assert len(ks) == 1 and gs[0].gemm.label == "residual+relu"


def test_long_elementwise_chain_is_cut_into_kernels_of_bounded_depth():
    """An unrolled loop of elementwise steps (400 here) used to be one kernel whose code
    generation recursed once per step (RecursionError past ~300)."""
    import jax
    import jax.numpy as jnp
    import numpy as np

    import nimblejax as nimble
    from nimblejax.compiler.fusion import MAX_INLINE_DEPTH

    def f(x):
        for _ in range(400):
            x = jnp.tanh(x * 1.01 + 0.5)
        return x

    x = on_host(np.random.default_rng(0).uniform(-1, 1, 64), jnp.float32)
    g = nimble.jit(f, backend="interpret")
    np.testing.assert_allclose(g(x), jax.jit(f)(x), rtol=1e-5, atol=1e-6)
    tasks = g.plan(x).tasks
    assert 1 < len(tasks) <= 1 + 3 * 400 // MAX_INLINE_DEPTH
    assert all(len(t.eqns) <= MAX_INLINE_DEPTH + 1 for t in tasks)


def test_a_literal_broadcast_is_recomputed_in_every_kernel_however_many():
    """`jax.grad` through `jnp.maximum(x, 0)` selects between full arrays of 1.0 and 0.0,
    one per shape, shared by every layer of that shape. They read no buffer: no kernel
    writes one, however many kernels (more than fusion.MAX_DUPLICATION) read it."""
    def loss(ws, x):
        for w in ws:
            x = jnp.maximum(x @ w, 0.0) + x  # a residual keeps each mask's kernel apart
        return jnp.sum(x * x)

    x, ws = rand(r, 4096, 256), [rand(r, 256, 256, scale=0.05) for _ in range(8)]
    grad = jax.grad(loss)
    ks, _ = kernels(grad, ws, x)
    assert len([k for k in ks if "select" in k.kernel.name]) > 4  # the masks: several kernels
    assert not [k for k in ks if not k.inputs]
    assert_tree_close(nimble.jit(grad, backend="interpret")(ws, x), jax.jit(grad)(ws, x))


def test_a_value_worth_writing_is_written_by_its_first_reader():
    """ResNet's residual `y = bn(conv) + shortcut` in a train step: relu reads it forward
    and the mask reads it backward. It reads two full-size buffers, so it is written, not
    recomputed; the relu kernel computes it and writes it beside its own result (no
    kernel of its own that relu reads back)."""
    def loss(a, c, w):
        y = a * 1.5 + c
        return jnp.sum((jnp.maximum(y, 0.0) @ w) ** 2)

    a, c, w = rand(r, 1024, 1024), rand(r, 1024, 1024), rand(r, 1024, 64, scale=0.05)
    grad = jax.grad(loss, argnums=(0, 1, 2))
    ks, _ = kernels(grad, a, c, w)
    (relu,) = [k for k in ks if "max" in k.kernel.name]
    assert len(relu.outputs) == 2 and {v.shape for v in relu.outputs} == {(1024, 1024)}
    assert not [k for k in ks if k.kernel.name.startswith("nimble_fused_mul_add_f32")]
    assert_tree_close(nimble.jit(grad, backend="interpret")(a, c, w), jax.jit(grad)(a, c, w))


def test_a_relu_mask_is_written_by_the_kernel_that_scales_it():
    """A frozen batch norm's backward: the relu mask `dy * (y > 0)` is read by the scale
    gradient's sum and, times the scale, by the GEMMs of the layer before. The scaling
    kernel writes the mask too, which the sum reads back: no kernel of the mask's own."""
    def loss(x, s, w1, w2):
        r = jnp.maximum((x @ w1) * s, 0.0)
        return jnp.sum((r @ w2) ** 2)

    x, s = rand(r, 2048, 256), rand(r, 512) + 1.0
    w1, w2 = rand(r, 256, 512, scale=0.05), rand(r, 512, 64, scale=0.05)
    grad = jax.grad(loss, argnums=(0, 1, 2))
    ks, _ = kernels(grad, x, s, w1, w2)
    masks = [k for k in ks if "selectn" in k.kernel.name and "reduce" not in k.kernel.name]
    assert len(masks) == 1 and len(masks[0].outputs) == 2  # the mask and the scaled mask
    assert_tree_close(nimble.jit(grad, backend="interpret")(x, s, w1, w2), jax.jit(grad)(x, s, w1, w2))

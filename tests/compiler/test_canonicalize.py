"""compiler/canonicalize on its own: each rewrite keeps the graph's values (the graph is
evaluated node by node with JAX, before and after, against jax.jit on random inputs)
and leaves the form lowering expects; and the one cuDNN decision (`use_cudnn`)."""
from __future__ import annotations

import itertools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax import lax

from tests.helpers import on_host
from tests.helpers.graphs import evaluate, names, trace
import nimblejax as nimble
from nimblejax.compiler.canonicalize import REWRITTEN, canonicalize, registry
from nimblejax.compiler.canonicalize import conv_path as conv_mod
from nimblejax.compiler.canonicalize.dot import gemm_layout, operand_layouts
from nimblejax.options import Options

NHWC = ("NHWC", "HWIO", "NHWC")


def check(fn, args, options=Options(), rtol=1e-5):
    """Canonicalize fn's graph; the values equal jax.jit's. Returns the new graph."""
    graph = trace(fn, *args)
    new = canonicalize(graph, options)
    want = jax.tree_util.tree_leaves(jax.jit(fn)(*args))
    got_all = evaluate(new, args)
    assert len(got_all) == len(want)
    for got, w in zip(got_all, want):
        np.testing.assert_allclose(np.asarray(got, np.float32), np.asarray(w, np.float32),
                                   rtol=rtol, atol=rtol)
    return new


def rand(rng, *shape):
    return on_host(rng.standard_normal(shape), jnp.float32)


def conv(x, w, strides=(1, 1), **kw):
    return lax.conv_general_dilated(x, w, strides, "SAME", dimension_numbers=NHWC,
                                    precision=lax.Precision.HIGHEST, **kw)


# ---- the cuDNN decision ----------------------------------------------------------
@pytest.mark.parametrize("conv_opt,found,batch", list(itertools.product(
    ["auto", "cudnn", "im2col"], [False, True], [1, conv_mod.CUDNN_MIN_BATCH - 1,
                                                 conv_mod.CUDNN_MIN_BATCH, 64])))
def test_use_cudnn_is_forced_refused_or_found_and_batch(conv_opt, found, batch):
    want = {"cudnn": True, "im2col": False}.get(conv_opt, found and batch >= conv_mod.CUDNN_MIN_BATCH)
    assert conv_mod.use_cudnn(Options(conv=conv_opt, cudnn=found), batch) is want


def test_conv_path_follows_use_cudnn_for_eligible_convolutions():
    rng = np.random.default_rng(0)
    w = rand(rng, 3, 3, 4, 4)
    for batch in (1, conv_mod.CUDNN_MIN_BATCH):
        node = trace(conv, rand(rng, batch, 6, 6, 4), w).nodes[0]
        for options in (Options(conv=c, cudnn=f) for c in ("auto", "cudnn", "im2col")
                        for f in (False, True)):
            want = "cudnn" if conv_mod.use_cudnn(options, batch) else "gemm"
            assert conv_mod.conv_path(node, options) == want
    # Not for cuDNN whatever the options: depthwise (direct kernel), 1x1 (already a GEMM).
    forced = Options(conv="cudnn")
    x = rand(rng, 8, 6, 6, 4)
    assert conv_mod.conv_path(trace(lambda x, w: conv(x, w, feature_group_count=4), x,
                                    rand(rng, 3, 3, 1, 4)).nodes[0], forced) == "direct"
    assert conv_mod.conv_path(trace(conv, x, rand(rng, 1, 1, 4, 8)).nodes[0], forced) == "gemm"


# ---- each rewrite keeps the values ---------------------------------------------------
def test_convolution_on_the_gemm_path_becomes_im2col_and_a_dot():
    rng = np.random.default_rng(1)
    new = check(lambda x, w: conv(x, w, (2, 2)), [rand(rng, 2, 9, 9, 3), rand(rng, 3, 3, 3, 5)],
                Options(conv="im2col"))
    assert "conv_general_dilated" not in names(new)
    assert names(new).count("nimble_im2col") == 1 and names(new).count("dot_general") == 1


def test_convolution_on_the_cudnn_path_becomes_one_cudnn_call_in_nhwc():
    rng = np.random.default_rng(2)
    new = check(lambda x, w: conv(x, w), [rand(rng, 2, 7, 7, 4), rand(rng, 3, 3, 4, 6)],
                Options(conv="cudnn"), rtol=1e-4)
    assert "conv_general_dilated" not in names(new)
    assert names(new).count("nimble_cudnn_conv") == 1


def test_filter_gradient_becomes_one_cudnn_backward_filter_call():
    """jax.grad's filter-gradient convolution (its window the whole activation map) is
    cuDNN's backward-filter call on x and dy as they are: no im2col, no pad where cuDNN's
    symmetric padding gives dy's size; on the GEMM path where the batch is small."""
    rng = np.random.default_rng(5)
    grad_w = jax.grad(lambda x, w: jnp.sum(jnp.tanh(conv(x, w))), argnums=1)
    args = [rand(rng, conv_mod.CUDNN_MIN_BATCH, 9, 9, 4), rand(rng, 3, 3, 4, 6)]
    new = check(grad_w, args, Options(conv="cudnn"), rtol=1e-4)
    assert names(new).count("nimble_cudnn_conv_filter_grad") == 1
    assert not {"nimble_im2col", "pad", "conv_general_dilated"} & set(names(new))
    (node,) = [n for n in trace(grad_w, *args).nodes if n.name == "conv_general_dilated"
               and n.inputs[1].shape == (conv_mod.CUDNN_MIN_BATCH, 9, 9, 6)]
    assert conv_mod.conv_path(node, Options(conv="auto", cudnn=True)) == "cudnn_filter_grad"
    assert conv_mod.conv_path(node, Options(conv="auto", cudnn=False)) == "gemm"
    small = [n for n in trace(grad_w, rand(rng, 1, 9, 9, 4), args[1]).nodes
             if n.name == "conv_general_dilated" and n.inputs[1].shape == (1, 9, 9, 6)]
    assert conv_mod.conv_path(small[0], Options(conv="auto", cudnn=True)) == "gemm"
    # An image's 3 channels: one GEMM over the forward's patches (MIN_CHANNELS), unless forced.
    rgb = [n for n in trace(grad_w, rand(rng, conv_mod.CUDNN_MIN_BATCH, 9, 9, 3), rand(rng, 3, 3, 3, 6)).nodes
           if n.name == "conv_general_dilated" and n.inputs[1].shape == (conv_mod.CUDNN_MIN_BATCH, 9, 9, 6)]
    assert conv_mod.conv_path(rgb[0], Options(conv="auto", cudnn=True)) == "gemm_filter_grad"
    assert conv_mod.conv_path(rgb[0], Options(conv="cudnn", cudnn=True)) == "cudnn_filter_grad"
    assert conv_mod.conv_path(rgb[0], Options(conv="im2col", cudnn=True)) == "gemm"
    # ... while its patches fit in MAX_PATCH_BYTES: ResNet-50's first layer at batch 32 does
    # (236 MB), 512² images at batch 64 do not (2.5 GB).
    first = jax.grad(lambda x, w: jnp.sum(lax.conv_general_dilated(x, w, (2, 2), [(3, 3)] * 2,
                                                                    dimension_numbers=NHWC)), argnums=1)
    for n, hw, want in [(32, 224, "gemm_filter_grad"), (64, 512, "cudnn_filter_grad")]:
        spec = [jax.ShapeDtypeStruct((n, hw, hw, 3), jnp.float32), jax.ShapeDtypeStruct((7, 7, 3, 64), jnp.float32)]
        (node,) = [m for m in trace(first, *spec).nodes if m.name == "conv_general_dilated"
                   and m.outputs[0].shape != (n, hw // 2, hw // 2, 64)]
        assert conv_mod.conv_path(node, Options(conv="auto", cudnn=True)) == want, (n, hw)
    # Stride 2 with "SAME" padding (0, 1): x is padded explicitly by one row and column.
    grad_s2 = jax.grad(lambda x, w: jnp.sum(jnp.tanh(conv(x, w, (2, 2)))), argnums=1)
    new = check(grad_s2, [rand(rng, 2, 8, 8, 4), args[1]], Options(conv="cudnn"), rtol=1e-4)
    assert names(new).count("nimble_cudnn_conv_filter_grad") == 1 and "nimble_im2col" not in names(new)


def test_depthwise_convolution_stays_one_node():
    rng = np.random.default_rng(3)
    new = check(lambda x, w: conv(x, w, feature_group_count=4),
                [rand(rng, 2, 6, 6, 4), rand(rng, 3, 3, 1, 8)], Options(conv="cudnn"))
    assert names(new) == ["conv_general_dilated"]


def test_dot_operands_are_laid_out_for_gemm():
    rng = np.random.default_rng(4)
    fn = lambda a, b: jnp.einsum("kbm,bnk->bmn", a, b, precision="highest")  # noqa: E731
    args = [rand(rng, 5, 3, 4), rand(rng, 3, 6, 5)]
    assert any(gemm_layout(n) is None for n in trace(fn, *args).nodes if n.name == "dot_general")
    new = check(fn, args)
    dots = [n for n in new.nodes if n.name == "dot_general"]
    # A float GEMM reads both operands where they are, with strides: a (5, 3, 4) as three
    # (4 x 5) matrices stored transposed (ld 12, batch stride 4), b as (6 x 5) ones.
    assert dots and "transpose" not in names(new)
    assert all(None not in operand_layouts(n) for n in dots)


def test_integer_dot_operands_are_made_contiguous():
    # The generated integer kernel reads contiguous operands in the canonical order.
    rng = np.random.default_rng(4)
    fn = lambda a, b: jnp.einsum("kbm,bnk->bmn", a, b)  # noqa: E731
    args = [rng.integers(-9, 9, (5, 3, 4)).astype(np.int32),
            rng.integers(-9, 9, (3, 6, 5)).astype(np.int32)]
    new = check(fn, args)
    dots = [n for n in new.nodes if n.name == "dot_general"]
    assert dots and all(gemm_layout(n) is not None for n in dots)
    assert names(new).count("transpose") == 2


def test_long_reduction_with_few_outputs_is_split_in_two():
    rng = np.random.default_rng(5)
    fn = lambda x: jnp.sum(x, axis=(0, 1, 2))  # noqa: E731  (a batch-norm statistic)
    x = rand(rng, 16, 32, 32, 8)
    assert names(trace(fn, x)).count("reduce_sum") == 1
    new = check(fn, [x], rtol=1e-4)
    assert names(new).count("reduce_sum") == 2
    small = check(fn, [rand(rng, 2, 4, 4, 8)])  # short: one kernel is enough
    assert names(small).count("reduce_sum") == 1


def test_strided_input_gradient_becomes_one_cudnn_backward_data_call():
    """The input gradient of a stride-2 convolution (lhs dilation 2) is cuDNN's
    backward-data call on dy and the flipped filter; with "SAME" padding on an even size
    cuDNN's dx has a row and a column more, sliced off."""
    rng = np.random.default_rng(6)
    grad_x = jax.grad(lambda x, w: jnp.sum(jnp.tanh(conv(x, w, (2, 2)))))
    for size, sliced in ((8, True), (9, False)):
        new = check(grad_x, [rand(rng, 2, size, size, 8), rand(rng, 3, 3, 8, 6)], Options(conv="cudnn"),
                    rtol=1e-4)
        assert names(new).count("nimble_cudnn_conv_data_grad") == 1
        assert "nimble_im2col" not in names(new) and ("slice" in names(new)) is sliced
    (node,) = [n for n in trace(grad_x, rand(rng, 1, 8, 8, 8), rand(rng, 3, 3, 8, 6)).nodes
               if n.name == "conv_general_dilated" and any(d > 1 for d in n.params["lhs_dilation"])]
    assert conv_mod.conv_path(node, Options(conv="auto", cudnn=True)) == "gemm"  # batch 1


def test_reduction_over_unit_axes_is_a_reshape():
    """A (C,) gradient reshaped to (1, 1, 1, C) and summed over the unit axes (as
    ResNet-50's train step has a hundred times): no kernel, bit for bit (-0.0 too)."""
    rng = np.random.default_rng(7)
    fn = lambda x: jnp.sum(jnp.sum(x, axis=(0, 1, 2)).reshape(1, 1, 1, 8), axis=(0, 1, 2))  # noqa: E731
    args = [rand(rng, 2, 4, 4, 8)]
    assert names(trace(fn, *args)).count("reduce_sum") == 2
    assert names(check(fn, args, rtol=1e-6)).count("reduce_sum") == 1
    for op in (jnp.sum, jnp.max, jnp.min, jnp.prod):
        x = jnp.asarray([[-0.0, 1.5, -2.0]], jnp.float32)
        new = check(lambda a, op=op: op(a, axis=0), [x])
        assert names(new) == ["reshape"]
        assert np.signbit(np.asarray(evaluate(new, [x])[0])[0])
    bools = jnp.asarray([[True], [False]])
    assert names(check(lambda a: jnp.any(a, axis=1), [bools])) == ["reshape"]


def test_transpose_of_unit_axes_only_is_a_reshape():
    """jax.nn.dot_product_attention's output transpose at batch 1 moves axes of size 1
    only: a reshape (a view, no copy kernel). A transpose that moves a longer axis stays."""
    from nimblejax.compiler.canonicalize.transposes import keeps_memory_order

    assert keeps_memory_order((1, 1, 128, 8, 64), (1, 2, 3, 0, 4))
    assert keeps_memory_order((4, 1, 5), (1, 0, 2)) and keeps_memory_order((3,), (0,))
    assert not keeps_memory_order((1, 2, 3), (0, 2, 1))
    rng = np.random.default_rng(8)
    x = rand(rng, 1, 1, 6, 2, 4)
    new = check(lambda a: jnp.transpose(a, (1, 2, 3, 0, 4)) * 2.0, [x])
    assert "transpose" not in names(new) and "reshape" in names(new)
    assert "transpose" in names(check(lambda a: jnp.transpose(a, (0, 1, 3, 2, 4)), [x]))


@pytest.mark.parametrize("shapes,spec", [
    (((1, 16), (16, 16)), "ij,jk->ik"),           # a row vector times a matrix
    (((16, 16), (16,)), "ij,j->i"),                # a matrix times a vector (diffrax's field)
    (((3, 16, 7), (3, 7)), "bij,bj->bi"),          # batched (336 multiply-adds)
    (((7,), (7, 16)), "j,jk->k"),                  # the stage combination of a Runge-Kutta step
])
def test_small_vector_products_become_a_multiply_and_a_sum(shapes, spec):
    rng = np.random.default_rng(9)
    args = [rand(rng, *s) for s in shapes]
    new = check(lambda a, b: jnp.einsum(spec, a, b), args, rtol=2e-6)
    assert "dot_general" not in names(new) and "reduce_sum" in names(new)


def test_larger_or_matrix_products_keep_their_dot():
    rng = np.random.default_rng(10)
    for shapes in (((1, 64), (64, 32)), ((4, 16), (16, 16))):  # past MAX_MACS; no vector side
        args = [rand(rng, *s) for s in shapes]
        assert "dot_general" in names(check(lambda a, b: a @ b, args, rtol=2e-3))
    ints = [jnp.asarray([[1, 2, 3]], jnp.int32), jnp.asarray([[1], [2], [3]], jnp.int32)]
    assert "dot_general" in names(check(lambda a, b: a @ b, ints))


def test_split_becomes_slices():
    rng = np.random.default_rng(6)
    fn = lambda x: jnp.split(x, [2, 5], axis=1)  # noqa: E731
    x = rand(rng, 3, 9)
    assert "split" in names(trace(fn, x))
    new = check(fn, [x])
    assert "split" not in names(new) and names(new).count("slice") == 3


def test_other_nodes_pass_through_unchanged():
    rng = np.random.default_rng(7)
    graph = trace(lambda x: jnp.tanh(x) * 2.0 + 1.0, rand(rng, 4, 5))
    new = canonicalize(graph, Options())
    assert new.nodes == graph.nodes and new.inputs == graph.inputs and new.outputs == graph.outputs


# ---- the table of rewrites (canonicalize/registry.py) ------------------------------------
def test_each_rewrite_is_registered_for_its_primitives_in_one_table():
    table = {name: (rule.fn.__module__.rsplit(".", 1)[1], rule.replaces, rule.after_merge)
             for name, rule in registry.REWRITES.items()}
    assert table == {
        "conv_general_dilated": ("conv_path", False, False),
        **{r: ("reductions", False, False) for r in ("reduce_sum", "reduce_max", "reduce_min", "reduce_prod",
                                                     "reduce_and", "reduce_or", "reduce_xor")},
        "split": ("slices", True, False),
        "stack": ("stacking", True, False), "unstack": ("stacking", True, False),
        "tile": ("stacking", True, False),
        "scatter-sub": ("scatter_sub", True, False),
        "select_and_scatter_add": ("pool_grad", True, False),
        "dot_general": ("dot", False, True),
        "transpose": ("transposes", False, False),
    }
    # What needs no lowering rule is read from the table.
    assert REWRITTEN == {"split", "stack", "unstack", "tile", "scatter-sub", "select_and_scatter_add"}


def test_a_second_rewrite_for_one_primitive_is_refused():
    name = "nimble_test_only_primitive"
    registry.rewrites(name)(lambda node, options: [node])
    try:
        with pytest.raises(ValueError, match="two canonicalization rewrites"):
            registry.rewrites(name)(lambda node, options: [])
    finally:
        del registry.REWRITES[name]


def test_the_dot_layout_runs_in_the_sweep_after_merge_dots_only():
    rng = np.random.default_rng(8)
    # a's free axes (0 and 2) are not one run of strides: a is transposed.
    fn = lambda a, b: jnp.einsum("akb,kn->abn", a, b, precision="highest")  # noqa: E731
    graph = trace(fn, rand(rng, 5, 3, 4), rand(rng, 3, 6))
    first = registry.sweep(graph.nodes, Options(), after_merge=False)
    assert first == list(graph.nodes)  # nothing of the first sweep applies
    second = registry.sweep(graph.nodes, Options(), after_merge=True)
    dots = [n for n in second if n.name == "dot_general"]
    assert "transpose" in [n.name for n in second] and all(gemm_layout(n) is not None for n in dots)


def test_input_gradient_of_few_channels_stays_off_cudnn():
    """An image's gradient (3 channels): cuDNN's NHWC backward-data kernels were 26x
    slower than XLA's there (conv_data_grad.MIN_CHANNELS)."""
    rng = np.random.default_rng(8)
    grad_x = jax.grad(lambda x, w: jnp.sum(jnp.tanh(conv(x, w, (2, 2)))))
    new = check(grad_x, [rand(rng, 2, 8, 8, 3), rand(rng, 3, 3, 3, 6)], Options(conv="cudnn"), rtol=1e-4)
    assert "nimble_cudnn_conv_data_grad" not in names(new)


@pytest.mark.parametrize("pool", ["max 3x3/2 SAME", "min 2x2/2 VALID", "max 3x3/1 padded, 2-D"])
def test_a_pool_gradient_is_a_selection_then_a_gather(pool):
    """select_and_scatter_add → nimble_pool_select (each window's offset) and
    nimble_pool_scatter (the gather): two kernels that give jax.jit's values bit for bit,
    ties included (the first best of a window wins), run by the kernel emulator."""
    from tests.helpers.models import assert_emulated_matches_jax

    window, strides, padding, shape = {
        "max 3x3/2 SAME": ((1, 3, 3, 1), (1, 2, 2, 1), "SAME", (2, 9, 9, 3)),
        "min 2x2/2 VALID": ((1, 2, 2, 1), (1, 2, 2, 1), "VALID", (2, 8, 8, 3)),
        "max 3x3/1 padded, 2-D": ((3, 3), (1, 1), ((1, 1), (0, 2)), (6, 7)),
    }[pool]
    reducer, init = (lax.min, jnp.inf) if pool.startswith("min") else (lax.max, -jnp.inf)
    f = jax.grad(lambda x: jnp.sum(lax.reduce_window(x, init, reducer, window, strides, padding) ** 2))
    x = on_host(np.random.default_rng(0).integers(-3, 3, shape), jnp.float32)  # many ties
    plan = nimble.jit(f, backend="interpret").plan(x)
    prims = [n.name for n in plan.graph.nodes]
    assert "select_and_scatter_add" not in prims
    assert "nimble_pool_select" in prims and "nimble_pool_scatter" in prims
    np.testing.assert_array_equal(nimble.jit(f, backend="interpret")(x), jax.jit(f)(x))
    assert_emulated_matches_jax(f, (x,))


@pytest.mark.parametrize("case", ["NHWC 7x7/2", "NHWC 3x3 SAME", "NCHW asymmetric", "NHWC dilated",
                                  "bfloat16", "NHWC 1x1", "NCHW 1x1"])
def test_a_filter_gradient_of_few_channels_is_one_gemm_over_the_forward_patches(case, monkeypatch):
    """conv_filter_grad.MIN_CHANNELS and 1×1 filters of stride 1: the forward
    convolution's patches of x, transposed, times dy; in NHWC neither x nor dy is
    transposed. Values as jax.jit's, and the
    generated kernels (im2col) on the kernel emulator."""
    from tests.helpers.models import assert_emulated_matches_jax

    monkeypatch.setattr(conv_mod.filter_grad, "POINTWISE_GEMM", True)  # off by default (its comment)
    rng = np.random.default_rng(7)
    dn, strides, padding, dilation, x_shape, w_shape, dtype = {
        "NHWC 7x7/2": (NHWC, (2, 2), [(3, 3)] * 2, (1, 1), (4, 20, 18, 3), (7, 7, 3, 8), jnp.float32),
        "NHWC 3x3 SAME": (NHWC, (1, 1), "SAME", (1, 1), (2, 9, 9, 2), (3, 3, 2, 5), jnp.float32),
        "NCHW asymmetric": (None, (2, 2), [(1, 2), (3, 0)], (1, 1), (3, 3, 15, 14), (5, 3, 4, 3), jnp.float32),
        "NHWC dilated": (NHWC, (1, 1), "VALID", (2, 2), (2, 12, 11, 1), (3, 3, 1, 4), jnp.float32),
        "bfloat16": (NHWC, (2, 2), "SAME", (1, 1), (2, 8, 8, 3), (3, 3, 3, 4), jnp.bfloat16),
        # a 1×1 filter of stride 1 (conv_filter_grad.pointwise), channels of any number: x is the patches
        "NHWC 1x1": (NHWC, (1, 1), "VALID", (1, 1), (2, 6, 5, 16), (1, 1, 16, 8), jnp.float32),
        "NCHW 1x1": (None, (1, 1), "SAME", (1, 1), (2, 12, 6, 5), (7, 12, 1, 1), jnp.float32),
    }[case]
    fwd = lambda x, w: lax.conv_general_dilated(x, w, strides, padding, rhs_dilation=dilation,  # noqa: E731
                                                dimension_numbers=dn, precision=lax.Precision.HIGHEST)
    grad_w = jax.grad(lambda x, w: jnp.sum(jnp.tanh(fwd(x, w))).astype(jnp.float32), argnums=1)
    args = [rand(rng, *x_shape).astype(dtype), rand(rng, *w_shape).astype(dtype)]
    options = Options(conv="auto", cudnn=True)
    paths = [conv_mod.conv_path(n, options) for n in trace(grad_w, *args).nodes if n.name == "conv_general_dilated"]
    assert "gemm_filter_grad" in paths, paths
    new = check(grad_w, args, options, rtol=2e-2 if dtype == jnp.bfloat16 else 1e-4)
    assert "nimble_cudnn_conv_filter_grad" not in names(new)
    if "1x1" in case:  # no gather at all: the forward is a GEMM over x, its filter gradient too
        assert "nimble_im2col" not in names(new) and names(new).count("dot_general") >= 2
    elif dn is NHWC:  # x is read as the forward wrote it: the forward's own patches (batch < 8) and these
        ims = [n for n in new.nodes if n.name == "nimble_im2col" and n.inputs[0] is new.inputs[0]]
        assert len(ims) == 2, ims
        # the gradient's patches are stored (R·S·C, N·P·Q): rows N·P·Q long keep the GEMM aligned
        assert sorted(bool(n.params.get("transposed")) for n in ims) == [False, True], ims
    if dtype == jnp.float32:
        assert_emulated_matches_jax(grad_w, tuple(args))


def test_a_convolutions_two_gradients_share_their_rewritten_operands():
    """Both gradients of an NCHW convolution (cuDNN's data and filter gradients) transpose
    the same dy to NHWC: canonicalize merges such repeats (trace.common_subexpressions),
    so the canonicalized graph computes no value twice."""
    from nimblejax.compiler.trace import _cse_key

    rng = np.random.default_rng(3)
    fwd = lambda x, w: lax.conv_general_dilated(x, w, (2, 2), "SAME")  # noqa: E731  NCHW, OIHW
    f = jax.grad(lambda x, w: jnp.sum(jnp.tanh(fwd(x, w))), argnums=(0, 1))
    args = [rand(rng, 8, 8, 9, 9), rand(rng, 16, 8, 3, 3)]
    new = check(f, args, Options(conv="cudnn", cudnn=True), rtol=1e-4)
    assert {"nimble_cudnn_conv_filter_grad", "nimble_cudnn_conv_data_grad"} <= set(names(new))
    keys = [k for n in new.nodes if (k := _cse_key(n)) is not None]
    assert len(keys) == len(set(keys)), "a value computed twice"

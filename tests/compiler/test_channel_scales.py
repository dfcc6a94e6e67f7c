"""A per-channel scale after a cuBLASLt GEMM folded into its weights
(compiler/canonicalize/channel_scales.py): where it is folded (asserted on the plan: the
GEMM's epilogue computes the batch norm's shift, the residual and the relu, and no kernel
reads the product), where it is not, and the numbers against jax.jit under the CPU
interpreter; marked `gpu`, the same on cuBLASLt."""
from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax import lax

import nimblejax as nimble
from tests.helpers.models import assert_tree_close, rand

r = np.random.default_rng(7)
DIMS = ("NHWC", "HWIO", "NHWC")


def conv1x1(x, w):
    return lax.conv_general_dilated(x, w, (1, 1), "VALID", dimension_numbers=DIMS)


def conv_bn_relu(x, w, scale, shift):
    return jnp.maximum(conv1x1(x, w) * scale + shift, 0.0)


def conv_bn_add_relu(x, w, scale, shift, res):
    return jax.nn.relu(conv1x1(x, w) * scale + shift + res)


def conv3x3_bn_relu(x, w, scale, shift, res=None):
    y = lax.conv_general_dilated(x, w, (1, 1), "SAME", dimension_numbers=DIMS) * scale + shift
    return jax.nn.relu(y if res is None else y + res)


def conv_bn_relu6(x, w, scale, shift):
    return jnp.clip(conv1x1(x, w) * scale + shift, 0.0, 6.0)


def args(dtype=jnp.float32, n=2, hw=16, cin=32, cout=64, residual=False):
    a = [rand(r, n, hw, hw, cin, dtype=dtype), rand(r, 1, 1, cin, cout, dtype=dtype, scale=0.2),
         rand(r, cout, dtype=dtype) + 1.5, rand(r, cout, dtype=dtype, scale=0.3)]
    return a + [rand(r, n, hw, hw, cout, dtype=dtype)] * residual


def plan_of(fn, *a):
    return nimble.jit(fn, backend="interpret").plan(*a)


def gemm_and_kernels(plan):
    gemms = [t for t in plan.tasks if t.gemm is not None]
    kernels = [t for t in plan.tasks if t.kind == "kernel" and t.gemm is None]
    return gemms, kernels


def reads_product(kernel, gemm) -> bool:
    return any(v in kernel.inputs for v in gemm.outputs)


def assert_not_folded(plan):
    """The GEMM has no bias, and no kernel reads the weights: the scale stays after it."""
    (g,), kernels = gemm_and_kernels(plan)
    assert "bias" not in g.gemm.label
    assert not any(plan.graph.inputs[1] in k.inputs for k in kernels)


@pytest.mark.parametrize("fn,residual,label", [(conv_bn_relu, False, "bias+relu"),
                                              (conv_bn_add_relu, True, "residual+bias+relu")])
def test_batch_norm_after_a_gemm_is_the_gemms_epilogue(fn, residual, label):
    a = args(residual=residual)
    plan = plan_of(fn, *a)
    (g,), kernels = gemm_and_kernels(plan)
    assert g.gemm.label == label
    assert g.gemm.bias is plan.graph.inputs[3]  # the shift, read as cuBLASLt's bias
    # one kernel: the weights times the scale, read by the GEMM; nothing reads the product
    (k,) = kernels
    assert set(k.inputs) == {plan.graph.inputs[1], plan.graph.inputs[2]} and k.outputs[0] in g.inputs
    assert_tree_close(nimble.jit(fn, backend="interpret")(*a), jax.jit(fn)(*a))


def test_half_types_keep_the_scale_after_the_gemm():
    a = args(jnp.bfloat16)
    assert_not_folded(plan_of(conv_bn_relu, *a))
    assert_tree_close(nimble.jit(conv_bn_relu, backend="interpret")(*a), jax.jit(conv_bn_relu)(*a))


def test_relu6_keeps_its_kernel_and_the_scale_stays_in_it():
    a = args()
    assert_not_folded(plan_of(conv_bn_relu6, *a))
    assert_tree_close(nimble.jit(conv_bn_relu6, backend="interpret")(*a), jax.jit(conv_bn_relu6)(*a))


def test_weights_larger_than_the_product_are_not_scaled():
    # one 2x2 image, 256 -> 512 channels: 131072 weights for a product of 2048 values
    a = args(n=1, hw=2, cin=256, cout=512)
    assert_not_folded(plan_of(conv_bn_relu, *a))
    assert_tree_close(nimble.jit(conv_bn_relu, backend="interpret")(*a), jax.jit(conv_bn_relu)(*a))


def test_a_scale_along_the_rows_or_a_product_read_twice_is_not_folded():
    x, w, scale, shift = args()
    per_pixel = rand(r, 2, 16, 16, 1) + 1.5

    def rows(x, w, s, b):
        return jax.nn.relu(conv1x1(x, w) * s + b)

    def twice(x, w, s, b):
        y = conv1x1(x, w)
        return jax.nn.relu(y * s + b), y

    for fn, a in ((rows, (x, w, per_pixel, shift)), (twice, (x, w, scale, shift))):
        assert_not_folded(plan_of(fn, *a))
        assert_tree_close(nimble.jit(fn, backend="interpret")(*a), jax.jit(fn)(*a))


def test_plain_cublas_has_no_epilogue_so_nothing_is_folded():
    a = args()
    assert_not_folded(nimble.jit(conv_bn_relu, backend="interpret", gemm="cublas").plan(*a))


def conv3x3_args(residual: bool, n=8, hw=12, cin=16, cout=32):
    a = args(n=n, hw=hw, cin=cin, cout=cout, residual=residual)
    a[1] = rand(r, 3, 3, cin, cout, scale=0.1)
    return a


@pytest.mark.parametrize("residual", [False, True])
def test_a_cudnn_convolutions_batch_norm_is_its_fused_bias_and_relu(residual):
    a = conv3x3_args(residual)
    f = nimble.jit(conv3x3_bn_relu, backend="interpret", conv="cudnn")
    plan = f.plan(*a)
    (c,) = [t for t in plan.tasks if t.kind == "cudnn"]
    assert c.conv.label == ("residual+" if residual else "") + "bias+relu"
    assert c.conv.bias is plan.graph.inputs[3] and c.conv.y in plan.graph.outputs
    assert (c.conv.residual is plan.graph.inputs[4]) if residual else c.conv.residual is None
    # one kernel: the weights to KRSC, times the scale; nothing reads the convolution's output
    (k,) = [t for t in plan.tasks if t.kind == "kernel"]
    assert k.outputs == (c.conv.w,)
    assert_tree_close(f(*a), jax.jit(conv3x3_bn_relu)(*a))


def test_a_cudnn_convolution_without_relu_keeps_its_batch_norm_kernel():
    a = conv3x3_args(False)
    fn = lambda x, w, s, b: lax.conv_general_dilated(x, w, (1, 1), "SAME", dimension_numbers=DIMS) * s + b  # noqa: E731
    f = nimble.jit(fn, backend="interpret", conv="cudnn")
    (c,) = [t for t in f.plan(*a).tasks if t.kind == "cudnn"]
    assert not c.conv.epilogue
    assert_tree_close(f(*a), jax.jit(fn)(*a))


@pytest.mark.gpu
@pytest.mark.parametrize("residual", [False, True])
def test_cudnn_fused_bias_and_relu_matches_jax(residual):
    a = conv3x3_args(residual, n=16, hw=28, cin=64, cout=64)
    f = nimble.jit(conv3x3_bn_relu, conv="cudnn")
    assert_tree_close(f(*a), jax.jit(conv3x3_bn_relu)(*a))
    (c,) = [t for t in f.plan(*a).tasks if t.kind == "cudnn"]
    assert c.conv.label.endswith("bias+relu")
    # NaN goes through relu as in jax.numpy.maximum
    x = a[0].at[0, 3, 4, 5].set(jnp.nan)
    got, want = f(x, *a[1:]), jax.jit(conv3x3_bn_relu)(x, *a[1:])
    assert np.array_equal(np.isnan(np.asarray(got)), np.isnan(np.asarray(want)))


@pytest.mark.gpu
@pytest.mark.parametrize("fn,residual", [(conv_bn_relu, False), (conv_bn_add_relu, True)])
def test_folded_batch_norm_on_cublaslt_matches_jax(fn, residual):
    a = args(n=8, hw=28, cin=64, cout=256, residual=residual)
    f = nimble.jit(fn)
    assert_tree_close(f(*a), jax.jit(fn)(*a))
    (g,) = [t for t in f.plan(*a).tasks if t.gemm is not None]
    assert g.gemm.label.endswith("bias+relu")

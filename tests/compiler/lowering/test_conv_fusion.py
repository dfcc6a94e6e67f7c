"""The direct (depthwise) convolution kernel with its input's elementwise producers
(lowering/conv.py: the rule's `fuses`) and its elementwise reader (fusion_conv_post.py)
computed inside it: MobileNetV2's and EfficientNet's blocks; the pooling kernel with its
elementwise reader (an average pool's division). Asserted on the plan; the
numbers against jax.jit under the CPU interpreter and with the generated kernels run by
the kernel emulator; the kernels compiled by NVRTC; marked `gpu`, on the GPU."""
from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax import lax

import nimblejax as nimble
from tests.helpers import kernel_emulator as emu
from tests.helpers.libraries import assert_kernels_compile
from tests.helpers.models import assert_tree_close, rand

r = np.random.default_rng(11)
DIMS = ("NHWC", "HWIO", "NHWC")
N, HW, C, E, OUT = 2, 9, 8, 24, 16  # batch, size, channels, expanded channels, projected


def depthwise(x, w, stride):
    return lax.conv_general_dilated(x, w, (stride, stride), "SAME", dimension_numbers=DIMS,
                                    feature_group_count=x.shape[-1])


def mobilenet_block(x, w_exp, s1, b1, w_dw, s2, b2, w_proj, stride=1):
    h = jnp.clip((x @ w_exp) * s1 + b1, 0.0, 6.0)  # expansion, batch norm, relu6
    h = jnp.clip(depthwise(h, w_dw, stride) * s2 + b2, 0.0, 6.0)
    return h.reshape(-1, h.shape[-1]) @ w_proj  # the projection reads the 2-D layout


def efficientnet_block(x, w_exp, s1, b1, w_dw, s2, b2, w_proj, stride=1):
    h = (x @ w_exp) * s1 + b1
    h = depthwise(h * jax.nn.sigmoid(h), w_dw, stride) * s2 + b2  # swish, then the depthwise conv
    h = h * jax.nn.sigmoid(h)
    return h.reshape(-1, h.shape[-1]) @ w_proj


def block_args():
    return (rand(r, N, HW, HW, C), rand(r, C, E, scale=0.4), rand(r, E) + 1.0, rand(r, E, scale=0.3),
            rand(r, 3, 3, 1, E, scale=0.4), rand(r, E) + 1.0, rand(r, E, scale=0.3), rand(r, E, OUT, scale=0.3))


def plan_of(fn, *args, **kw):
    return nimble.jit(fn, backend="interpret", **kw).plan(*args)


def conv_tasks(plan):
    return [t for t in plan.tasks if t.kind == "kernel" and "conv" in t.kernel.name]


CASES = {"mobilenet": mobilenet_block, "efficientnet": efficientnet_block}


def block_plan(fn, stride):
    """(the block at `stride`, its arguments, its plan, the convolution task, the
    expansion and projection GEMM tasks)."""
    a = block_args()
    g = lambda *a: fn(*a, stride=stride)  # noqa: E731
    plan = plan_of(g, *a)
    (conv,) = conv_tasks(plan)
    expansion, projection = [t for t in plan.tasks if t.gemm is not None]
    return g, a, plan, conv, expansion, projection


@pytest.mark.parametrize("stride", [1, 2])
@pytest.mark.parametrize("name", sorted(CASES))
def test_the_depthwise_kernel_reads_the_gemm_product_and_writes_what_the_next_gemm_reads(name, stride):
    """The tiled kernel (conv_tiled.py) computes the batch norm and relu6, or swish, once
    per loaded element, and the second batch norm and activation after its sum."""
    g, a, plan, conv, expansion, projection = block_plan(CASES[name], stride)
    assert conv.kernel.name.startswith("nimble_dwconv_")
    assert expansion.outputs[0] in conv.inputs  # the producers computed in the tile
    assert reads(projection, conv.outputs[0], plan)
    # no kernel besides the convolution reads or writes an expanded activation
    assert [t for t in plan.tasks if t.kind == "kernel" and t.gemm is None] == [conv]
    if name == "efficientnet":
        assert "logistic" in conv.kernel.name
    assert_tree_close(nimble.jit(g, backend="interpret")(*a), jax.jit(g)(*a))


@pytest.mark.parametrize("stride", [1, 2])
def test_the_generic_kernel_does_not_recompute_swish_in_every_window(stride):
    """Few channels (under conv_tiled.MIN_CHANNELS) take the generic direct kernel, which
    reads each input element once per window position: swish is written first."""
    g = lambda *a: efficientnet_block(*a, stride=stride)  # noqa: E731
    a = (rand(r, N, HW, HW, C), rand(r, C, 8, scale=0.4), rand(r, 8) + 1.0, rand(r, 8, scale=0.3),
         rand(r, 3, 3, 1, 8, scale=0.4), rand(r, 8) + 1.0, rand(r, 8, scale=0.3), rand(r, 8, OUT, scale=0.3))
    plan = plan_of(g, *a)
    (conv,) = conv_tasks(plan)
    assert conv.kernel.name.startswith("nimble_conv_conv_")
    expansion, _ = [t for t in plan.tasks if t.gemm is not None]
    (swish,) = [t for t in plan.tasks if t.kind == "kernel" and t.gemm is None and t is not conv]
    assert expansion.outputs[0] in swish.inputs and swish.outputs[0] in conv.inputs
    assert "logistic" in conv.kernel.name  # the second swish, after the sum
    assert_tree_close(nimble.jit(g, backend="interpret")(*a), jax.jit(g)(*a))


def reads(task, value, plan) -> bool:
    """task reads value's bytes (itself, or a view of it)."""
    same = plan.storage.get(value, value)
    return any(plan.storage.get(v, v) is same for v in task.inputs)


@pytest.mark.skipif(emu.compiler() is None, reason="no C++ compiler for the kernel emulator")
@pytest.mark.parametrize("stride", [1, 2])
@pytest.mark.parametrize("name", sorted(CASES))
def test_emulated_conv_kernels_match_jax(name, stride):
    fn = CASES[name]
    a = block_args()
    g = lambda *a: fn(*a, stride=stride)  # noqa: E731
    plan = plan_of(g, *a)
    outs, emulated = emu.run(plan, [np.asarray(v) for v in a])
    assert emulated >= 1
    assert_tree_close(outs[0], jax.jit(g)(*a))


def test_a_convolution_read_twice_writes_its_result():
    x, w = rand(r, N, HW, HW, E), rand(r, 3, 3, 1, E)

    def two_readers(x, w):
        y = depthwise(x, w, 1)
        return jax.nn.relu(y), jnp.sum(y, axis=(1, 2))

    plan = plan_of(two_readers, x, w)
    (conv,) = conv_tasks(plan)
    assert conv.kernel.name.startswith("nimble_dwconv_f32")  # nothing fused after it
    assert_tree_close(nimble.jit(two_readers, backend="interpret")(x, w), jax.jit(two_readers)(x, w))


def test_conv_kernels_with_fused_producers_and_readers_compile():
    a = block_args()
    kernels = {t.kernel.name: t.kernel.source for fn in CASES.values() for s in (1, 2)
               for t in conv_tasks(plan_of(lambda *a: fn(*a, stride=s), *a))}
    assert len(kernels) == 4
    assert_kernels_compile(kernels, "nimble_conv_fusion")


def avg_pool_branch(x, w):
    """Inception-v3's pooling branch: an average pool (its count a literal) and a 1x1
    convolution reading the 2-D layout."""
    p = lax.reduce_window(x, 0.0, lax.add, (1, 3, 3, 1), (1, 1, 1, 1), "SAME") / 9.0
    return p.reshape(-1, p.shape[-1]) @ w


def counted_avg_pool(x):
    """jax's way with SAME padding: the sum over the count of real elements."""
    dims, strides = (1, 3, 3, 1), (1, 2, 2, 1)
    total = lax.reduce_window(x, 0.0, lax.add, dims, strides, "SAME")
    count = lax.reduce_window(jnp.ones_like(x), 0.0, lax.add, dims, strides, "SAME")
    return jax.nn.relu(total / count - 0.1)


POOLS = {"avg_pool_branch": (avg_pool_branch, lambda: (rand(r, N, HW, HW, E), rand(r, E, OUT, scale=0.3))),
         "counted_avg_pool": (counted_avg_pool, lambda: (rand(r, N, HW, HW, E),))}


@pytest.mark.parametrize("name", sorted(POOLS))
def test_a_pooling_kernel_computes_its_elementwise_reader(name):
    fn, make = POOLS[name]
    a = make()
    plan = plan_of(fn, *a)
    kernels = [t for t in plan.tasks if t.kind == "kernel" and t.gemm is None]
    pools = [t for t in kernels if "pool" in t.kernel.name]
    # the division (and relu) inside the pooling kernel: no other kernel reads a pool's sum
    pooled = {v for t in pools for v in t.outputs}
    assert not any(pooled & set(t.inputs) for t in kernels if t not in pools)
    assert any("div" in t.kernel.name for t in pools)
    assert_tree_close(nimble.jit(fn, backend="interpret")(*a), jax.jit(fn)(*a))
    if emu.compiler() is not None:
        outs, emulated = emu.run(plan, [np.asarray(v) for v in a])
        assert emulated >= 1
        assert_tree_close(outs[0], jax.jit(fn)(*a))
    assert_kernels_compile({t.kernel.name: t.kernel.source for t in pools}, f"nimble_{name}")


@pytest.mark.gpu
@pytest.mark.parametrize("name", sorted(POOLS))
def test_pooling_with_its_reader_on_the_gpu_matches_jax(name):
    fn, make = POOLS[name]
    a = make()
    assert_tree_close(nimble.jit(fn)(*a), jax.jit(fn)(*a))


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("name", sorted(CASES))
def test_fused_depthwise_blocks_on_the_gpu_match_jax(name, dtype):
    fn = CASES[name]
    a = (rand(r, 8, 28, 28, 32), rand(r, 32, 96, scale=0.2), rand(r, 96) + 1.0, rand(r, 96, scale=0.3),
         rand(r, 3, 3, 1, 96, scale=0.4), rand(r, 96) + 1.0, rand(r, 96, scale=0.3), rand(r, 96, 32, scale=0.2))
    a = tuple(jnp.asarray(v, dtype) for v in a)
    for stride in (1, 2):
        g = lambda *a: fn(*a, stride=stride)  # noqa: E731
        got, want = nimble.jit(g)(*a), jax.jit(g)(*a)
        if dtype == "float32":
            assert_tree_close(got, want)
        else:  # XLA's rounding points are not nimble's: relative to the largest value
            got, want = np.asarray(got, np.float32), np.asarray(want, np.float32)
            assert np.abs(got - want).max() <= 0.02 * np.abs(want).max()


def se_block(x, w_dw, s, b, w1, w2):
    """EfficientNet's depthwise convolution, batch norm and swish, then squeeze and excite:
    the swish read by the squeeze's mean and by the excite multiply, the gate a sigmoid
    per image and channel read once per pixel."""
    h = depthwise(x, w_dw, 1) * s + b
    h = h * jax.nn.sigmoid(h)
    z = jnp.mean(h, axis=(1, 2))
    z = jax.nn.sigmoid(jax.nn.silu(z @ w1) @ w2)
    return h * z[:, None, None, :]


def test_a_swish_read_twice_is_written_once_and_the_gate_once_per_channel():
    """Large values with a transcendental function (fusion_costs.TRANSCENDENTAL) are written
    once: the swish by the convolution kernel (its post group), read by the squeeze and
    by the excite multiply; the gate before its broadcast, not recomputed per pixel."""
    a = (rand(r, 2, 48, 48, 256), rand(r, 3, 3, 1, 256, scale=0.4), rand(r, 256) + 1.0,
         rand(r, 256, scale=0.3), rand(r, 256, 16, scale=0.2), rand(r, 16, 256, scale=0.2))
    plan = plan_of(se_block, *a)
    (conv,) = conv_tasks(plan)
    assert "logistic" in conv.kernel.name  # the swish, written by the convolution
    big = [t for t in plan.tasks if t.kind == "kernel" and t.outputs[0].size == conv.outputs[0].size]
    excite = [t for t in big if t is not conv]
    assert len(excite) == 1 and "logistic" not in excite[0].kernel.name
    assert not [t for t in plan.tasks if t.kind == "kernel" and "reduce" in t.kernel.name
                and "logistic" in t.kernel.name]  # the squeeze reads the swish
    want = jax.jit(se_block)(*a)
    assert_tree_close(nimble.jit(se_block, backend="interpret")(*a), want)
    if emu.compiler() is not None:  # the excite, gate and small kernels (the others: JAX)
        outs, emulated = emu.run(plan, [np.asarray(v) for v in a])
        assert emulated >= 3
        assert_tree_close(outs[0], want)


@pytest.mark.skipif(emu.compiler() is None, reason="no C++ compiler for the kernel emulator")
@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
@pytest.mark.parametrize("name", sorted(CASES))
def test_half_precision_kernels_take_their_readers_and_compute_the_same_bytes(name, dtype, monkeypatch):
    """In bfloat16 and float16 the depthwise kernel computes its batch norm and activation
    too: bit for bit what the convolution kernel and a kernel of its own computed (the
    value handed to the reader rounded as stored), and close to jax.jit."""
    from nimblejax.compiler import fusion_conv_post

    a = tuple(np.asarray(v).astype(jnp.dtype(dtype)) for v in block_args())
    g = lambda *a: CASES[name](*a, stride=1)  # noqa: E731
    plan = plan_of(g, *a)
    (conv,) = conv_tasks(plan)
    assert conv.kernel.name.startswith("nimble_dwconv_") and f"_{dtype[0]}" in conv.kernel.name
    fused, _ = emu.run(plan, list(a))
    monkeypatch.setattr(fusion_conv_post, "POST_DTYPES", frozenset({"float32"}))
    alone = plan_of(g, *a)
    assert len(alone.tasks) == len(plan.tasks) + 1
    unfused, _ = emu.run(alone, list(a))
    assert np.asarray(fused[0]).tobytes() == np.asarray(unfused[0]).tobytes()
    got, want = np.asarray(fused[0], np.float32), np.asarray(jax.jit(g)(*a), np.float32)
    # against XLA's rounding points, which are not nimble's: relative to the largest value
    assert np.abs(got - want).max() <= 0.02 * np.abs(want).max()

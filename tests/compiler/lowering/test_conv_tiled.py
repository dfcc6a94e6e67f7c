"""The tiled depthwise convolution kernel (lowering/conv_tiled.py): which convolutions
take it, and its results against jax.jit with its kernels run by the kernel emulator
(several tiles and channel chunks, a partial last chunk, strides, dilation, padding,
half precision, fused producers and readers); the kernels compiled by NVRTC; marked
`gpu`, on the GPU."""
from __future__ import annotations

import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax import lax

import nimblejax as nimble
from nimblejax.compiler.lowering import conv_tiled
from nimblejax.compiler.lowering.conv_tiled import MAX_TILE_BYTES, LANES, tiles
from tests.helpers import kernel_emulator as emu
from tests.helpers.libraries import assert_kernels_compile
from tests.helpers.models import assert_tree_close, rand

r = np.random.default_rng(5)
DIMS = ("NHWC", "HWIO", "NHWC")


def dw(x, w, strides=(1, 1), padding="SAME", dilation=(1, 1)):
    return lax.conv_general_dilated(x, w, strides, padding, rhs_dilation=dilation,
                                    dimension_numbers=DIMS, feature_group_count=x.shape[-1])


def swish_dw_relu(x, w, s, b, strides=(1, 1), padding="SAME", dilation=(1, 1)):
    h = x * s + b
    h = dw(h * jax.nn.sigmoid(h), w, strides, padding, dilation)
    return jax.nn.relu(h * s + b)


# (label, x shape, window, strides, padding, dilation, dtype)
CASES = [
    ("tiles-and-chunks", (2, 19, 21, 48), 3, (1, 1), "SAME", (1, 1), "float32"),
    ("stride2-k5", (1, 17, 15, 40), 5, (2, 2), "SAME", (1, 1), "float32"),
    ("dilated-valid", (1, 12, 13, 32), 3, (1, 1), "VALID", (2, 2), "float32"),
    ("asymmetric-pad", (1, 10, 11, 16), 3, (2, 1), ((0, 2), (1, 0)), (1, 1), "float32"),
    ("half", (1, 11, 9, 24), 3, (1, 1), "SAME", (1, 1), "float16"),
]


def case_args(shape, k, dtype):
    c = shape[-1]
    args = (rand(r, *shape), rand(r, k, k, 1, c, scale=0.4), rand(r, c) + 1.0, rand(r, c, scale=0.3))
    return tuple(a.astype(dtype) for a in args)


def conv_kernels(plan):
    return [t for t in plan.tasks if t.kind == "kernel" and "conv" in t.kernel.name]


@pytest.mark.parametrize("case", CASES, ids=[c[0] for c in CASES])
def test_tiled_kernel_matches_jax_emulated(case):
    _, shape, k, strides, padding, dilation, dtype = case
    a = case_args(shape, k, dtype)
    g = lambda *a: swish_dw_relu(*a, strides=strides, padding=padding, dilation=dilation)  # noqa: E731
    plan = nimble.jit(g, backend="interpret").plan(*a)
    (conv,) = conv_kernels(plan)
    assert conv.kernel.name.startswith("nimble_dwconv_")
    assert "logistic" in conv.kernel.name  # swish computed in the tile
    assert "for (int run = warp;" in conv.kernel.source  # the window loaded by row runs
    if dtype == "float32":  # the only kernel: the producers and the reader are inside it
        assert [t for t in plan.tasks if t.kind == "kernel"] == [conv]
    want = jax.jit(g)(*a)
    assert_tree_close(nimble.jit(g, backend="interpret")(*a), want)
    if emu.compiler() is not None:
        outs, emulated = emu.run(plan, [np.asarray(v) for v in a])
        assert emulated == len([t for t in plan.tasks if t.kind == "kernel"])
        assert_tree_close(outs[0], want)
    assert_kernels_compile({conv.kernel.name: conv.kernel.source}, "nimble_dwconv")


def test_batch_norm_parameters_are_read_once_per_channel_not_per_position():
    """conv_tiled.per_channel: the producers' and the reader's scale and shift (read
    through a broadcast along the channels) are loaded before the loops over positions."""
    a = case_args((2, 16, 18, 32), 3, "bfloat16")
    plan = nimble.jit(swish_dw_relu, backend="interpret").plan(*a)
    source = conv_kernels(plan)[0].kernel.source
    load_loop, out_loop = source.index("for (int run = warp;"), source.index("for (int e = warp;")
    assert len(re.findall(r"in\d+\[cc\]", source[:load_loop])) == 2
    assert len(re.findall(r"in\d+\[c\]", source[load_loop:out_loop])) == 2 + 1  # and the first tap
    assert not re.findall(r"in\d+\[cc?\]", source[out_loop:])
    assert not re.findall(r"in\d+\[cc\]", source[load_loop:out_loop])


def test_run_length_keeps_the_busiest_warp_short():
    assert conv_tiled.run_length(18, 10) == 6   # 3 runs a row, 30 runs: 4 a warp, 24 elements
    assert conv_tiled.run_length(33, 17) == 3   # 11 runs a row, 187 runs: 24 a warp, 72 elements
    for iw, ih in [(18, 10), (33, 17), (20, 12), (35, 19), (3, 3)]:
        u = conv_tiled.run_length(iw, ih)
        assert u in conv_tiled.RUNS


def test_a_plain_depthwise_convolution_alone():
    x, w = rand(r, 2, 9, 10, 40), rand(r, 3, 3, 1, 40)
    plan = nimble.jit(dw, backend="interpret").plan(x, w)
    (conv,) = conv_kernels(plan)
    assert conv.kernel.name.startswith("nimble_dwconv_f32")
    if emu.compiler() is not None:
        outs, _ = emu.run(plan, [x, w])
        assert_tree_close(outs[0], jax.jit(dw)(x, w))


def node_of(fn, *args):
    """The conv_general_dilated node of fn's plan graph."""
    from nimblejax.compiler.pipeline import trace_stages
    from nimblejax.options import Options

    specs = [jax.ShapeDtypeStruct(a.shape, a.dtype) for a in args]
    graph = trace_stages(fn, specs, Options())["canonicalize"].value
    (node,) = [n for n in graph.nodes if n.name == "conv_general_dilated"]
    return node


def test_which_convolutions_take_tiles():
    x, w = jnp.zeros((1, 56, 56, 96)), jnp.zeros((3, 3, 1, 96))
    t = tiles(node_of(dw, x, w))
    assert (t.th, t.tw, t.ih, t.iw) == (8, 16, 10, 18)
    t = tiles(node_of(lambda x, w: dw(x, w, (2, 2)), x, jnp.zeros((5, 5, 1, 96))))
    assert t.ih * t.iw * LANES * 4 <= MAX_TILE_BYTES
    # few channels, a channel multiplier, NCHW: the generic kernel
    assert tiles(node_of(dw, jnp.zeros((1, 8, 8, 8)), jnp.zeros((3, 3, 1, 8)))) is None
    mult = lambda x, w: lax.conv_general_dilated(x, w, (1, 1), "SAME", dimension_numbers=DIMS,  # noqa: E731
                                                 feature_group_count=16)
    assert tiles(node_of(mult, jnp.zeros((1, 8, 8, 16)), jnp.zeros((3, 3, 1, 32)))) is None
    nchw = lambda x, w: lax.conv_general_dilated(x, w, (1, 1), "SAME", feature_group_count=32)  # noqa: E731
    assert tiles(node_of(nchw, jnp.zeros((1, 32, 8, 8)), jnp.zeros((32, 1, 3, 3)))) is None


@pytest.mark.gpu
@pytest.mark.parametrize("case", CASES, ids=[c[0] for c in CASES])
def test_tiled_kernel_on_the_gpu_matches_jax(case):
    _, shape, k, strides, padding, dilation, dtype = case
    a = case_args((8, 2 * shape[1] + 3, 2 * shape[2] + 1, 3 * shape[3]), k, dtype)
    g = lambda *a: swish_dw_relu(*a, strides=strides, padding=padding, dilation=dilation)  # noqa: E731
    assert_tree_close(nimble.jit(g)(*a), jax.jit(g)(*a))

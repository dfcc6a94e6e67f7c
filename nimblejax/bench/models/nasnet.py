"""NASNet-A Mobile (Zoph et al. 2018), "4 @ 1056", 224×224.

Follows TF-slim's nasnet.py (mobile ImageNet config): stem 3×3/2 conv 32 (valid) + BN,
two reduction cells as the stem (filters 11 and 22), then 12 normal cells in three
stacks of 4 (filters 44, 88, 176) with a reduction cell before the second and third
stack; ReLU, global average pool, dense 1056 → 1000.

Cells are the paper's NASNet-A normal and reduction cells (5 blocks each, combined by
addition; the normal cell concatenates the previous-cell input and the 5 block outputs,
the reduction cell its 4 unused block outputs). Each cell starts with ReLU + 1×1 conv +
BN on its input, and brings the previous-previous input to shape with a 1×1 conv (same
size) or the factorized reduction (two shifted stride-2 1×1 paths, concatenated) when
the spatial size differs. Separable ops are two stacked ReLU + separable conv (depthwise
k×k, depth multiplier 1, then pointwise 1×1, no bias) + BN, the first carrying the
stride; "none" is identity (or ReLU + 1×1 conv + BN where it must change shape); pools
are 3×3 with TensorFlow SAME padding (average pool excluding the padding).

Simplified: inference only, so no auxiliary head, no drop-path, no dropout; batch norm
folded into a per-channel scale and shift; the stride-2 1×1 average pools of the
factorized reduction are written as strided slices (the same values).
"""
from __future__ import annotations

from dataclasses import dataclass

import jax.numpy as jnp
from jax import lax

from nimblejax.bench.models import layers as L

NORMAL = dict(
    ops=("separable_5x5_2", "separable_3x3_2", "separable_5x5_2", "separable_3x3_2",
         "avg_pool_3x3", "none", "avg_pool_3x3", "avg_pool_3x3", "separable_3x3_2", "none"),
    inputs=(0, 1, 1, 1, 0, 1, 1, 1, 0, 0),
    used=(1, 0, 0, 0, 0, 0, 0))
REDUCTION = dict(
    ops=("separable_5x5_2", "separable_7x7_2", "max_pool_3x3", "separable_7x7_2",
         "avg_pool_3x3", "separable_5x5_2", "none", "avg_pool_3x3", "separable_3x3_2",
         "max_pool_3x3"),
    inputs=(0, 1, 0, 1, 0, 1, 3, 2, 2, 0),
    used=(1, 1, 1, 0, 0, 0, 0))


@dataclass(frozen=True)
class Config:
    cells: int = 12  # normal cells (3 stacks)
    filters: int = 44  # penultimate filters 1056 = 24 × 44
    stem_filters: int = 32
    image: int = 224
    classes: int = 1000


FULL = Config()
TINY = Config(cells=3, filters=8, stem_filters=8, image=32)


def input_shape(cfg: Config, batch: int) -> tuple:
    return (batch, cfg.image, cfg.image, 3)


def reduction_layers(cells: int, reductions: int = 2) -> list[int]:
    return [int(p / (reductions + 1) * cells) for p in range(1, reductions + 1)]


def factorized_reduction(ctx: L.Context, x, filters: int, stride: int):
    if stride == 1:
        return L.conv_bn(ctx, x, filters, 1)
    n, h, w, c = x.shape
    p1 = lax.slice(x, (0, 0, 0, 0), (n, h, w, c), (1, 2, 2, 1))
    p1 = L.conv(ctx, p1, filters // 2, 1)
    shifted = jnp.pad(x, ((0, 0), (0, 1), (0, 1), (0, 0)))  # shift by one pixel
    p2 = lax.slice(shifted, (0, 1, 1, 0), (n, h + 1, w + 1, c), (1, 2, 2, 1))
    p2 = L.conv(ctx, p2, filters // 2 + filters % 2, 1)
    return L.batch_norm(ctx, jnp.concatenate([p1, p2], axis=-1))


def _separable(ctx: L.Context, x, filters: int, kernel: int, layers: int, stride: int):
    for i in range(layers):
        x = L.separable_conv(ctx, L.relu(x), filters, kernel, stride)
        x = L.batch_norm(ctx, x, scale=0.5 if i == layers - 1 else 1.0)  # random init: keep sums bounded
        stride = 1
    return x


def apply_op(ctx: L.Context, x, op: str, stride: int, filters: int):
    in_ch = x.shape[-1]
    if op.startswith("separable"):
        k, layers = op.split("_")[1:]
        return _separable(ctx, x, filters, int(k.split("x")[0]), int(layers), stride)
    if op == "none":
        if stride > 1 or in_ch != filters:
            x = L.conv_bn(ctx, L.relu(x), filters, 1, stride=stride)
        return x
    if op == "avg_pool_3x3":
        x = L.avg_pool(x, 3, stride, "SAME", count_include_pad=False)
    elif op == "max_pool_3x3":
        x = L.max_pool(x, 3, stride, "SAME")
    else:
        raise ValueError(op)
    if in_ch != filters:
        x = L.conv_bn(ctx, x, filters, 1)
    return x


def cell(ctx: L.Context, net, prev, filters: int, stride: int, spec: dict):
    if prev is None:
        prev = net
    elif prev.shape[2] != net.shape[2]:
        prev = factorized_reduction(ctx, L.relu(prev), filters, 2)
    elif prev.shape[-1] != filters:
        prev = L.conv_bn(ctx, L.relu(prev), filters, 1)
    hs = [L.conv_bn(ctx, L.relu(net), filters, 1), prev]
    ops, inputs = spec["ops"], spec["inputs"]
    for i in range(0, len(ops), 2):
        pair = []
        for j in (i, i + 1):
            with ctx.scope(f"comb{i // 2}_{'left' if j == i else 'right'}"):
                s = stride if inputs[j] < 2 else 1
                pair.append(apply_op(ctx, hs[inputs[j]], ops[j], s, filters))
        hs.append(pair[0] + pair[1])
    final = hs[-1]
    out = []
    for i, (h, used) in enumerate(zip(hs, spec["used"])):
        if used:
            continue
        if h.shape[2] != final.shape[2] or h.shape[-1] != final.shape[-1]:
            with ctx.scope(f"reduce{i}"):
                h = factorized_reduction(ctx, h, final.shape[-1], 2 if h.shape[2] != final.shape[2] else 1)
        out.append(h)
    return jnp.concatenate(out, axis=-1)


def forward(cfg: Config, ctx: L.Context, x):
    net = L.conv_bn(ctx, x, cfg.stem_filters, 3, stride=2, padding="VALID")
    outputs = [None, net]
    scaling = 1.0 / 4  # two stem cells, filter scaling rate 2
    for i in range(2):
        with ctx.scope(f"stem{i}"):
            net = cell(ctx, net, outputs[-2], int(cfg.filters * scaling), 2, REDUCTION)
        outputs.append(net)
        scaling *= 2
    scaling = 1.0
    reductions = reduction_layers(cfg.cells)
    for i in range(cfg.cells):
        if i in reductions:
            scaling *= 2
            with ctx.scope(f"reduction{reductions.index(i)}"):
                net = cell(ctx, net, outputs[-2], int(cfg.filters * scaling), 2, REDUCTION)
            outputs.append(net)
        with ctx.scope(f"cell{i}"):
            net = cell(ctx, net, outputs[-2], int(cfg.filters * scaling), 1, NORMAL)
        outputs.append(net)
    return L.dense(ctx, L.global_avg_pool(L.relu(net)), cfg.classes, name="classifier")

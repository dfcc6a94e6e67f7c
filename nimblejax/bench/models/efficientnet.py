"""EfficientNet-B0 (Tan & Le 2019), 224×224.

Stem 3×3/2 conv 32 + BN + swish; MBConv stages (expand, kernel, stride, out, repeats) =
(1,3,1,16,1) (6,3,2,24,2) (6,5,2,40,2) (6,3,2,80,3) (6,5,1,112,3) (6,5,2,192,4)
(6,3,1,320,1): 1×1 expansion + BN + swish, k×k depthwise + BN + swish, squeeze-excitation
(global mean, reduce to max(1, in/4) channels with bias + swish, expand with bias +
sigmoid, rescale), linear 1×1 projection + BN, identity skip when stride 1 and in = out;
head 1×1 conv 1280 + BN + swish; global average pool; dense 1280 → 1000. Inference:
no dropout, no drop-connect. TensorFlow SAME padding. The squeeze-excitation 1×1 convs on
a 1×1 map are written as dense layers (the same arithmetic).
"""
from __future__ import annotations

import math
from dataclasses import dataclass

from nimblejax.bench.models import layers as L

STAGES = ((1, 3, 1, 16, 1), (6, 3, 2, 24, 2), (6, 5, 2, 40, 2), (6, 3, 2, 80, 3),
          (6, 5, 1, 112, 3), (6, 5, 2, 192, 4), (6, 3, 1, 320, 1))


@dataclass(frozen=True)
class Config:
    width: float = 1.0
    depth: float = 1.0
    image: int = 224
    classes: int = 1000
    head: int = 1280


FULL = Config()
TINY = Config(width=0.125, depth=0.5, image=32, head=128)


def input_shape(cfg: Config, batch: int) -> tuple:
    return (batch, cfg.image, cfg.image, 3)


def _filters(cfg: Config, c: int) -> int:
    return L.make_divisible(c * cfg.width, 8)


def squeeze_excite(ctx: L.Context, x, reduced: int):
    s = L.global_avg_pool(x)
    s = L.swish(L.dense(ctx, s, reduced, name="se_reduce"))
    s = L.sigmoid(L.dense(ctx, s, x.shape[-1], name="se_expand"))
    return x * s[:, None, None, :]


def mbconv(ctx: L.Context, x, out_ch: int, kernel: int, stride: int, expand: int):
    in_ch = x.shape[-1]
    h = x
    if expand != 1:
        h = L.conv_bn(ctx, h, in_ch * expand, 1, act=L.swish)
    h = L.swish(L.batch_norm(ctx, L.depthwise(ctx, h, kernel, stride)))
    h = squeeze_excite(ctx, h, max(1, int(in_ch * 0.25)))
    h = L.conv_bn(ctx, h, out_ch, 1, bn_scale=0.5)
    return x + h if stride == 1 and in_ch == out_ch else h


def forward(cfg: Config, ctx: L.Context, x):
    x = L.conv_bn(ctx, x, _filters(cfg, 32), 3, stride=2, act=L.swish)
    for si, (e, k, s, c, n) in enumerate(STAGES):
        out_ch = _filters(cfg, c)
        for i in range(int(math.ceil(n * cfg.depth))):
            with ctx.scope(f"stage{si}_block{i}"):
                x = mbconv(ctx, x, out_ch, k, s if i == 0 else 1, e)
    x = L.conv_bn(ctx, x, _filters(cfg, cfg.head), 1, act=L.swish)
    return L.dense(ctx, L.global_avg_pool(x), cfg.classes, name="classifier")

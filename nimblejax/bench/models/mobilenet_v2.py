"""MobileNetV2 (Sandler et al. 2018), 224×224.

Stem 3×3/2 conv 32 + BN + ReLU6; inverted residual blocks (t, c, n, s) =
(1,16,1,1) (6,24,2,2) (6,32,3,2) (6,64,4,2) (6,96,3,1) (6,160,3,2) (6,320,1,1):
1×1 expansion + BN + ReLU6, 3×3 depthwise (feature_group_count = channels) + BN + ReLU6,
linear 1×1 projection + BN, residual when stride 1 and shapes match; 1×1 conv 1280 + BN +
ReLU6; global average pool; dense 1280 → 1000 (dropout omitted: inference). Channels
are rounded to multiples of 8 as in the reference code; for width < 1 the last conv stays
1280 (as in the paper). TensorFlow SAME padding.
"""
from __future__ import annotations

from dataclasses import dataclass

from nimblejax.bench.models import layers as L

SETTINGS = ((1, 16, 1, 1), (6, 24, 2, 2), (6, 32, 3, 2), (6, 64, 4, 2),
            (6, 96, 3, 1), (6, 160, 3, 2), (6, 320, 1, 1))


@dataclass(frozen=True)
class Config:
    width: float = 1.0
    image: int = 224
    classes: int = 1000
    last_channels: int = 1280


FULL = Config()
TINY = Config(width=0.125, image=32, last_channels=128)


def input_shape(cfg: Config, batch: int) -> tuple:
    return (batch, cfg.image, cfg.image, 3)


def inverted_residual(ctx: L.Context, x, out_ch: int, stride: int, expand: int):
    in_ch = x.shape[-1]
    h = x
    if expand != 1:
        h = L.conv_bn(ctx, h, in_ch * expand, 1, act=L.relu6)
    h = L.batch_norm(ctx, L.depthwise(ctx, h, 3, stride))
    h = L.relu6(h)
    h = L.conv_bn(ctx, h, out_ch, 1, bn_scale=0.5)
    return x + h if stride == 1 and in_ch == out_ch else h


def forward(cfg: Config, ctx: L.Context, x):
    x = L.conv_bn(ctx, x, L.make_divisible(32 * cfg.width), 3, stride=2, act=L.relu6)
    for si, (t, c, n, s) in enumerate(SETTINGS):
        out_ch = L.make_divisible(c * cfg.width)
        for i in range(n):
            with ctx.scope(f"block{si}_{i}"):
                x = inverted_residual(ctx, x, out_ch, s if i == 0 else 1, t)
    last = L.make_divisible(cfg.last_channels * max(1.0, cfg.width))
    x = L.conv_bn(ctx, x, last, 1, act=L.relu6)
    return L.dense(ctx, L.global_avg_pool(x), cfg.classes, name="classifier")

"""ResNet-50 (He et al. 2016), torchvision's v1.5 layout (stride 2 on the 3×3 conv).

Stem 7×7/2 conv 64 + BN + ReLU + 3×3/2 max pool; bottleneck stages [3, 4, 6, 3] of
widths 64/128/256/512 (expansion 4); projection shortcuts (1×1 conv + BN) where shape
changes; global average pool; dense 2048 → 1000. PyTorch's explicit symmetric padding.
Batch norm is in inference form (folded scale and shift); the last BN of each residual
branch starts at scale 0.2 so the random network's activations stay bounded.
"""
from __future__ import annotations

from dataclasses import dataclass

from nimblejax.bench.models import layers as L


@dataclass(frozen=True)
class Config:
    blocks: tuple = (3, 4, 6, 3)
    width: float = 1.0
    image: int = 224
    classes: int = 1000


FULL = Config()
TINY = Config(blocks=(1, 1, 1, 1), width=0.125, image=32)


def input_shape(cfg: Config, batch: int) -> tuple:
    return (batch, cfg.image, cfg.image, 3)


def _ch(cfg: Config, c: int) -> int:
    return max(1, int(round(c * cfg.width)))


def bottleneck(ctx: L.Context, x, width: int, stride: int):
    out_ch = 4 * width
    h = L.conv_bn(ctx, x, width, 1, padding=0, act=L.relu)
    h = L.conv_bn(ctx, h, width, 3, stride=stride, padding=1, act=L.relu)
    h = L.conv_bn(ctx, h, out_ch, 1, padding=0, bn_scale=0.2)
    if stride != 1 or x.shape[-1] != out_ch:
        x = L.conv_bn(ctx, x, out_ch, 1, stride=stride, padding=0)
    return L.relu(h + x)


def forward(cfg: Config, ctx: L.Context, x):
    x = L.conv_bn(ctx, x, _ch(cfg, 64), 7, stride=2, padding=3, act=L.relu)
    x = L.max_pool(x, 3, 2, padding=1)
    for stage, (n, w) in enumerate(zip(cfg.blocks, (64, 128, 256, 512))):
        for i in range(n):
            with ctx.scope(f"stage{stage}_block{i}"):
                x = bottleneck(ctx, x, _ch(cfg, w), stride=2 if (i == 0 and stage > 0) else 1)
    return L.dense(ctx, L.global_avg_pool(x), cfg.classes, name="classifier")

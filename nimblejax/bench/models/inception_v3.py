"""Inception-v3 (Szegedy et al. 2016), 299×299, torchvision's layout without the
auxiliary classifier (an inference benchmark never evaluates it).

Every conv is BasicConv2d: conv (no bias) + BN + ReLU. Stem: 3×3/2 32 (valid), 3×3 32
(valid), 3×3 64 (pad 1), 3×3/2 max pool, 1×1 80, 3×3 192 (valid), 3×3/2 max pool.
Then Mixed_5b/5c/5d (InceptionA, pool features 32/64/64), Mixed_6a (InceptionB),
Mixed_6b–6e (InceptionC, 7×7 factorized as 1×7/7×1, c7 = 128/160/160/192), Mixed_7a
(InceptionD), Mixed_7b/7c (InceptionE, split 1×3/3×1 branches), global average pool,
dense 2048 → 1000 (dropout omitted). Average pools inside blocks are 3×3/1 pad 1 with the
padding counted (PyTorch's default). BN eps is folded away.
"""
from __future__ import annotations

from dataclasses import dataclass

import jax.numpy as jnp

from nimblejax.bench.models import layers as L


@dataclass(frozen=True)
class Config:
    width: float = 1.0
    image: int = 299
    classes: int = 1000


FULL = Config()
TINY = Config(width=0.125, image=75)  # 75 is the smallest input the valid convs allow


def input_shape(cfg: Config, batch: int) -> tuple:
    return (batch, cfg.image, cfg.image, 3)


class _Net:
    def __init__(self, cfg: Config, ctx: L.Context) -> None:
        self.cfg, self.ctx = cfg, ctx

    def c(self, x, ch: int, kernel, stride: int = 1, padding=0):
        """BasicConv2d."""
        ch = max(1, int(round(ch * self.cfg.width)))
        return L.conv_bn(self.ctx, x, ch, kernel, stride=stride, padding=padding, act=L.relu)

    def block_a(self, x, pool_features: int):
        b1 = self.c(x, 64, 1)
        b5 = self.c(self.c(x, 48, 1), 64, 5, padding=2)
        b3 = self.c(self.c(self.c(x, 64, 1), 96, 3, padding=1), 96, 3, padding=1)
        bp = self.c(L.avg_pool(x, 3, 1, padding=1), pool_features, 1)
        return jnp.concatenate([b1, b5, b3, bp], axis=-1)

    def block_b(self, x):
        b3 = self.c(x, 384, 3, stride=2)
        bd = self.c(self.c(self.c(x, 64, 1), 96, 3, padding=1), 96, 3, stride=2)
        bp = L.max_pool(x, 3, 2)
        return jnp.concatenate([b3, bd, bp], axis=-1)

    def block_c(self, x, c7: int):
        b1 = self.c(x, 192, 1)
        b7 = self.c(x, c7, 1)
        b7 = self.c(b7, c7, (1, 7), padding=(0, 3))
        b7 = self.c(b7, 192, (7, 1), padding=(3, 0))
        bd = self.c(x, c7, 1)
        bd = self.c(bd, c7, (7, 1), padding=(3, 0))
        bd = self.c(bd, c7, (1, 7), padding=(0, 3))
        bd = self.c(bd, c7, (7, 1), padding=(3, 0))
        bd = self.c(bd, 192, (1, 7), padding=(0, 3))
        bp = self.c(L.avg_pool(x, 3, 1, padding=1), 192, 1)
        return jnp.concatenate([b1, b7, bd, bp], axis=-1)

    def block_d(self, x):
        b3 = self.c(self.c(x, 192, 1), 320, 3, stride=2)
        b7 = self.c(x, 192, 1)
        b7 = self.c(b7, 192, (1, 7), padding=(0, 3))
        b7 = self.c(b7, 192, (7, 1), padding=(3, 0))
        b7 = self.c(b7, 192, 3, stride=2)
        bp = L.max_pool(x, 3, 2)
        return jnp.concatenate([b3, b7, bp], axis=-1)

    def block_e(self, x):
        b1 = self.c(x, 320, 1)
        b3 = self.c(x, 384, 1)
        b3 = jnp.concatenate([self.c(b3, 384, (1, 3), padding=(0, 1)),
                              self.c(b3, 384, (3, 1), padding=(1, 0))], axis=-1)
        bd = self.c(self.c(x, 448, 1), 384, 3, padding=1)
        bd = jnp.concatenate([self.c(bd, 384, (1, 3), padding=(0, 1)),
                              self.c(bd, 384, (3, 1), padding=(1, 0))], axis=-1)
        bp = self.c(L.avg_pool(x, 3, 1, padding=1), 192, 1)
        return jnp.concatenate([b1, b3, bd, bp], axis=-1)


def forward(cfg: Config, ctx: L.Context, x):
    n = _Net(cfg, ctx)
    x = n.c(x, 32, 3, stride=2)
    x = n.c(x, 32, 3)
    x = n.c(x, 64, 3, padding=1)
    x = L.max_pool(x, 3, 2)
    x = n.c(x, 80, 1)
    x = n.c(x, 192, 3)
    x = L.max_pool(x, 3, 2)
    for name, pf in (("mixed_5b", 32), ("mixed_5c", 64), ("mixed_5d", 64)):
        with ctx.scope(name):
            x = n.block_a(x, pf)
    with ctx.scope("mixed_6a"):
        x = n.block_b(x)
    for name, c7 in (("mixed_6b", 128), ("mixed_6c", 160), ("mixed_6d", 160), ("mixed_6e", 192)):
        with ctx.scope(name):
            x = n.block_c(x, c7)
    with ctx.scope("mixed_7a"):
        x = n.block_d(x)
    for name in ("mixed_7b", "mixed_7c"):
        with ctx.scope(name):
            x = n.block_e(x)
    return L.dense(ctx, L.global_avg_pool(x), cfg.classes, name="classifier")

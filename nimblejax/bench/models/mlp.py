"""Branchy MLP: parallel branches of dense + bias + tanh, summed (the multi-stream case).

Full size: 8 branches × 6 layers of 256×256, input (batch, 256). Each branch is an
independent chain, so the graph has 8-way parallelism for the multi-stream scheduler.
"""
from __future__ import annotations

from dataclasses import dataclass

import jax.numpy as jnp

from nimblejax.bench.models import layers as L


@dataclass(frozen=True)
class Config:
    branches: int = 8
    layers: int = 6
    width: int = 256


FULL = Config()
TINY = Config(branches=3, layers=2, width=32)


def input_shape(cfg: Config, batch: int) -> tuple:
    return (batch, cfg.width)


def forward(cfg: Config, ctx: L.Context, x):
    out = None
    for b in range(cfg.branches):
        with ctx.scope(f"branch{b}"):
            h = x
            for _ in range(cfg.layers):
                h = jnp.tanh(L.dense(ctx, h, cfg.width))
        out = h if out is None else out + h
    return out

"""LSTM, unrolled with a Python loop (not lax.scan), returning the last hidden state.

Full size: 32 steps, hidden 512, input (batch, 32, 512). Gates (i, f, g, o) as in
Hochreiter & Schmidhuber / cuDNN: one (in, 4·hidden) input matrix, one (hidden,
4·hidden) recurrent matrix and one bias. The input projections of all steps are
independent of the recurrence, which gives the scheduler work to overlap.
"""
from __future__ import annotations

from dataclasses import dataclass

import jax.numpy as jnp

from nimblejax.bench.models import layers as L


@dataclass(frozen=True)
class Config:
    steps: int = 32
    hidden: int = 512
    features: int = 512


FULL = Config()
TINY = Config(steps=4, hidden=32, features=16)


def input_shape(cfg: Config, batch: int) -> tuple:
    return (batch, cfg.steps, cfg.features)


def forward(cfg: Config, ctx: L.Context, x):
    hd = cfg.hidden
    w_ih = ctx.param("w_ih", (cfg.features, 4 * hd), "normal", 1.0 / cfg.features ** 0.5)
    w_hh = ctx.param("w_hh", (hd, 4 * hd), "normal", 1.0 / hd ** 0.5)
    b = ctx.param("b", (4 * hd,), "bn_shift", 1.0)
    batch = x.shape[0]
    h = jnp.zeros((batch, hd), x.dtype)
    c = jnp.zeros((batch, hd), x.dtype)
    for t in range(cfg.steps):
        z = x[:, t, :] @ w_ih + h @ w_hh + b
        i, f, g, o = (z[:, k * hd:(k + 1) * hd] for k in range(4))
        c = L.sigmoid(f) * c + L.sigmoid(i) * jnp.tanh(g)
        h = L.sigmoid(o) * jnp.tanh(c)
    return h

"""A decoder-only transformer (GPT-2 style): pre-LN layers of causal self-attention
through `jax.nn.dot_product_attention(..., is_causal=True)` and a tanh-GELU MLP, a final
LayerNorm. Not in the default suite (`python -m nimblejax.bench --models gpt`).

Full size: 4 layers, hidden 512, 8 heads, FFN 2048, sequence 128, LayerNorm eps 1e-5.
The input is the embedding output (batch, seq, hidden) in float32: no tokenizer, no
embedding lookup, no LM head.
"""
from __future__ import annotations

from dataclasses import dataclass

import jax

from nimblejax.bench.models import layers as L


@dataclass(frozen=True)
class Config:
    layers: int = 4
    hidden: int = 512
    heads: int = 8
    ffn: int = 2048
    seq: int = 128


FULL = Config()
TINY = Config(layers=2, hidden=64, heads=4, ffn=128, seq=16)
EPS = 1e-5


def input_shape(cfg: Config, batch: int) -> tuple:
    return (batch, cfg.seq, cfg.hidden)


def attention(cfg: Config, ctx: L.Context, x):
    b, s, d = x.shape
    h, dh = cfg.heads, d // cfg.heads
    q = L.dense(ctx, x, d, name="query").reshape(b, s, h, dh)
    k = L.dense(ctx, x, d, name="key").reshape(b, s, h, dh)
    v = L.dense(ctx, x, d, name="value").reshape(b, s, h, dh)
    y = jax.nn.dot_product_attention(q, k, v, is_causal=True).reshape(b, s, d)
    return L.dense(ctx, y, d, name="attn_out")


def forward(cfg: Config, ctx: L.Context, x):
    for i in range(cfg.layers):
        with ctx.scope(f"layer{i}"):
            x = x + attention(cfg, ctx, L.layer_norm(ctx, x, EPS, name="ln_attn"))
            h = L.layer_norm(ctx, x, EPS, name="ln_mlp")
            h = jax.nn.gelu(L.dense(ctx, h, cfg.ffn, name="ffn_in"), approximate=True)
            x = x + L.dense(ctx, h, cfg.hidden, name="ffn_out")
    return L.layer_norm(ctx, x, EPS, name="ln_final")

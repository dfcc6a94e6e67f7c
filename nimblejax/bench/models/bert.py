"""BERT-base encoder stack (Devlin et al. 2019): post-LN transformer layers.

Full size: 12 layers, hidden 768, 12 heads, FFN 3072, exact (erf) GELU, sequence 128.
The input is the embedding output (batch, seq, hidden) in float32: no tokenizer, no
embedding lookup (no gather), no attention mask, no pooler. LayerNorm eps 1e-12.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import jax.numpy as jnp

from nimblejax.bench.models import layers as L


@dataclass(frozen=True)
class Config:
    layers: int = 12
    hidden: int = 768
    heads: int = 12
    ffn: int = 3072
    seq: int = 128


FULL = Config()
TINY = Config(layers=2, hidden=64, heads=4, ffn=128, seq=16)


def input_shape(cfg: Config, batch: int) -> tuple:
    return (batch, cfg.seq, cfg.hidden)


def attention(cfg: Config, ctx: L.Context, x):
    b, s, d = x.shape
    q, k, v = L.heads_qkv(ctx, x, cfg.heads)
    scores = jnp.einsum("bqhd,bkhd->bhqk", q, k) * (1.0 / math.sqrt(d // cfg.heads))
    ctx_v = jnp.einsum("bhqk,bkhd->bqhd", L.softmax(scores, axis=-1), v).reshape(b, s, d)
    return L.dense(ctx, ctx_v, d, name="attn_out")


def forward(cfg: Config, ctx: L.Context, x):
    for i in range(cfg.layers):
        with ctx.scope(f"layer{i}"):
            x = L.layer_norm(ctx, x + attention(cfg, ctx, x))
            ff = L.dense(ctx, L.gelu(L.dense(ctx, x, cfg.ffn, name="ffn_in")), cfg.hidden, name="ffn_out")
            x = L.layer_norm(ctx, x + ff)
    return x

"""A decoder-only transformer (GPT-2 style): pre-LN layers of causal self-attention
through `jax.nn.dot_product_attention(..., is_causal=True)` and a tanh-GELU MLP, a final
LayerNorm. Not in the default suite (`python -m nimblejax.bench --models gpt`).

Full size: 4 layers, hidden 512, 8 heads, FFN 2048, sequence 128, LayerNorm eps 1e-5.
The input is the embedding output (batch, seq, hidden) in float32: no tokenizer, no
embedding lookup, no LM head.
"""
from __future__ import annotations

import jax

from nimblejax.bench.models import layers as L
from nimblejax.bench.models.bert import TINY, Config, input_shape  # noqa: F401 (the model's API)

FULL = Config(layers=4, hidden=512, heads=8, ffn=2048, seq=128)
EPS = 1e-5


def attention(cfg: Config, ctx: L.Context, x):
    q, k, v = L.heads_qkv(ctx, x, cfg.heads)
    y = jax.nn.dot_product_attention(q, k, v, is_causal=True).reshape(x.shape)
    return L.dense(ctx, y, x.shape[-1], name="attn_out")


def forward(cfg: Config, ctx: L.Context, x):
    for i in range(cfg.layers):
        with ctx.scope(f"layer{i}"):
            x = x + attention(cfg, ctx, L.layer_norm(ctx, x, EPS, name="ln_attn"))
            h = L.layer_norm(ctx, x, EPS, name="ln_mlp")
            h = jax.nn.gelu(L.dense(ctx, h, cfg.ffn, name="ffn_in"), approximate=True)
            x = x + L.dense(ctx, h, cfg.hidden, name="ffn_out")
    return L.layer_norm(ctx, x, EPS, name="ln_final")

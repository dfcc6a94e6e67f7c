"""Transformer layers as flax users write them (flax.linen's MultiHeadDotProductAttention,
LayerNorm, Dense; jax.nn.dot_product_attention), timed as inference runs them: jax.jit
(its default and XLA's CONCURRENT command-buffer scheduling) against nimble.jit in one
process, rounds alternated; looped (the parameters the same objects, a fresh input each
call, one block at the end) and GPU time (nimble: its graph by CUDA events; jax.jit:
calls back to back, which its dispatch keeps ahead of on the GPU).

    PYTHONPATH=. python3 examples/gpu/benchmark_transformers.py [--batch 1,8] [--json out.json]

Sizes: width 512, 8 heads of 64, feed-forward 2048, 128 tokens (GPT-2 small's shapes at
a narrower width). `--tiny --backend interpret` runs small ones on the CPU interpreter
(a check of the script, not a timing). Needs flax (`pip install -e ".[test]"`).
"""
from __future__ import annotations

import argparse
import json
import statistics
import time
from dataclasses import dataclass
from typing import Callable, Optional

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np

import nimblejax as nimble
from nimblejax.bench import timing
from nimblejax.bench.needs_gpu import require_gpu

ROUNDS = 3
FRESH = 4  # distinct inputs cycled through


@dataclass(frozen=True)
class Size:
    dim: int = 512
    heads: int = 8
    ffn: int = 2048
    seq: int = 128
    vocab: int = 32000


TINY = Size(dim=32, heads=4, ffn=64, seq=16, vocab=50)


class Block(nn.Module):
    """A pre-LN encoder (or, `causal`, decoder) block."""

    size: Size
    causal: bool = False

    @nn.compact
    def __call__(self, x):
        mask = nn.make_causal_mask(jnp.ones(x.shape[:2])) if self.causal else None
        y = nn.LayerNorm()(x)
        x = x + nn.MultiHeadDotProductAttention(num_heads=self.size.heads)(y, y, mask=mask)
        y = nn.LayerNorm()(x)
        return x + nn.Dense(self.size.dim)(nn.gelu(nn.Dense(self.size.ffn)(y)))


class Encoder(nn.Module):
    size: Size
    layers: int = 4

    @nn.compact
    def __call__(self, x):
        for _ in range(self.layers):
            x = Block(self.size)(x)
        return nn.LayerNorm()(x)


class TextEncoder(nn.Module):
    """Token and position embeddings, two blocks, a pooled classifier head."""

    size: Size

    @nn.compact
    def __call__(self, tokens):
        x = nn.Embed(self.size.vocab, self.size.dim)(tokens)
        x = x + self.param("pos", nn.initializers.normal(0.02), (tokens.shape[1], self.size.dim))
        x = Encoder(self.size, layers=2)(x)
        return nn.Dense(3)(jnp.mean(x, axis=1))


Case = tuple[str, Callable, list]  # name, fn, argument sets (the first leaves the same objects)


def cases(size: Size, batch: int) -> list[Case]:
    rng = np.random.default_rng(0)

    def hidden(seed: int):
        r = np.random.default_rng(seed)
        return jnp.asarray(r.standard_normal((batch, size.seq, size.dim)), jnp.float32)

    def module_case(name: str, module: nn.Module, make_input: Callable[[int], jax.Array]) -> Case:
        params = module.init(jax.random.PRNGKey(0), make_input(0))
        return name, (lambda p, x: module.apply(p, x)), [(params, make_input(s)) for s in range(FRESH)]

    def tokens(seed: int):
        r = np.random.default_rng(seed)
        return jnp.asarray(r.integers(0, size.vocab, (batch, size.seq)), jnp.int32)

    head = size.dim // size.heads
    qkv = [tuple(jnp.asarray(rng.standard_normal((batch, size.seq, size.heads, head)), jnp.float32)
                 for _ in range(3)) for _ in range(FRESH)]
    return [
        module_case("encoder stack x4", Encoder(size), hidden),
        module_case("causal self-attention block", Block(size, causal=True), hidden),
        module_case("embedding + encoder x2", TextEncoder(size), tokens),
        ("jax.nn.dot_product_attention, causal",
         lambda q, k, v: jax.nn.dot_product_attention(q, k, v, is_causal=True), qkv),
    ]


def max_rel_err(got, want) -> float:
    got, want = np.asarray(got, np.float64), np.asarray(want, np.float64)
    return float(np.max(np.abs(got - want)) / (np.max(np.abs(want)) + 1e-30))


def run_case(fn: Callable, sets: list, backend: Optional[str]) -> dict:
    """Each configuration's first call (CONCURRENT's program is compiled before it, so its
    time is not a first call's and the table leaves it out), error against jax.jit,
    looped and GPU µs."""
    first = sets[0]
    configs: dict[str, Callable] = {"jax.jit": jax.jit(fn)}
    concurrent = timing.concurrent_jax(fn, first) if backend is None else None
    if concurrent is not None:
        configs["jax.jit concurrent"] = concurrent
    configs["nimble"] = nimble.jit(fn, **({"backend": backend} if backend else {}))
    rows: dict[str, dict] = {}
    want = None
    for label, f in configs.items():  # jax.jit first: its first call compiles, its values are the reference
        t0 = time.perf_counter()
        got = jax.block_until_ready(f(*first))
        want = got if want is None else want
        rows[label] = dict(first_call_s=time.perf_counter() - t0, max_rel_err=max_rel_err(got, want), rounds=[])
    for _ in range(ROUNDS):
        for label, f in configs.items():
            rows[label]["rounds"].append(timing.looped_us(f, sets, calls=50, repeats=1))
    for label, f in configs.items():
        rows[label]["looped_us"] = statistics.median(rows[label]["rounds"])
        if backend is None:
            rows[label]["gpu_us"] = (timing.nimble_gpu_us(f) if label == "nimble"
                                     else timing.throughput_us(f, first))
    return rows


def line(name: str, batch: int, rows: dict) -> str:
    """A table row: each configuration's looped (and GPU) µs, nimble's speedups against
    the better jax.jit setting."""
    jax_rows = [r for k, r in rows.items() if k != "nimble"]
    nb = rows["nimble"]
    best = min(r["looped_us"] for r in jax_rows)
    cells = [f"{r['looped_us']:.1f}" + (f" / {r['gpu_us']:.1f}" if r.get("gpu_us") else "") for r in rows.values()]
    gpu = ""
    if nb.get("gpu_us"):
        gpu = f"{min(r['gpu_us'] for r in jax_rows) / nb['gpu_us']:.2f}x"
    while len(cells) < 3:  # no CONCURRENT row (an XLA without the option, or the CPU)
        cells.insert(1, "-")
    return (f"| {name} | {batch} | " + " | ".join(cells) + f" | {best / nb['looped_us']:.2f}x | {gpu} | "
            f"{rows['jax.jit']['first_call_s']:.2f} / {nb['first_call_s']:.2f} | {nb['max_rel_err']:.1e} |")


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--batch", default="1,8")
    ap.add_argument("--json")
    ap.add_argument("--only", default="")
    ap.add_argument("--tiny", action="store_true", help="small sizes (a check of the script)")
    ap.add_argument("--backend", default=None, help="interpret: the CPU interpreter")
    opts = ap.parse_args()
    if opts.backend != "interpret":
        require_gpu(__file__)
    size = TINY if opts.tiny else Size()
    print(f"{jax.devices()[0].device_kind}; jax {jax.__version__}; {size}")
    print("| program | batch | jax.jit µs looped / GPU | CONCURRENT | nimble | speedup looped | speedup GPU "
          "| first call s (jax / nimble) | max rel err |")
    print("|---|---|---|---|---|---|---|---|---|")
    results = []
    for batch in (int(b) for b in opts.batch.split(",")):
        for name, fn, sets in cases(size, batch):
            if opts.only and opts.only not in name:
                continue
            rows = run_case(fn, sets, opts.backend)
            results.append(dict(program=name, batch=batch, rows=rows))
            print(line(name, batch, rows), flush=True)
    if opts.json:
        with open(opts.json, "w") as fh:
            json.dump({"device": jax.devices()[0].device_kind, "jax": jax.__version__,
                       "size": size.__dict__, "results": results}, fh, indent=1)


if __name__ == "__main__":
    main()

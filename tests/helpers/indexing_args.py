"""Shared by the indexing tests (tests/compiler/lowering/test_indexing.py and
test_scatter_fusion.py): an embedding table and ids, and a plan's kernel tasks."""
from __future__ import annotations

import jax.numpy as jnp
import numpy as np

import nimblejax as nimble
from tests.helpers import on_host

VOCAB, DIM, TOKENS, CLASSES = 50, 16, 24, 7


def rng(seed=0):
    return np.random.default_rng(seed)


def embed_args(seed=0, dtype=jnp.float32):
    r = rng(seed)
    table = on_host(r.normal(size=(VOCAB, DIM)), dtype)
    ids = on_host(r.integers(0, VOCAB, TOKENS), jnp.int32)
    return table, ids


def kernel_tasks(fn, *args):
    plan = nimble.jit(fn, backend="interpret").plan(*args)
    return [t for t in plan.tasks if t.kind == "kernel"]

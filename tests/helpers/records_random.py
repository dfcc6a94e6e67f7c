"""Primitive records for the random-number primitives (see primitive_table.py).

They have no lowering rule: tracing expands them into uint32 arithmetic
(compiler/prng.py). Keys are random key data, typed keys made from it;
functions return key data, so records compare as uint32 arrays, bit for bit."""
from __future__ import annotations

import jax
import jax.numpy as jnp
from jax.extend import random as jex_random

from tests.helpers.primitive_table import rec, f32, dt, i32, u32, boolean  # noqa: F401


def raw_key(*batch):
    """jax.random.PRNGKey-style key data (uint32[..., 2]), random bits."""
    return u32(*batch, 2)


def typed_key(*batch):
    """jax.random.key-style typed keys over random key data."""
    return lambda r: jax.random.wrap_key_data(u32(*batch, 2)(r))


data = jax.random.key_data

rec("random_seed", lambda s: data(jax.random.key(s)), i32(lo=-2 ** 31, hi=2 ** 31 - 1))
rec("random_seed", jax.random.PRNGKey, i32(lo=-2 ** 31, hi=2 ** 31 - 1), label="raw")
rec("random_seed", lambda s: data(jax.vmap(jax.random.key)(s)), i32(6, lo=0, hi=2 ** 31 - 1),
    label="batched")
rec("random_wrap", lambda k: data(jax.random.wrap_key_data(k)), raw_key(3))
rec("random_unwrap", lambda k: data(k)[::-1], typed_key(4))
rec("random_clone", lambda k: data(jax.random.clone(k)), typed_key())

rec("random_bits", lambda k: jax.random.bits(k, (5, 7)), raw_key())
rec("random_bits", lambda k: jax.random.bits(k, (33,), jnp.uint8), raw_key(), label="u8")
rec("random_bits", lambda k: jax.random.bits(k, (3, 5), jnp.uint16), typed_key(), label="u16")
rec("random_bits", jax.vmap(lambda k: jax.random.bits(k, (3,))), typed_key(4), label="batched")
rec("random_bits", lambda k: jax.random.randint(k, (4, 9), -7, 1000), raw_key(), label="randint")

rec("random_split", lambda k: jax.random.split(k, 5), raw_key())
rec("random_split", lambda k: data(jax.random.split(k, (2, 3))), typed_key(), label="typed")
rec("random_split", lambda k: data(jax.vmap(jax.random.split)(k)), typed_key(3), label="batched")

rec("random_fold_in", jax.random.fold_in, raw_key(), i32(lo=-2 ** 31, hi=2 ** 31 - 1))
rec("random_fold_in", lambda k, d: data(jax.vmap(jax.random.fold_in)(k, d)), typed_key(4),
    u32(4), label="batched")

rec("threefry2x32", jex_random.threefry_2x32, u32(2), u32(7))
rec("threefry2x32", jex_random.threefry_2x32, u32(2), u32(4, 6), label="even")

# stack / unstack on key arrays (vmapped over the key data, compiler/prng.py) and on key
# data (jax.random's own split emits stack; on jax 0.11 it also emits unstack); both
# rewritten by canonicalize/stacking.py.
rec("stack", lambda a, b: data(jnp.stack([a, b], axis=1)), typed_key(3), typed_key(3), label="keys")
rec("unstack", lambda k: [data(x) for x in jnp.unstack(k)], typed_key(3), label="keys")
rec("unstack", lambda k: jnp.unstack(jax.random.split(k, 3)), raw_key(), label="key-data")
rec("unstack", lambda k: [jax.random.bits(x, (4,)) for x in jnp.unstack(jax.random.split(k, 3))],
    typed_key(), label="split-then-bits")

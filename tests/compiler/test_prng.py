"""compiler/prng.py on its own: typed keys become their uint32 key data, and random
primitives the threefry2x32 arithmetic, bit for bit as jax.jit computes them (the
traced graph is evaluated node by node with JAX)."""
from __future__ import annotations

import jax
import jax.extend.random as jex_random
import jax.numpy as jnp
import numpy as np
import pytest

from tests.helpers import on_host
from tests.helpers.graphs import evaluate, names, trace
from nimblejax.compiler import prng
from nimblejax.compiler.errors import UnsupportedPrimitiveError

RNG = np.random.default_rng(0)


def words(*shape):
    return on_host(RNG.integers(0, 2 ** 32, shape, dtype=np.uint64), jnp.uint32)


def a_key():
    return jax.random.wrap_key_data(words(2))


def data(x):
    return np.asarray(jax.random.key_data(x) if prng.is_key(x.dtype) else x)


def test_threefry2x32_matches_jax():
    k1, k2 = words(), words()
    x = words(2, 37)
    y1, y2 = prng.threefry2x32(k1, k2, x[0], x[1], shape=(37,))
    want = jex_random.threefry_2x32(jnp.stack([k1, k2]), x.reshape(-1))
    np.testing.assert_array_equal(np.concatenate([y1, y2]), np.asarray(want))


def test_threefry2x32_broadcasts_to_shape():
    k1, k2, x1 = words(), words(), words(4, 1)
    y1, y2 = prng.threefry2x32(k1, k2, x1, words(3), shape=(4, 3))
    assert y1.shape == y2.shape == (4, 3) and y1.dtype == jnp.uint32


def test_iota_2x32_and_its_limit():
    high, low = prng.iota_2x32(shape=(3, 5), source="here.py:1")
    np.testing.assert_array_equal(high, np.zeros((3, 5), np.uint32))
    np.testing.assert_array_equal(low, np.arange(15, dtype=np.uint32).reshape(3, 5))
    with pytest.raises(UnsupportedPrimitiveError, match="here.py:7"):
        prng.iota_2x32(shape=(2 ** 16, 2 ** 16), source="here.py:7")


def test_key_arrays_are_held_as_key_data():
    keys = jax.random.split(a_key(), 4)
    aval = jax.ShapeDtypeStruct(keys.shape, keys.dtype)
    assert prng.physical(aval) == ((4, 2), np.dtype(np.uint32))
    assert prng.physical(jax.ShapeDtypeStruct((2, 3), jnp.float16)) == ((2, 3), np.dtype(np.float16))
    np.testing.assert_array_equal(prng.key_data(keys), jax.random.key_data(keys))
    plain = np.arange(3)
    assert prng.key_data(plain) is plain


PROGRAMS = {
    "split": lambda k: jax.random.split(k, 5),
    "split_shape": lambda k: jax.random.split(k, (2, 3)),
    "fold_in": lambda k: jax.random.fold_in(k, 77),
    "bits": lambda k: jax.random.bits(k, (6, 5)),
    "key_slice": lambda k: jax.random.split(k, 4)[1:3],  # slice on key arrays
    "randint": lambda k: jax.random.randint(k, (9,), -5, 500),
    "uniform": lambda k: jax.random.uniform(k, (4, 7)),
    "normal_of_split": lambda k: jax.random.normal(jax.random.split(k)[1], (10,)),
    "vmap_bits": lambda k: jax.vmap(lambda kk: jax.random.bits(kk, (4,)))(jax.random.split(k, 3)),
}


@pytest.mark.parametrize("name", PROGRAMS)
def test_random_programs_become_uint32_arithmetic_equal_to_jax(name):
    fn = PROGRAMS[name]
    key = a_key()
    graph = trace(fn, key)
    assert not set(names(graph)) & prng.RANDOM_PRIMITIVES, names(graph)
    values = [a for n in graph.nodes for a in n.inputs + n.outputs] + list(graph.inputs)
    assert not any(prng.is_key(v.dtype) for v in values)
    assert [v.shape for v in graph.inputs] == [(2,)]  # the key's data
    (got,) = evaluate(graph, [jax.random.key_data(key)])
    want = data(jax.jit(fn)(key))
    assert got.shape == want.shape and np.dtype(got.dtype) == want.dtype
    if want.dtype.kind == "f":
        np.testing.assert_allclose(np.asarray(got), want, rtol=2e-6, atol=1e-6)
    else:
        np.testing.assert_array_equal(np.asarray(got), want)


def test_raw_uint32_keys_give_the_same_graph_values_as_typed_keys():
    raw = words(2)
    fn_raw = lambda k: jax.random.bits(jax.random.fold_in(k, 3), (8,))  # noqa: E731
    (got,) = evaluate(trace(fn_raw, raw), [raw])
    np.testing.assert_array_equal(np.asarray(got), np.asarray(jax.jit(fn_raw)(raw)))


def test_other_implementations_are_refused_naming_the_line():
    key = jax.random.key(1, impl="rbg")
    with pytest.raises(UnsupportedPrimitiveError, match=r"threefry2x32.*test_prng\.py:\d+.*rbg"):
        trace(lambda k: jax.random.split(k), key)

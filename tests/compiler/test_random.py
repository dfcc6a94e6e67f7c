"""Random numbers inside nimble functions, bit for bit against jax.jit: raw keys
(jax.random.PRNGKey) and typed keys (jax.random.key) as arguments, made inside, split,
folded, and returned; dropout in a flax module in train mode; gradients through
functions that draw random numbers; both settings of jax_threefry_partitionable.
The interpreter on the CPU; the cuda backend under `-m gpu`."""
from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import nimblejax as nimble
from tests.helpers import jit_init, on_host
from tests.helpers.models import assert_tree_close
from nimblejax.compiler.lowering import RULES

# jax.random's float samplers turn bits into floats with bitcast_convert_type.
needs_bitcast = pytest.mark.skipif("bitcast_convert_type" not in RULES,
                                   reason="no lowering rule for bitcast_convert_type yet")
BACKENDS = ["interpret", pytest.param("cuda", marks=pytest.mark.gpu)]


def _keys(seed: int):
    """A raw key and a typed key over random key data (never a small seed)."""
    data = on_host(np.random.default_rng(seed).integers(0, 2 ** 32, 2, dtype=np.uint64), jnp.uint32)
    return {"raw": data, "typed": jax.random.wrap_key_data(data)}


def _data(tree):
    return jax.tree_util.tree_map(
        lambda a: jax.random.key_data(a) if jax.dtypes.issubdtype(a.dtype, jax.dtypes.prng_key) else a,
        tree)


def assert_bits_equal(got, want) -> None:
    """Same tree, dtypes, key types and bits."""
    got_leaves, got_tree = jax.tree_util.tree_flatten(got)
    want_leaves, want_tree = jax.tree_util.tree_flatten(want)
    assert got_tree == want_tree
    for g, w in zip(got_leaves, want_leaves):
        assert g.dtype == w.dtype and g.shape == w.shape, (g.dtype, g.shape, w.dtype, w.shape)
        g, w = np.asarray(_data(g)), np.asarray(_data(w))
        assert g.tobytes() == w.tobytes(), (g, w)


# ---- samplers, bit for bit ----------------------------------------------------------
INTEGER_SAMPLERS = {
    "bits": lambda k: jax.random.bits(k, (7, 5)),
    "bits_u8": lambda k: jax.random.bits(k, (33,), jnp.uint8),
    "randint": lambda k: jax.random.randint(k, (3, 11), -9, 1000),
    "split": lambda k: jax.random.split(k, 6),
    "split_shape": lambda k: jax.random.split(k, (2, 3)),
    "fold_in": lambda k: jax.random.fold_in(k, 12345),
    "split_fold_bits": lambda k: jax.random.bits(jax.random.fold_in(jax.random.split(k)[1], 3), (9,)),
    "permutation": lambda k: jax.random.permutation(k, 10),
    "vmap_split": lambda k: jax.vmap(lambda kk: jax.random.bits(kk, (4,)))(jax.random.split(k, 3)),
}
FLOAT_SAMPLERS = {
    "uniform": lambda k: jax.random.uniform(k, (4, 9)),
    "uniform_odd": lambda k: jax.random.uniform(k, (7,)),
    "bernoulli": lambda k: jax.random.bernoulli(k, 0.3, (5, 6)),
    "dropout_mask": lambda k: jnp.where(jax.random.bernoulli(k, 0.75, (8, 4)), 2.0, 0.0),
    "categorical": lambda k: jax.random.categorical(k, jnp.linspace(-1.0, 1.0, 12).reshape(3, 4)),
}


# Raw keys under the partitionable threefry (JAX >= 0.5's default), typed keys under the
# original one: each key kind and each of JAX's two split/bits paths.
SETTINGS = [("raw", True), ("typed", False)]


@pytest.mark.parametrize("kind,partitionable", SETTINGS)
@pytest.mark.parametrize("name", sorted(INTEGER_SAMPLERS))
def test_integer_samplers_bit_exact(name, kind, partitionable):
    check_bits(INTEGER_SAMPLERS[name], _keys(sum(map(ord, name)))[kind], partitionable, "interpret")


@needs_bitcast
@pytest.mark.parametrize("kind,partitionable", SETTINGS)
@pytest.mark.parametrize("name", sorted(FLOAT_SAMPLERS))
def test_float_samplers_bit_exact(name, kind, partitionable):
    check_bits(FLOAT_SAMPLERS[name], _keys(sum(map(ord, name)))[kind], partitionable, "interpret")


@needs_bitcast
@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("kind", ["raw", "typed"])
def test_normal(kind, backend):
    """normal goes through erf_inv: the bits are exact, the float polynomial is close."""
    f = lambda k: jax.random.normal(k, (6, 7))  # noqa: E731
    key = _keys(5)[kind]
    assert_tree_close(nimble.jit(f, backend=backend)(key), jax.jit(f)(key))


def check_bits(f, key, partitionable: bool, backend: str) -> None:
    # Fresh functions on both sides: each traces the PRNG under this setting.
    with jax.threefry_partitionable(partitionable):
        want = jax.jit(lambda k: f(k))(key)
        got = nimble.jit(lambda k: f(k), backend=backend)(key)
    assert_bits_equal(got, want)


def test_partitionable_setting_changes_the_bits():
    """The two settings give different split keys: the tests above see both paths."""
    key = _keys(1)["raw"]
    with jax.threefry_partitionable(True):
        a = nimble.jit(lambda k: jax.random.split(k, 3), backend="interpret")(key)
    with jax.threefry_partitionable(False):
        b = nimble.jit(lambda k: jax.random.split(k, 3), backend="interpret")(key)
    assert not np.array_equal(np.asarray(a), np.asarray(b))


# ---- typed keys across the boundary ---------------------------------------------------
def key_program(key, x):
    k1, k2 = jax.random.split(key)
    fresh = jax.random.key(11)
    return {"next": k1, "many": jax.random.split(k2, 4), "fresh": fresh,
            "bits": jax.random.bits(jax.random.fold_in(fresh, 2), x.shape) ^ x}


@pytest.mark.parametrize("call_path", ["auto", "python"])
def test_typed_keys_in_and_out(call_path):
    key, x = _keys(3)["typed"], jnp.arange(5, dtype=jnp.uint32) * 977
    f = nimble.jit(key_program, backend="interpret", call_path=call_path)
    for _ in range(2):  # the cached plan runs again, fed its own key
        got, want = f(key, x), jax.jit(key_program)(key, x)
        assert_bits_equal(got, want)
        assert jax.random.key_impl(got["next"]) == jax.random.key_impl(want["next"])
        key = got["next"]
    assert f.cache_size == 1


def test_array_ops_on_typed_keys():
    """concatenate, slice, select, broadcast and gather on key arrays (each vmapped
    over the key data), and a key array closed over as a constant."""
    closed = jax.random.split(_keys(12)["typed"], 3)

    def f(k, pick):
        ks = jnp.concatenate([closed, jax.random.split(k, 2)])
        chosen = jax.lax.select(pick, ks[0:2], ks[3:5])
        return (chosen, jnp.broadcast_to(k, (2,)), ks[jnp.array([4, 0])],
                jax.random.bits(ks[4], (3,)))

    args = (_keys(13)["typed"], jnp.array([True, False]))
    assert_bits_equal(nimble.jit(f, backend="interpret")(*args), jax.jit(f)(*args))


@pytest.mark.parametrize("kind", ["raw", "typed"])
def test_keys_through_scan_and_cond(kind):
    """A key carried through a scan (split each step) and chosen by a cond."""
    def f(key, x):
        def step(carry, _):
            key, acc = carry
            key, sub = jax.random.split(key)
            return (key, acc + jax.random.randint(sub, (3,), 0, 100)), jax.random.bits(sub, (2,))

        (key, acc), ys = jax.lax.scan(step, (key, x), None, length=4)
        key = jax.lax.cond(acc[0] > 150, lambda k: jax.random.fold_in(k, 1), lambda k: k, key)
        return key, acc, ys

    args = (_keys(14)[kind], jnp.arange(3, dtype=jnp.int32))
    assert_bits_equal(nimble.jit(f, backend="interpret")(*args), jax.jit(f)(*args))


def test_typed_key_output_as_key_data_for_numpy_output():
    key = _keys(4)["typed"]
    got = nimble.jit(lambda k: jax.random.split(k, 3), backend="interpret", output="numpy")(key)
    assert isinstance(got, np.ndarray) and got.dtype == np.uint32
    np.testing.assert_array_equal(got, jax.random.key_data(jax.random.split(key, 3)))


def test_typed_keys_plan_from_shapes_has_no_random_primitives():
    spec = jax.ShapeDtypeStruct((3,), jax.random.key(0).dtype)
    plan = nimble.jit(lambda k: jax.vmap(lambda kk: jax.random.bits(kk, (8,)))(k),
                      backend="interpret").plan(spec)
    names = {n.name for n in plan.graph.nodes}
    assert not names & {"random_bits", "random_wrap", "random_unwrap", "threefry2x32"}, names
    assert plan.graph.inputs[0].shape == (3, 2) and plan.graph.inputs[0].dtype == np.uint32


def test_nimble_function_inside_jit_and_vmap():
    keys = jax.random.split(_keys(6)["typed"], 4)
    f = nimble.jit(lambda k: (jax.random.bits(k, (3,)), jax.random.split(k)), backend="interpret")
    ref = lambda k: (jax.random.bits(k, (3,)), jax.random.split(k))  # noqa: E731
    assert_bits_equal(jax.jit(jax.vmap(f))(keys), jax.vmap(ref)(keys))
    assert_bits_equal(jax.jit(lambda k: f(k[1]))(keys), ref(keys[1]))


def test_rbg_keys_raise_naming_the_impl():
    f = nimble.jit(lambda k: jax.random.bits(k, (4,)), backend="interpret", fallback="error")
    with pytest.raises(NotImplementedError, match=r"'rbg'.*backend=\"jax\""):
        f(jax.random.key(1, impl="rbg"))
    g = nimble.jit(lambda: jax.random.bits(jax.random.key(1, impl="unsafe_rbg"), (4,)), backend="interpret",
                   fallback="error")
    with pytest.raises(NotImplementedError, match="unsafe_rbg"):
        g()


# ---- dropout in a flax module, gradients ----------------------------------------------
def _dropout_model():
    nn = pytest.importorskip("flax.linen")

    class Block(nn.Module):
        @nn.compact
        def __call__(self, x, train: bool):
            x = nn.Dense(16)(x)
            x = nn.Dropout(0.4, deterministic=not train)(nn.relu(x))
            return nn.Dense(4)(x)

    model = Block()
    x = on_host(np.random.default_rng(8).normal(size=(6, 12)), jnp.float32)
    params = jit_init(model, jax.random.PRNGKey(0), x, train=False)
    return model, params, x


@needs_bitcast
@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("kind", ["raw", "typed"])
def test_flax_dropout_train_mode(kind, backend):
    model, params, x = _dropout_model()

    def fn(params, x, key):
        return model.apply(params, x, train=True, rngs={"dropout": key})

    key = _keys(9)[kind]
    got = nimble.jit(fn, backend=backend)(params, x, key)
    assert_tree_close(got, jax.jit(fn)(params, x, key))
    # dropout is on: another key gives another output
    other = nimble.jit(fn, backend=backend)(params, x, _keys(10)[kind])
    assert not np.allclose(np.asarray(got), np.asarray(other))


@needs_bitcast
@pytest.mark.parametrize("backend", BACKENDS)
def test_grad_through_dropout(backend):
    model, params, x = _dropout_model()

    def loss(params, x, key):
        y = model.apply(params, x, train=True, rngs={"dropout": key})
        noise = jax.random.normal(jax.random.fold_in(key, 1), y.shape)
        return jnp.mean((y - noise) ** 2)

    key = _keys(11)["typed"]
    want = jax.jit(jax.grad(loss))(params, x, key)
    # the nimble function differentiated (its backward is a nimble plan) ...
    assert_tree_close(jax.grad(nimble.jit(loss, backend=backend))(params, x, key), want)
    # ... and the gradient function planned whole
    assert_tree_close(nimble.jit(jax.grad(loss), backend=backend)(params, x, key), want)


# ---- the same on the GPU ------------------------------------------------------------------
# categorical adds -log(-log(u)): its argmax may differ from XLA's where the GPU's log
# differs by an ulp, so it is checked bit for bit on the interpreter only.
GPU_SAMPLERS = [*sorted(INTEGER_SAMPLERS), *[pytest.param(n, marks=needs_bitcast) for n in
                                             sorted(FLOAT_SAMPLERS) if n != "categorical"]]


@pytest.mark.gpu
@pytest.mark.parametrize("kind", ["raw", "typed"])
@pytest.mark.parametrize("name", GPU_SAMPLERS)
def test_samplers_cuda(name, kind):
    f = {**INTEGER_SAMPLERS, **FLOAT_SAMPLERS}[name]
    for partitionable in (True, False):
        check_bits(f, _keys(sum(map(ord, name)))[kind], partitionable, "cuda")


@pytest.mark.gpu
def test_typed_keys_in_and_out_cuda():
    key, x = _keys(3)["typed"], jnp.arange(5, dtype=jnp.uint32) * 977
    f = nimble.jit(key_program, backend="cuda")
    for _ in range(2):
        got = f(key, x)
        assert_bits_equal(got, jax.jit(key_program)(key, x))
        key = got["next"]

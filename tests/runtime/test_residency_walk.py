"""The residency extension's walk of a call's arguments (runtime/residency.c `structure`,
`steady_call`): the leaves it finds are jax.tree_util's, in jax's order; a call of
another structure or type is left to jax's flatten; and a nimble function's steady
state runs through it with every residency rule kept."""
from __future__ import annotations

import collections
import shutil

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import nimblejax as nimble
from nimblejax.runtime import residency
from nimblejax.runtime.residency import HELD, PASSED, Record
from tests.helpers import on_host

needs_cc = pytest.mark.skipif((shutil.which("cc") or shutil.which("gcc")) is None,
                              reason="no C compiler (cc or gcc) on PATH")


@pytest.fixture(scope="module")
def ext(tmp_path_factory):
    if (shutil.which("cc") or shutil.which("gcc")) is None:
        pytest.skip("no C compiler")
    module = residency.load_extension(str(tmp_path_factory.mktemp("residency_cache")))
    assert module is not None, "the residency extension did not build"
    return module


def random_tree(r, depth: int = 0):
    kind = r.integers(7 if depth < 3 else 3)
    if kind == 0:
        return jnp.asarray(r.normal(size=(2,)).astype(np.float32))
    if kind == 1:
        return [float(r.normal()), int(r.integers(9)), bool(r.integers(2))][r.integers(3)]
    if kind == 2:
        return None
    if kind == 3:
        return tuple(random_tree(r, depth + 1) for _ in range(r.integers(4)))
    if kind == 4:
        return [random_tree(r, depth + 1) for _ in range(r.integers(4))]
    keys = [f"k{int(k)}" for k in r.permutation(6)[: r.integers(5)]]  # inserted unsorted
    return {k: random_tree(r, depth + 1) for k in keys}


def jax_leaves(args, kwargs) -> list:
    return jax.tree_util.tree_leaves((args, kwargs))


@needs_cc
@pytest.mark.parametrize("seed", range(20))
def test_the_walk_finds_jaxs_leaves_in_jaxs_order(ext, seed):
    r = np.random.default_rng(seed)
    args = tuple(random_tree(r) for _ in range(r.integers(1, 4)))
    kwargs = {f"w{i}": random_tree(r) for i in r.permutation(3)[: r.integers(3)]}
    codes, walked = ext.structure(args, kwargs)
    want = jax_leaves(args, kwargs)
    assert len(walked) == len(want) and all(a is b for a, b in zip(walked, want))
    assert residency.structure(ext, args, kwargs, want) == codes


@needs_cc
@pytest.mark.parametrize("arg", [
    collections.namedtuple("Pair", "a b")(jnp.ones(2), jnp.ones(2)),
    np.ones(3, np.float32),
    collections.OrderedDict(a=jnp.ones(2)),
    {1: jnp.ones(2), "b": jnp.ones(2)},  # keys Python cannot order (nor jax)
    [jnp.ones(2), jax.ShapeDtypeStruct((2,), jnp.float32)],
], ids=["namedtuple", "numpy", "ordereddict", "mixed-keys", "other-leaf"])
def test_other_types_are_left_to_jax(ext, arg):
    assert ext.structure((arg,), {}) is None


class Calls:
    def __init__(self, outs):
        self.outs, self.seen = outs, []

    def __call__(self, *passed):
        self.seen.append(passed)
        return list(self.outs)


def made_record(args, kwargs, ext, sources):
    leaves = jax_leaves(args, kwargs)
    sigs = tuple((tuple(x.shape), x.dtype, False) for x in leaves)
    rec = Record(None, (), None, sigs, frozenset(), frozenset(), None, list(sources), Calls([7]), leaves)
    rec.structure = residency.structure(ext, args, kwargs, leaves)
    return rec


@needs_cc
def test_steady_call_runs_the_check_on_the_walked_leaves(ext):
    params = {"w": jnp.ones((2,)), "b": [jnp.zeros((2,)), jnp.ones((2,))]}
    x = jnp.arange(2.0)
    rec = made_record((params, x), {}, ext, [HELD, HELD, HELD, PASSED])
    fresh = jnp.arange(2.0) + 1
    assert ext.steady_call((params, fresh), {}, rec.structure, rec) == [7]
    assert rec.fn.seen[-1] == (fresh,) and rec.leaves[-1] is fresh
    # A new parameter: the sources change, no call, the record stays.
    assert ext.steady_call(({**params, "w": jnp.ones((2,))}, x), {}, rec.structure, rec) is None
    assert len(rec.fn.seen) == 1


@needs_cc
@pytest.mark.parametrize("changed", [
    lambda p, x: ((p, x, x), {}),                       # one argument more
    lambda p, x: (({**p, "c": x}, x), {}),              # a key more
    lambda p, x: (({"w": p["w"], "c": p["b"]}, x), {}),  # a key renamed
    lambda p, x: ((p, [x]), {}),                        # a leaf became a list
    lambda p, x: ((p, x), {"y": x}),                    # a keyword more
    lambda p, x: ((p, (x,)), {}),                       # a leaf became a tuple
    lambda p, x: ((p, np.asarray(x)), {}),              # a numpy leaf: jax flattens
])
def test_another_structure_is_none(ext, changed):
    params = {"w": jnp.ones((2,)), "b": [jnp.zeros((2,))]}
    x = jnp.arange(2.0)
    rec = made_record((params, x), {}, ext, [HELD, HELD, PASSED])
    args, kwargs = changed(params, x)
    assert ext.steady_call(args, kwargs, rec.structure, rec) is None
    assert rec.fn.seen == []


def model(params, x, scale=1.0):
    h = jnp.tanh(x @ params["w1"] + params["b"][0])
    return {"out": h @ params["w2"] * scale, "h": h}


def model_args(r):
    params = {"w2": on_host(r.normal(size=(8, 3)), jnp.float32),
              "w1": on_host(r.normal(size=(4, 8)), jnp.float32),
              "b": [on_host(r.normal(size=(8,)), jnp.float32)]}
    return params, [on_host(r.normal(size=(5, 4)), jnp.float32) for _ in range(4)]


def check(got, want):
    for g, w in zip(jax.tree_util.tree_leaves(got), jax.tree_util.tree_leaves(want)):
        np.testing.assert_allclose(np.asarray(g), np.asarray(w), rtol=1e-5, atol=1e-6)


@needs_cc
@pytest.mark.parametrize("residency_choice", ["c", "python"])
def test_a_steady_state_through_the_walk_matches_jax(residency_choice):
    r = np.random.default_rng(3)
    params, xs = model_args(r)
    f = nimble.jit(model, backend="interpret", residency=residency_choice)
    for k, x in enumerate(xs * 2):
        check(f(params, x, scale=2.0), jax.jit(model)(params, x, scale=2.0))
        if k >= 1:
            rec = f._resident
            assert rec is not None and rec.sources.count(HELD) == 3
            assert (rec.structure is not None) == (residency_choice == "c")
    # Another structure (no keyword), new parameters, a numpy input: each still right.
    check(f(params, xs[0]), jax.jit(model)(params, xs[0]))
    params2, _ = model_args(r)
    check(f(params2, xs[1]), jax.jit(model)(params2, xs[1]))
    check(f(params2, np.asarray(xs[2])), jax.jit(model)(params2, np.asarray(xs[2])))


@needs_cc
def test_a_deleted_held_parameter_raises_through_the_walk():
    r = np.random.default_rng(4)
    params, xs = model_args(r)
    f = nimble.jit(model, backend="interpret", residency="c")
    f(params, xs[0]), f(params, xs[1])
    assert f._resident.structure is not None
    params["w1"].delete()
    with pytest.raises(RuntimeError, match="deleted"):
        f(params, xs[2])

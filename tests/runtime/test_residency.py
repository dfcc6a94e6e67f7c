"""The residency check's C extension (runtime/residency.c) against its pure-Python twin
(runtime/residency.py): the same decisions on the same records, hand-made and random,
and a build that degrades to the Python check with one warning."""
from __future__ import annotations

import shutil
import warnings

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from nimblejax.runtime import ffi as nffi
from nimblejax.runtime import residency
from nimblejax.runtime.residency import HELD, PASSED, Record

CC = shutil.which("cc") or shutil.which("gcc")
needs_cc = pytest.mark.skipif(CC is None, reason="no C compiler (cc or gcc) on PATH")

SIGS = [((3,), np.dtype("float32"), False), ((2, 2), np.dtype("float32"), False),
        ((3,), np.dtype("int32"), False), ((), np.dtype("float32"), True)]


@pytest.fixture(scope="module")
def ext(tmp_path_factory):
    if CC is None:
        pytest.skip("no C compiler")
    module = residency.load_extension(str(tmp_path_factory.mktemp("residency_cache")))
    assert module is not None, "the residency extension did not build"
    return module


def array(sig: tuple, r) -> jax.Array:
    shape, dtype, weak = sig
    if weak:  # a weakly typed jax.Array, as jnp.asarray of a Python float makes
        return jnp.asarray(float(r.normal()))
    values = r.normal(size=shape) * 10
    return jnp.asarray(values.astype(dtype))


class Calls:
    """A stand-in for the jitted call: records its operands, returns fresh results."""

    def __init__(self, outs: list) -> None:
        self.outs, self.seen = outs, []

    def __call__(self, *passed):
        self.seen.append(passed)
        return list(self.outs)


def record(sigs, leaves, outs, sources, always_passed=(), feedable=(), fn=None) -> Record:
    rec = Record(None, (), None, tuple(sigs), frozenset(always_passed), frozenset(feedable), None,
                 list(sources), fn or Calls([]), list(leaves))
    rec.outs = list(outs)
    return rec


def both(ext, leaves, make) -> tuple:
    """(C decision, Python decision) on two records made alike by `make()`."""
    return ext.decide(list(leaves), make()), residency.decide_python(list(leaves), make())


def same_decision(c, py) -> None:
    assert (c is None) == (py is None), (c, py)
    if c is not None:
        assert c[0] == py[0]
        assert len(c[1]) == len(py[1]) and all(a is b for a, b in zip(c[1], py[1]))


# ---- hand-made cases: each residency rule ------------------------------------------------
@needs_cc
def test_identity_holds_and_equal_values_do_not(ext):
    r = np.random.default_rng(0)
    last = [array(SIGS[0], r), array(SIGS[1], r)]
    make = lambda: record(SIGS[:2], last, [], [PASSED, PASSED])  # noqa: E731
    c, py = both(ext, last, make)
    same_decision(c, py)
    assert c[0] == [HELD, HELD] and c[1] == []
    copy = [last[0], jnp.array(last[1])]  # equal values, another object
    c, py = both(ext, copy, make)
    same_decision(c, py)
    assert c[0] == [HELD, PASSED] and c[1][0] is copy[1]


@needs_cc
def test_deleted_numpy_and_always_passed_leaves_are_passed(ext):
    r = np.random.default_rng(1)
    last = [array(SIGS[0], r) for _ in range(3)] + [np.asarray(r.normal(size=3), np.float32)]
    make = lambda: record([SIGS[0]] * 4, last, [], [HELD] * 4, always_passed={2})  # noqa: E731
    last[1].delete()
    c, py = both(ext, last, make)
    same_decision(c, py)
    assert c[0] == [HELD, PASSED, PASSED, PASSED]


@needs_cc
def test_results_fed_back_where_feedable_and_not_deleted(ext):
    r = np.random.default_rng(2)
    last = [array(SIGS[0], r) for _ in range(4)]
    outs = [array(SIGS[0], r) for _ in range(4)]
    make = lambda: record([SIGS[0]] * 4, last, outs, [PASSED] * 4,  # noqa: E731
                          always_passed={3}, feedable={0, 1, 3})
    leaves = [outs[1], outs[0], outs[2], outs[3]]  # 2 is not feedable, leaf 3 always passed
    c, py = both(ext, leaves, make)
    same_decision(c, py)
    assert c[0] == [1, 0, PASSED, PASSED]
    outs[0].delete()
    c, py = both(ext, leaves, make)
    same_decision(c, py)
    assert c[0] == [1, PASSED, PASSED, PASSED]


@needs_cc
def test_a_result_twice_feeds_from_its_last_position(ext):
    r = np.random.default_rng(3)
    y = array(SIGS[0], r)
    make = lambda: record([SIGS[0]], [array(SIGS[0], r)], [y, y], [PASSED],  # noqa: E731
                          feedable={0, 1})
    c, py = both(ext, [y], make)
    same_decision(c, py)
    assert c[0] == [1]


@needs_cc
@pytest.mark.parametrize("changed", [np.zeros((4,), np.float32), jnp.zeros((3,), jnp.int32),
                                     jnp.asarray(1.5), 2.5, "text"])
def test_a_changed_signature_is_none(ext, changed):
    r = np.random.default_rng(4)
    last = [array(SIGS[0], r), array(SIGS[0], r)]
    make = lambda: record([SIGS[0]] * 2, last, [], [HELD, PASSED])  # noqa: E731
    c, py = both(ext, [last[0], changed], make)
    same_decision(c, py)
    assert c is None


@needs_cc
def test_python_scalars_and_numpy_keep_their_signature(ext):
    r = np.random.default_rng(5)
    sigs = [((), np.dtype("float32"), True), ((), np.dtype("int32"), True), ((3,), np.dtype("float32"), False)]
    last = [0.5, 3, np.asarray(r.normal(size=3))]  # float64 numpy: float32 without x64
    make = lambda: record(sigs, last, [], [PASSED] * 3)  # noqa: E731
    c, py = both(ext, [1.5, 4, np.asarray(r.normal(size=3))], make)
    same_decision(c, py)
    assert c[0] == [PASSED] * 3
    assert both(ext, [1.5, 4.0, last[2]], make) == (None, None)  # an int became a float


@needs_cc
def test_a_tracer_is_none(ext):
    r = np.random.default_rng(6)
    last = [array(SIGS[0], r)]
    got = []

    def traced(x):
        got.append(both(ext, [x], lambda: record([SIGS[0]], last, [], [PASSED])))
        return x

    jax.jit(traced)(last[0])
    assert got == [(None, None)]


@needs_cc
def test_a_record_that_does_not_fit_is_none(ext):
    r = np.random.default_rng(7)
    last = [array(SIGS[0], r)]
    c, py = both(ext, last + last, lambda: record([SIGS[0]], last, [], [PASSED]))
    assert c is None and py is None


@needs_cc
def test_same_sources_are_the_records_own_list(ext):
    r = np.random.default_rng(8)
    last = [array(SIGS[0], r), array(SIGS[0], r)]
    rec = record([SIGS[0]] * 2, last, [], [HELD, PASSED])
    fresh = [last[0], array(SIGS[0], r)]
    assert ext.decide(fresh, rec)[0] is rec.sources
    assert residency.decide_python(fresh, rec)[0] is rec.sources


@needs_cc
def test_steady_calls_with_the_passed_leaves_and_updates_the_record(ext):
    r = np.random.default_rng(9)
    last = [array(SIGS[0], r), array(SIGS[1], r)]
    results = [array(SIGS[0], r)]
    for steady in (ext.steady, residency.steady_python):
        fn = Calls(results)
        rec = record(SIGS[:2], last, [], [HELD, PASSED], fn=fn)
        fresh = [last[0], array(SIGS[1], r)]
        outs = steady(fresh, rec)
        assert outs == results and rec.outs is outs and rec.leaves is fresh
        assert len(fn.seen) == 1 and len(fn.seen[0]) == 1 and fn.seen[0][0] is fresh[1]
        assert steady([array(SIGS[0], r), fresh[1]], rec) is None  # sources changed: no call
        assert len(fn.seen) == 1 and rec.leaves is fresh


@needs_cc
def test_steady_passes_errors_of_the_call_through(ext):
    def fail(*xs):
        raise RuntimeError("the jitted call failed")

    r = np.random.default_rng(10)
    last = [array(SIGS[0], r)]
    rec = record([SIGS[0]], last, [], [PASSED], fn=fail)
    fresh = [array(SIGS[0], r)]
    with pytest.raises(RuntimeError, match="jitted call failed"):
        ext.steady(fresh, rec)
    assert rec.leaves[0] is last[0]  # the record keeps the last call that ran


# ---- random records: the two checks agree ---------------------------------------------
def random_leaf(r, i: int, sigs: list, last: list, outs: list):
    choice = r.integers(8)
    if choice == 0:
        return last[i]
    if choice == 1 and outs:
        return outs[r.integers(len(outs))]
    if choice == 2:
        return array(sigs[i], r)
    if choice == 3:
        return array(SIGS[r.integers(len(SIGS))], r)
    if choice == 4:
        x = array(sigs[i], r)
        x.delete()
        return x
    if choice == 5:
        return np.asarray(array(sigs[i], r))
    return float(r.normal()) if choice == 6 else last[i]


@needs_cc
@pytest.mark.parametrize("seed", range(12))
def test_random_records_decide_alike(ext, seed):
    r = np.random.default_rng(seed)
    for _ in range(40):
        n, n_out = int(r.integers(1, 10)), int(r.integers(0, 8))
        sigs = [SIGS[k] for k in r.integers(len(SIGS), size=n)]
        last = [array(s, r) for s in sigs]
        outs = [array(SIGS[k], r) for k in r.integers(len(SIGS), size=n_out)]
        for x in last + outs:
            if r.random() < 0.1:
                x.delete()
        always = {i for i in range(n) if r.random() < 0.3}
        feedable = {j for j in range(n_out) if r.random() < 0.6}
        leaves = [random_leaf(r, i, sigs, last, outs) for i in range(n)]
        sources = [int(s) for s in r.choice([PASSED, HELD, 0], size=n)]
        make = lambda: record(sigs, last, outs, sources, always, feedable)  # noqa: E731
        same_decision(*both(ext, leaves, make))
        # More calls on one record: the C check's aval shortcut must not change a decision.
        rec = make()
        for other in (leaves, [random_leaf(r, i, sigs, last, outs) for i in range(n)]):
            same_decision(ext.decide(other, rec), residency.decide_python(other, make()))


# ---- the build ----------------------------------------------------------------------------
@needs_cc
def test_build_is_cached_per_source_and_python(tmp_path):
    path = residency.build(str(tmp_path))
    assert path is not None and path.is_file() and path == residency.build_path(str(tmp_path))
    stamp = path.stat().st_mtime_ns
    assert residency.build(str(tmp_path)) == path and path.stat().st_mtime_ns == stamp
    assert path.parent.name.startswith("residency-")


@pytest.fixture
def fresh_warnings(monkeypatch):
    monkeypatch.setattr(nffi, "_warned", set())
    monkeypatch.setattr(residency, "_extension", {})


def test_no_compiler_falls_back_to_python_with_one_warning(tmp_path, fresh_warnings):
    cache = str(tmp_path)
    with pytest.warns(RuntimeWarning, match="no C compiler"):
        assert residency.load_extension(cache, compiler="no-such-cc-nimble") is None
    python_check = (residency.steady_python, residency.decide_python, None)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # once per process: no second warning
        assert residency.load_extension(cache, compiler="no-such-cc-nimble") is None
        assert residency.implementation("auto", cache) == python_check
        with pytest.raises(RuntimeError, match="residency='c'"):
            residency.implementation("c", cache)
    assert residency.implementation("python", cache) == python_check


@needs_cc
def test_no_python_headers_falls_back(tmp_path, fresh_warnings, monkeypatch):
    import sysconfig

    paths = dict(sysconfig.get_paths(), include=str(tmp_path))
    monkeypatch.setattr(sysconfig, "get_paths", lambda *a, **k: paths)
    with pytest.warns(RuntimeWarning, match="no Python headers"):
        assert residency.build(str(tmp_path)) is None


@needs_cc
def test_a_failing_compiler_falls_back(tmp_path, fresh_warnings):
    with pytest.warns(RuntimeWarning, match="building its residency check failed"):
        assert residency.build(str(tmp_path), compiler="false") is None
    assert not list(tmp_path.rglob("*.tmp"))  # no half-written module left behind


# ---- the signature of a Python scalar (checked on every call that passes one) ----------
@pytest.mark.parametrize("x64", [False, True])
def test_python_scalar_signature_is_jnp_asarray_dtype(x64):
    from nimblejax.arguments import signature

    r = np.random.default_rng(11)
    bound = 2 ** 63 if x64 else 2 ** 31
    ints = [int(v) for v in r.integers(-2 ** 31, 2 ** 31, size=20)] + [bound - 1, -bound]
    values = ints + [float(v) for v in r.normal(size=10) * 1e3] + [True, False]
    jax.config.update("jax_enable_x64", x64)
    try:
        for x in values:
            assert signature(x) == ((), np.dtype(jnp.asarray(x).dtype), True), x
        for x in (bound, -bound - 1):  # out of range: jnp's OverflowError, as jax.jit
            with pytest.raises(OverflowError):
                signature(x)
    finally:
        jax.config.update("jax_enable_x64", False)


@pytest.mark.parametrize("kind", ["held", "fed", "passed"])
def test_the_wrapper_benchmark_times_its_steady_state(kind):
    from nimblejax.bench import resident_wrapper

    call = resident_wrapper.steady_call(kind, 3, "python")  # raises if it left the state
    assert resident_wrapper.per_call_us(call, number=20) > 0

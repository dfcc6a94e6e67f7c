"""Each registered primitive matches jax.jit under the CPU plan interpreter."""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import nimblejax as nimble
from nimblejax.options import Options
from nimblejax.compiler.lowering import RULES
from tests.helpers.primitive_table import RECORDS
from tests.helpers.models import assert_tree_close


def test_every_rule_has_a_record():
    covered = {r.primitive for r in RECORDS}
    missing = sorted(set(RULES) - covered)
    assert not missing, f"registered rules without a test record: {missing}"


def test_every_record_emits_its_primitive():
    for r in RECORDS:
        a = r.args(np.random.default_rng(0))
        names = set()

        def walk(jaxpr):
            for e in jaxpr.eqns:
                names.add(e.primitive.name)
                for p in e.params.values():
                    inner = getattr(p, "jaxpr", None)
                    if inner is not None:
                        walk(getattr(inner, "jaxpr", inner))

        walk(jax.make_jaxpr(r.fn)(*a).jaxpr)
        if r.label.startswith("since-") and r.primitive not in names:
            continue  # a primitive of newer JAX versions; the record still runs
        if r.label == "internal":
            continue  # nimblejax's own primitive, emitted by a rewrite, not by JAX
        assert r.primitive in names, f"{r.id} does not emit {r.primitive}: {sorted(names)}"


# jax.jit's results are computed for this many consecutive records at once, in one
# program (each record's function on its own arguments): an XLA compile per chunk
# instead of one per record, whose fixed cost was most of a reference's time (200
# records: 7.6 s one by one, 1.4 s in one program). Consecutive, so that each of
# pytest -n's workers, given a run of the records, computes the chunks it needs.
CHUNK = 32


def _arguments(record):
    return record.args(np.random.default_rng(1))


@functools.cache
def _chunk_references(start: int) -> list:
    records = RECORDS[start:start + CHUNK]
    fns = [r.fn for r in records]
    return jax.jit(lambda arg_lists: [fn(*a) for fn, a in zip(fns, arg_lists)])(
        [_arguments(r) for r in records])


def interpreted(fn):
    """`fn` under the plan interpreter, called on the Python path: the XLA call path
    would compile a program per record around the interpreter's callback, and has
    tests of its own (tests/api)."""
    return nimble.jit(fn, backend="interpret", options=Options(call_path="python"))


_POSITION = {id(r): i for i, r in enumerate(RECORDS)}


def reference(record):
    """jax.jit's result of `record`'s function on its arguments (`_arguments`)."""
    i = _POSITION[id(record)]
    return _chunk_references(i - i % CHUNK)[i % CHUNK]


@pytest.mark.parametrize("record", RECORDS, ids=lambda r: r.id)
def test_matches_jax(record):
    a = _arguments(record)
    f = interpreted(record.fn)
    assert_tree_close(f(*a), reference(record))


CONV_RECORDS = [r for r in RECORDS if r.primitive == "conv_general_dilated"]


@pytest.mark.parametrize("path", ["cudnn", "im2col"])
@pytest.mark.parametrize("record", CONV_RECORDS, ids=lambda r: r.id)
def test_conv_paths_match_jax(record, path, monkeypatch):
    """Both convolution rewrites (the cuDNN one and im2col + GEMM) are planned and
    interpreted on the CPU, whichever one this machine would pick."""
    monkeypatch.setenv("NIMBLE_CONV", path)
    a = _arguments(record)
    f = interpreted(record.fn)
    assert_tree_close(f(*a), reference(record))
    kinds = {t.kind for t in f.plan(*a).tasks}
    if path == "im2col":
        assert "cudnn" not in kinds


def test_small_batch_convolutions_take_im2col_large_ones_cudnn(monkeypatch):
    """Where cuDNN is available ('auto'), a convolution of a small batch goes through
    im2col + GEMM (faster there, measured) and one of a large batch through cuDNN."""
    monkeypatch.delenv("NIMBLE_CONV", raising=False)

    def f(x, w):
        return jax.lax.conv_general_dilated(x, w, (1, 1), "SAME",
                                            dimension_numbers=("NHWC", "HWIO", "NHWC"))

    w = jax.ShapeDtypeStruct((3, 3, 8, 8), jnp.float32)
    kinds = lambda n, hw, **opts: {t.kind for t in nimble.jit(f, **opts).plan(  # noqa: E731
        jax.ShapeDtypeStruct((n, hw, hw, 8), jnp.float32), w).tasks}
    assert "cudnn" not in kinds(1, 56, cudnn=True)
    assert "cudnn" in kinds(32, 8, cudnn=True)
    assert "cudnn" not in kinds(32, 8, cudnn=False)  # where cuDNN is not found
    assert "cudnn" in kinds(1, 17, conv="cudnn")  # forced: every eligible convolution
    monkeypatch.setenv("NIMBLE_CONV", "cudnn")  # the same from the environment
    assert "cudnn" in kinds(1, 17)
    monkeypatch.setenv("NIMBLE_CONV", "im2col")
    assert "cudnn" not in kinds(32, 8, cudnn=True)

"""Each registered primitive matches jax.jit under the CPU plan interpreter."""
from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import nimblejax as nimble
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


@pytest.mark.parametrize("record", RECORDS, ids=lambda r: r.id)
def test_matches_jax(record):
    a = record.args(np.random.default_rng(1))
    f = nimble.jit(record.fn, backend="interpret")
    assert_tree_close(f(*a), jax.jit(record.fn)(*a))


CONV_RECORDS = [r for r in RECORDS if r.primitive == "conv_general_dilated"]


@pytest.mark.parametrize("path", ["cudnn", "im2col"])
@pytest.mark.parametrize("record", CONV_RECORDS, ids=lambda r: r.id)
def test_conv_paths_match_jax(record, path, monkeypatch):
    """Both convolution rewrites (the cuDNN one and im2col + GEMM) are planned and
    interpreted on the CPU, whichever one this machine would pick."""
    monkeypatch.setenv("NIMBLE_CONV", path)
    a = record.args(np.random.default_rng(1))
    f = nimble.jit(record.fn, backend="interpret")
    assert_tree_close(f(*a), jax.jit(record.fn)(*a))
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

"""Benchmark models (nimblejax.bench.models): shapes, parameter counts, and the tiny
BERT / LSTM / MLP against jax.jit under nimble's CPU plan interpreter."""
from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import nimblejax as nimble
from nimblejax.bench.models import MODELS, ModelSpec, layers
from nimblejax.bench.models import nasnet

CNNS = ("resnet50", "mobilenet_v2", "efficientnet_b0", "inception_v3", "nasnet_mobile")

# Full-size output shape for batch b, tiny output shape, published parameter count.
EXPECTED = {
    "mlp": (lambda b: (b, 256), lambda b: (b, 32), 8 * 6 * (256 * 256 + 256)),
    "bert": (lambda b: (b, 128, 768), lambda b: (b, 16, 64), 85e6),
    "lstm": (lambda b: (b, 512), lambda b: (b, 32), 2.1e6),
    "resnet50": (lambda b: (b, 1000), lambda b: (b, 1000), 25.6e6),
    "mobilenet_v2": (lambda b: (b, 1000), lambda b: (b, 1000), 3.5e6),
    "efficientnet_b0": (lambda b: (b, 1000), lambda b: (b, 1000), 5.3e6),
    "inception_v3": (lambda b: (b, 1000), lambda b: (b, 1000), 23.8e6),  # without aux head
    "nasnet_mobile": (lambda b: (b, 1000), lambda b: (b, 1000), 5.3e6),
    # 4 layers of 4·512² + 2·512·2048 weights: 12.6M
    "gpt": (lambda b: (b, 128, 512), lambda b: (b, 16, 64), 12.6e6),
}


def test_registry_lists_every_model():
    assert set(EXPECTED) <= set(MODELS)
    for name, spec in MODELS.items():
        assert isinstance(spec, ModelSpec) and spec.name == name and spec.description


@pytest.mark.parametrize("name", sorted(EXPECTED))
def test_tiny_output_shape(name):
    spec = MODELS[name]
    fn, args = spec.abstract(2, tiny=True)
    out = jax.eval_shape(fn, *args)
    assert out.shape == EXPECTED[name][1](2)
    assert out.dtype == jnp.float32


@pytest.mark.parametrize("name", sorted(EXPECTED))
def test_full_spec_shape_and_parameter_count(name):
    """Published sizes, from shapes only: no weight is materialized."""
    spec = MODELS[name]
    specs, out = spec.specs(batch=3)
    assert out.shape == EXPECTED[name][0](3)
    n = layers.count_params(specs)
    want = EXPECTED[name][2]
    assert abs(n - want) <= 0.15 * want, f"{name}: {n / 1e6:.2f}M parameters, published {want / 1e6:.2f}M"
    fn, (params, x) = spec.abstract(3)
    assert all(isinstance(p, jax.ShapeDtypeStruct) for p in jax.tree_util.tree_leaves(params))
    assert jax.eval_shape(fn, params, x).shape == out.shape


@pytest.mark.parametrize("name", ["mlp", "lstm", "bert", "gpt"])
def test_tiny_matches_jax_jit_under_interpreter(name):
    fn, args = MODELS[name].build(2, jnp.float32, np.random.default_rng(1), tiny=True)
    want = np.asarray(jax.jit(fn)(*args))
    got = np.asarray(nimble.jit(fn, backend="interpret")(*args))
    assert got.shape == want.shape
    assert np.all(np.isfinite(want)) and np.std(want) > 1e-3  # a non-trivial output
    np.testing.assert_allclose(got, want, rtol=2e-3, atol=2e-3)


def test_build_is_deterministic_and_pure():
    spec = MODELS["mlp"]
    fn, (p1, x1) = spec.build(2, rng=np.random.default_rng(5), tiny=True)
    _, (p2, x2) = spec.build(2, rng=np.random.default_rng(5), tiny=True)
    assert sorted(p1) == sorted(p2)
    for k in p1:
        np.testing.assert_array_equal(np.asarray(p1[k]), np.asarray(p2[k]))
    np.testing.assert_array_equal(np.asarray(fn(p1, x1)), np.asarray(fn(p2, x2)))


@pytest.mark.parametrize("name", CNNS)
def test_cnn_uses_conv_and_pooling_primitives(name):
    fn, args = MODELS[name].abstract(1, tiny=True)
    prims = {e.primitive.name for e in jax.make_jaxpr(fn)(*args).jaxpr.eqns}
    assert "conv_general_dilated" in prims
    if name in ("resnet50", "inception_v3", "nasnet_mobile"):
        assert "reduce_window_max" in prims
    assert "gather" not in prims


def test_depthwise_uses_feature_groups():
    fn, args = MODELS["mobilenet_v2"].abstract(1, tiny=True)
    groups = [e.params["feature_group_count"] for e in jax.make_jaxpr(fn)(*args).jaxpr.eqns
              if e.primitive.name == "conv_general_dilated"]
    assert max(groups) > 1


def test_avg_pool_same_excludes_padding():
    x = jnp.arange(2 * 5 * 5 * 3, dtype=jnp.float32).reshape(2, 5, 5, 3)
    got = np.asarray(layers.avg_pool(x, 3, 2, "SAME", count_include_pad=False))
    xs = np.asarray(x)
    want = np.zeros((2, 3, 3, 3), np.float32)
    for i in range(3):
        for j in range(3):
            win = xs[:, max(2 * i - 1, 0):2 * i + 2, max(2 * j - 1, 0):2 * j + 2, :]
            want[:, i, j, :] = win.mean(axis=(1, 2))
    np.testing.assert_allclose(got, want, rtol=1e-6)
    incl = np.asarray(layers.avg_pool(x, 3, 1, 1))
    np.testing.assert_allclose(incl[:, 0, 0], xs[:, :2, :2].sum(axis=(1, 2)) / 9, rtol=1e-6)


def test_nasnet_reduction_positions():
    assert nasnet.reduction_layers(12) == [4, 8]


def test_the_suite_is_the_eight_models_and_all_means_the_suite():
    from nimblejax.bench import cli
    from nimblejax.bench.models import SUITE

    assert len(SUITE) == 8 and "gpt" in MODELS and "gpt" not in SUITE
    assert cli.parse_args([]).model_names == list(SUITE)
    assert cli.parse_args(["--models", "gpt,bert"]).model_names == ["gpt", "bert"]


def test_gpt_attention_is_causal_through_dot_product_attention():
    fn, (params, x) = MODELS["gpt"].build(1, rng=np.random.default_rng(2), tiny=True)
    changed = x.at[:, -1].add(1.0)  # the last position sees itself only: earlier rows keep
    before, after = jax.jit(fn)(params, x), jax.jit(fn)(params, changed)
    np.testing.assert_allclose(np.asarray(before[:, :-1]), np.asarray(after[:, :-1]), rtol=1e-6)
    plan = nimble.jit(fn, backend="interpret").plan(params, x)
    assert any("iota" in t.name for t in plan.tasks)  # the causal mask, in the softmax's row kernel

"""Errors a user can act on, and re-tracing on new signatures."""
from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import nimblejax as nimble
from tests.helpers.models import rand

r = np.random.default_rng(0)


def test_unsupported_primitive_names_it_and_the_user_line():
    def f(x):
        return jnp.linalg.eigvalsh(x) * 2.0  # this line is the one reported

    with pytest.raises(NotImplementedError) as info:
        nimble.jit(f, backend="interpret", fallback="error")(rand(r, 3, 3))
    msg = str(info.value)
    assert "'eigh'" in msg
    assert f"test_errors.py:{f.__code__.co_firstlineno + 1}" in msg
    assert 'backend="jax"' in msg
    assert "linear algebra" in msg  # the reason nimblejax/compiler/unsupported.py gives


def test_unsupported_dtype_is_named():
    with pytest.raises(NotImplementedError, match="complex64"):
        nimble.jit(lambda x: x * 2, backend="interpret", fallback="error")(
            rand(r, 4).astype(jnp.complex64))


def test_non_array_argument_is_a_type_error_naming_it():
    f = nimble.jit(lambda x, opts: x * 2, backend="interpret")
    with pytest.raises(TypeError, match=r"^argument opts of <lambda> is a str.*static"):
        f(rand(r, 3), "fast")


def test_non_array_leaf_inside_a_dict_is_named():
    f = nimble.jit(lambda d: d["w"] * 2, backend="interpret")
    with pytest.raises(TypeError, match=r"'name'"):
        f({"w": rand(r, 3), "name": object()})


def predict(params, x, *rest, scale=1.0, **extra):
    return x


@pytest.mark.parametrize("args, kwargs, name", [
    (([rand(r, 2), (rand(r, 2), "a")], rand(r, 2)), {}, "params[1][1]"),
    (({"w": rand(r, 2), "name": "s"}, rand(r, 2)), {}, "params['name']"),
    ((rand(r, 2), "s"), {}, "x"),
    ((rand(r, 2), rand(r, 2), rand(r, 1), "s"), {}, "rest[1]"),
    ((rand(r, 2), rand(r, 2)), {"scale": "s"}, "scale"),
    ((rand(r, 2), rand(r, 2)), {"opts": {"mode": "s"}}, "extra['opts']['mode']"),
])
def test_non_array_argument_is_named_by_its_path_as_jax_jit_names_it(args, kwargs, name):
    """`argument params[1][1] of predict`: the parameter's name and the path inside it,
    the name jax.jit's own error gives for the same call."""
    with pytest.raises(TypeError) as ours:
        nimble.jit(predict, backend="interpret")(*args, **kwargs)
    assert str(ours.value).startswith(f"argument {name} of predict is a str"), ours.value
    with pytest.raises(TypeError) as theirs:
        jax.jit(predict)(*args, **kwargs)
    assert f"at path {name}." in str(theirs.value), theirs.value


def test_argument_paths_skip_static_arguments_and_self():
    g = nimble.jit(predict, static_argnums=0, backend="interpret")
    with pytest.raises(TypeError, match=r"^argument x\[1\] of predict is a str"):
        g("static", [rand(r, 1), "s"])

    class Model:
        @nimble.jit(backend="interpret")
        def __call__(self, x, y):
            return x + y

    with pytest.raises(TypeError, match=r"^argument y of __call__ is a str"):
        Model()(rand(r, 2), "s")


def test_plan_names_the_bad_leaf_not_an_abstract_one():
    f = nimble.jit(predict, backend="interpret")
    with pytest.raises(TypeError, match=r"^argument x of predict is a str"):
        f.plan(jax.ShapeDtypeStruct((2,), jnp.float32), "s")


def test_unhashable_static_argument():
    f = nimble.jit(lambda x, n: x * len(n), static_argnums=1, backend="interpret")
    with pytest.raises(TypeError, match="hashable"):
        f(rand(r, 3), [1, 2])


def test_bad_options():
    with pytest.raises(ValueError, match="backend"):
        nimble.jit(lambda x: x, backend="tpu")
    with pytest.raises(ValueError, match="max_streams"):
        nimble.jit(lambda x: x, max_streams=0)
    with pytest.raises(ValueError, match="output"):
        nimble.jit(lambda x: x, output="torch")


def test_new_shapes_trace_again_and_old_plans_stay():
    f = nimble.jit(lambda x: jnp.tanh(x) * 2.0, backend="interpret")
    for shape in [(3,), (4, 5), (3,)]:
        x = rand(r, *shape)
        np.testing.assert_allclose(f(x), jnp.tanh(x) * 2.0, rtol=1e-6)
    assert f.cache_size == 2
    f(rand(r, 3).astype(jnp.bfloat16))
    assert f.cache_size == 3


def test_static_argnames_and_kwargs():
    def f(x, *, scale, mode):
        return x * scale if mode == "mul" else x + scale
    g = nimble.jit(f, static_argnames=("mode",), backend="interpret")
    x = rand(r, 4)
    np.testing.assert_allclose(g(x, scale=2.0, mode="mul"), x * 2.0, rtol=1e-6)
    np.testing.assert_allclose(g(x, scale=2.0, mode="add"), x + 2.0, rtol=1e-6)
    assert g.cache_size == 2


def test_python_scalars_and_numpy_inputs():
    f = nimble.jit(lambda x, s: x * s, backend="interpret")
    x = np.random.default_rng(1).standard_normal(5)  # float64 numpy: JAX makes it f32
    out = f(x, 3)
    assert out.dtype == jnp.float32
    np.testing.assert_allclose(out, jax.jit(lambda x, s: x * s)(x, 3), rtol=1e-6)


def test_identity_literal_and_duplicate_outputs():
    f = nimble.jit(lambda x: (x, 1.0, jnp.sin(x), jnp.sin(x)), backend="interpret")
    x = rand(r, 3)
    a, one, s1, s2 = f(x)
    np.testing.assert_array_equal(a, x)
    assert float(one) == 1.0
    np.testing.assert_allclose(s1, jnp.sin(x), rtol=1e-6)
    np.testing.assert_allclose(s2, jnp.sin(x), rtol=1e-6)


def test_no_gpu_defaults_to_jax_with_a_warning(monkeypatch):
    import nimblejax.api as api

    monkeypatch.setattr(api, "gpu_available", lambda: False)
    monkeypatch.setattr(api, "_warned_no_gpu", False)
    f = nimble.jit(lambda x: x + 1)
    with pytest.warns(UserWarning, match="no CUDA GPU"):
        out = f(jnp.ones(2))
    np.testing.assert_array_equal(out, 2.0)


def test_unsupported_primitive_inside_a_library_names_the_users_call(tmp_path, monkeypatch):
    """A primitive emitted inside an installed library (optax, flax) names the library's
    line and the user's line that called into it."""
    lib = tmp_path / "site-packages"
    lib.mkdir()
    (lib / "fakelib_nimble.py").write_text(
        "from jax import lax\n\ndef to_complex(x):\n    return lax.complex(x, x)\n")
    monkeypatch.syspath_prepend(str(lib))
    import fakelib_nimble

    def f(x):
        return fakelib_nimble.to_complex(x)  # the user's line

    line = f.__code__.co_firstlineno + 1
    with pytest.raises(NotImplementedError) as e:
        nimble.jit(f, backend="interpret", fallback="error")(rand(r, 3))
    msg = str(e.value)
    assert "fakelib_nimble.py:4" in msg and f"called from {__file__}:{line}" in msg, msg
    assert 'backend="jax"' in msg

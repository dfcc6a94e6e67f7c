"""The call contract of nimble.jit, checked on the CPU (interpret backend): what a
jax.jit user expects of jit, grad, vmap, donation, statics, methods and threads."""
from __future__ import annotations

import os
import re
import threading

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import nimblejax as nimble
from tests.helpers.models import rand

r = np.random.default_rng(0)


def close(a, b, tol=1e-5):
    for x, y in zip(jax.tree_util.tree_leaves(a), jax.tree_util.tree_leaves(b)):
        np.testing.assert_allclose(np.asarray(x), np.asarray(y), rtol=tol, atol=tol)


def mlp(p, x):
    return jnp.tanh(x @ p["w"] + p["b"]).sum(), x * 2.0


PARAMS = {"w": rand(r, 4, 3), "b": rand(r, 3)}
X = rand(r, 2, 4)


def test_default_path_is_a_jax_operation():
    f = nimble.jit(mlp, backend="interpret")
    close(f(PARAMS, X), jax.jit(mlp)(PARAMS, X))
    assert f.call_path == "xla" and f.cache_size == 1
    f(PARAMS, rand(r, 2, 4))
    assert f.cache_size == 1  # same signature: no new plan


def test_inside_jax_jit_and_a_larger_program():
    f = nimble.jit(mlp, backend="interpret")
    outer = jax.jit(lambda p, x: f(p, jnp.sin(x))[1] + jnp.cos(x))
    close(outer(PARAMS, X), jnp.sin(X) * 2.0 + jnp.cos(X))
    close(jax.jit(f)(PARAMS, X), mlp(PARAMS, X))


def test_grad_and_value_and_grad_match_jax():
    f = nimble.jit(mlp, backend="interpret")
    loss = lambda fn: (lambda p, x: fn(p, x)[0])  # noqa: E731
    close(jax.grad(loss(f))(PARAMS, X), jax.grad(loss(mlp))(PARAMS, X))
    close(jax.value_and_grad(loss(f), argnums=(0, 1))(PARAMS, X),
          jax.value_and_grad(loss(mlp), argnums=(0, 1))(PARAMS, X))
    close(jax.jit(jax.grad(loss(f)))(PARAMS, X), jax.grad(loss(mlp))(PARAMS, X))


def test_grad_with_integer_inputs_and_outputs():
    def g(x, i):
        return jnp.sum(x * i), i + 1

    f = nimble.jit(g, backend="interpret")
    i = jnp.arange(4, dtype=jnp.int32)
    x = rand(r, 4)
    close(jax.grad(lambda x: f(x, i)[0])(x), jax.grad(lambda x: g(x, i)[0])(x))


def test_vmap_plans_the_batched_function():
    f = nimble.jit(mlp, backend="interpret")
    xs = rand(r, 5, 2, 4)
    close(jax.vmap(f, in_axes=(None, 0))(PARAMS, xs), jax.vmap(mlp, in_axes=(None, 0))(PARAMS, xs))
    x3 = rand(r, 2, 4, 3)
    close(jax.vmap(f, in_axes=(None, 2))(PARAMS, x3), jax.vmap(mlp, in_axes=(None, 2))(PARAMS, x3))
    # one plan of the batched function (its tasks see the batch dimension), not a loop
    shapes = [v.shape for c in f._specs.values() for v in c.plan.graph.inputs]
    assert (5, 2, 4) in shapes


def test_numpy_argument_mutated_or_reshaped_between_calls():
    f = nimble.jit(lambda x: x * 2.0, backend="interpret")
    g = nimble.jit(lambda x: x * 2.0, backend="interpret", call_path="python")
    for fn in (f, g):
        a = np.ones((2, 3), np.float32)
        close(fn(a), 2 * np.ones((2, 3)))
        a[0, 0] = 5.0
        close(fn(a), 2 * a)
        a.shape = (3, 2)
        out = fn(a)
        assert out.shape == (3, 2)
        close(out, 2 * a)


def test_iota_only_output_and_zero_argument_function():
    f = nimble.jit(lambda: jnp.arange(5) * 2, backend="interpret")
    close(f(), jnp.arange(5) * 2)
    g = nimble.jit(lambda x: (x + 1.0, jnp.arange(3, dtype=jnp.float32)), backend="interpret")
    close(g(X), (X + 1.0, jnp.arange(3, dtype=jnp.float32)))


def test_static_argnums_out_of_range_and_unknown_names_raise_value_error():
    def h(x, n):
        return x * n

    with pytest.raises(ValueError, match="static_argnums"):
        nimble.jit(h, static_argnums=5)
    with pytest.raises(ValueError, match="static_argnames"):
        nimble.jit(h, static_argnames="m")
    f = nimble.jit(h, static_argnums=1, backend="interpret")
    close(f(X, 3), X * 3)


def test_output_and_donation_are_honored_or_refused():
    with pytest.raises(ValueError, match="output='cupy'"):
        nimble.jit(lambda x: x + 1, backend="interpret", output="cupy")(X)
    out = nimble.jit(lambda x: x + 1, backend="interpret", output="numpy")(X)
    assert isinstance(out, np.ndarray)
    with pytest.raises(ValueError, match="donate_argnums"):
        nimble.jit(lambda x: x + 1, backend="interpret", donate_argnums=0, call_path="python")(X)
    f = nimble.jit(lambda p, x: jax.tree_util.tree_map(lambda a: a * 0.5, p), backend="interpret",
                   donate_argnums=0)
    p = jax.tree_util.tree_map(jnp.copy, PARAMS)
    close(f(p, X), jax.tree_util.tree_map(lambda a: a * 0.5, PARAMS))
    assert f.call_path == "xla"  # jax.jit donates the buffers (deleted where XLA can)


def test_cuda_backend_without_a_gpu_says_so():
    from nimblejax.api import gpu_available

    if gpu_available():
        pytest.skip("a GPU is visible")
    with pytest.raises(RuntimeError, match="no CUDA GPU is visible"):
        nimble.jit(lambda x: x + 1, backend="cuda")(X)


def test_asking_for_a_gpu_imports_no_cupy(monkeypatch):
    """gpu_available asks the CUDA driver (runtime/nvrtc.py), not CuPy: a cold first call
    imports CuPy later, while its kernels compile."""
    import sys

    from nimblejax.api import gpu_available
    from nimblejax.runtime import nvrtc

    monkeypatch.delitem(sys.modules, "cupy", raising=False)
    available = gpu_available()
    assert "cupy" not in sys.modules
    assert available == (nvrtc.driver_device_count() > 0)


class FakeDriver:
    """libcuda's cuDeviceGetCount and cuDriverGetVersion."""

    def __init__(self, count: int, version: int) -> None:
        self.count, self.version = count, version

    def cuDeviceGetCount(self, out) -> int:
        out._obj.value = self.count
        return 0

    def cuDriverGetVersion(self, out) -> int:
        out._obj.value = self.version
        return 0


def test_a_driver_older_than_cupys_cuda_counts_no_gpu(monkeypatch):
    """CuPy built for CUDA 13 cannot use a CUDA 12 driver: no GPU for nimble either (the
    cuda backend then says no GPU is visible, not a CUDA error code later)."""
    from nimblejax.runtime import nvrtc

    monkeypatch.setattr(nvrtc, "cupy_cuda_release", lambda: 13000)
    monkeypatch.setattr(nvrtc, "_driver", lambda: FakeDriver(2, 12080))
    assert nvrtc.driver_device_count() == 0
    monkeypatch.setattr(nvrtc, "_driver", lambda: FakeDriver(2, 13000))
    assert nvrtc.driver_device_count() == 2
    monkeypatch.setattr(nvrtc, "_driver", lambda: None)
    assert nvrtc.driver_device_count() == 0


def test_two_threads_calling_one_function():
    f = nimble.jit(mlp, backend="interpret")
    xs = [rand(np.random.default_rng(i), 2, 4) for i in range(8)]
    want = [mlp(PARAMS, x) for x in xs]
    got = [None] * len(xs)

    def work(i):
        got[i] = f(PARAMS, xs[i])

    threads = [threading.Thread(target=work, args=(i,)) for i in range(len(xs))]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    for g, w in zip(got, want):
        close(g, w)


def test_method_binds_self_as_static():
    class Model:
        def __init__(self, scale):
            self.scale = scale

        def __hash__(self):
            return hash(self.scale)

        def __eq__(self, other):
            return isinstance(other, Model) and other.scale == self.scale

        @nimble.jit
        def apply(self, x):
            return x * self.scale

    m = Model(3.0)
    close(m.apply(X), X * 3.0)
    close(Model(4.0).apply(X), X * 4.0)


def test_explain_twice_gives_equal_text():
    assert str(nimble.explain(mlp, PARAMS, X)) == str(nimble.explain(mlp, PARAMS, X))


def test_options_override_the_environment_and_enter_the_plan(monkeypatch):
    monkeypatch.setenv("NIMBLE_MAX_STREAMS", "1")
    assert nimble.jit(mlp).options.max_streams == 1
    assert nimble.jit(mlp, max_streams=3).options.max_streams == 3
    assert nimble.jit(mlp, options=nimble.Options(max_streams=2)).options.max_streams == 2
    with pytest.raises(ValueError, match="NIMBLE_CONV"):
        monkeypatch.setenv("NIMBLE_CONV", "bogus")
        nimble.jit(mlp)
    monkeypatch.delenv("NIMBLE_CONV")
    with pytest.raises(TypeError, match="unknown nimblejax option"):
        nimble.jit(mlp, streams=2)


def test_debug_option_verifies_every_plan():
    f = nimble.jit(mlp, backend="interpret", debug=1)
    assert f.options.verify
    close(f(PARAMS, X), mlp(PARAMS, X))


def test_no_environment_variable_is_read_outside_options():
    root = os.path.join(os.path.dirname(__file__), "..", "..", "nimblejax")
    offenders = []
    for folder, _, files in os.walk(root):
        for name in files:
            path = os.path.join(folder, name)
            # The bench's cold timings set the cache folders of what they time (its own
            # kernel caches, a child process's environment).
            cold_timing = path.endswith(os.path.join("bench", "measure.py")) or \
                path.endswith(os.path.join("bench", "first_call.py"))
            if not name.endswith(".py") or name == "options.py" or cold_timing:
                continue
            text = open(path).read()
            if re.search(r"os\.environ|getenv\(", text):
                offenders.append(os.path.relpath(path, root))
    assert offenders == []


@pytest.mark.parametrize("resident", [False, True])
def test_the_jitted_calls_compile_with_the_wrapper_options(monkeypatch, resident):
    """xla_path.WRAPPER_COMPILER_OPTIONS reaches XLA's compile of both jitted calls (the
    plain operation of a one-leaf call, the resident call of a larger one): an option XLA
    does not know is refused, a known one compiles and gives the same result."""
    from nimblejax import xla_path

    def fn(x, *rest):
        return jnp.sin(x) * 2 + sum(rest)

    args = (X,) + ((X + 1, X + 2, X + 3) if resident else ())
    want = np.asarray(jax.jit(fn)(*args))
    monkeypatch.setattr(xla_path, "WRAPPER_COMPILER_OPTIONS", {"not_an_xla_option": True})
    with pytest.raises(Exception, match="not_an_xla_option"):
        nimble.jit(fn, backend="interpret")(*args)
    monkeypatch.setattr(xla_path, "WRAPPER_COMPILER_OPTIONS", {"xla_backend_optimization_level": 0})
    np.testing.assert_allclose(np.asarray(nimble.jit(fn, backend="interpret")(*args)), want, rtol=1e-6)

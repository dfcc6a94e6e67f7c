"""GPU runtime: results against jax.jit, and the life cycle of a compiled function.
Marked `gpu`; skipped where no CUDA GPU is visible."""
from __future__ import annotations

import os
import subprocess
import sys
import threading

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import nimblejax as nimble
from tests.helpers.models import (MODELS, assert_tree_close, branchy_args, branchy_mlp, model_args,
                                  rand)
from tests.helpers.primitive_table import RECORDS

pytestmark = pytest.mark.gpu


@pytest.mark.parametrize("name", sorted(MODELS))
def test_model_matches_jax(name):
    fn, _, opts = MODELS[name]
    args = model_args(name)
    want = jax.jit(fn, **opts)(*args)
    for mode in (dict(), dict(max_streams=1), dict(eager=True)):
        f = nimble.jit(fn, backend="cuda", **opts, **mode)
        assert_tree_close(f(*args), want)
        assert_tree_close(f(*args), want)


@pytest.mark.parametrize("record", RECORDS, ids=lambda r: r.id)
def test_primitive_matches_jax(record):
    a = record.args(np.random.default_rng(1))
    assert_tree_close(nimble.jit(record.fn, backend="cuda")(*a), jax.jit(record.fn)(*a))


def test_life_cycle_one_graph_launch_per_call_and_no_kernels():
    """The Python call path's counters (the XLA path is checked in test_xla_op.py)."""
    args = branchy_args(np.random.default_rng(0))
    f = nimble.jit(branchy_mlp, backend="cuda", call_path="python")
    want = jax.jit(branchy_mlp)(*args)
    outs = [f(*args) for _ in range(5)]
    assert f.cache_size == 1
    (exe,) = f.executables()
    assert exe.stats["calls"] == 5 and exe.stats["graph_launches"] == 5
    launched = exe.stats["task_launches"]
    f(*args)
    assert exe.stats["task_launches"] == launched, "steady state must launch no kernel"
    assert exe.stats["graph_launches"] == 6
    for o in outs:
        assert_tree_close(o, want)
    # Parameters are the same jax.Arrays every call: copied once, at the first call.
    assert exe.stats["input_copies"] == len(jax.tree_util.tree_leaves(args))


def test_outputs_are_never_overwritten_or_aliased():
    f = nimble.jit(lambda x: jnp.tanh(x) * 3.0, backend="cuda")
    x1, x2 = rand(np.random.default_rng(1), 64), rand(np.random.default_rng(2), 64)
    y1 = f(x1)
    y1_copy = np.asarray(y1).copy()
    y2 = f(x2)
    np.testing.assert_array_equal(np.asarray(y1), y1_copy)
    assert y1.unsafe_buffer_pointer() != y2.unsafe_buffer_pointer()
    np.testing.assert_allclose(y2, jnp.tanh(x2) * 3.0, rtol=1e-5)


def test_changed_inputs_are_copied_and_used():
    f = nimble.jit(lambda w, x: x @ w, backend="cuda")
    rng = np.random.default_rng(3)
    w = rand(rng, 8, 8)
    for _ in range(3):
        x = rand(rng, 2, 8)
        assert_tree_close(f(w, x), jax.jit(lambda w, x: x @ w)(w, x))


def test_input_still_being_computed_by_xla():
    big = jax.jit(lambda k: jax.random.normal(k, (2048, 2048)) @ jax.random.normal(k, (2048, 2048)))
    x = big(jax.random.PRNGKey(0))  # enqueued, not waited for
    f = nimble.jit(lambda a: jnp.sum(a, axis=0), backend="cuda")
    assert_tree_close(f(x), jax.jit(lambda a: jnp.sum(a, axis=0))(x))


def test_numpy_and_cupy_inputs_and_cupy_output():
    import cupy

    f = nimble.jit(lambda a, b: a * b + 1.0, backend="cuda", output="cupy")
    a = np.random.default_rng(0).standard_normal(10).astype(np.float32)
    b = cupy.asarray(np.random.default_rng(1).standard_normal(10).astype(np.float32))
    out = f(a, b)
    assert isinstance(out, cupy.ndarray)
    np.testing.assert_allclose(cupy.asnumpy(out), a * cupy.asnumpy(b) + 1.0, rtol=1e-6)


def test_two_threads_calling_one_function():
    f = nimble.jit(branchy_mlp, backend="cuda")
    params, _ = branchy_args(np.random.default_rng(0))
    xs = [rand(np.random.default_rng(i), 2, 64) for i in range(8)]
    wants = [np.asarray(jax.jit(branchy_mlp)(params, x)) for x in xs]
    f(params, xs[0])
    errors = []

    def worker(k):
        try:
            for j in range(20):
                i = (k + j) % len(xs)
                np.testing.assert_allclose(np.asarray(f(params, xs[i])), wants[i], rtol=2e-3, atol=2e-3)
        except Exception as e:  # pragma: no cover - reported below
            errors.append(e)

    threads = [threading.Thread(target=worker, args=(k,)) for k in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors, errors[0]


def test_donated_arguments():
    f = nimble.jit(lambda p, g: jax.tree_util.tree_map(lambda a, b: a - 0.1 * b, p, g),
                   backend="cuda", donate_argnums=(0,))
    p = {"w": rand(np.random.default_rng(0), 16)}
    g = {"w": rand(np.random.default_rng(1), 16)}
    want = p["w"] - 0.1 * g["w"]
    np.testing.assert_allclose(f(p, g)["w"], want, rtol=1e-6)
    assert p["w"].is_deleted() and not g["w"].is_deleted()  # as under jax.jit


def test_exception_during_capture_leaves_the_stream_usable(monkeypatch):
    from nimblejax.runtime.graph import DeviceGraph

    calls = {"n": 0}
    original = DeviceGraph.launch_tasks

    def flaky(self, tasks=None):
        calls["n"] += 1
        if calls["n"] == 2:  # the second pass is the one under capture
            raise RuntimeError("injected failure during capture")
        return original(self, tasks)

    monkeypatch.setattr(DeviceGraph, "launch_tasks", flaky)
    x = rand(np.random.default_rng(0), 32)
    with pytest.raises(RuntimeError, match="injected"):
        nimble.jit(lambda a: jnp.exp(a) + 1.0, backend="cuda")(x)
    monkeypatch.setattr(DeviceGraph, "launch_tasks", original)
    np.testing.assert_allclose(nimble.jit(lambda a: jnp.exp(a) + 2.0, backend="cuda")(x),
                               jnp.exp(x) + 2.0, rtol=1e-5)


def test_beside_default_jax_preallocation():
    """A fresh process with JAX's default 75% preallocation: nimble still runs."""
    code = (
        "import jax, numpy as np, nimblejax as nimble;"
        "from tests.helpers.models import branchy_args, branchy_mlp, assert_tree_close;"
        "a = branchy_args(np.random.default_rng(0), width=256, batch=32);"
        "jax.jit(branchy_mlp)(*a).block_until_ready();"
        "assert_tree_close(nimble.jit(branchy_mlp, backend='cuda')(*a), jax.jit(branchy_mlp)(*a));"
        "print('ok')")
    env = {k: v for k, v in os.environ.items() if not k.startswith("XLA_PYTHON_CLIENT")}
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    env["PYTHONPATH"] = root + os.pathsep + env.get("PYTHONPATH", "")
    res = subprocess.run([sys.executable, "-c", code], cwd=root, env=env, capture_output=True,
                         text=True, timeout=300)
    assert res.returncode == 0 and "ok" in res.stdout, res.stderr[-2000:]


def test_out_of_memory_names_the_bytes():
    from nimblejax.runtime.io import OutOfMemoryError, allocate

    with pytest.raises(OutOfMemoryError, match=r"needs \d+ bytes"):
        allocate(1 << 50, "a test buffer")


@pytest.mark.parametrize("path", ["cudnn", "im2col"])
@pytest.mark.parametrize("record", [r for r in RECORDS if r.primitive == "conv_general_dilated"],
                         ids=lambda r: r.id)
def test_conv_paths_on_gpu(record, path, monkeypatch):
    monkeypatch.setenv("NIMBLE_CONV", path)
    a = record.args(np.random.default_rng(2))
    assert_tree_close(nimble.jit(record.fn, backend="cuda")(*a), jax.jit(record.fn)(*a))


@pytest.mark.parametrize("shape,axes", [((2, 56, 56, 24), (1, 2)), ((3, 7, 5), (1,)), ((1000, 3), (0,)),
                                        ((4, 33, 65), (0, 1)), ((8, 4096, 40), (1,)), ((2, 9, 9, 1152), (1, 2))])
@pytest.mark.parametrize("op", ["sum", "max", "mean_bf16", "sum_int"])
def test_column_reductions_match_jax(shape, axes, op):
    """Reductions that keep the innermost axis (the tiled column kernel, split or not)."""
    x = rand(np.random.default_rng(3), *shape)
    fn = {"sum": lambda a: jnp.sum(jnp.tanh(a), axis=axes), "max": lambda a: jnp.max(a, axis=axes),
          "mean_bf16": lambda a: jnp.mean(a.astype(jnp.bfloat16), axis=axes),
          "sum_int": lambda a: jnp.sum((a * 10).astype(jnp.int32), axis=axes)}[op]
    assert_tree_close(nimble.jit(fn, backend="cuda")(x), jax.jit(fn)(x))


@pytest.mark.parametrize("shape", [(3, 70001), (64, 32, 33), (1 << 16,), (256, 1024)])
def test_large_fused_kernels_with_tails_match_jax(shape):
    """Fused kernels of ≥ UNROLL_MIN elements compute 4 per thread; sizes that are not
    multiples of the unrolled step run their tail through the plain loop."""
    rng = np.random.default_rng(5)
    x, y = rand(rng, *shape), rand(rng, *shape)
    bias = rand(rng, shape[-1])

    def f(x, y, bias):
        z = jnp.tanh(x * 2.0 + bias) - y
        flipped = jnp.flip(z, axis=-1).reshape(-1)
        return (flipped * 0.5).reshape(shape), (z > 0).astype(jnp.int32) + 3, z.astype(jnp.bfloat16)

    assert_tree_close(nimble.jit(f, backend="cuda")(x, y, bias), jax.jit(f)(x, y, bias))

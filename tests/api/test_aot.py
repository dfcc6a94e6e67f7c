"""Ahead of time (nimblejax/aot.py): `nimble.jit(f).lower(*args)` plans one signature from
jax.ShapeDtypeStruct arguments without running anything, and `.compile()` builds the
executable a call runs, in the names of JAX's AOT API; the compiled executable computes
what jax.jit does, on the interpreter here and, marked `gpu`, on the GPU."""
from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import nimblejax as nimble
from tests.helpers.models import assert_tree_close, rand

r = np.random.default_rng(5)


def layer(params, x):
    return jnp.tanh(x @ params["w"] + params["b"]).sum(axis=-1)


def args():
    return {"w": rand(r, 16, 8), "b": rand(r, 8)}, rand(r, 4, 16)


def specs(tree):
    return jax.tree_util.tree_map(lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype), tree)


def test_lower_plans_abstract_arguments_and_prints_every_pass():
    lowered = nimble.jit(layer, backend="interpret").lower(*specs(args()))
    assert list(lowered.stages) == ["trace", "canonicalize", "fuse", "lower", "buffers", "streams",
                                    "memory"]
    text = lowered.as_text()
    assert "dot_general" in text and "tanh" in text and str(lowered) == text
    assert lowered.plan.tasks and str(lowered.explain()).splitlines()[-1].startswith(
        f"totals: {len(lowered.plan.tasks)} tasks")


def test_compile_returns_jaxs_executable_that_computes_what_jax_does():
    a = args()
    compiled = nimble.jit(layer, backend="interpret").lower(*specs(a)).compile()
    assert isinstance(compiled, jax.stages.Compiled)
    assert "nimble_call" in compiled.as_text() or "custom_call" in compiled.as_text()
    assert_tree_close(compiled(*a), jax.jit(layer)(*a))
    b = args()  # another set of values of the same signature
    assert_tree_close(compiled(*b), jax.jit(layer)(*b))


def test_static_arguments_are_fixed_at_lowering_as_in_jax():
    f = nimble.jit(lambda x, n: x * n + 1.0, static_argnums=1, backend="interpret")
    compiled = f.lower(jax.ShapeDtypeStruct((3,), jnp.float32), 4).compile()
    x = rand(r, 3)
    np.testing.assert_allclose(compiled(x), np.asarray(x) * 4 + 1.0, rtol=1e-6)
    with pytest.raises(TypeError):
        compiled(x, 4)  # as jax's Compiled: static arguments are not passed again


def test_a_call_of_another_signature_is_refused():
    compiled = nimble.jit(layer, backend="interpret").lower(*specs(args())).compile()
    with pytest.raises(TypeError):
        compiled({"w": rand(r, 16, 8), "b": rand(r, 8)}, rand(r, 5, 16))


def test_backend_jax_is_jax_jits_own_aot():
    a = args()
    compiled = nimble.jit(layer, backend="jax").lower(*specs(a)).compile()
    assert "nimble_call" not in compiled.as_text()
    assert_tree_close(compiled(*a), jax.jit(layer)(*a))


def test_the_python_call_path_refuses_to_compile_ahead_and_says_why():
    lowered = nimble.jit(layer, backend="interpret", output="numpy").lower(*specs(args()))
    with pytest.raises(NotImplementedError, match="XLA call path.*output='jax'"):
        lowered.compile()


@pytest.mark.gpu
def test_compiled_on_the_gpu_computes_what_jax_does():
    a = args()
    compiled = nimble.jit(layer, backend="cuda").lower(*specs(a)).compile()
    for _ in range(2):
        assert_tree_close(compiled(*a), jax.jit(layer)(*a))
        a = args()

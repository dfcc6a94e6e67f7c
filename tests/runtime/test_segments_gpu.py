"""A segmented plan on the GPU (Options.segments, runtime/ffi_runner.py): its graphs
launched as one custom call each, one after another over one arena, the results those
of jax.jit; the handler refuses segments called out of turn."""
from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import nimblejax as nimble
from tests.helpers.train_models import tanh_mlp_loss as loss

pytestmark = pytest.mark.gpu
r = np.random.default_rng(0)


def rand(*shape):
    return jnp.asarray(r.normal(size=shape), jnp.float32)


def params(layers=6, width=128):
    return [(rand(width, width) * 0.1, rand(width) * 0.1) for _ in range(layers)]


def close(a, b, tol=1e-5):
    for x, y in zip(jax.tree_util.tree_leaves(a), jax.tree_util.tree_leaves(b)):
        np.testing.assert_allclose(np.asarray(x), np.asarray(y), rtol=tol, atol=tol)


def segmented_runner(f):
    from nimblejax.runtime.ffi_runner import FfiRunner

    runners = [x for x in f.runners() if isinstance(x, FfiRunner)]
    assert runners and len({len(x.segment_ids) for x in runners}) == 1
    return runners[-1]


@pytest.mark.parametrize("n", [2, 3])
def test_gradients_inside_a_jit_match_jax(n):
    p = params()
    f = nimble.jit(jax.value_and_grad(loss), segments=n)
    inside = jax.jit(lambda p, x: jax.tree_util.tree_map(lambda g: g * 2.0, f(p, x)))
    want = jax.jit(lambda p, x: jax.tree_util.tree_map(lambda g: g * 2.0, jax.value_and_grad(loss)(p, x)))
    for _ in range(3):  # fresh inputs each call
        x = rand(32, 128)
        close(inside(p, x), want(p, x))
    runner = segmented_runner(f)
    assert len(runner.segment_ids) == n and len(runner.exe.raw_execs) == n


def test_a_fed_back_donated_step_from_python():
    """The resident path: a top-level call, state fed back and donated, operands held."""
    def step(p, x):
        g = jax.grad(loss)(p, x)
        return jax.tree_util.tree_map(lambda a, b: a - 0.1 * b, p, g)

    f = nimble.jit(step, donate_argnums=0, segments=2)
    ref = jax.jit(step)
    p_n, p_j = params(), params()
    p_j = jax.tree_util.tree_map(jnp.copy, p_n)
    for _ in range(4):
        x = rand(32, 128)
        p_n, p_j = f(p_n, x), ref(p_j, x)
        close(p_n, p_j, tol=2e-5)
    assert len(segmented_runner(f).segment_ids) == 2


def test_the_handler_refuses_a_segment_out_of_turn():
    from nimblejax.runtime.ffi import TARGET

    p = params()
    f = nimble.jit(jax.value_and_grad(loss), segments=2)
    call = jax.jit(lambda p, x: f(p, x))
    call(p, rand(32, 128))[0].block_until_ready()
    runner = segmented_runner(f)
    seg = runner.segments[1]
    specs = [runner.out_specs[j] for j in seg.outputs]
    second_first = jax.jit(lambda t: jax.ffi.ffi_call(TARGET, specs)(t, plan=np.int64(runner.segment_ids[1])))
    with pytest.raises(Exception, match="segment 1 of plan .* was called where segment 0 was due"):
        jax.block_until_ready(second_first(jnp.zeros(4)))
    x = rand(32, 128)
    close(call(p, x), jax.value_and_grad(loss)(p, x))  # in turn again

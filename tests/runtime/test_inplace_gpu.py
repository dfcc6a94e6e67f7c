"""In-place operands and results on the GPU (runtime/inplace.py, runtime/ffi_runner.py):
the handler re-points kernel nodes to XLA's buffers instead of copying."""
from __future__ import annotations

import time

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import nimblejax as nimble

pytestmark = pytest.mark.gpu
r = np.random.default_rng(0)


def rand(*shape, dtype=jnp.float32):
    return jnp.asarray(r.normal(size=shape), dtype)


def close(a, b, tol=1e-5):
    for x, y in zip(jax.tree_util.tree_leaves(a), jax.tree_util.tree_leaves(b)):
        np.testing.assert_allclose(np.asarray(x), np.asarray(y), rtol=tol, atol=tol)


def ffi_runners(f) -> list:
    from nimblejax.runtime.ffi_runner import FfiRunner

    return [x for x in f.runners() if isinstance(x, FfiRunner)]


def stats(f) -> dict:
    """The handler's counters summed over f's plans (a donating function has a plan for
    its first call and one whose donated state stays resident)."""
    total: dict = {}
    for runner in ffi_runners(f):
        for k, v in runner.stats(next(iter(runner.exes))).items():
            total[k] = total.get(k, 0) + v
    return total


def test_a_trivial_call_copies_nothing_and_sets_one_node_per_fresh_address():
    f = nimble.jit(lambda x: x * 2.0 + 1.0)
    xs = [rand(4096) for _ in range(6)]
    outs = [f(x) for x in xs]  # looped: no block in between
    for x, y in zip(xs, outs):
        close(y, x * 2.0 + 1.0)
    (runner,) = ffi_runners(f)
    assert runner.inplace_on[0].inputs == {0} and len(runner.inplace_on[0].outputs) == 1
    s = stats(f)
    assert s["calls"] == 6 and s["copy_launches"] == 0
    assert s["graph_copies"] == 0 and s["copy_node_sets"] == 0  # the copy nodes stay empty
    assert s["nodes_set"] <= 6  # one node; set only when an address changed


def test_a_one_kernel_plan_launches_its_kernel_without_the_graph_and_its_graph_stays_right():
    """With nothing to copy, the handler launches a one-kernel plan's kernel itself (no
    node set, no graph launch); the graph, timed alone as the bench does (pointed back
    at its arena), still runs, and calls after it are right."""
    from nimblejax.bench import timing

    f = nimble.jit(lambda x: jnp.tanh(x) * 2.0 + 1.0)
    xs = [rand(4096) for _ in range(5)]
    outs = [f(x) for x in xs]
    for x, y in zip(xs, outs):
        close(y, jnp.tanh(x) * 2.0 + 1.0)
    (runner,) = ffi_runners(f)
    assert runner.direct_on[0] is True
    assert stats(f)["direct_launches"] == stats(f)["calls"] == 5
    assert timing.nimble_gpu_us(f, calls=20) > 0  # the graph exec, re-pointed at the arena
    more = [rand(4096) for _ in range(3)]
    for x in more + xs[:1]:  # fresh buffers, and one seen before the graph was rested
        close(f(x), jnp.tanh(x) * 2.0 + 1.0)
    assert stats(f)["direct_launches"] == 9


def test_a_plan_of_several_kernels_launches_its_graph():
    f = nimble.jit(lambda x: jnp.sum(jnp.tanh(x) * 2.0, axis=0) + jnp.max(x))
    x = rand(64, 300)
    for _ in range(3):
        close(f(x), jnp.sum(jnp.tanh(x) * 2.0, axis=0) + jnp.max(x), tol=1e-4)
    (runner,) = ffi_runners(f)
    assert not runner.direct_on.get(0, False) and stats(f)["direct_launches"] == 0


def test_held_operand_stays_pointed_at_and_a_new_one_is_seen():
    f = nimble.jit(lambda p, x: jnp.tanh(x) * p)
    p = rand(1024)
    for _ in range(3):
        x = rand(1024)
        close(f(p, x), jnp.tanh(x) * p)
    p2 = rand(1024)  # a new parameter object: passed, the graph re-pointed
    x = rand(1024)
    close(f(p2, x), jnp.tanh(x) * p2)
    close(f(p, x), jnp.tanh(x) * p)  # and back
    assert stats(f)["copy_launches"] == 0


def test_results_land_in_xlas_buffers_and_survive_later_calls():
    f = nimble.jit(lambda x: (jnp.sin(x), jnp.cos(x) * 3.0))
    xs = [rand(257, 3) for _ in range(5)]
    outs = [f(x) for x in xs]
    for x, (s, c) in zip(xs, outs):  # each result is its own buffer, not overwritten
        close(s, jnp.sin(x))
        close(c, jnp.cos(x) * 3.0)
    assert stats(f)["copy_launches"] == 0


def test_scatter_add_result_written_in_place():
    table_shape, n = (4000, 64), 2048

    def backward(ids, g):
        return jnp.zeros(table_shape, g.dtype).at[ids].add(g)

    f = nimble.jit(backward)
    for _ in range(3):
        ids = jnp.asarray(r.integers(0, table_shape[0], n), jnp.int32)
        g = rand(n, table_shape[1])
        close(f(ids, g), jax.jit(backward)(ids, g), tol=1e-4)
    (runner,) = ffi_runners(f)
    assert runner.inplace_on[0].outputs


def test_gemm_operands_and_results_are_still_copied_and_correct():
    f = nimble.jit(lambda x, w: (x @ w, jnp.tanh(x)), tc_gemm=False)  # a cuBLASLt call
    w = rand(64, 32)
    for _ in range(3):
        x = rand(16, 64)
        got = f(x, w)
        close(got[0], jnp.matmul(x, w), tol=2e-2)
        close(got[1], jnp.tanh(x))
    s = stats(f)  # copied by the graph's own copy nodes, not by launches beside it
    assert s["copy_launches"] == 0 and s["graph_copies"] >= 3 and s["copy_node_sets"] >= 1


def donated_loop_stats(leaves: int, size: int, calls: int) -> dict:
    """A state of `leaves` arrays donated and fed back `calls` times, checked against
    jax.jit's; the handler's counters (a donated operand is always copied in)."""
    def step(state, x):
        return [jnp.tanh(v + x) for v in state], sum(jnp.sum(v) for v in state)

    f = nimble.jit(step, donate_argnums=0)
    state = [rand(size) for _ in range(leaves)]
    want = [jnp.copy(v) for v in state]
    for _ in range(calls):
        x = rand(size)
        (state, total), (want, w) = f(state, x), jax.jit(step)(want, x)
        close(total, w, tol=1e-4)
    close(state, want)
    return stats(f)


def test_a_donated_state_loop_copies_inside_the_graph_alone():
    s = donated_loop_stats(leaves=6, size=2048, calls=5)
    assert s["copy_launches"] == 0 and s["graph_copies"] >= 5 * 6


def test_more_copies_than_a_copy_node_holds():
    """160 copies in the graph's copy node, the rest launched beside it."""
    s = donated_loop_stats(leaves=170, size=32, calls=4)
    assert s["graph_copies"] >= 4 * 160 and s["copy_launches"] >= 4


def test_donated_state_loop_matches_jax():
    def step(state, x):
        return {k: v * 0.9 + jnp.mean(x) for k, v in state.items()}

    f = nimble.jit(step, donate_argnums=0)
    state = {k: rand(512) for k in "abc"}
    want = jax.tree_util.tree_map(jnp.copy, state)
    for _ in range(5):
        x = rand(64)
        state, want = f(state, x), jax.jit(step)(want, x)
    close(state, want)


def test_state_fed_back_without_donation_is_read_where_it_was_written():
    """Results written in place and fed back: the graph reads the previous call's XLA
    buffers directly (no copy, and JAX is not passed them)."""
    def step(state, x):
        # max, not sum: a sum would share mean's reduction, whose result five kernel
        # nodes name (small and read by many: copied, runtime/inplace.py)
        return {k: jnp.tanh(v + jnp.mean(x)) for k, v in state.items()}, jnp.max(x)

    f = nimble.jit(step)
    state = {k: rand(2048) for k in "abcd"}
    want = state
    history = []
    for _ in range(6):
        x = rand(32)
        (state, s), (want, w) = f(state, x), jax.jit(step)(want, x)
        history.append((state, want))
    for got, exp in history:  # earlier results were not overwritten by later calls
        close(got, exp)
    assert [k[3] for k in f._resident_fns][-1] == (0, 1, 2, 3, -1)
    assert stats(f)["copy_launches"] == 0


def test_inside_an_outer_jit_with_intermediate_operands():
    f = nimble.jit(lambda x, y: jnp.tanh(x) + y)
    outer = jax.jit(lambda x: jnp.sum(f(x * 3.0, x - 1.0) ** 2, axis=0))
    for _ in range(3):
        x = rand(128, 8)
        close(outer(x), jnp.sum((jnp.tanh(x * 3.0) + x - 1.0) ** 2, axis=0), tol=1e-4)


def test_the_same_array_twice():
    f = nimble.jit(lambda x, y: x * y + x)
    for _ in range(3):
        x = rand(300)
        close(f(x, x), x * x + x)


def test_integer_results_bit_exact():
    f = nimble.jit(lambda a, b: (a * 3 + b, a ^ b))
    for _ in range(3):
        a = jnp.asarray(r.integers(-1000, 1000, 999), jnp.int32)
        b = jnp.asarray(r.integers(-1000, 1000, 999), jnp.int32)
        got, want = f(a, b), jax.jit(lambda a, b: (a * 3 + b, a ^ b))(a, b)
        for g, w in zip(got, want):
            assert np.array_equal(np.asarray(g), np.asarray(w))


def test_a_steady_state_call_returns_before_its_gpu_work_ends():
    """A call enqueues its graph on XLA's stream and returns: no synchronization on the
    call path, and no copy kernel beside the graph (its GEMMs' operand is copied by the
    graph itself). Four calls of about 2.8 ms of GEMMs each are issued back to back: a
    call that waited for the GPU at its end would return a ready result, one that waited
    at its start would find the second call's result ready when the fourth is issued."""
    def heavy(x, w):
        for _ in range(8):
            x = jnp.tanh(x @ w)
        return x

    f = nimble.jit(heavy)
    w = rand(4096, 4096) * (1 / 64)
    xs = [rand(4096, 4096) for _ in range(6)]
    for x in xs[:2]:  # planned and captured
        jax.block_until_ready(f(x, w))
    outs = [f(x, w) for x in xs[2:]]
    ready = [out.is_ready() for out in outs]
    jax.block_until_ready(outs)
    assert not ready[1] and not ready[-1], f"results ready when the fourth call returned: {ready}"
    close(outs[-1], jax.jit(heavy)(xs[-1], w), tol=2e-2)
    s = stats(f)
    assert s["copy_launches"] == 0 and s["graph_copies"] >= 1


def test_tensor_core_gemm_kernels_read_their_operands_in_place():
    """A GEMM the generated TF32 kernel takes (lowering/gemm_tc.py) is a kernel node:
    its operands are re-pointed, not copied."""
    f = nimble.jit(lambda x, w: jnp.tanh(x @ w))
    w = rand(64, 128)
    for _ in range(3):
        x = rand(32, 64)
        close(f(x, w), jnp.tanh(jnp.matmul(x, w)), tol=2e-2)
    (runner,) = ffi_runners(f)
    assert runner.inplace_on[0].inputs == frozenset({0, 1})

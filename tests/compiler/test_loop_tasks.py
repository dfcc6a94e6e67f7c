"""Loops and branches kept as loops and branches (`loops="graph"`, compiler/loops.py):
WHILE and SWITCH tasks whose bodies are plans of their own. Every case against jax.jit
on random inputs, on the CPU interpreter (which runs the step plan with the carry in
fixed slots, as the GPU does) and, marked `gpu`, on the cuda backend."""
from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax import lax

import nimblejax as nimble
from nimblejax.compiler import control, loops
from nimblejax.compiler.kinds import TaskKind

BACKENDS = ["interpret", pytest.param("cuda", marks=pytest.mark.gpu)]
TOL = {"interpret": 1e-5, "cuda": 2e-2}


def rand(rng, *shape):
    return rng.normal(size=shape).astype(np.float32)


def graph_jit(fn, backend="interpret", **kw):
    return nimble.jit(fn, backend=backend, loops="graph", debug=1, **kw)  # debug: verify plans


def check(fn, args, backend="interpret", exact=False):
    got = graph_jit(fn, backend)(*args)
    want = jax.jit(fn)(*args)
    got_leaves, got_tree = jax.tree_util.tree_flatten(got)
    want_leaves, want_tree = jax.tree_util.tree_flatten(want)
    assert got_tree == want_tree
    for g, w in zip(got_leaves, want_leaves):
        g, w = np.asarray(g), np.asarray(w)
        assert g.shape == w.shape and g.dtype == w.dtype
        if exact:
            np.testing.assert_array_equal(g, w)
        else:
            np.testing.assert_allclose(g, w, rtol=TOL[backend], atol=TOL[backend])


def kinds(fn, *args):
    plan = graph_jit(fn).plan(*args)
    return [t.kind for t in plan.tasks], plan


# ---- while with a run-time trip count ----------------------------------------------
def doubling(x, n):
    return lax.fori_loop(0, n, lambda i, x: jnp.sin(x) * 2.0 + i.astype(jnp.float32), x)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("n", [0, 1, 17])
def test_fori_loop_with_a_run_time_bound_zero_one_and_many_iterations(backend, n):
    check(doubling, (rand(np.random.default_rng(n), 5, 3), np.int32(n)), backend)


def test_a_run_time_while_is_one_while_task_and_explain_says_why():
    x, n = rand(np.random.default_rng(0), 5, 3), np.int32(4)
    task_kinds, plan = kinds(doubling, x, n)
    assert task_kinds.count(TaskKind.WHILE) == 1
    (task,) = [t for t in plan.tasks if t.kind is TaskKind.WHILE]
    assert isinstance(task.control, loops.LoopCall)
    assert task.control.passed == (False, True, False)  # fori_loop: (i, upper, x)
    assert [d.choice for d in plan.control] == ["while task"]
    text = str(nimble.explain(graph_jit(doubling), x, n))
    assert "while task, the trip count is not static" in text and "while:" in text


def newton_sqrt(a):
    def body(c):
        x, _, k = c
        nx = 0.5 * (x + a / x)
        return nx, jnp.max(jnp.abs(nx - x)), k + 1
    x, _, k = lax.while_loop(lambda c: (c[1] > 1e-6) & (c[2] < 100), body,
                             (a, jnp.float32(jnp.inf), jnp.int32(0)))
    return x, k


@pytest.mark.parametrize("backend", BACKENDS)
def test_newton_iteration_to_convergence_on_256_values(backend):
    a = np.abs(rand(np.random.default_rng(1), 256)) * 50.0 + 0.5
    check(newton_sqrt, (a,), backend)
    x, k = graph_jit(newton_sqrt, backend)(a)
    assert 3 < int(k) < 100  # data-dependent trip count
    np.testing.assert_allclose(np.asarray(x), np.sqrt(a), rtol=1e-5)


def collatz_steps(x):
    """Integers, bit for bit: steps of each value to reach 1, a nested data-dependent loop."""
    def one(v):
        def body(c):
            v, k = c
            return jnp.where(v % 2 == 0, v // 2, 3 * v + 1), k + 1
        return lax.while_loop(lambda c: c[0] > 1, body, (v, jnp.int32(0)))[1]

    def outer(c):
        i, out = c
        return i + 1, out.at[i].set(one(x[i]))

    return lax.while_loop(lambda c: c[0] < x.shape[0] - (x[0] % 3), outer,
                          (jnp.int32(0), jnp.zeros_like(x)))[1]


@pytest.mark.parametrize("backend", BACKENDS)
def test_nested_while_on_integers_is_bit_exact(backend):
    x = np.random.default_rng(2).integers(1, 200, size=12).astype(np.int32)
    check(collatz_steps, (x,), backend, exact=True)
    task_kinds, plan = kinds(collatz_steps, x)
    (outer,) = [t for t in plan.tasks if t.kind is TaskKind.WHILE]
    assert [t.kind for t in outer.control.step.tasks].count(TaskKind.WHILE) == 1


def shuffle_carry(a, b, c, n):
    """Carries swapped, passed through unchanged, set to a constant and reshaped: each
    next carry must be copied into its slot without clobbering a slot still read."""
    def body(i, s):
        a, b, c, d, k = s
        return b, a, c, jnp.reshape(c, d.shape), jnp.float32(3.0)
    out = lax.fori_loop(0, n, body, (a, b, c, jnp.reshape(-c, (2, 3)), a[0]))
    return out[0] * 1.0, out[1] + 0.0, out[2], out[3], out[4]


@pytest.mark.parametrize("n", [0, 1, 2, 5])
def test_swapped_passed_constant_and_reshaped_carries(n):
    rng = np.random.default_rng(3)
    check(shuffle_carry, (rand(rng, 4), rand(rng, 4), rand(rng, 6), np.int32(n)))
    plan = graph_jit(shuffle_carry).plan(rand(rng, 4), rand(rng, 4), rand(rng, 6), np.int32(n))
    (task,) = [t for t in plan.tasks if t.kind is TaskKind.WHILE]
    step = task.control.step
    # Every next carry but a passed one, and the condition, are buffers the step writes,
    # none in an input's bytes (the reshaped carry is a copy, not a view of its slot).
    # (i, n, a, b, d, k): JAX makes the unchanged c a loop constant; d, a reshape of it, a copy.
    assert task.control.passed == (False, True, False, False, False, False)
    for k, out in enumerate(step.graph.outputs):
        passed = k < task.control.ncarry and task.control.passed[k]
        assert step.output_kind(out) == ("input" if passed else "buffer")
        assert passed or step.storage.get(out, out) not in step.graph.inputs


def test_loops_unroll_keeps_co_execution_for_a_run_time_while():
    x, n = rand(np.random.default_rng(4), 5, 3), np.int32(3)
    with pytest.raises(NotImplementedError, match="'while'.*not static"):
        nimble.jit(doubling, backend="interpret", fallback="error", loops="unroll")(x, n)
    np.testing.assert_allclose(nimble.jit(doubling, backend="interpret", loops="unroll")(x, n),
                               jax.jit(doubling)(x, n), rtol=1e-5, atol=1e-5)


def test_loops_graph_is_the_default():
    assert nimble.jit(doubling).options.loops == "graph"
    x, n = rand(np.random.default_rng(4), 5, 3), np.int32(3)
    np.testing.assert_allclose(nimble.jit(doubling, backend="interpret", fallback="error")(x, n),
                               jax.jit(doubling)(x, n), rtol=1e-5, atol=1e-5)


def test_loops_option_is_checked_and_read_from_the_environment(monkeypatch):
    with pytest.raises(ValueError, match="loops"):
        nimble.jit(doubling, loops="sometimes")
    monkeypatch.setenv("NIMBLE_LOOPS", "unroll")
    assert nimble.jit(doubling).options.loops == "unroll"


def test_step_plan_keeps_the_stream_cap_of_the_options():
    def wide(x, n):
        def body(i, x):
            return jnp.stack([jnp.sin(x[k]) * (k + 1.0) for k in range(x.shape[0])])
        return lax.fori_loop(0, n, body, x)

    x = rand(np.random.default_rng(5), 6, 4)
    plan = graph_jit(wide, max_streams=2).plan(x, np.int32(3))
    (task,) = [t for t in plan.tasks if t.kind is TaskKind.WHILE]
    assert task.control.step.schedule.num_streams <= 2
    check(wide, (x, np.int32(3)))


# ---- cond / switch as SWITCH tasks ------------------------------------------------
def heavy(x):
    for _ in range(12):
        x = jnp.tanh(x @ x.T @ x * 0.1 + 1.0)
    return x


def costly_switch(i, x):
    return lax.switch(i, [heavy, lambda x: jnp.cos(heavy(x)), lambda x: x * 2.0], x)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("index", [-3, 0, 1, 2, 7])
def test_switch_on_a_device_value_runs_the_taken_branch(backend, index):
    check(costly_switch, (np.int32(index), rand(np.random.default_rng(6), 4, 4)), backend)


def test_costly_branches_are_a_switch_task_tiny_ones_a_select():
    x = rand(np.random.default_rng(7), 4, 4)
    task_kinds, plan = kinds(costly_switch, np.int32(1), x)
    assert task_kinds.count(TaskKind.SWITCH) == 1
    (d,) = plan.control
    assert d.choice == "switch task" and "BRANCH_TASK_MIN_EQNS" in d.reason
    tiny = lambda p, x: lax.cond(p > 0, jnp.sin, jnp.cos, x)  # noqa: E731
    task_kinds, plan = kinds(tiny, np.float32(1.0), x)
    assert TaskKind.SWITCH not in task_kinds and [d.choice for d in plan.control] == ["select"]
    text = str(nimble.explain(graph_jit(costly_switch), np.int32(1), x))
    assert "switch task" in text and "switch: 3 branch plans" in text


@pytest.mark.parametrize("backend", BACKENDS)
def test_cond_on_a_device_value_inside_a_while(backend):
    def f(x, n):
        def body(i, x):
            return lax.cond(jnp.sum(x) > 0, heavy, lambda x: -x + 0.5, x)
        return lax.fori_loop(0, n, body, x)

    for seed in (8, 9):
        check(f, (rand(np.random.default_rng(seed), 4, 4), np.int32(3)), backend)


# ---- scans beyond the unroll limit: a WHILE task, and their gradients --------------
def rnn_loss(params, xs):
    def cell(h, x):
        h = jnp.tanh(x @ params["wx"] + h @ params["wh"] + params["b"])
        return h, h
    h, hs = lax.scan(cell, jnp.zeros((xs.shape[1], params["wh"].shape[0]), jnp.float32), xs)
    return jnp.mean(h ** 2) + 1e-2 * jnp.mean(hs[::-1] * xs[..., :1])


@pytest.mark.parametrize("backend", BACKENDS)
def test_grad_of_a_scan_beyond_the_unroll_limit_runs_as_while_tasks(backend, monkeypatch):
    monkeypatch.setattr(control, "UNROLL_MAX_EQNS", 40)
    rng = np.random.default_rng(10)
    params = {"wx": rand(rng, 8, 16) * 0.3, "wh": rand(rng, 16, 16) * 0.2, "b": rand(rng, 16) * 0.1}
    xs = rand(rng, 12, 3, 8)
    step = jax.value_and_grad(rnn_loss)
    check(step, (params, xs), backend)
    task_kinds, plan = kinds(step, params, xs)
    assert task_kinds.count(TaskKind.WHILE) == 2  # the scan and its transpose
    assert {(d.primitive, d.choice) for d in plan.control} == {("scan", "while task"),
                                                               ("while", "while task")}


@pytest.mark.parametrize("reverse", [False, True])
def test_long_scan_with_stacked_outputs_and_reverse(reverse, monkeypatch):
    monkeypatch.setattr(control, "UNROLL_MAX_EQNS", 30)

    def f(c, xs):
        return lax.scan(lambda c, x: (c * 0.9 + x["a"], (c.sum(), x["b"] - c[0])), c,
                        xs, reverse=reverse)

    rng = np.random.default_rng(11)
    check(f, (rand(rng, 3), {"a": rand(rng, 40, 3), "b": rand(rng, 40)}))


# ---- vmapped loops (a predicate per row) and random_gamma, whose rejection loop is one ----
def vmapped_doubling(xs):
    return jax.vmap(lambda x: lax.while_loop(lambda c: c[0] < x, lambda c: (c[0] + 1.0, c[1] * 1.5),
                                             (jnp.float32(0.0), jnp.float32(1.0))))(xs)


@pytest.mark.parametrize("backend", BACKENDS)
def test_a_vmapped_while_keeps_finished_rows(backend):
    xs = np.abs(rand(np.random.default_rng(8), 16)) * 10.0  # rows stop after 1 to ~30 steps
    check(vmapped_doubling, (xs,), backend)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("sampler", ["gamma", "beta", "dirichlet"])
def test_random_gamma_family_matches_jax(backend, sampler):
    a = np.abs(rand(np.random.default_rng(9), 32)) * 3.0 + 0.2
    fns = {"gamma": lambda k, a: jax.random.gamma(k, a),
           "beta": lambda k, a: jax.random.beta(k, a, 2.0 * a),
           "dirichlet": lambda k, a: jax.random.dirichlet(k, a.reshape(8, 4))}
    fn, key = fns[sampler], jax.random.PRNGKey(3)
    got = nimble.jit(fn, backend=backend, fallback="error")(key, a)
    np.testing.assert_allclose(np.asarray(got), np.asarray(jax.jit(fn)(key, a)), rtol=2e-5, atol=1e-6)
    kinds = [t.kind for t in nimble.jit(fn, backend="interpret").plan(key, a).tasks]
    assert TaskKind.WHILE in kinds


def test_newtons_step_is_one_row_kernel_that_also_writes_the_counter():
    """fusion._late_row_outputs: the counter `k + 1` (a next carry, read by the condition
    beside the step's reduction) is the row kernel's another output, not a kernel."""
    from nimblejax.runtime import interpret
    from tests.helpers import kernel_emulator as emu

    rng = np.random.default_rng(5)
    a = np.abs(rand(rng, 256)) * 50.0 + 0.5
    (task,) = [t for t in graph_jit(newton_sqrt).plan(a).tasks if t.kind is TaskKind.WHILE]
    step = task.control.step
    (kernel,) = [t for t in step.tasks if t.kind is TaskKind.KERNEL]
    assert kernel.name.startswith("nimble_row_") and len(kernel.outputs) == 4
    # The generated kernel, run on the CPU, against the step's equations.
    for k in (0, 41, 99, 100):
        args = [np.asarray(rng.uniform(0.5, 50.0, v.shape), v.dtype) if v.dtype.kind == "f"
                else np.asarray(k, v.dtype) for v in step.graph.inputs]
        want = interpret.run(step, args)
        got, emulated = emu.run(step, args)
        assert emulated == 1
        for g, w in zip(got, want):
            np.testing.assert_array_equal(g, w) if w.dtype.kind in "biu" else \
                np.testing.assert_allclose(g, w, rtol=1e-6)

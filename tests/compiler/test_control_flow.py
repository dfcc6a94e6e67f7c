"""Control flow inside a plan (compiler/control.py): scan and counter loops unrolled,
cond/switch as select_n. Every case against jax.jit on random inputs, on the CPU
interpreter and (marked `gpu`) on the cuda backend."""
from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax import lax

import nimblejax as nimble
from nimblejax.compiler import control
from tests.helpers import jit_init

BACKENDS = ["interpret", pytest.param("cuda", marks=pytest.mark.gpu)]
# Interpreter: the same JAX ops on the CPU. cuda: TF32-like dots on both sides, and
# transcendental functions of our own kernels.
TOL = {"interpret": 1e-5, "cuda": 2e-2}


def rand(rng, *shape):
    return rng.normal(size=shape).astype(np.float32)


def check(fn, args, backend, static_argnums=()):
    got = nimble.jit(fn, backend=backend, static_argnums=static_argnums)(*args)
    want = jax.jit(fn, static_argnums=static_argnums)(*args)
    got_leaves, got_tree = jax.tree_util.tree_flatten(got)
    want_leaves, want_tree = jax.tree_util.tree_flatten(want)
    assert got_tree == want_tree
    for g, w in zip(got_leaves, want_leaves):
        w = np.asarray(w)
        assert np.asarray(g).shape == w.shape and np.asarray(g).dtype == w.dtype
        np.testing.assert_allclose(np.asarray(g), w, rtol=TOL[backend], atol=TOL[backend])


def decisions(fn, *args):
    return nimble.jit(fn, backend="interpret").plan(*args).control


# ---- scan -----------------------------------------------------------------------
def scan_pytrees(carry, xs, reverse):
    def body(c, x):
        a, (b, n) = c
        a = jnp.tanh(a * x["u"] + b)
        b = b + x["v"].sum(axis=0)
        return (a, (b, n + 1)), {"h": a * 2.0, "s": (b.sum(), x["u"] - a)}
    return lax.scan(body, carry, xs, reverse=reverse)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("reverse", [False, True])
def test_scan_pytree_carry_and_stacked_outputs(backend, reverse):
    rng = np.random.default_rng(1)
    carry = (rand(rng, 4, 3), (rand(rng, 3), np.int32(0)))
    xs = {"u": rand(rng, 7, 4, 3), "v": rand(rng, 7, 2, 3)}
    check(lambda c, x: scan_pytrees(c, x, reverse), (carry, xs), backend)


@pytest.mark.parametrize("backend", BACKENDS)
def test_scan_length_without_xs_and_closed_over_constants(backend):
    rng = np.random.default_rng(2)
    table = rand(rng, 5)  # a numpy constant closed over: a const of the body jaxpr

    def f(x, w):
        def body(c, _):
            c = jnp.sin(c * w) + jnp.asarray(table)
            return c, c.sum()
        return lax.scan(body, x, None, length=6, unroll=2)

    check(f, (rand(rng, 5), rand(rng, 5)), backend)
    assert [d.choice for d in decisions(f, rand(rng, 5), rand(rng, 5))] == ["unrolled"]


@pytest.mark.parametrize("backend", BACKENDS)
def test_nested_scan(backend):
    def f(x, xs):
        def outer(c, row):
            def inner(d, v):
                return d * 0.9 + jnp.cos(v), d
            d, ds = lax.scan(inner, c, row)
            return d + c, ds.sum(axis=0)
        return lax.scan(outer, x, xs, reverse=True)

    rng = np.random.default_rng(3)
    check(f, (rand(rng, 3), rand(rng, 4, 5, 3)), backend)


# ---- fori_loop and while --------------------------------------------------------
def power_iteration(a, v):
    def body(i, v):
        w = a @ v
        return w / jnp.linalg.norm(w)
    return lax.fori_loop(0, 12, body, v)


@pytest.mark.parametrize("backend", BACKENDS)
def test_fori_loop_static_count_power_iteration(backend):
    rng = np.random.default_rng(4)
    a = rand(rng, 8, 8)
    check(power_iteration, (a @ a.T, rand(rng, 8)), backend)


@pytest.mark.parametrize("backend", BACKENDS)
def test_while_with_static_trip_count_is_unrolled(backend):
    def f(x):
        def body(c):
            i, x, acc = c
            return i + 1, x * 0.5 + jnp.sin(acc), acc + x.sum()
        return lax.while_loop(lambda c: c[0] < 9, body, (2, x, jnp.float32(0.0)))

    rng = np.random.default_rng(5)
    check(f, (rand(rng, 6),), backend)
    (d,) = decisions(f, rand(rng, 6))
    assert (d.primitive, d.choice) == ("while", "unrolled") and "7 iterations" in d.reason


@pytest.mark.parametrize("backend", BACKENDS)
def test_fori_loop_with_static_bounds_as_arguments(backend):
    """Bounds passed as static arguments: a scan (or a counter while) at trace time."""
    def f(x, lo, hi):
        return lax.fori_loop(lo, hi, lambda i, x: x * 1.5 - jnp.float32(i), x)

    rng = np.random.default_rng(6)
    check(f, (rand(rng, 4), 3, 8), backend, static_argnums=(1, 2))


def test_loop_counter_is_folded_into_literals():
    """fori_loop's index is known at every iteration: no `i + 1` chain is left."""
    def f(x):
        return lax.fori_loop(0, 40, lambda i, x: x * 0.5 + jnp.float32(i) * jnp.sin(x), x)

    x = rand(np.random.default_rng(14), 8)
    check(f, (x,), "interpret")
    graph = nimble.jit(f, backend="interpret").plan(x).graph
    assert not [n for n in graph.nodes if n.name == "add" and n.outputs[0].dtype == np.int32]


def test_while_with_dynamic_trip_count_names_primitive_line_and_way_out():
    def newton_sqrt(a):
        def body(c):
            x, _ = c
            nx = 0.5 * (x + a / x)
            return nx, jnp.max(jnp.abs(nx - x))
        return lax.while_loop(lambda c: c[1] > 1e-6, body, (a, jnp.float32(1.0)))[0]

    a = np.abs(rand(np.random.default_rng(7), 5)) + 1.0
    with pytest.raises(NotImplementedError) as err:
        nimble.jit(newton_sqrt, backend="interpret", fallback="error", loops="unroll")(a)
    msg = str(err.value)
    assert "'while'" in msg and "test_control_flow.py:" in msg and 'backend="jax"' in msg
    assert "not static" in msg
    # backend="jax" is the way out, and it runs.
    np.testing.assert_allclose(nimble.jit(newton_sqrt, backend="jax")(a), np.sqrt(a), rtol=1e-5)


def test_fori_loop_with_a_traced_bound_is_dynamic():
    def f(x, n):
        return lax.fori_loop(0, n, lambda i, x: x * 2.0, x)

    with pytest.raises(NotImplementedError, match="'while'.*not static"):
        nimble.jit(f, backend="interpret", fallback="error", loops="unroll")(np.ones(3, np.float32),
                                                                            np.int32(4))


def test_loop_too_large_to_unroll_is_refused_with_the_reason(monkeypatch):
    monkeypatch.setattr(control, "UNROLL_MAX_EQNS", 20)

    def f(x):
        return lax.scan(lambda c, _: (jnp.sin(c) * 2.0 + 1.0, None), x, None, length=30)[0]

    with pytest.raises(NotImplementedError, match="'scan'.*30 iterations.*> UNROLL_MAX_EQNS"):
        nimble.jit(f, backend="interpret", fallback="error", loops="unroll")(np.ones(3, np.float32))


# ---- while with a counter bound and a data-dependent exit: unrolled, predicated ----
def bounded_newton(a, tol):
    """At most 6 Newton steps (the counter term), fewer once a step is below `tol`."""
    def body(c):
        x, _, k = c
        nx = 0.5 * (x + a / x)
        return nx, jnp.max(jnp.abs(nx - x)), k + 1
    return lax.while_loop(lambda c: (c[1] > tol) & (c[2] < 6), body,
                          (a, jnp.float32(jnp.inf), jnp.int32(0)))


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("tol", [1e-3, 0.0, 1e9])  # stops early / runs to the bound / stops after one
def test_bounded_while_is_unrolled_with_its_carry_selected(backend, tol):
    a = np.abs(rand(np.random.default_rng(3), 64)) * 40 + 0.5
    check(bounded_newton, (a, np.float32(tol)), backend)
    got = nimble.jit(bounded_newton, backend="interpret")(a, np.float32(tol))
    assert int(got[2]) == int(jax.jit(bounded_newton)(a, np.float32(tol))[2])  # the counter too


def test_bounded_while_decision_says_predicated_and_makes_no_while_task():
    a = np.abs(rand(np.random.default_rng(4), 8)) + 1.0
    plan = nimble.jit(bounded_newton, backend="interpret", loops="graph").plan(a, np.float32(1e-3))
    assert not any(t.control for t in plan.tasks)
    (d,) = [d for d in plan.control if d.primitive == "while"]
    assert d.choice == "unrolled, predicated" and "at most 6 iterations" in d.reason
    # With loops="unroll" it runs too (no WHILE task needed).
    nimble.jit(bounded_newton, backend="interpret", loops="unroll", fallback="error")(a, np.float32(1e-3))


def test_a_bound_beyond_predicated_max_trips_stays_a_while_task():
    def f(a):
        return lax.while_loop(lambda c: (c[0].sum() > 1.0) & (c[1] < control.PREDICATED_MAX_TRIPS + 1),
                              lambda c: (c[0] * 0.5, c[1] + 1), (a, jnp.int32(0)))

    a = np.abs(rand(np.random.default_rng(5), 8)) + 1.0
    (d,) = [d for d in decisions(f, a) if d.primitive == "while"]
    assert d.choice == "while task"


def test_counter_under_passthroughs_and_a_late_start_bounds_the_loop():
    """equinox's form: `nonbatchable(and(any(data), convert(lt(i, n))))`, the counter
    starting at 2: at most n - 2 iterations; integers bit for bit."""
    def f(x, n0):
        def cond(c):
            i, v, j = c
            go = (v.sum() % 7 != 0) & lax.convert_element_type(i < 9, np.bool_)
            return go
        def body(c):
            i, v, j = c
            return i + 1, v * 3 + j, j + v[0]
        return lax.while_loop(cond, body, (jnp.int32(2), x, n0))

    x = np.random.default_rng(6).integers(-50, 50, size=(5,)).astype(np.int32)
    for n0 in (np.int32(1), np.int32(4)):
        got = nimble.jit(f, backend="interpret")(x, n0)
        want = jax.jit(f)(x, n0)
        for g, w in zip(got, want):
            np.testing.assert_array_equal(np.asarray(g), np.asarray(w))
    (d,) = [d for d in decisions(f, x, np.int32(1)) if d.primitive == "while"]
    assert d.choice == "unrolled, predicated" and "at most 7 iterations" in d.reason


# ---- cond / switch --------------------------------------------------------------
@pytest.mark.parametrize("backend", BACKENDS)
def test_cond_on_a_data_value(backend):
    def f(p, x, y):
        return lax.cond(p.sum() > 0, lambda a, b: (jnp.sin(a) * b, a),
                        lambda a, b: (a - b, jnp.exp(-a * a)), x, y)

    rng = np.random.default_rng(8)
    x, y = rand(rng, 3, 4), rand(rng, 3, 4)
    for p in (np.float32([1.0, 2.0]), np.float32([-1.0, -2.0])):
        check(f, (p, x, y), backend)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("index", [-3, 0, 1, 2, 7])
def test_switch_three_branches_index_clamped(backend, index):
    branches = [lambda x: jnp.sin(x), lambda x: x * x - 1.0, lambda x: jnp.float32(2.0) + 0 * x]

    def f(i, x):
        return lax.switch(i, branches, x)

    check(f, (np.int32(index), rand(np.random.default_rng(9), 5)), backend)


# ---- lax.platform_dependent: the branch a CUDA plan takes, known when planning --------
def on_platform(x):
    """jnp.diagonal's pattern (numpyro's MultivariateNormal reaches it): a Mosaic branch
    and a default one; CUDA's branch is the default's."""
    return lax.platform_dependent(x, mosaic=lambda a: a * 0.0 - 1.0, default=lambda a: jnp.tanh(a) * 3.0)


@pytest.mark.parametrize("backend", BACKENDS)
def test_platform_dependent_takes_the_default_branch(backend):
    x = rand(np.random.default_rng(11), 4, 5)
    check(on_platform, (x,), backend)
    check(lambda a: jnp.diagonal(a @ a.T) + jnp.diagonal(a, offset=1), (x,), backend)
    (decision,) = decisions(on_platform, x)
    assert decision.choice == "constant" and "branch 1 of 2 alone" in decision.reason


def test_platform_dependent_takes_cudas_branch_on_the_interpreter_too():
    """The interpreter runs the plan a GPU runs: CUDA's branch, not the CPU's."""
    def f(x):
        return lax.platform_dependent(x, cpu=lambda a: a * 2.0, cuda=lambda a: jnp.sin(a) * 3.0)

    x = rand(np.random.default_rng(12), 6)
    got = nimble.jit(f, backend="interpret", fallback="error")(x)
    np.testing.assert_allclose(got, jax.jit(lambda a: jnp.sin(a) * 3.0)(x), rtol=1e-6)


def test_platform_dependent_without_a_cuda_branch_is_refused():
    def f(x):
        return lax.platform_dependent(x, cpu=lambda a: a * 2.0, tpu=lambda a: a * 4.0)

    with pytest.raises(nimble.UnsupportedPrimitiveError, match="no branch for 'cuda'"):
        nimble.jit(f, backend="interpret", fallback="error")(rand(np.random.default_rng(13), 3))


def test_cond_is_a_select_and_explain_shows_the_decisions():
    def f(p, x):
        y = lax.cond(p > 0, jnp.sin, jnp.cos, x)
        return lax.scan(lambda c, v: (c + v, c * v), y, x[None].repeat(3, 0))

    x = rand(np.random.default_rng(10), 4)
    text = str(nimble.explain(f, np.float32(1.0), x))
    assert "control flow:" in text
    assert "cond (" in text and "select" in text
    assert "scan (" in text and "unrolled, 3 iterations" in text
    assert "UNROLL_MAX_EQNS" in text


# ---- gradients: an RNN training step ---------------------------------------------
def rnn_loss(params, xs, target):
    def cell(h, x):
        h = jnp.tanh(x @ params["wx"] + h @ params["wh"] + params["b"])
        return h, h
    h0 = jnp.zeros((xs.shape[1], params["wh"].shape[0]), jnp.float32)
    h, hs = lax.scan(cell, h0, xs)
    return jnp.mean((h @ params["wo"] - target) ** 2) + 1e-3 * jnp.mean(hs ** 2)


def rnn_train_step(params, xs, target):
    loss, grads = jax.value_and_grad(rnn_loss)(params, xs, target)
    new = jax.tree_util.tree_map(lambda p, g: p - 0.1 * g, params, grads)
    return loss, grads, new


def rnn_args(rng, hidden=32, steps=16, batch=4, features=8):
    params = {"wx": rand(rng, features, hidden) * 0.3, "wh": rand(rng, hidden, hidden) * 0.2,
              "b": rand(rng, hidden) * 0.1, "wo": rand(rng, hidden, 2) * 0.3}
    return params, rand(rng, steps, batch, features), rand(rng, batch, 2)


@pytest.mark.parametrize("backend", BACKENDS)
def test_rnn_training_step_grad_of_scan(backend):
    args = rnn_args(np.random.default_rng(11))
    check(rnn_train_step, args, backend)
    kinds = {(d.primitive, d.choice) for d in decisions(rnn_train_step, *args)}
    assert kinds == {("scan", "unrolled")}  # the forward scan and its reverse (VJP) scan


# ---- flax nn.RNN, and the generated kernels of these plans compile -----------------
@pytest.mark.parametrize("backend", BACKENDS)
def test_flax_rnn_gru_forward(backend):
    nn = pytest.importorskip("flax.linen")
    model = nn.RNN(nn.GRUCell(features=16))
    rng = np.random.default_rng(12)
    xs = rand(rng, 2, 10, 6)  # batch, time, features
    params = jit_init(model, jax.random.PRNGKey(0), xs)
    params = jax.tree_util.tree_map(lambda p: np.asarray(p), params)
    check(lambda p, x: model.apply(p, x), (params, xs), backend)


def test_generated_kernels_of_control_flow_plans_compile():
    from nimblejax.testing.nvrtc_check import available_compiler, compile_to_ptx

    if available_compiler() is None:
        pytest.skip("no NVRTC or nvcc")
    rng = np.random.default_rng(13)
    switch = lambda i, x: lax.switch(i, [jnp.sin, jnp.cos, jnp.tanh], x)  # noqa: E731
    cases = [(rnn_train_step, rnn_args(rng)),
             (switch, (np.int32(1), rand(rng, 5))),
             (lambda c, x: scan_pytrees(c, x, True),
              ((rand(rng, 4, 3), (rand(rng, 3), np.int32(0))),
               {"u": rand(rng, 3, 4, 3), "v": rand(rng, 3, 2, 3)}))]
    kernels: dict[str, str] = {}
    for fn, args in cases:
        plan = nimble.jit(fn, backend="interpret").plan(*args)
        kernels.update((k.name, k.source)
                       for t in plan.tasks if t.kernel for k in t.kernel.launches)
    ptx = compile_to_ptx("\n".join(kernels.values()), "nimble_control.cu", arch="sm_90", fast=True)
    assert not [name for name in kernels if f".entry {name}(" not in ptx]

"""compiler/trace.py on its own: jaxpr → graph IR. Nested calls inlined, identities
dropped, common subexpressions merged, dead code dropped, constants and literals bound,
each node keeping the user's line; the graph's values equal jax.jit's."""
from __future__ import annotations

import inspect

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from tests.helpers import on_host
from tests.helpers.graphs import evaluate, names, trace
from nimblejax.compiler.ir import Literal, Var

RNG = np.random.default_rng(0)


def rand(*shape):
    return on_host(RNG.standard_normal(shape), jnp.float32)


def assert_matches_jax(fn, *args):
    graph = trace(fn, *args)
    want = jax.tree_util.tree_leaves(jax.jit(fn)(*args))
    got = evaluate(graph, args)
    assert len(got) == len(want)
    for g, w in zip(got, want):
        np.testing.assert_allclose(np.asarray(g), np.asarray(w), rtol=1e-6, atol=1e-6)
    return graph


@jax.custom_vjp
def clipped(x):
    return jnp.clip(x, -1.0, 1.0)


clipped.defvjp(lambda x: (clipped(x), None), lambda _, g: (g,))


@pytest.mark.parametrize("name,fn", [
    ("jit", lambda x: jax.jit(lambda y: jnp.sin(y) * 2.0)(x) + 1.0),
    ("nested_jit", lambda x: jax.jit(lambda y: jax.jit(jnp.cos)(y) - y)(x)),
    ("custom_jvp", lambda x: jax.nn.relu(x) + jax.nn.softplus(x)),
    ("custom_vjp", lambda x: clipped(x * 3.0)),
    ("checkpoint", lambda x: jax.checkpoint(lambda y: jnp.tanh(y) ** 2)(x)),
    ("grad_of_checkpoint", jax.grad(lambda x: jnp.sum(jax.checkpoint(jnp.sin)(x) ** 2))),
])
def test_calls_are_inlined(name, fn):
    graph = assert_matches_jax(fn, rand(4, 5))
    inlined = {"pjit", "jit", "closed_call", "custom_jvp_call", "custom_vjp_call",
               "custom_vjp_call_jaxpr", "remat", "remat2", "checkpoint"}
    assert not inlined & set(names(graph)), names(graph)


def test_identities_leave_no_node():
    graph = assert_matches_jax(lambda x: jax.lax.stop_gradient(x) * 2.0, rand(3))
    assert names(graph) == ["mul"]
    graph = trace(lambda x: jax.lax.stop_gradient(x), rand(3))
    assert graph.nodes == () and graph.outputs == graph.inputs


def test_a_sharding_constraint_to_one_device_is_the_identity():
    """jax.lax.with_sharding_constraint in a one-device program (issue 33): no node, and
    co-execution leaves nothing of it to XLA."""
    import nimblejax as nimble

    one = jax.sharding.SingleDeviceSharding(jax.devices()[0])

    def f(x):
        return jnp.tanh(jax.lax.with_sharding_constraint(x * 2.0, one)) + 1.0

    x = np.random.default_rng(0).standard_normal((4, 8)).astype(np.float32)
    assert "sharding_constraint" not in names(trace(f, x))
    left = nimble.jit(f).partition(x).xla_steps()
    assert not [s for s in left if "no lowering rule" in (s.why or "")], [s.why for s in left]
    np.testing.assert_allclose(nimble.jit(f, backend="interpret")(x), jax.jit(f)(x), rtol=1e-6, atol=1e-6)


def test_custom_linear_solve_is_its_solve_inlined():
    """lax.custom_linear_solve (issue 33): its value is its `solve` jaxpr, inlined with
    that jaxpr's constants and the right-hand side; its gradient (the transposed solve)
    goes through the same path."""
    import nimblejax as nimble

    def f(d, w, b):
        a = jnp.diag(d) + 0.01 * w  # solved approximately: the solve is a Jacobi step
        x = jax.lax.custom_linear_solve(lambda v: a @ v, b, solve=lambda mv, r: r / d,
                                        transpose_solve=lambda vm, r: r / d)
        return jnp.tanh(x) * w.sum()

    r = np.random.default_rng(1)
    d = (2.0 + r.random(6)).astype(np.float32)
    w = r.standard_normal((6, 6)).astype(np.float32)
    b = r.standard_normal(6).astype(np.float32)
    assert "custom_linear_solve" not in names(trace(f, d, w, b))
    np.testing.assert_allclose(nimble.jit(f, backend="interpret")(d, w, b), jax.jit(f)(d, w, b),
                               rtol=1e-5, atol=1e-6)
    g = jax.grad(lambda *a: f(*a).sum(), argnums=(0, 2))
    for got, want in zip(nimble.jit(g, backend="interpret")(d, w, b), jax.jit(g)(d, w, b)):
        np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6)


def test_common_subexpressions_are_merged():
    graph = assert_matches_jax(lambda x: jnp.sin(x) + jnp.sin(x) * jnp.sin(x), rand(6))
    assert names(graph).count("sin") == 1
    # jnp.var computes the mean again: one reduction of x for the mean
    graph = assert_matches_jax(lambda x: (jnp.mean(x, axis=0), jnp.var(x, axis=0)), rand(5, 3))
    sums_of_x = [n for n in graph.nodes if n.name == "reduce_sum" and n.inputs[0] is graph.inputs[0]]
    assert len(sums_of_x) == 1


def test_same_primitive_different_params_is_not_merged():
    graph = assert_matches_jax(lambda x: jnp.sum(x, axis=0) + jnp.sum(x, axis=1), rand(4, 4))
    assert names(graph).count("reduce_sum") == 2


def test_dead_code_is_dropped():
    def fn(x, y):
        unused = jnp.exp(x) @ y  # noqa: F841
        return x * 2.0

    graph = assert_matches_jax(fn, rand(3, 3), rand(3, 3))
    assert names(graph) == ["mul"] and len(graph.inputs) == 2


def test_constants_and_literals():
    table = np.arange(12, dtype=np.float32).reshape(3, 4)
    graph = assert_matches_jax(lambda x: x * table + 0.5, rand(3, 4))
    (const,) = graph.consts
    np.testing.assert_array_equal(graph.consts[const], table)
    assert any(isinstance(a, Literal) and a.value == 0.5 for n in graph.nodes for a in n.inputs)
    assert graph.inputs[0] not in graph.consts and isinstance(graph.inputs[0], Var)


def test_nodes_name_the_users_line():
    def fn(x):
        y = jnp.sin(x)
        return y * jax.nn.relu(y)

    first = inspect.getsourcelines(fn)[1]
    graph = trace(fn, rand(3))
    sources = {n.name: n.source for n in graph.nodes}
    assert sources["sin"].endswith(f"test_trace.py:{first + 1}")
    # relu is a cached custom_jvp body: its nodes report the call site
    assert sources["max"].endswith(f"test_trace.py:{first + 2}")


def test_value_ids_restart_per_trace():
    fn = lambda x, y: jnp.tanh(x @ y) + 1.0  # noqa: E731
    a, b = rand(2, 3), rand(3, 2)
    assert trace(fn, a, b).pretty() == trace(fn, a, b).pretty()
    assert [v.id for v in trace(fn, a, b).inputs] == [0, 1]


def test_dtypes_and_weak_types_are_kept():
    from nimblejax.compiler.ir import fresh_ids
    from nimblejax.compiler.trace import make_graph

    specs = [jax.ShapeDtypeStruct((3,), jnp.float32, weak_type=True),
             jax.ShapeDtypeStruct((3,), jnp.int32)]
    with fresh_ids():
        graph, out = make_graph(lambda x, i: (x + 1, i * 2), specs)
    assert [(np.dtype(v.dtype), v.weak_type) for v in graph.inputs] == [(np.float32, True),
                                                                       (np.int32, False)]
    assert [np.dtype(a.dtype) for a in graph.outputs] == [np.float32, np.int32]
    assert [o.shape for o in out] == [(3,), (3,)]

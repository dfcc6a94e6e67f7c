"""Co-execution (issue 33): a function with equations nimble cannot lower runs, its
supported regions as nimble_calls and the rest under XLA inside one jax.jit
(compiler/partition.py, runtime/coexec.py). Each program is compared with jax.jit on
random inputs, on the CPU interpreter and (marked gpu) on the default backend."""
from __future__ import annotations

import re
import warnings

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax import lax
from jax.extend.core import Primitive
from jax.interpreters import mlir

import nimblejax as nimble
from nimblejax.compiler import control, partition
from nimblejax.compiler.lowering import rules_linalg
from nimblejax.compiler.jaxprs import open_jaxpr
from nimblejax.compiler.partition import Region

pytestmark = pytest.mark.filterwarnings("ignore:nimblejax. .* nimble region")


@pytest.fixture(autouse=True)
def cholesky_left_to_xla(monkeypatch):
    """These programs co-execute around a cholesky that XLA runs: nimble's own kernels
    (lowering/rules_linalg.py) take matrices up to MAX_DIM; with none taken, every
    cholesky here is an equation nimble leaves to XLA, as a larger one would be."""
    monkeypatch.setattr(rules_linalg, "MAX_DIM", 0)


def rand(rng, *shape):
    return rng.standard_normal(shape).astype(np.float32)


def close(got, want, tol=1e-5):
    for g, w in zip(jax.tree_util.tree_leaves(got), jax.tree_util.tree_leaves(want)):
        np.testing.assert_allclose(np.asarray(g), np.asarray(w), rtol=tol, atol=tol)


def _eqns(jaxpr):
    """Every equation of a (closed) jaxpr, nested bodies' included, in order."""
    for eqn in open_jaxpr(jaxpr)[0].eqns:
        yield eqn
        for sub in control._sub_jaxprs(eqn.params):
            yield from _eqns(sub)


def primitives(jaxpr) -> list[str]:
    return [e.primitive.name for e in _eqns(jaxpr)]


# ---- the programs ------------------------------------------------------------------
def cholesky_middle(a, w):
    s = a @ a.T + 4.0 * jnp.eye(a.shape[0], dtype=a.dtype)
    l = jnp.linalg.cholesky(s)  # left to XLA
    return jnp.tanh(l @ w).sum(axis=0), jnp.max(s, axis=1)


def newton_sqrt(a, m):
    """x ← (x + a/x)/2 until converged: a run-time trip count; a GEMM in the body."""
    def body(c):
        x, _, i = c
        nx = 0.5 * (x + a / x) + 0.0 * (m @ x)
        return nx, jnp.max(jnp.abs(nx - x)), i + 1

    x, _, n = lax.while_loop(lambda c: c[1] > 1e-6, body, (a, jnp.float32(1.0), 0))
    return x, n


def printing(x, w):
    """The second print reads only an input: ordered by data alone it could go first."""
    l = jnp.linalg.cholesky(x @ x.T + 16.0 * jnp.eye(x.shape[0]))
    y = jnp.tanh(l @ w)
    jax.debug.print("first {}", y.sum(), ordered=True)
    jax.debug.print("second {}", x.sum(), ordered=True)
    z = jnp.sum(y * y, axis=0)
    jax.debug.print("third {}", z.sum(), ordered=True)
    return z


def args_cholesky(seed=0, n=6):
    r = np.random.default_rng(seed)
    return rand(r, n, n), rand(r, n, 5)


def args_newton(seed=1):
    r = np.random.default_rng(seed)
    return np.abs(rand(r, 7)) + 1.0, rand(r, 7, 7)


# ---- interpreter -----------------------------------------------------------------------
def test_cholesky_in_the_middle_runs_beside_nimble_regions():
    a, w = args_cholesky()
    f = nimble.jit(cholesky_middle, backend="interpret")
    close(f(a, w), jax.jit(cholesky_middle)(a, w))
    close(f(a, w), jax.jit(cholesky_middle)(a, w))  # the resident path's second call too
    names = primitives(jax.make_jaxpr(f)(a, w))
    assert "cholesky" in names and names.count("nimble_call") >= 1
    assert "dot_general" not in names  # every GEMM inside a region


def test_warns_once_naming_the_primitive_and_the_user_line():
    a, w = args_cholesky(2)
    f = nimble.jit(cholesky_middle, backend="interpret")
    line = cholesky_middle.__code__.co_firstlineno + 2
    with pytest.warns(UserWarning, match=rf"'cholesky' \(.*test_coexec.py:{line}\)"):
        f(a, w)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        close(f(*args_cholesky(3, n=8)), jax.jit(cholesky_middle)(*args_cholesky(3, n=8)))


def test_fallback_error_keeps_the_clear_error(monkeypatch):
    a, w = args_cholesky()
    with pytest.raises(nimble.UnsupportedPrimitiveError) as info:
        nimble.jit(cholesky_middle, backend="interpret", fallback="error")(a, w)
    line = cholesky_middle.__code__.co_firstlineno + 2
    assert "'cholesky'" in str(info.value) and f"test_coexec.py:{line}" in str(info.value)
    monkeypatch.setenv("NIMBLE_FALLBACK", "error")
    with pytest.raises(nimble.UnsupportedPrimitiveError, match="'cholesky'"):
        nimble.jit(cholesky_middle, backend="interpret")(a, w)
    with pytest.raises(ValueError, match="NIMBLE_FALLBACK"):
        nimble.jit(cholesky_middle, backend="interpret", fallback="sometimes")


def test_while_with_a_run_time_trip_count_is_xlas_loop_around_a_nimble_body():
    a, m = args_newton()
    f = nimble.jit(newton_sqrt, backend="interpret", loops="unroll")
    got, want = f(a, m), jax.jit(newton_sqrt)(a, m)
    close(got, want)
    assert int(got[1]) == int(want[1]) > 2
    closed = jax.make_jaxpr(f)(a, m)
    (loop,) = [e for e in _eqns(closed) if e.primitive.name == "while"]
    assert "nimble_call" in primitives(loop.params["body_jaxpr"])


def newton_beside_cholesky(a, m, s):
    """A run-time while nimble can plan, beside a cholesky it leaves to XLA."""
    root, n = newton_sqrt(a, m)
    return root, n, jnp.linalg.cholesky(s @ s.T + 4.0 * jnp.eye(s.shape[0]))


def test_while_beside_an_xla_equation_is_a_while_task_in_a_region():
    a, m = args_newton()
    s = rand(np.random.default_rng(9), 6, 6)
    f = nimble.jit(newton_beside_cholesky, backend="interpret")  # loops="graph"
    got, want = f(a, m, s), jax.jit(newton_beside_cholesky)(a, m, s)
    close(got, want)
    assert int(got[1]) == int(want[1]) > 2
    program = f.partition(a, m, s)
    left = {st.name for st in program.xla_steps()}
    assert "cholesky" in left and "while" not in left  # (a tiny select beside it too)
    (loop,) = [r for r in program.regions() if any(st.name == "while" for st in r.steps)]
    plan = nimble.explain(f, a, m, s).plans[loop.name]
    assert [t.kind.value for t in plan.tasks].count("while") == 1
    # Under loops="unroll" the loop cannot be planned: XLA's loop around nimble bodies.
    g = nimble.jit(newton_beside_cholesky, backend="interpret", loops="unroll")
    close(g(a, m, s), want)
    assert "while" in {st.name for st in g.partition(a, m, s).xla_steps()}


def test_debug_prints_keep_their_order(capfd):
    r = np.random.default_rng(4)
    x, w = rand(r, 8, 16), rand(r, 8, 4)
    f = nimble.jit(printing, backend="interpret")
    close(f(x, w), jax.jit(printing)(x, w))
    jax.effects_barrier()
    out = capfd.readouterr().out
    lines = [ln.split()[0] for ln in out.splitlines() if ln.split()[:1] in (["first"], ["second"], ["third"])]
    assert lines == ["first", "second", "third"] * 2, out
    want = float(x.sum())
    second = [float(ln.split()[1]) for ln in out.splitlines() if ln.startswith("second")]
    np.testing.assert_allclose(second, [want, want], rtol=1e-4)


def test_grad_through_a_partitioned_function():
    a, w = args_cholesky(5)
    f = nimble.jit(cholesky_middle, backend="interpret")

    def loss(fn):
        return lambda a, w: sum(jnp.sum(o * o) for o in fn(a, w))

    got = jax.jit(jax.grad(loss(f), argnums=(0, 1)))(a, w)
    close(got, jax.grad(loss(cholesky_middle), argnums=(0, 1))(a, w), tol=1e-4)


@pytest.mark.filterwarnings("ignore:Some donated buffers were not usable")
@jax.custom_jvp
def sqrt_newton(a):
    """A run-time while loop (not reverse-differentiable) under a custom JVP rule."""
    def body(c):
        x, _ = c
        nx = 0.5 * (x + a / x)
        return nx, jnp.max(jnp.abs(nx - x))
    return lax.while_loop(lambda c: c[1] > 1e-6, body, (a, jnp.float32(1.0)))[0]


@sqrt_newton.defjvp
def _sqrt_newton_jvp(primals, tangents):
    y = sqrt_newton(primals[0])
    return y, tangents[0] / (2.0 * y)


def test_a_custom_jvp_rule_around_a_partitioned_loop_is_kept():
    def f(a, w):
        return jnp.sum(jnp.tanh(w @ sqrt_newton(jnp.abs(a) + 1.0)))

    a, w = args_newton(12)
    g = nimble.jit(f, backend="interpret", loops="unroll")  # the loop left to XLA
    close(g(a, w), jax.jit(f)(a, w))
    close(jax.grad(g, argnums=(0, 1))(a, w), jax.jit(jax.grad(f, argnums=(0, 1)))(a, w), tol=1e-4)
    assert "custom_jvp_call" in {s.name for s in g.partition(a, w).xla_steps()}


def test_a_vjp_nimble_cannot_plan_falls_back_to_co_execution():
    """The forward is one plan; its backward holds a cholesky, so the VJP body is
    partitioned instead of refused."""
    @jax.custom_vjp
    def gram(a):
        return a @ a.T + 4.0 * jnp.eye(a.shape[0])

    def fwd(a):
        return gram(a), a

    def bwd(a, ct):
        return (jnp.linalg.cholesky(ct @ ct.T + 4.0 * jnp.eye(a.shape[0])) @ a,)

    gram.defvjp(fwd, bwd)

    def f(a):
        return jnp.sum(jnp.tanh(gram(a)), axis=0)

    a = rand(np.random.default_rng(13), 5, 5)
    g = nimble.jit(f, backend="interpret", fallback="error")
    close(g(a), jax.jit(f)(a))  # the forward: one plan
    loss = lambda fn: lambda a: jnp.sum(fn(a) ** 2)  # noqa: E731
    with pytest.raises(nimble.UnsupportedPrimitiveError, match="'cholesky'"):
        jax.grad(loss(g))(a)
    h = nimble.jit(f, backend="interpret")
    close(jax.grad(loss(h))(a), jax.grad(loss(f))(a), tol=1e-4)


@pytest.mark.filterwarnings("ignore:Some donated buffers were not usable")
def test_vmap_and_donation_across_the_partition():
    r = np.random.default_rng(6)
    a, w = rand(r, 3, 6, 6), rand(r, 3, 6, 5)
    f = nimble.jit(cholesky_middle, backend="interpret")
    close(jax.vmap(f)(a, w), jax.vmap(cholesky_middle)(a, w))
    g = nimble.jit(cholesky_middle, backend="interpret", donate_argnums=(1,))
    want = jax.jit(cholesky_middle)(a[0], w[0])
    close(g(a[0], jnp.asarray(w[0])), want)


def test_scan_too_large_to_unroll_keeps_xlas_loop_around_a_nimble_body(monkeypatch):
    monkeypatch.setattr(control, "UNROLL_MAX_EQNS", 20)

    def f(h, xs, w):
        def step(c, x):
            c = jnp.tanh(c @ w + x)
            return c, jnp.sum(c, axis=-1)
        return lax.scan(step, h, xs)

    r = np.random.default_rng(7)
    args = rand(r, 4, 8), rand(r, 30, 4, 8), rand(r, 8, 8) * 0.5
    g = nimble.jit(f, backend="interpret", loops="unroll")
    close(g(*args), jax.jit(f)(*args))
    (loop,) = [e for e in _eqns(jax.make_jaxpr(g)(*args)) if e.primitive.name == "scan"]
    assert "nimble_call" in primitives(loop.params["jaxpr"])


def test_typed_prng_keys_cross_the_partition():
    def f(key, a):
        k1, k2 = jax.random.split(key)
        s = a @ a.T + 0.1 * jax.random.normal(k1, a.shape) + 5.0 * jnp.eye(a.shape[0])
        return jnp.sum(jnp.linalg.cholesky(s) @ a, axis=0), k2

    key, a = jax.random.key(3), rand(np.random.default_rng(14), 4, 4)
    (got, k), (want, kw) = nimble.jit(f, backend="interpret")(key, a), jax.jit(f)(key, a)
    close(got, want)
    np.testing.assert_array_equal(jax.random.key_data(k), jax.random.key_data(kw))


def test_tiny_regions_are_left_to_xla():
    def f(a):
        return jnp.linalg.cholesky(a @ a.T + 3.0 * jnp.eye(4)) * 2.0 + 1.0  # `* 2 + 1`: tiny

    a = rand(np.random.default_rng(8), 4, 4)
    g = nimble.jit(f, backend="interpret")
    close(g(a), jax.jit(f)(a))
    program = g.partition(a)
    assert all(any(s.name in partition.HEAVY for s in r.steps) or
               len(r.steps) >= partition.MIN_REGION_EQNS for r in program.regions())
    assert any("too small" in s.why for s in program.xla_steps())


def test_dead_equations_are_dropped_before_partitioning():
    """numpyro's argument validation leaves an eigh nothing reads (XLA drops it): it is
    not left to XLA, and the GEMM feeding only it is not planned."""
    def f(a, w):
        s = a @ a.T + 4.0 * jnp.eye(a.shape[0])
        jnp.linalg.eigh(w @ w.T)  # dead
        return jnp.tanh(jnp.linalg.cholesky(s) @ w).sum(axis=0)

    a, w = args_cholesky(6, n=5)
    g = nimble.jit(f, backend="interpret")
    close(g(a, w), jax.jit(f)(a, w))
    program = g.partition(a, w)
    assert "eigh" in primitives(jax.make_jaxpr(f)(a, w))  # the jaxpr keeps it
    assert {s.name for s in program.xla_steps()} == {"cholesky"}
    assert sum(s.name == "dot_general" for r in program.regions() for s in r.steps) == 2


def test_explain_lists_regions_and_what_went_to_xla():
    a, m = args_newton()
    text = str(nimble.explain(nimble.jit(newton_sqrt, backend="interpret", loops="unroll"), a, m))
    assert "co-execution" in text and "xla while (" in text and "not static" in text
    assert re.search(r"region while\d+\.1/r\d+: \d+ equations, \d+ in, \d+ out → \d+ tasks", text), text
    text = str(nimble.explain(cholesky_middle, *args_cholesky()))
    assert re.search(r"region r0: \d+ equations", text) and "xla cholesky (" in text
    assert "the generated kernels take at most" in text  # the reason rules_linalg.accepts gives


def test_regions_are_convex():
    """c = a@a does not depend on the cholesky; d reads both. Grouped in program order,
    {a, c, d} would leave through the cholesky and come back; by depth, {a, c} and {d}."""
    def f(x):
        a = x @ x.T + 5.0 * jnp.eye(5)
        b = jnp.linalg.cholesky(a)
        c = jnp.sum(a @ a, axis=0)
        return jnp.sum(b @ a, axis=1) + c

    x = rand(np.random.default_rng(9), 5, 5)
    program = nimble.jit(f, backend="interpret").partition(x)
    _assert_convex(program)
    first = program.regions()[0]
    assert "reduce_sum" in {s.name for s in first.steps}  # c went with a
    close(nimble.jit(f, backend="interpret")(x), jax.jit(f)(x))


@pytest.mark.parametrize("seed", range(12))
def test_random_programs_partition_into_convex_regions_that_compute_the_same(seed, monkeypatch):
    """Random DAGs of matmuls and elementwise ops; `cos` plays the unsupported primitive.
    Regions evaluated as plain JAX (no plan): the partition alone must keep the program."""
    monkeypatch.setattr(partition, "MIN_REGION_EQNS", 1)
    r = np.random.default_rng(100 + seed)
    ops = [jnp.sin, jnp.cos, jnp.tanh, lambda a, b: a + b, lambda a, b: a @ b * 0.5, jnp.cos]
    picks = [(int(r.integers(len(ops))), r.integers(0, 1 << 30, 2)) for _ in range(14)]

    def f(*xs):
        pool = list(xs)
        for k, (i, j) in picks:
            op = ops[k]
            args = [pool[int(x) % len(pool)] for x in (i, j)][: 1 if k in (0, 1, 2, 5) else 2]
            pool.append(op(*args))
        return pool[-3:]

    xs = [rand(r, 4, 4) * 0.5 for _ in range(3)]
    classify = lambda eqn, ins: "test" if eqn.primitive.name == "cos" else None  # noqa: E731
    program = partition.partition(jax.make_jaxpr(f)(*xs), classify)
    _assert_convex(program)
    assert all(s.name == "cos" for s in program.xla_steps())
    from nimblejax.runtime import coexec

    got = coexec.evaluate(program, xs, lambda region, ys: coexec.run_region(region, *ys))
    close(got, f(*xs), tol=1e-6)


def _assert_convex(program) -> None:
    """No path from a region through any other part back into it."""
    made = {}
    for k, part in enumerate(program.parts):
        outs = part.outputs if isinstance(part, Region) else [v for v in part.outs if v is not None]
        made.update({v: k for v in outs})
    reach = {k: set() for k in range(len(program.parts))}  # parts each part depends on
    for k, part in enumerate(program.parts):
        ins = part.inputs if isinstance(part, Region) else part.ins
        for v in ins:
            if v in made:
                reach[k] |= {made[v]} | reach[made[v]]
    for k, part in enumerate(program.parts):
        assert k not in reach[k], f"part {k} depends on itself through another part"


# ---- item 2: a library primitive implemented in JAX is inlined -------------------------
softsign_p = Primitive("test_softsign")
softsign_p.def_impl(lambda x, scale: scale * x / (1.0 + jnp.abs(x)))
softsign_p.def_abstract_eval(lambda x, scale: jax.core.ShapedArray(x.shape, x.dtype))
mlir.register_lowering(softsign_p, mlir.lower_fun(lambda x, scale: [scale * x / (1.0 + jnp.abs(x))],
                                                  multiple_results=True))


def test_library_primitive_is_traced_through_its_implementation():
    def f(x, w):
        return jnp.sum(softsign_p.bind(x @ w, scale=2.0), axis=0)

    r = np.random.default_rng(10)
    x, w = rand(r, 6, 8), rand(r, 8, 3)
    g = nimble.jit(f, backend="interpret", fallback="error")  # one plan, no XLA part
    close(g(x, w), jax.jit(f)(x, w))
    text = str(nimble.explain(g, x, w))
    assert "test_softsign" in text and "inlined" in text


# ---- GPU: the same programs on the default backend --------------------------------------
@pytest.mark.gpu
@pytest.mark.parametrize("program,make", [(cholesky_middle, args_cholesky), (newton_sqrt, args_newton),
                                          (printing, lambda: (rand(np.random.default_rng(4), 8, 16),
                                                              rand(np.random.default_rng(5), 8, 4)))])
def test_gpu_programs_match_jax_jit(program, make):
    args = make()
    f = nimble.jit(program)
    for _ in range(2):
        close(f(*args), jax.jit(program)(*args), tol=1e-4)
    assert "nimble_call" in primitives(jax.make_jaxpr(f)(*args))


@pytest.mark.gpu
def test_gpu_grad_and_vmap_through_a_partitioned_function():
    a, w = args_cholesky(11)
    f = nimble.jit(cholesky_middle)
    loss = lambda fn: lambda a, w: sum(jnp.sum(o * o) for o in fn(a, w))  # noqa: E731
    close(jax.grad(loss(f))(a, w), jax.grad(loss(cholesky_middle))(a, w), tol=1e-3)
    r = np.random.default_rng(12)
    a3, w3 = rand(r, 3, 6, 6), rand(r, 3, 6, 5)
    close(jax.vmap(f)(a3, w3), jax.vmap(cholesky_middle)(a3, w3), tol=1e-4)

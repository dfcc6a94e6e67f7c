"""The scatter family's fused kernels: a scatter that computes its fused operand into its
output (the gradient of a lookup is one task, no zero fill), and a scatter that updates
its operand's buffer in place when it is the last reader; plans, the interpreter and the
generated kernels on the CPU (tests/helpers/kernel_emulator.py) against jax.jit. Split
out of test_indexing.py."""
from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from tests.helpers import on_host
from tests.helpers import kernel_emulator
import nimblejax as nimble
from tests.helpers.indexing_args import DIM, TOKENS, VOCAB, embed_args, kernel_tasks
from tests.helpers.indexing_args import rng as _rng
from tests.helpers.models import assert_tree_close


# ---- a scatter computes its fused operand into its output --------------------------------
# `zeros((vocab, dim)).at[ids].add(g)` (the gradient of a lookup) is one task: its first
# launch fills the table (no zero-fill kernel, no copy), its second adds the updates,
# reading the ids through their normalization (negative ids) and the updates' producers.
def _embedding_backward(vocab, dim, dtype):
    return lambda i, g: jnp.zeros((vocab, dim), dtype).at[i].add(g)


@pytest.mark.parametrize("dtype, vector", [(jnp.float32, "float4"),
                                           (jnp.bfloat16, "__nv_bfloat162")])
def test_embedding_backward_is_one_task_that_writes_the_table_once(dtype, vector):
    vocab, dim, tokens = 32000, 512, 4096  # nimblejax.bench.indexing's case
    ids = jax.ShapeDtypeStruct((tokens,), jnp.int32)
    g = jax.ShapeDtypeStruct((tokens, dim), dtype)
    report = nimble.explain(_embedding_backward(vocab, dim, dtype), ids, g)
    plan = report.plan
    assert report.num_tasks == 1, str(report)
    (task,) = plan.tasks
    init, combine = task.kernel.launches
    assert combine.name.startswith("nimble_scatter_scatteradd")
    assert init.name == combine.name + "_init"
    # It reads the ids and the updates only, and writes the table once: 16 bytes of the
    # fill per thread, no operand read.
    assert [v.shape for v in task.inputs] == [(tokens,), (tokens, dim)]
    table = vocab * dim * np.dtype(dtype).itemsize
    assert sum(v.nbytes for t in plan.tasks for v in plan.writes[t]) == table
    assert "uint4" in init.source and "in0[" not in init.source and "in1[" not in init.source
    inputs = tokens * dim * np.dtype(dtype).itemsize + tokens * 4
    assert report.arena_bytes <= table + inputs + 3 * 256  # the table, ids, g: no zero buffer
    # Consecutive threads add consecutive elements of one row; on Hopper several a thread,
    # one vector atomic.
    assert f"atomicAdd(({vector}*)" in combine.source and "__CUDA_ARCH__ >= 900" in combine.source


def test_grad_of_a_lookup_has_no_zero_fill_kernel():
    table, ids = embed_args()
    fn = jax.grad(lambda t, i: jnp.sum(jnp.sin(t[i]) ** 2))
    tasks = kernel_tasks(fn, table, ids)
    assert all(len(t.kernel.launches) == 2 for t in tasks if "scatter" in t.name)
    zero_fills = [t for t in tasks if "scatter" not in t.name and not t.inputs]
    assert not zero_fills, [t.name for t in tasks]


def test_an_operand_transposed_along_its_rows_keeps_its_tiled_kernel():
    x = on_host(_rng().normal(size=(DIM, VOCAB)), jnp.float32)
    _, ids = embed_args()
    g = on_host(_rng(1).normal(size=(TOKENS, DIM)), jnp.float32)
    fn = lambda x, i, g: (x.T * 2.0).at[i].add(g)  # noqa: E731
    tasks = kernel_tasks(fn, x, ids, g)
    assert len(tasks) == 2 and any("scatter" in t.name for t in tasks)
    assert_tree_close(nimble.jit(fn, backend="interpret")(x, ids, g), jax.jit(fn)(x, ids, g))


# Fused operands and updates, every combine, the dtypes the brief names. V x D x 4 bytes
# is a multiple of 16 (the 16-byte fill); D splits into 4 and 2 (Hopper's vector atomics).
V, D, N = 37, 8, 60


def _ids(r, unique=False):
    """Ids over [-V, V) (negatives count from the end): N with duplicates, or V - 5
    distinct rows."""
    if unique:
        return on_host(r.permutation(V)[:V - 5] - V * r.integers(0, 2, V - 5), jnp.int32)
    return on_host(r.integers(-V, V, N), jnp.int32)


def _vals(r, dtype, shape, near_one=False):
    if jnp.issubdtype(dtype, jnp.integer):
        lo, hi = (-2, 3) if near_one else (-40, 40)
        return on_host(r.integers(lo, hi, shape), dtype)
    return on_host(r.uniform(0.9, 1.1, shape) if near_one else r.uniform(-3, 3, shape), dtype)


def _args_maker(dtype, unique=False, near_one=False):
    def make(r):
        i = _ids(r, unique)
        return (_vals(r, dtype, (V, D), near_one), i, _vals(r, dtype, (i.shape[0], D), near_one))
    return make


def _fused_cases():
    """(id, fn(x, i, u), make_args(rng)); every scatter's operand and updates are fused."""
    cases = []
    for dtype in (jnp.float32, jnp.bfloat16, jnp.float16, jnp.int32):
        d, c2, c1 = jnp.dtype(dtype).name, jnp.asarray(2, dtype), jnp.asarray(1, dtype)
        plain = _args_maker(dtype)
        cases += [
            # A uniform operand (the 16-byte fill), fused updates: the embedding backward.
            (f"add-zeros-{d}", lambda x, i, u, t=dtype, c2=c2:
             jnp.zeros((V, D), t).at[i].add(u * c2), plain),
            # Any elementwise chain as the operand (the elementwise loop), updates a buffer.
            (f"add-chain-{d}", lambda x, i, u, c2=c2, c1=c1: (x * c2 + c1).at[i].add(u), plain),
            (f"set-chain-{d}", lambda x, i, u, c2=c2, c1=c1: (x - c1).at[i].set(u * c2),
             _args_maker(dtype, unique=True)),
            # A broadcast of a traced scalar: uniform, read once per thread.
            (f"mul-full-{d}", lambda x, i, u, t=dtype: jnp.full((V, D), x[3, 1], t).at[i].multiply(u),
             _args_maker(dtype, near_one=True)),
            (f"min-chain-{d}", lambda x, i, u, c2=c2: (x * c2).at[i].min(u - c2), plain),
            (f"max-zeros-{d}", lambda x, i, u, t=dtype: jnp.zeros((V, D), t).at[i].max(u), plain),
        ]
    r32 = lambda shape: (lambda r: (_ids(r), _vals(r, jnp.float32, shape)))  # noqa: E731
    cases += [
        # float2 atomics (rows of 6).
        ("add-zeros-float32-d6", lambda i, u: jnp.zeros((V, 6), jnp.float32).at[i].add(u),
         r32((N, 6))),
        # A uniform operand of 60 bytes, not 16-byte sized: the elementwise loop.
        ("add-ones-float32-odd", lambda i, u: jnp.ones((5, 3), jnp.float32).at[i % 5].add(u),
         r32((N, 3))),
    ]
    return cases


FUSED = _fused_cases()


def _fused_args(case):
    _, fn, make = case
    return fn, make(np.random.default_rng(8))


@pytest.fixture(scope="module")
def fused_libraries():
    """The fused cases' kernels built for the CPU twice: as a GPU before Hopper builds them
    (one element a thread) and as Hopper does (vector atomics)."""
    if kernel_emulator.compiler() is None:
        pytest.skip("no host C++ compiler")
    plans = [nimble.jit(fn, backend="interpret").plan(*a) for fn, a in map(_fused_args, FUSED)]
    ks = [k for p in plans for k in kernel_emulator.kernels(p)]
    return {None: kernel_emulator.build(ks), 900: kernel_emulator.build(ks, arch=900)}


def _assert_scatter_close(got, want, op):
    """Float sums and products may combine in another order than XLA's (equal within
    rounding, scaled as the GPU test scales it); everything else is bit-exact."""
    got, want = np.asarray(got), np.asarray(want)
    assert got.shape == want.shape and got.dtype == want.dtype, (got.dtype, want.dtype)
    g, w = got.astype(np.float64), want.astype(np.float64)
    if op in ("add", "mul") and jnp.issubdtype(want.dtype, jnp.floating):
        tol = {"float32": 1e-5, "bfloat16": 2e-2, "float16": 4e-3}[want.dtype.name]
        np.testing.assert_allclose(g, w, rtol=tol, atol=tol * 4 * np.abs(w).max())
    else:
        np.testing.assert_array_equal(g, w)


@pytest.mark.parametrize("case", FUSED, ids=lambda c: c[0])
def test_scatter_with_fused_operands_matches_jax(case, fused_libraries):
    """Interpreter, then the generated kernels on the CPU (both builds), against jax.jit
    (set's ids are distinct, so one answer is right)."""
    fn, a = _fused_args(case)
    op = case[0].split("-")[0]
    want = jax.jit(fn)(*a)
    _assert_scatter_close(nimble.jit(fn, backend="interpret")(*a), want, op)
    plan = nimble.jit(fn, backend="interpret").plan(*a)
    # The operand's, the ids' and the updates' producers fused: no fill kernel.
    assert [t.name.startswith("nimble_scatter") for t in plan.tasks] == [True], plan.tasks
    for lib in fused_libraries.values():
        (got,), emulated = kernel_emulator.run(plan, a, lib)
        assert emulated == 1
        _assert_scatter_close(got, want, op)


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16, jnp.int32])
def test_scatter_set_with_duplicate_ids_keeps_one_update_per_row(dtype):
    """With duplicate ids any one update wins (XLA); every other element is the fused
    operand's."""
    r = np.random.default_rng(9)
    x, i, u = _vals(r, dtype, (V, D)), _ids(r), _vals(r, dtype, (N, D))
    fn = lambda x, i, u: (x * jnp.asarray(2, dtype)).at[i].set(u)  # noqa: E731
    plan = nimble.jit(fn, backend="interpret").plan(x, i, u)
    outs = [nimble.jit(fn, backend="interpret")(x, i, u)]
    if kernel_emulator.compiler() is not None:
        for arch in (None, 900):
            lib = kernel_emulator.build(kernel_emulator.kernels(plan), arch=arch)
            outs.append(kernel_emulator.run(plan, (x, i, u), lib)[0][0])
    rows = np.asarray(i) % V
    base = np.asarray(x * jnp.asarray(2, dtype)).astype(np.float64)
    for out in outs:
        out = np.asarray(out).astype(np.float64)
        for row in range(V):
            hits = np.flatnonzero(rows == row)
            if hits.size == 0:
                np.testing.assert_array_equal(out[row], base[row])
            else:
                candidates = np.asarray(u)[hits].astype(np.float64)
                assert any((out[row] == c).all() for c in candidates), row


def test_fused_scatter_kernels_compile_for_hopper_and_before():
    from nimblejax.testing.nvrtc_check import available_compiler, compile_to_ptx

    if available_compiler() is None:
        pytest.skip("no NVRTC or nvcc")
    kernels = {}
    for fn, a in map(_fused_args, FUSED):
        plan = nimble.jit(fn, backend="interpret").plan(*a)
        kernels.update((k.name, k.source) for t in plan.tasks for k in t.kernel.launches)
    source = "\n".join(kernels.values())
    hopper = compile_to_ptx(source, "fused_scatter.cu", arch="sm_90")
    assert all(v in hopper for v in ("add.v4.f32", "add.v2.f32", "bf16x2", "f16x2"))
    ampere = compile_to_ptx(source, "fused_scatter.cu", arch="sm_80")
    assert "v4.f32" not in ampere and all(f".entry {n}(" in ampere for n in kernels)


# ---- a scatter whose update is a literal scalar ---------------------------------------------
LITERAL_UPDATES = {"add": lambda x, i: x.at[i].add(1.5), "set": lambda x, i: x.at[i].set(-2.0),
                   "mul": lambda x, i: x.at[i].multiply(3.0), "max": lambda x, i: x.at[i].max(0.25),
                   "min": lambda x, i: x.at[i].min(-0.25)}


@pytest.mark.parametrize("op", sorted(LITERAL_UPDATES))
def test_scatter_of_a_literal_update_matches_jax(op):
    """`x.at[i].add(1.5)`: the update is a jaxpr literal, not a buffer (the gradient of a
    diffrax solve reaches it): interpreter, then its kernels on the CPU (both builds) and
    compiled by NVRTC, against jax.jit."""
    fn = LITERAL_UPDATES[op]
    x, i = _vals(np.random.default_rng(12), jnp.float32, (V,)), np.int32(3)
    assert "Literal" in repr(jax.make_jaxpr(fn)(x, i).eqns[-1].invars[2].__class__)
    want = jax.jit(fn)(x, i)
    _assert_scatter_close(nimble.jit(fn, backend="interpret", fallback="error")(x, i), want, op)
    plan = nimble.jit(fn, backend="interpret").plan(x, i)
    if kernel_emulator.compiler() is not None:
        for arch in (None, 900):
            lib = kernel_emulator.build(kernel_emulator.kernels(plan), arch=arch)
            _assert_scatter_close(kernel_emulator.run(plan, (x, i), lib)[0][0], want, op)
    from nimblejax.testing.nvrtc_check import available_compiler, compile_to_ptx

    if available_compiler() is not None:
        source = "\n".join(k.source for t in plan.tasks if t.kernel for k in t.kernel.launches)
        compile_to_ptx(source, f"literal_scatter_{op}.cu", arch="sm_90")


# ---- a scatter that is the last reader of its operand's buffer updates it in place ----------
def _gemm_then_scatters(a, w, i, u):
    x = a @ w                                 # a buffer of the plan's own (a GEMM's output)
    y = x.at[i].add(u)                        # its only reader: updated in place
    z = y.at[i[:7]].max(u[:7] * 2.0)          # and again
    return z.sum(0), jnp.tanh(z)


def _in_place_args(seed=10, dtype=jnp.float32):
    r = _rng(seed)
    return (on_host(r.normal(size=(V, 16)), dtype), on_host(r.normal(size=(16, D)), dtype),
            _ids(r), _vals(r, dtype, (N, D)))


def test_scatter_updates_its_operand_in_place_when_it_is_the_last_reader():
    a = _in_place_args()
    plan = nimble.jit(_gemm_then_scatters, backend="interpret").plan(*a)
    scatters = [t for t in plan.tasks if "scatter" in t.name]
    assert len(scatters) == 2
    gemm = [t for t in plan.tasks if t.gemm is not None]
    for t in scatters:
        # One launch (no copy), its output in its operand's bytes, the operand not a param.
        assert len(t.kernel.launches) == 1 and t.aliases
        (out, operand), = t.aliases
        assert plan.offset(out) == plan.offset(operand) == plan.offset(gemm[0].outputs[0])
        assert operand not in t.kernel.params and operand in t.inputs
    assert_tree_close(nimble.jit(_gemm_then_scatters, backend="interpret")(*a),
                      jax.jit(_gemm_then_scatters)(*a))


@pytest.mark.parametrize("fn, in_place", [
    (lambda a, w, i, u: (a @ w).at[i].add(u), True),  # the scatter's output is an output
    (lambda a, w, i, u: ((a @ w).at[i].add(u), (a @ w).sum()), False),  # read twice
    (lambda a, w, i, u: (lambda x: (x, x.at[i].add(u)))(a @ w), False),  # an output itself
    (lambda a, w, i, u: jnp.tanh((a @ w).reshape(-1, 4).at[i].add(1.0)), False),  # a view
    (lambda a, w, i, u: a.at[i, :D].add(u), False),  # an argument: never written
    (lambda a, w, i, u: (a * 2.0).at[i, 3:3 + D].add(u), False),  # fused: computed, no copy
    # The transpose keeps its tiled kernel (not fused), whose output is updated in place.
    (lambda a, w, i, u: jnp.tanh(w.T.at[i % D].add(u[:, :1])), True),
], ids=["gemm-output", "read-twice", "output", "view", "argument", "fused", "transposed"])
def test_scatter_updates_in_place_only_a_buffer_nothing_else_reads(fn, in_place):
    """Only a buffer that a task of the plan writes, read by the scatter alone, is
    updated in place; the others are copied (or, fused, computed) into the output."""
    a = _in_place_args()
    plan = nimble.jit(fn, backend="interpret").plan(*a)
    (t,) = [t for t in plan.tasks if "scatter" in t.name]
    assert bool(t.aliases) == in_place
    assert len(t.kernel.launches) == (1 if in_place else 2)
    assert_tree_close(nimble.jit(fn, backend="interpret")(*a), jax.jit(fn)(*a))


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_in_place_scatters_on_parallel_streams_match_jax(dtype):
    """Two GEMM → scatter-add → scatter-max chains on two streams: the interpreter in
    random interleavings, and the generated kernels on the CPU (both builds)."""
    def chain(a, w, i, u):
        return (a @ w).at[i].add(u).at[i[:7]].max(u[:7] * 2.0)

    def fn(a, w, i, u):
        return chain(a, w, i, u), chain(a * 2, w, i[::-1], u)

    a = _in_place_args(11, dtype)
    want = jax.jit(fn)(*a)
    plan = nimble.jit(fn, backend="interpret").plan(*a)
    assert plan.schedule.num_streams >= 2 and sum(bool(t.aliases) for t in plan.tasks) == 4
    from nimblejax.runtime import interpret

    for seed in range(4):
        assert_tree_close(tuple(interpret.run(plan, a, seed=seed)), want)
    if kernel_emulator.compiler() is not None:
        for arch in (None, 900):
            lib = kernel_emulator.build(kernel_emulator.kernels(plan), arch=arch)
            assert_tree_close(tuple(kernel_emulator.run(plan, a, lib)[0]), want)

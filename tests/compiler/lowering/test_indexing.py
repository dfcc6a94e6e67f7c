"""Gather and the scatter family: plan structure, the CPU interpreter against jax.jit
(an embedding + integer-label cross-entropy training step with optax.adam included), and
the same on the GPU (`gpu` marker). Per-primitive records are in records_indexing.py."""
from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from tests.helpers import jit_init, on_host
from tests.helpers import kernel_emulator
import nimblejax as nimble
from tests.helpers.indexing_args import CLASSES, DIM, TOKENS, VOCAB, embed_args, kernel_tasks
from tests.helpers.indexing_args import rng as _rng
from tests.helpers.models import assert_tree_close


# ---- structure ---------------------------------------------------------------------------
def test_embedding_lookup_fuses_into_its_consumer():
    table, ids = embed_args()
    tasks = kernel_tasks(lambda t, i: jnp.tanh(t[i] * 2.0), table, ids)
    # The index normalization (negative ids), the gather and the tanh: one kernel.
    assert len(tasks) == 1 and "gather" in tasks[0].kernel.name


def test_scatter_is_one_task_of_two_launches():
    table, ids = embed_args()
    upd = on_host(_rng(1).normal(size=(TOKENS, DIM)), jnp.float32)
    tasks = kernel_tasks(lambda t, i, u: t.at[i].add(u), table, ids, upd)
    (scatter,) = [t for t in tasks if "scatter" in t.kernel.name]
    first, second = scatter.kernel.launches
    assert first.params == second.params and "atomicAdd" in second.source
    assert scatter.inputs[0].shape == table.shape  # the operand is read (by the copy)


def test_half_min_uses_a_16_bit_compare_and_swap():
    x = on_host(_rng().normal(size=(9,)), jnp.bfloat16)
    tasks = kernel_tasks(lambda x, i, u: x.at[i].min(u), x, jnp.arange(4) * 2, x[:4])
    src = [t for t in tasks if "scatter" in t.kernel.name][0].kernel.source
    assert "unsigned short" in src and "atomicCAS" in src


# ---- interpreter against jax.jit ---------------------------------------------------------
@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_grad_of_gather_interpret(dtype):
    table, ids = embed_args(dtype=dtype)
    fn = jax.grad(lambda t, i: jnp.sum(jnp.sin(t[i].astype(jnp.float32)) ** 2))
    assert_tree_close(nimble.jit(fn, backend="interpret")(table, ids), jax.jit(fn)(table, ids))


def test_scatter_modes_with_out_of_range_indices_interpret():
    x = on_host(_rng().normal(size=(12, 5)), jnp.float32)
    i = on_host(_rng(2).integers(-20, 20, 30), jnp.int32)
    u = on_host(_rng(3).normal(size=(30, 5)), jnp.float32)

    def fn(x, i, u):
        return (x.at[i].add(u, mode="drop"), x.at[i].add(u, mode="clip"),
                x.at[i].max(u, mode="drop"), jnp.take(x, i, axis=0, mode="fill", fill_value=3.0),
                jnp.take(x, i, axis=0, mode="clip"))

    assert_tree_close(nimble.jit(fn, backend="interpret")(x, i, u), jax.jit(fn)(x, i, u))


def _train_step():
    """nn.Embed → mean over tokens → nn.Dense, optax integer-label cross-entropy, adam."""
    nn = pytest.importorskip("flax.linen", reason="flax is a test extra")
    optax = pytest.importorskip("optax", reason="optax is a test extra")
    from tests.helpers.flax_programs import integer_label_step

    class Model(nn.Module):
        @nn.compact
        def __call__(self, ids):
            h = nn.Embed(VOCAB, DIM)(ids)                # (batch, seq, dim)
            return nn.Dense(CLASSES)(jnp.tanh(h).mean(axis=1))

    model, tx = Model(), optax.adam(1e-2)
    r = _rng(4)
    ids = on_host(r.integers(0, VOCAB, (6, 5)), jnp.int32)
    labels = on_host(r.integers(0, CLASSES, 6), jnp.int32)
    params = jit_init(model, jax.random.PRNGKey(0), ids)
    opt_state = tx.init(params)

    return integer_label_step(model, tx), (params, opt_state, ids, labels)


def _run_steps(step, args, backend, n=3):
    f = nimble.jit(step, backend=backend) if backend else jax.jit(step)
    params, opt_state, ids, labels = args
    losses = []
    for _ in range(n):
        params, opt_state, loss = f(params, opt_state, ids, labels)
        losses.append(loss)
    return params, losses


def _check_train_steps(backend: str) -> None:
    step, args = _train_step()
    got_params, got_losses = _run_steps(step, args, backend)
    want_params, want_losses = _run_steps(step, args, None)
    assert_tree_close(got_losses, want_losses)
    assert_tree_close(got_params, want_params)
    assert float(got_losses[-1]) < float(got_losses[0])


def test_embedding_cross_entropy_adam_step_interpret():
    _check_train_steps("interpret")


# ---- GPU ---------------------------------------------------------------------------------
@pytest.mark.gpu
def test_embedding_cross_entropy_adam_step_gpu():
    _check_train_steps("cuda")


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_large_embedding_lookup_and_backward_gpu(dtype):
    """32000 x 512 table, 4096 tokens with many repeats (atomic adds collide)."""
    r = _rng(5)
    table = on_host(r.normal(size=(32000, 512)), dtype)
    ids = on_host(r.integers(0, 300, 4096), jnp.int32)
    g = on_host(r.normal(size=(4096, 512)), dtype)
    fwd = lambda t, i: t[i] * 2  # noqa: E731
    bwd = lambda t, i, g: jnp.zeros_like(t).at[i].add(g)  # noqa: E731
    assert_tree_close(nimble.jit(fwd, backend="cuda")(table, ids), jax.jit(fwd)(table, ids))
    got = nimble.jit(bwd, backend="cuda")(table, ids, g).astype(jnp.float32)
    want = jax.jit(bwd)(table, ids, g).astype(jnp.float32)
    # Atomic adds sum in another order than XLA: equal within float (bf16) rounding.
    tol = 1e-4 if dtype == jnp.float32 else 0.1
    np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=tol, atol=tol * 10)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16, jnp.float16, jnp.int32,
                                   jnp.int8, jnp.uint8, jnp.int16])
@pytest.mark.parametrize("op", ["add", "subtract", "mul", "min", "max", "set"])
def test_scatter_family_with_collisions_gpu(dtype, op):
    """Every update index collides with others: the atomic (or CAS) paths are exercised.
    'set' uses distinct indices (with duplicates any one update wins, as in XLA)."""
    r = _rng(6)
    if op == "mul" and jnp.issubdtype(dtype, jnp.floating):
        x, u = r.uniform(0.9, 1.1, (64, 3)), r.uniform(0.9, 1.1, (2000, 3))
    elif op == "mul":
        x, u = r.integers(-3, 4, (64, 3)), np.where(r.random((2000, 3)) < 0.99, 1, -1)
    else:
        x, u = r.uniform(-50, 50, (64, 3)), r.uniform(-50, 50, (2000, 3))
        if dtype == jnp.uint8:  # subtract wraps, as XLA's does
            x, u = np.abs(x), np.abs(u) / 20
    x, u = jnp.asarray(x, dtype), jnp.asarray(u, dtype)
    i = on_host(r.integers(-8, 72, 2000), jnp.int32)  # some out of range: dropped
    if op == "set":
        i, u = on_host(r.permutation(64)[:40], jnp.int32), u[:40]
    fn = lambda x, i, u: getattr(x.at[i], op)(u, mode="drop")  # noqa: E731
    got = np.asarray(nimble.jit(fn, backend="cuda")(x, i, u)).astype(np.float64)
    want = np.asarray(jax.jit(fn)(x, i, u)).astype(np.float64)
    tol = 0.0  # min, max, set and integer arithmetic (wrapping, order-free) are exact
    if op in ("add", "subtract", "mul") and jnp.issubdtype(dtype, jnp.floating):
        # Atomic updates combine in another order than XLA: equal within rounding.
        tol = {jnp.float32: 1e-5, jnp.bfloat16: 2e-2, jnp.float16: 4e-3}[dtype]
    np.testing.assert_allclose(got, want, rtol=tol, atol=tol * 4 * np.abs(want).max())


@pytest.mark.gpu
def test_gather_and_scatter_records_on_gpu_repeatedly():
    """Each indexing record twice on one compiled function (the init copy runs every call)."""
    from tests.helpers.primitive_table import RECORDS

    for rec in RECORDS:
        if "gather" in rec.primitive or "scatter" in rec.primitive:
            a = rec.args(_rng(7))
            f = nimble.jit(rec.fn, backend="cuda")
            want = jax.jit(rec.fn)(*a)
            assert_tree_close(f(*a), want)
            assert_tree_close(f(*a), want)


# ---- the generated kernels themselves, run on the CPU --------------------------------------
# The interpreter checks plans with JAX, not our CUDA C. Here each indexing record's plan
# runs its generated kernels on the CPU (tests/helpers/kernel_emulator.py: every launch of a task,
# atomics and compare-and-swap included, and no kernel may write outside its buffers). It
# checks the index arithmetic, the modes, the out-of-range handling and the
# compare-and-swap helpers against jax.jit.
def _cpu_records():
    from tests.helpers.primitive_table import RECORDS

    return [r for r in RECORDS if r.primitive.startswith(("gather", "scatter", "dynamic_"))]


def _plan(record):
    a = record.args(np.random.default_rng(1))
    return nimble.jit(record.fn, backend="interpret").plan(*a), a


@pytest.fixture(scope="module")
def cpu_library():
    """Every record's kernels in one library (one compiler run)."""
    if kernel_emulator.compiler() is None:
        pytest.skip("no host C++ compiler")
    plans = [_plan(r)[0] for r in _cpu_records()]
    return kernel_emulator.build([k for p in plans for k in kernel_emulator.kernels(p)])


@pytest.mark.parametrize("record", _cpu_records(), ids=lambda r: r.id)
def test_generated_kernels_on_cpu_match_jax(record, cpu_library):
    plan, a = _plan(record)
    assert all(t.kind in ("kernel", "view") for t in plan.tasks), [t.kind for t in plan.tasks]
    got, emulated = kernel_emulator.run(plan, a, cpu_library)
    assert emulated == sum(t.kind == "kernel" for t in plan.tasks)  # every kernel ran as C++
    want = jax.tree_util.tree_leaves(jax.jit(record.fn)(*a))
    assert len(got) == len(want)
    for g, w in zip(got, want):
        assert_tree_close(np.asarray(g).astype(np.asarray(w).dtype), w)

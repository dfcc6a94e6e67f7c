"""An LSTM cell computed by the recurrent GEMM's tensor-core kernel or its small-M kernel
(compiler/fusion_gemm_gates.py, lowering/gemm_gates.py, lowering/gemm_small.py): which
readers merge, the plan of the bench LSTM, the kernels on the CPU emulator against
jax.jit, NVRTC, and (marked gpu) the GPU."""
from __future__ import annotations

import collections

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import nimblejax as nimble
from nimblejax.bench.models import MODELS, lstm
from nimblejax.compiler.lowering import gemm_tc
from nimblejax.testing.nvrtc_check import available_compiler, compile_to_ptx
from tests.helpers import kernel_emulator as emu
from tests.helpers.models import (assert_emulated_matches_jax, assert_interpreted_matches_jax,
                                  assert_tree_close, rand)

r = np.random.default_rng(0)
needs_cxx = pytest.mark.skipif(emu.compiler() is None, reason="no host C++ compiler")
GATES = "_gates4_"


def cell(z, c):
    """The LSTM cell of bench/models/lstm.py on z = (M, 4H): gates i, f, g, o."""
    hd = z.shape[1] // 4
    i, f, g, o = (z[:, k * hd:(k + 1) * hd] for k in range(4))
    c = jax.nn.sigmoid(f) * c + jax.nn.sigmoid(i) * jnp.tanh(g)
    return jax.nn.sigmoid(o) * jnp.tanh(c), c


def lstm_steps(w_ih, w_hh, b, x):
    """bench/models/lstm.py's forward with its weights as arguments, h and c returned."""
    h = c = jnp.zeros((x.shape[0], w_hh.shape[0]), x.dtype)
    for t in range(x.shape[1]):
        h, c = cell(x[:, t, :] @ w_ih + h @ w_hh + b, c)
    return h, c


def lstm_args(batch: int, hidden: int, steps: int = 3, features: int = 16):
    return (rand(r, features, 4 * hidden, scale=features ** -0.5), rand(r, hidden, 4 * hidden, scale=hidden ** -0.5),
            rand(r, 4 * hidden), rand(r, batch, steps, features))


def plan_of(fn, *args, **opts):
    return nimble.jit(fn, backend="interpret", **opts).plan(*args)


def gate_tasks(plan) -> list:
    return [t for t in plan.tasks if GATES in t.name]


def test_every_step_of_the_bench_lstm_is_one_task():
    """Full size at batch 32: the recurrent GEMM and the cell are one kernel a step."""
    fn, args = MODELS["lstm"].abstract(32)
    plan = plan_of(fn, *args)
    tasks = gate_tasks(plan)
    kinds = collections.Counter("gates" if t in tasks else t.name.split("_")[1] for t in plan.tasks)
    # The input projections of all steps (one GEMM), the zeros and the bias (one kernel).
    assert kinds == {"gates": lstm.FULL.steps, "float32": 1, "horizontal": 1}, kinds
    assert {t.name.split(GATES)[0] for t in tasks} == {"nimble_gemm_tc_32x2048x512_nn"}
    # Each step writes h and c but the last (c is read by nothing after it).
    assert [len(t.outputs) for t in tasks] == [2] * (lstm.FULL.steps - 1) + [1]
    for t in tasks:
        assert set(t.inputs) == {v for v in t.kernel.params if v not in t.outputs}
    # The recurrence: each step reads the h (and c) the step before wrote.
    for before, after in zip(tasks, tasks[1:]):
        assert set(before.outputs) <= set(after.inputs)


@pytest.mark.parametrize("batch", [1, 4])
def test_at_small_batch_each_step_is_one_small_m_kernel(batch):
    """Batch 1 and 4: the recurrent GEMM is the small-M kernel (gemm_small.py), and the
    cell runs in it too, h and c written by each step but the last (c unread after it)."""
    fn, args = MODELS["lstm"].abstract(batch)
    tasks = gate_tasks(plan_of(fn, *args))
    assert len(tasks) == lstm.FULL.steps
    assert {t.name.split(GATES)[0] for t in tasks} == {f"nimble_gemm_small_m{batch}_f32"}
    assert [len(t.outputs) for t in tasks] == [2] * (lstm.FULL.steps - 1) + [1]
    for before, after in zip(tasks, tasks[1:]):
        assert set(before.outputs) <= set(after.inputs)
    # The steps differ only in the time step of x's projection they read, a scalar
    # argument (KernelBuilder.hoist): one source, compiled once (the last writes no c).
    assert len({t.kernel.source for t in tasks[:-1]}) == 1
    assert sorted(t.kernel.scalars for t in tasks) == [(step,) for step in range(lstm.FULL.steps)], \
        [t.kernel.scalars for t in tasks]


@needs_cxx
@pytest.mark.parametrize("batch", [1, 3])
def test_small_m_cells_on_the_emulator_match_jax(batch, monkeypatch):
    """The small-M kernel with the cell, at a hidden size its rule would leave to
    cuBLASLt (MIN_KN lowered, so that the emulator's threads stay few): 8-column blocks,
    2 units a gate; M = 3 leaves rows of the staged tile unused."""
    from nimblejax.compiler.lowering import gemm_small

    monkeypatch.setattr(gemm_small, "MIN_KN", 1 << 14)
    args = lstm_args(batch, 128)
    tasks = gate_tasks(plan_of(lstm_steps, *args))
    assert len(tasks) == 3 and all(t.name.startswith(f"nimble_gemm_small_m{batch}_") for t in tasks)
    assert_emulated_matches_jax(lstm_steps, args)


def test_the_cells_loads_are_issued_before_the_product():
    """xproj_t's, the bias's and c's loads do not wait for the GEMM (lowering/gemm_gates.py):
    they come before its loop; the gates' values come from the staged tile."""
    # The second step's: h and w for the product; xproj, the bias and c for the cell.
    task = gate_tasks(plan_of(lstm_steps, *lstm_args(32, 128)))[1]
    assert len(task.kernel.params) == 2 + 2 + 3
    source = task.kernel.source
    loop, staged = source.index("float acc["), source.index("float* const Z = smem;")
    assert all(source.rindex(f"{name}[") < loop for name in ("in0", "in1", "in2"))
    assert "gate0_0" in source[staged:] and "gate0_0" not in source[:staged]


def test_what_does_not_merge():
    h, c, w = rand(r, 32, 64), rand(r, 32, 64), rand(r, 64, 256, scale=0.1)
    kept = {
        "slices off the gate boundaries": lambda h, c, w: jnp.tanh((h @ w)[:, :64]) * (h @ w)[:, 100:164],
        "slices of unequal width": lambda h, c, w: (jnp.tanh((h @ w)[:, :64]), jax.nn.sigmoid((h @ w)[:, 64:])),
        "a strided slice": lambda h, c, w: jnp.tanh((h @ w)[:, :64]) * (h @ w)[:, 64::3],
        "a gate read transposed": lambda h, c, w: jnp.tanh((h @ w)[:, :64].T[:32, :]) * c[:, :32],
        "the result also read by a reduction": lambda h, c, w: (cell(h @ w, c), jnp.sum(h @ w, axis=0)),
        "the result also returned": lambda h, c, w: (cell(h @ w, c), h @ w),
        "three gates (the tile's 32 columns do not split in 3)":
            lambda h, c, w: jnp.tanh((h @ w[:, :192])[:, :64]) * jax.nn.sigmoid((h @ w[:, :192])[:, 128:]),
        "the option is off": None,
    }
    for why, fn in kept.items():
        plan = plan_of(cell_of_dot, h, c, w, tc_gemm=False) if fn is None else plan_of(fn, h, c, w)
        assert not gate_tasks(plan) and not [t for t in plan.tasks if "_gates" in t.name], why


def cell_of_dot(h, c, w):
    return cell(h @ w, c)


def test_a_cell_reading_the_product_alone_merges():
    args = (rand(r, 32, 64), rand(r, 32, 64), rand(r, 64, 256, scale=0.1))
    (task,) = plan_of(cell_of_dot, *args).tasks
    assert GATES in task.name and len(task.outputs) == 2


@needs_cxx
@pytest.mark.parametrize("hidden,rows", [(32, 16), (64, 32), (128, 16), (128, 32)])
def test_lstm_on_the_emulator_matches_jax(hidden, rows, monkeypatch):
    """The rule's 16 x 32 tiles (8 units a gate, 16-byte copies of B) and, with those
    off, its 32-row tiles: hidden 64 in 32 x 8 tiles (2 units a gate, 4-byte copies),
    hidden 128 in 32 x 16 (4 units)."""
    if rows == 32:
        monkeypatch.setattr(gemm_tc, "HALF_MAX_K", 0)
    args = lstm_args(32, hidden)
    tasks = gate_tasks(plan_of(lstm_steps, *args))
    assert len(tasks) == 3 and f"Tile {rows}x" in tasks[0].kernel.source
    assert ("nimble_cp_async4(&Bs" in tasks[0].kernel.source) == (hidden == 64)
    assert_emulated_matches_jax(lstm_steps, args)


def test_the_interpreter_runs_the_merged_tasks():
    """The CPU interpreter evaluates a merged task's equations: the cell's outputs too."""
    assert_interpreted_matches_jax(lstm_steps, lstm_args(32, 64))
    stages = nimble.jit(cell_of_dot, backend="interpret").stages(
        rand(r, 32, 64), rand(r, 32, 64), rand(r, 64, 256))
    assert "(through 4 gates)" in str(stages)


@needs_cxx
def test_a_bias_epilogue_and_a_transposed_weight():
    """The GEMM's own bias epilogue at the gate's column; B stored (4H, K), K-major."""
    fn = lambda h, c, w, b: cell(h @ w.T + b, c)  # noqa: E731
    args = (rand(r, 48, 64), rand(r, 48, 32), rand(r, 128, 64, scale=0.1), rand(r, 128))
    (task,) = plan_of(fn, *args).tasks
    assert GATES in task.name and task.gemm.trans_b and task.gemm.epilogue.bias
    assert_emulated_matches_jax(fn, args)


@pytest.mark.skipif(available_compiler() is None, reason="no NVRTC or nvcc")
def test_gate_kernels_compile_for_sm90():
    cases = [(lstm_steps, lstm_args(batch, hidden)) for batch, hidden in ((32, 32), (32, 128), (32, 512), (1, 512))]
    cases.append((lambda h, c, w, b: cell(h @ w.T + b, c),
                  (rand(r, 48, 64), rand(r, 48, 32), rand(r, 128, 64), rand(r, 128))))
    for fn, args in cases:
        tasks = gate_tasks(plan_of(fn, *args))
        assert tasks
        for t in tasks:
            compile_to_ptx(t.kernel.source, t.kernel.name, fast=True)


@pytest.mark.gpu
@pytest.mark.parametrize("batch,hidden", [(32, 64), (32, 512), (1, 512), (4, 512)])
def test_on_the_gpu_twice(batch, hidden):
    """The tensor-core kernel at batch 32, the small-M kernel at batch 1 and 4."""
    args = lstm_args(batch, hidden, steps=4, features=hidden)
    f = nimble.jit(lstm_steps, backend="cuda")
    assert len(gate_tasks(f.plan(*args))) == 4
    for _ in range(2):
        assert_tree_close(f(*args), jax.jit(lstm_steps)(*args))

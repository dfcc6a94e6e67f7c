"""Horizontal fusion (compiler/fusion_horizontal.py, lowering/horizontal.py): independent
small elementwise kernels of one level, and the small kernels nothing reads, packed into
one launch. Structure on the plan, numbers against jax.jit under the CPU interpreter and
with the kernels themselves run on the CPU (tests/helpers/kernel_emulator.py), NVRTC
compiles them, and the GPU compares with jax.jit."""
from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import nimblejax as nimble
from nimblejax.compiler import fusion_horizontal as fh
from nimblejax.compiler.kinds import GroupKind
from nimblejax.testing.nvrtc_check import available_compiler, compile_to_ptx
from tests.helpers import on_host
from tests.helpers import kernel_emulator as emu
from tests.helpers.models import assert_tree_close, rand

r = np.random.default_rng(7)


def update_step(params, x):
    """An optimizer-like update over many leaves of different sizes and dtypes."""
    new = [p * 0.9 + 0.1 * jnp.tanh(x[: p.shape[0]]) for p in params]
    return new, sum(jnp.sum(p) for p in new)


def update_args(n: int = 40):
    params = [rand(r, int(s)) for s in r.integers(3, 200, size=n)]
    return params, rand(r, 256)


def int_step(xs, k):
    return [(x * 3 + k) ^ (x >> 1) for x in xs], [x.astype(jnp.float32) * 0.5 for x in xs]


def int_args():
    xs = [on_host(r.integers(-1000, 1000, size=int(s)), jnp.int32) for s in (5, 17, 64, 300)]
    return xs, jnp.int32(7)


def chain_then_updates(w, x):
    """Terminal updates made at different levels (a backward chain's gradients)."""
    h1 = jnp.tanh(x * w[0])
    h2 = jnp.tanh(h1 * w[1])
    h3 = jnp.tanh(h2 * w[2])
    return [w[0] - 0.1 * h1, w[1] - 0.1 * h2, w[2] - 0.1 * h3], jnp.sum(h3)


def chain_args():
    return [rand(r, 128) for _ in range(3)], rand(r, 128)


CASES = {"update_step": (update_step, update_args), "int_step": (int_step, int_args),
         "chain_then_updates": (chain_then_updates, chain_args)}


def plan_of(fn, *args, **options):
    return nimble.jit(fn, backend="interpret", **options).plan(*args)


def horizontal_tasks(plan) -> list:
    return [t for t in plan.tasks if t.kernel is not None and "horizontal" in t.kernel.name]


# ---- structure ------------------------------------------------------------------------
def test_many_independent_updates_are_few_launches():
    args = update_args(40)
    plan = plan_of(update_step, *args)
    packs = horizontal_tasks(plan)
    assert packs and sum(len(t.outputs) for t in packs) >= 30
    off = plan_of(update_step, *args, horizontal=False)
    assert len(plan.tasks) <= len(off.tasks) - 30
    assert not horizontal_tasks(off)


def test_terminal_updates_of_different_levels_share_one_launch():
    plan = plan_of(chain_then_updates, *chain_args())
    (pack,) = horizontal_tasks(plan)
    assert len(pack.outputs) == 3


def test_packs_respect_member_and_parameter_caps(monkeypatch):
    monkeypatch.setattr(fh, "MAX_MEMBERS", 8)
    plan = plan_of(update_step, *update_args(40))
    packs = horizontal_tasks(plan)
    assert packs and all(len(t.outputs) <= 8 for t in packs)
    assert all(len(t.kernel.params) <= fh.MAX_PARAMS for t in packs)


def test_large_and_transposing_groups_keep_their_own_kernels():
    big = rand(r, 1 << 20)
    grid = rand(r, 64, 48)

    def fn(a, b, c, d):
        return a * 2.0, b + 1.0, jnp.transpose(c) * 3.0, d - 1.0

    plan = plan_of(fn, big, rand(r, 10), grid, rand(r, 12))
    (pack,) = horizontal_tasks(plan)
    assert {v.shape for v in pack.outputs} == {(10,), (12,)}


def test_pack_order_is_topological_and_verified():
    fn, make = CASES["update_step"]
    plan = nimble.jit(fn, backend="interpret", debug=1).plan(*make())
    made = set(plan.graph.inputs) | set(plan.graph.consts)
    for t in plan.tasks:
        assert all(v in made for v in t.inputs if hasattr(v, "shape")), t.name
        made.update(t.outputs)


# ---- numbers ----------------------------------------------------------------------------
@pytest.mark.parametrize("name", sorted(CASES))
def test_interpreter_matches_jax(name):
    fn, make = CASES[name]
    args = make()
    assert_tree_close(nimble.jit(fn, backend="interpret")(*args), jax.jit(fn)(*args))


@pytest.mark.skipif(emu.compiler() is None, reason="no C++ compiler for the kernel emulator")
@pytest.mark.parametrize("name", sorted(CASES))
def test_emulated_horizontal_kernels_match_jax(name):
    fn, make = CASES[name]
    args = make()
    plan = plan_of(fn, *args)
    outs, emulated = emu.run(plan, [np.asarray(a) for a in jax.tree_util.tree_leaves(args)])
    assert emulated >= len(horizontal_tasks(plan)) >= 1
    for got, want in zip(outs, jax.tree_util.tree_leaves(jax.jit(fn)(*args))):
        if np.issubdtype(np.asarray(want).dtype, np.integer):
            np.testing.assert_array_equal(got, want)
        else:
            assert_tree_close(np.asarray(got), want)


@pytest.mark.skipif(available_compiler() is None, reason="no NVRTC or nvcc")
def test_horizontal_kernels_compile():
    kernels = {}
    for fn, make in CASES.values():
        for t in horizontal_tasks(plan_of(fn, *make())):
            kernels[t.kernel.name] = t.kernel.source
    ptx = compile_to_ptx("\n".join(kernels.values()), "nimble_horizontal.cu", arch="sm_90", fast=True)
    assert kernels and not [name for name in kernels if f".entry {name}(" not in ptx]


@pytest.mark.gpu
@pytest.mark.parametrize("name", sorted(CASES))
def test_cuda_matches_jax(name):
    fn, make = CASES[name]
    args = make()
    got, want = nimble.jit(fn, backend="cuda")(*args), jax.jit(fn)(*args)
    for g, w in zip(jax.tree_util.tree_leaves(got), jax.tree_util.tree_leaves(want)):
        if np.issubdtype(np.asarray(w).dtype, np.integer):
            np.testing.assert_array_equal(np.asarray(g), np.asarray(w))
        else:
            assert_tree_close(g, w)

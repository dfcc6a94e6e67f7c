"""Programmatic dependent launch (runtime/pdl.py): every generated kernel waits before its
first statement, the waiting kernels compute what the plain ones do (the CPU emulator,
where the wait is empty), the option, the launch structures' layout, and (marked `gpu`)
whole plans launched so against jax.jit and against the plain launches bit for bit."""
from __future__ import annotations

import ctypes
import re

import jax
import jax.numpy as jnp
from jax import lax
import numpy as np
import pytest

import nimblejax as nimble
from nimblejax import options
from nimblejax.compiler import control, loops
from nimblejax.runtime import pdl
from tests.helpers import kernel_emulator as emu
from tests.helpers.models import MODELS, attention, branchy_args, branchy_mlp, rand
from tests.runtime.test_conditional import newton

KERNEL = re.compile(r"__global__\b[^{;]*\{")


def plan_kernels(fn, *args):
    plan = nimble.jit(fn, backend="interpret").plan(*args)
    return plan, [k for t in plan.tasks if t.kernel is not None for k in t.kernel.launches]


def sort_rows(x):
    return jnp.sort(x, axis=-1)


def scatter_add(x, idx, y):
    return x.at[idx].add(y)


def programs():
    rng = np.random.default_rng(7)
    yield branchy_mlp, branchy_args(rng)
    yield attention, tuple(rand(rng, 2, 16, 32) for _ in range(3))
    yield sort_rows, (rand(rng, 8, 300),)  # a kernel with __launch_bounds__ (rules_sort.py)
    yield scatter_add, (rand(rng, 64, 8), jnp.asarray(rng.integers(0, 64, 40), jnp.int32), rand(rng, 40, 8))


@pytest.mark.parametrize("case", range(4))
def test_every_kernel_waits_first_thing(case):
    fn, args = list(programs())[case]
    _, kernels = plan_kernels(fn, *args)
    assert kernels
    for k in kernels:
        src = pdl.waiting_source(k.source)
        bodies = KERNEL.findall(k.source)
        assert bodies, k.name
        assert src.count(" NIMBLE_PDL_WAIT();") == len(bodies), k.name
        for m in KERNEL.finditer(src):
            assert src[m.end():].startswith(" NIMBLE_PDL_WAIT();"), k.name
        assert pdl.waiting(k).name == k.name and pdl.waiting(k).params == k.params


def test_a_kernel_with_kernels_before_it_waits_in_each():
    fn, args = list(programs())[3]
    _, kernels = plan_kernels(fn, *args)
    with_pre = [k for k in kernels if k.pre]
    for k in with_pre:
        assert all(" NIMBLE_PDL_WAIT();" in p.source for p in pdl.waiting(k).launches)


@pytest.mark.skipif(emu.compiler() is None, reason="needs g++")
def test_waiting_kernels_compute_what_the_plain_ones_do():
    """The emulator (no __CUDACC__: the wait is empty) runs each plan from the plain and
    from the waiting sources: the same bytes."""
    for fn, args in programs():
        plan, _ = plan_kernels(fn, *args)
        flat = [np.asarray(a) for a in jax.tree_util.tree_leaves(args)]
        if not emu.kernels(plan):
            continue
        plain, n = emu.run(plan, flat)
        waiting = emu.build([pdl.waiting(k) for k in emu.kernels(plan)])
        got, m = emu.run(plan, flat, waiting)
        assert n == m >= 1
        for a, b in zip(plain, got):
            np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


def test_the_option_is_on_unless_turned_off(monkeypatch):
    monkeypatch.delenv("NIMBLE_PDL", raising=False)
    assert options.from_env().pdl is True
    monkeypatch.setenv("NIMBLE_PDL", "0")
    assert options.from_env().pdl is False
    with pytest.raises(ValueError, match="NIMBLE_PDL"):
        options.Options(pdl="yes")


def test_the_launch_structures_have_cuda_h_layout():
    """cuda.h on 64-bit Linux: CUlaunchAttribute is 72 bytes (id, padding, a 64-byte
    union), CUlaunchConfig 56 (seven unsigned ints, the stream, the attributes, their count)."""
    assert ctypes.sizeof(pdl.LaunchAttribute) == 72 and pdl.LaunchAttribute.value.offset == 8
    assert ctypes.sizeof(pdl.LaunchConfig) == 56
    assert (pdl.LaunchConfig.stream.offset, pdl.LaunchConfig.attrs.offset, pdl.LaunchConfig.num_attrs.offset) == (32, 40, 48)


@pytest.mark.gpu
@pytest.mark.parametrize("call_path", ["ffi", "python"])
@pytest.mark.parametrize("name", ["branchy_mlp", "mlp"])
def test_plans_launched_programmatically_match_plain_launches_bit_for_bit(name, call_path):
    fn, make, _ = MODELS[name]
    args = make(np.random.default_rng(3))
    plain = nimble.jit(fn, call_path=call_path, pdl=False)(*args)
    f = nimble.jit(fn, call_path=call_path, pdl=True)
    for _ in range(2):  # the second call replays the captured graph
        got = f(*args)
        for a, b in zip(jax.tree_util.tree_leaves(got), jax.tree_util.tree_leaves(plain)):
            np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


def rnn(h, xs, w, u):
    """A scan whose step is a GEMM, a generated kernel reading it and one after."""
    def step(h, x):
        h = jnp.tanh(h @ w + x @ u) * 0.9 + 0.05
        return h, jnp.sum(h * h, axis=-1)
    return lax.scan(step, h, xs)


def switched(i, x):
    heavy = lambda x: jnp.tanh(x @ x.T @ x * 0.1 + 1.0)  # noqa: E731
    return lax.switch(i, [lambda x: heavy(jnp.sin(heavy(x))), lambda x: jnp.cos(heavy(x)) + 1.0,
                          lambda x: x * 2.0], x)


def loop_programs():
    rng = np.random.default_rng(11)
    yield rnn, (rand(rng, 4, 64), rand(rng, 40, 4, 32), rand(rng, 64, 64, scale=0.2),
                rand(rng, 32, 64, scale=0.2))
    yield newton, (np.abs(rng.normal(size=256)).astype(np.float32) * 50 + 0.5,)
    yield switched, (jnp.int32(0), rand(rng, 16, 16))
    yield switched, (jnp.int32(1), rand(rng, 16, 16))


@pytest.mark.gpu
@pytest.mark.parametrize("case", range(4))
def test_loop_and_branch_bodies_launched_programmatically_match_plain_launches(case, monkeypatch):
    """The kernels inside a WHILE node's body (a scan, a data-dependent while) and inside
    a SWITCH node's branches are launched programmatically too: the same bytes."""
    monkeypatch.setattr(control, "UNROLL_MAX_EQNS", 16)  # the scan stays a loop
    monkeypatch.setattr(loops, "BRANCH_TASK_MIN_EQNS", 4)  # the switch a SWITCH node
    fn, args = list(loop_programs())[case]
    plain = nimble.jit(fn, loops="graph", pdl=False)(*args)
    f = nimble.jit(fn, loops="graph", pdl=True)
    assert any(t.control is not None for t in f.plan(*args).tasks)
    for _ in range(2):
        got = f(*args)
        for a, b in zip(jax.tree_util.tree_leaves(got), jax.tree_util.tree_leaves(plain)):
            np.testing.assert_array_equal(np.asarray(a), np.asarray(b))

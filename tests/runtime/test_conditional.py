"""runtime/conditional.py: the device side of conditional nodes compiles without a GPU;
on the GPU (marked `gpu`), WHILE and SWITCH tasks run captured (graph), from the host
(eager) and on the direct path, against jax.jit on random inputs."""
from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax import lax

import nimblejax as nimble
from nimblejax.runtime import conditional


def test_conditional_kernels_compile_to_ptx_with_nvrtc():
    from nimblejax.testing.nvrtc_check import available_compiler, compile_to_ptx

    if available_compiler() is None:
        pytest.skip("no NVRTC or nvcc")
    ptx = compile_to_ptx(conditional.SOURCE, "nimble_conditional")
    for name in ("nimble_set_branch", "nimble_copy_pairs", "nimble_set_and_copy"):
        assert f".entry {name}" in ptx
    assert "cudaGraphSetConditional" in ptx  # the builtin, resolved by the driver's JIT


def test_runtime_ptx_is_made_by_nvrtc_for_the_device_arch():
    pytest.importorskip("cuda.bindings.nvrtc")
    ptx = conditional.ptx_of(conditional.SOURCE, "compute_90")
    assert b".target sm_90" in ptx and b"nimble_set_and_copy" in ptx


class _Step:
    def __init__(self) -> None:
        self.launches = 0

    def launch_all(self) -> None:
        self.launches += 1


def _host_loop(monkeypatch, flags: list):
    """ControlLaunchers' host-driven WHILE over fakes: each read of the condition pops
    `flags`; copies and joins do nothing."""
    launchers = object.__new__(conditional.ControlLaunchers)
    launchers.private = "private"
    monkeypatch.setattr(launchers, "_copy", lambda pairs, stream: None, raising=False)
    monkeypatch.setattr(launchers, "_join", lambda a, b: None, raising=False)
    reads = []
    monkeypatch.setattr(conditional, "_read_bool", lambda address, stream: reads.append(address)
                        or flags.pop(0))
    run = type("run", (), {"copy_in": [], "copy_out": [], "next_carry": [], "pred0": "pred0",
                           "flag": "flag", "step": _Step()})()
    return launchers, run, reads


def test_the_warm_up_runs_a_loops_step_once_and_reads_no_condition(monkeypatch):
    launchers, run, reads = _host_loop(monkeypatch, [])
    with conditional.warming():  # the arena holds no inputs: reading would be garbage
        launchers._host_while(run, "stream")
    assert run.step.launches == 1 and reads == []
    launchers, run, reads = _host_loop(monkeypatch, [True, True, True, False])
    launchers._host_while(run, "stream")  # a real host-driven run (eager mode)
    assert run.step.launches == 3 and reads == ["pred0", "flag", "flag", "flag"]


def test_the_warm_up_runs_every_branch_once_and_reads_no_index(monkeypatch):
    launchers, _, _ = _host_loop(monkeypatch, [])
    reads = []
    monkeypatch.setattr(conditional, "_read", lambda address, dtype, stream: reads.append(address)
                        or np.int32(7))
    subs = [_Step(), _Step(), _Step()]
    run = type("run", (), {"index": "index", "branches": [(sub, [], []) for sub in subs]})()
    with conditional.warming():
        launchers._host_switch(run, "stream")
    assert [sub.launches for sub in subs] == [1, 1, 1] and reads == []
    launchers._host_switch(run, "stream")  # index 7 clamped to the last branch
    assert [sub.launches for sub in subs] == [1, 1, 2] and reads == ["index"]


def test_driver_calls_take_edge_data_as_the_installed_bindings_say():
    driver = pytest.importorskip("cuda.bindings.driver")
    takes = conditional._takes_edge_data(driver.cuGraphAddNode)
    assert takes == ("dependencyData" in driver.cuGraphAddNode.__doc__.splitlines()[0])
    assert conditional._takes_edge_data(driver.cuStreamBeginCaptureToGraph)  # 12.3+ and 13.x


def newton(a):
    def body(c):
        x, _, k = c
        nx = 0.5 * (x + a / x)
        return nx, jnp.max(jnp.abs(nx - x)), k + 1
    return lax.while_loop(lambda c: (c[1] > 1e-5) & (c[2] < 100), body,
                          (a, jnp.float32(jnp.inf), jnp.int32(0)))


def branchy(i, x):
    heavy = lambda x: jnp.tanh(x @ x.T @ x * 0.1 + 1.0)  # noqa: E731
    return lax.switch(i, [lambda x: heavy(heavy(heavy(x))), lambda x: jnp.cos(heavy(heavy(x))),
                          lambda x: x * 2.0], x)


@pytest.mark.gpu
@pytest.mark.parametrize("mode", [dict(), dict(eager=True), dict(output="numpy")])
def test_while_task_on_the_gpu(mode):
    a = np.abs(np.random.default_rng(0).normal(size=256)).astype(np.float32) * 50 + 0.5
    f = nimble.jit(newton, loops="graph", **mode)
    for _ in range(2):  # the second call relaunches the captured graph
        got, want = f(a), jax.jit(newton)(a)
        np.testing.assert_allclose(np.asarray(got[0]), np.asarray(want[0]), rtol=1e-4)
        assert int(np.asarray(got[2])) == int(want[2])


def mixed_carry(x, b, n):
    """Carries of mixed sizes for the body's one copy kernel: 1.2 MB of float32 (more
    than one pass of its grid), 7 int8 bytes (not a multiple of four), a counter."""
    def body(c):
        x, b, k = c
        return x * 0.5 + 1.0, (b + 3).astype(jnp.int8), k + 1
    return lax.while_loop(lambda c: c[2] < n, body, (x, b, jnp.int32(0)))


@pytest.mark.gpu
def test_while_body_copies_every_carry_in_one_kernel_on_the_gpu():
    rng = np.random.default_rng(2)
    x = rng.normal(size=300_000).astype(np.float32)
    b = rng.integers(-100, 100, size=7).astype(np.int8)
    f = nimble.jit(mixed_carry, loops="graph")
    for n in (0, 1, 37):  # the trip count only known at run time
        got, want = f(x, b, np.int32(n)), jax.jit(mixed_carry)(x, b, np.int32(n))
        np.testing.assert_allclose(np.asarray(got[0]), np.asarray(want[0]), rtol=1e-6)
        np.testing.assert_array_equal(np.asarray(got[1]), np.asarray(want[1]))
        assert int(np.asarray(got[2])) == n


@pytest.mark.gpu
@pytest.mark.parametrize("index", [-1, 0, 1, 2, 5])
def test_switch_task_on_the_gpu(index):
    x = np.random.default_rng(1).normal(size=(8, 8)).astype(np.float32)
    f = nimble.jit(branchy, loops="graph")
    assert any(t.kind == "switch" for t in f.plan(np.int32(index), x).tasks)
    np.testing.assert_allclose(np.asarray(f(np.int32(index), x)),
                               np.asarray(jax.jit(branchy)(np.int32(index), x)), rtol=2e-2, atol=2e-2)

"""runtime/placement.py: a first call lowers with placement deferred, builds what the
lowering deferred while XLA compiles, and calls; on the CPU with a primitive whose
lowering defers a fake runner (the FFI runner's deferral runs on the GPU:
tests/runtime/test_compile_gpu.py)."""
from __future__ import annotations

import threading

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.extend.core import Primitive
from jax.interpreters import mlir

from nimblejax.runtime import placement


class FakeRunner:
    """Defers its placement when asked to; counts what happens to it."""

    def __init__(self, fail: bool = False) -> None:
        self.fail = fail
        self.lowered = self.finished = self.abandoned = 0
        self.built = threading.Event()

    def place(self) -> None:
        self.lowered += 1
        pending = placement.deferring()
        if pending is not None and self not in pending:
            pending.append(self)

    def finish_placement(self) -> None:
        self.finished += 1
        self.built.set()
        if self.fail:
            raise RuntimeError("the build failed")

    def abandon_placement(self) -> None:
        self.abandoned += 1


def doubling(runner: FakeRunner):
    """A jitted x -> 2x whose lowering places `runner`."""
    p = Primitive(f"placement_test_{id(runner)}")
    p.def_abstract_eval(lambda x: x)

    def lowering(ctx, x):
        runner.place()
        return mlir.lower_fun(lambda y: y * 2, multiple_results=False)(ctx, x)

    mlir.register_lowering(p, lowering)
    return jax.jit(lambda x: p.bind(x))


def values() -> jax.Array:
    return jnp.asarray(np.random.default_rng(0).standard_normal(16), jnp.float32)


def test_without_deferral_the_call_is_plain():
    runner = FakeRunner()
    x = values()
    np.testing.assert_array_equal(placement.first_run(doubling(runner), (x,), defer=False), x * 2)
    assert (runner.lowered, runner.finished) == (1, 0)


def test_deferred_placement_is_finished_while_xla_compiles_then_called_once(monkeypatch):
    runner, x = FakeRunner(), values()
    f = doubling(runner)
    overlapped: list = []
    real = placement._compile

    def compile_after_the_build(lowered):  # XLA's compile, held until the build is done
        overlapped.append(runner.built.wait(timeout=60))
        real(lowered)

    monkeypatch.setattr(placement, "_compile", compile_after_the_build)
    np.testing.assert_array_equal(placement.first_run(f, (x,)), x * 2)
    assert runner.finished == 1 and runner.abandoned == 0
    assert overlapped == [True]  # the compile was under way while the graph was built
    assert runner.lowered == 1  # the call took the program lower().compile() made
    np.testing.assert_array_equal(placement.first_run(f, (x + 1,)), (x + 1) * 2)
    assert (runner.lowered, runner.finished) == (1, 1)  # nothing new: nothing deferred
    assert placement.deferring() is None


def test_a_failed_build_is_abandoned_and_the_next_call_lowers_again():
    runner, x = FakeRunner(fail=True), values()
    f = doubling(runner)
    with pytest.raises(RuntimeError, match="the build failed"):
        placement.first_run(f, (x,))
    assert (runner.finished, runner.abandoned) == (1, 1) and placement.deferring() is None
    runner.fail = False
    np.testing.assert_array_equal(f(x), x * 2)  # not the program naming the lost ids
    assert runner.lowered == 2


def test_under_a_transformation_the_call_is_plain():
    """A first call inside the caller's jax.jit or grad is lowered by the caller's program."""
    runner = FakeRunner()
    f = doubling(runner)
    x = values()
    np.testing.assert_array_equal(jax.jit(lambda y: placement.first_run(f, (y,)))(x), x * 2)
    assert runner.finished == 0


@pytest.mark.parametrize("transform", ["jit", "grad"])
def test_a_nimble_functions_first_call_under_a_transformation_with_deferred_builds(transform):
    import nimblejax as nimble

    def fn(x):
        return jnp.sin(x) * x

    f = nimble.jit(fn, backend="interpret", defer_build=True)
    x = values()
    if transform == "jit":
        got, want = jax.jit(f)(x), jax.jit(fn)(x)
    else:
        got, want = jax.grad(lambda y: f(y).sum())(x), jax.grad(lambda y: fn(y).sum())(x)
    np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=1e-6, atol=1e-6)

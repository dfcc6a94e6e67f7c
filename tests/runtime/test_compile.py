"""runtime/compile.py: a plan's new kernels compiled as one module (NVRTC parses the
shared headers once), each alone where the module fails, nothing compiled twice. The
module's handling runs against a fake CuPy here; NVRTC itself compiles the suite's
plans as one module (the real check that concatenated kernels do not collide), and the
GPU tests compile and run them through CuPy."""
from __future__ import annotations

import sys
import types

import pytest

from nimblejax.bench.models import MODELS
from nimblejax.compiler.lowering.task import Kernel
from nimblejax.runtime import compile as compile_mod
from nimblejax.testing.nvrtc_check import available_compiler, compile_to_ptx


class CompileException(Exception):
    pass


class FakeModule:
    """A RawModule whose compile fails when its code defines one function twice."""

    built: list = []

    def __init__(self, code: str, options: tuple) -> None:
        self.code, self.options = code, options

    def compile(self) -> None:
        names = [line.split("(")[0].split()[-1] for line in self.code.splitlines()
                 if line.startswith('extern "C"')]
        if len(names) != len(set(names)):
            raise CompileException("redefinition")
        FakeModule.built.append(names)

    def get_function(self, name: str) -> tuple:
        assert f" {name}(" in self.code, name
        return (id(self), name)


@pytest.fixture
def fake_cupy(monkeypatch):
    cupy = types.SimpleNamespace(RawModule=FakeModule, cuda=types.SimpleNamespace(
        compiler=types.SimpleNamespace(CompileException=CompileException)))
    monkeypatch.setitem(sys.modules, "cupy", cupy)
    monkeypatch.setattr(compile_mod, "_modules", {})
    FakeModule.built = []
    return cupy


def kernel(name: str, body: str = "") -> Kernel:
    return Kernel(name, f'extern "C" __global__ void {name}(float* out) {{ {body} }}\n',
                  (1, 1, 1), (32, 1, 1), ())


def test_new_kernels_are_one_module_and_compiled_once(fake_cupy):
    ks = [kernel("a"), kernel("b"), kernel("c")]
    funcs = compile_mod.compile_kernels(ks)
    assert FakeModule.built == [["a", "b", "c"]]
    assert len({f[0] for f in funcs.values()}) == 1 and [f[1] for f in funcs.values()] == ["a", "b", "c"]
    again = compile_mod.compile_kernels(ks + [kernel("d")])  # only d is new: alone
    assert FakeModule.built == [["a", "b", "c"], ["d"]] and again["a"] == funcs["a"]


def test_a_module_that_fails_is_compiled_kernel_by_kernel(fake_cupy):
    ks = [kernel("a"), kernel("a", "return;"), kernel("b")]  # two sources define `a`
    compile_mod.compile_kernels(ks)
    assert FakeModule.built == [["a"], ["a"], ["b"]]


@pytest.mark.skipif(available_compiler() is None, reason="no NVRTC or nvcc")
@pytest.mark.parametrize("name", ["resnet50", "bert", "lstm"])
def test_a_suite_plans_kernels_compile_as_one_module(name):
    import nimblejax as nimble

    fn, args = MODELS[name].abstract(1, tiny=True)
    plan = nimble.jit(fn, backend="interpret").plan(*args)
    sources = {k.source: k for t in plan.tasks if t.kernel is not None for k in t.kernel.launches}
    ptx = compile_to_ptx("\n".join(sources), f"{name}_all.cu", options=compile_mod.OPTIONS)
    assert all(f".entry {k.name}(" in ptx for k in sources.values())

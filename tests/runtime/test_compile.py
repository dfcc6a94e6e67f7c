"""runtime/compile.py: a plan's new kernels compiled in a few modules on parallel threads
(NVRTC parses the shared headers once per module), each kernel alone where its module
fails, nothing compiled twice. The
module's handling runs against a fake CuPy here; NVRTC itself compiles the suite's
plans as one module (the real check that concatenated kernels do not collide), and the
GPU tests compile and run them through CuPy."""
from __future__ import annotations

import re
import sys
import types

import jax
import jax.numpy as jnp
import pytest

from nimblejax.bench.models import MODELS
from nimblejax.compiler.lowering.task import Kernel
from nimblejax.runtime import compile as compile_mod
from nimblejax.testing.nvrtc_check import available_compiler, compile_to_ptx
from tests.runtime.test_conditional import branchy, newton


class CompileException(Exception):
    pass


@pytest.fixture(autouse=True)
def _compiled_through_nvrtc_itself(monkeypatch):
    """Each test starts with NVRTC called directly, as a process does."""
    monkeypatch.setattr(compile_mod, "_cupy_compiles", [])


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


class FakeDevice:
    """cupy.cuda.Device: the current one (id 0) and a context that makes one current."""

    compute_capability = "90"

    def __init__(self, id: int = 0) -> None:
        self.id = id

    def __enter__(self) -> "FakeDevice":
        return self

    def __exit__(self, *exc) -> None:
        return None


def fake_load(code: str, arch: str | None = None) -> FakeModule:
    """compile.load_module on the fake: a module of `code`, compiled at once."""
    module = FakeModule(code, compile_mod.OPTIONS)
    module.compile()
    return module


@pytest.fixture
def fake_cupy(monkeypatch):
    cupy = types.SimpleNamespace(RawModule=FakeModule, cuda=types.SimpleNamespace(
        compiler=types.SimpleNamespace(CompileException=CompileException), Device=FakeDevice))
    monkeypatch.setitem(sys.modules, "cupy", cupy)
    monkeypatch.setattr(compile_mod, "_modules", {})
    monkeypatch.setattr(compile_mod, "_pending", {})
    monkeypatch.setattr(compile_mod, "load_module", fake_load)
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


def test_a_compile_that_raised_is_compiled_again_by_the_next_call(fake_cupy, monkeypatch):
    failing = [True]

    def load(code, arch=None):
        if failing.pop() if failing else False:
            raise RuntimeError("the compile thread broke")
        return fake_load(code)

    monkeypatch.setattr(compile_mod, "load_module", load)
    with pytest.raises(RuntimeError, match="broke"):
        compile_mod.compile_kernels([kernel("a")])
    assert compile_mod.compile_kernels([kernel("a")])["a"][1] == "a" and FakeModule.built == [["a"]]


def test_module_split_deals_every_source_once_into_even_modules():
    sources = [f"k{i}" + "x" * (i % 7) for i in range(21)]
    for threads, count in ((1, 1), (4, 4), (8, 5), (64, 5)):  # ≥ 4 kernels a module
        modules = compile_mod.module_split(sources, threads)
        assert len(modules) == count
        assert sorted(s for m in modules for s in m) == sorted(sources)
        sizes = [sum(map(len, m)) for m in modules]
        assert max(sizes) - min(sizes) <= max(map(len, sources))
    assert compile_mod.module_split(sources[:3], 8) == [sorted(sources[:3], key=len, reverse=True)]


def test_a_few_large_kernels_compile_side_by_side():
    """An LSTM step's gate kernels (about 8 KB of source each): one module each, where a
    module of four took as long as its kernels one after another."""
    large = [f"k{i}" + "x" * 8000 for i in range(3)] + ["small"]
    modules = compile_mod.module_split(large, 8)
    assert len(modules) == 4 and sorted(s for m in modules for s in m) == sorted(large)
    assert len(compile_mod.module_split(large, 2)) == 2
    assert len(compile_mod.module_split(["a" * 3000, "b" * 2000], 8)) == 1  # 5 KB: one module


def test_compiling_starts_in_the_background_and_is_waited_for(fake_cupy):
    ks = [kernel("a"), kernel("b")]
    compile_mod.start_compiling(ks)
    assert set(compile_mod._pending) == {k.source for k in ks}
    compile_mod.start_compiling(ks)  # already under way: not submitted twice
    funcs = compile_mod.compile_kernels(ks)
    assert FakeModule.built == [["a", "b"]] and set(funcs) == {"a", "b"}
    assert not compile_mod._pending


def test_many_new_kernels_build_several_modules_on_threads(fake_cupy, monkeypatch):
    monkeypatch.setattr(compile_mod, "threads", lambda: 3)
    ks = [kernel(f"k{i}") for i in range(12)]
    funcs = compile_mod.compile_kernels(ks)
    assert sorted(len(names) for names in FakeModule.built) == [4, 4, 4]
    assert sorted(n for names in FakeModule.built for n in names) == sorted(k.name for k in ks)
    assert len({f[0] for f in funcs.values()}) == 3 and set(funcs) == {k.name for k in ks}
    compile_mod.compile_kernels(ks)  # all known: nothing compiled again
    assert len(FakeModule.built) == 3


@pytest.mark.skipif(available_compiler() is None, reason="no NVRTC or nvcc")
@pytest.mark.parametrize("name", ["resnet50", "bert", "lstm"])
def test_a_suite_plans_kernels_compile_as_one_module(name):
    import nimblejax as nimble

    fn, args = MODELS[name].abstract(1, tiny=True)
    plan = nimble.jit(fn, backend="interpret").plan(*args)
    sources = {k.source: k for t in plan.tasks if t.kernel is not None for k in t.kernel.launches}
    ptx = compile_to_ptx("\n".join(sources), f"{name}_all.cu", options=compile_mod.OPTIONS)
    assert all(f".entry {k.name}(" in ptx for k in sources.values())


def looped(a):
    """A run-time while loop (test_conditional's Newton iteration): a WHILE task whose
    step plan has kernels of its own."""
    return newton(jnp.abs(a) + 0.5)[0] * 3.0


def test_plan_kernels_are_the_sources_the_graph_build_compiles():
    """What the first call starts compiling early (api.py) is what Launchers compiles:
    the programmatic-launch forms where pdl applies, the loop's step plan included."""
    import nimblejax as nimble
    from nimblejax.runtime import pdl
    from nimblejax.runtime.launch import plan_kernels

    plan = nimble.jit(looped, backend="interpret", loops="graph").plan(jax.ShapeDtypeStruct((64,), jnp.float32))
    (loop,) = [t for t in plan.tasks if t.control is not None]
    own = plan_kernels(plan, pdl=False)
    step = plan_kernels(loop.control.step, pdl=False)
    assert own and step and not {k.source for k in own} & {k.source for k in step}
    nested = plan_kernels(plan, pdl=False, nested=True)
    assert [k.source for k in nested] == [k.source for k in own + step]
    waiting = plan_kernels(plan, pdl=True, nested=True)
    assert [k.source for k in waiting] == [pdl.waiting_source(k.source) for k in nested]
    assert [k.name for k in waiting] == [k.name for k in nested]


def test_plan_kernels_take_every_branch_of_a_switch():
    import nimblejax as nimble
    from nimblejax.compiler.loops import SwitchCall
    from nimblejax.runtime.launch import plan_kernels

    x = jax.ShapeDtypeStruct((32, 32), jnp.float32)
    plan = nimble.jit(branchy, backend="interpret", loops="graph").plan(jax.ShapeDtypeStruct((), jnp.int32), x)
    (switch,) = [t for t in plan.tasks if t.control is not None]
    assert isinstance(switch.control, SwitchCall) and len(switch.control.branches) == 3
    branch_sources = [k.source for b in switch.control.branches for k in plan_kernels(b, pdl=False, nested=True)]
    nested = [k.source for k in plan_kernels(plan, pdl=False, nested=True)]
    assert branch_sources and nested[-len(branch_sources):] == branch_sources


def test_no_flush_to_zero_in_the_options():
    """XLA's kernels keep subnormal float32 values; so do nimble's (load_module compiles with
    OPTIONS as they are, where CuPy's RawModule would append -ftz=true)."""
    assert not any("ftz" in o for o in compile_mod.OPTIONS)


@pytest.mark.skipif(available_compiler() is None, reason="no NVRTC or nvcc")
def test_kernels_compiled_with_the_options_keep_subnormals():
    src = 'extern "C" __global__ void k(float* x, float* y) { y[0] = x[0] * x[1] + sqrtf(x[2]); }\n'
    ptx = compile_to_ptx(src, "k", options=compile_mod.OPTIONS)
    ops = [line.split()[0] for line in ptx.splitlines() if ".f32" in line and ("fma" in line or "sqrt" in line)]
    assert ops == ["sqrt.approx.f32", "fma.rn.f32"], ops


def test_load_compiles_with_the_options_as_they_are_and_caches_the_cubin(monkeypatch, tmp_path):
    """load_module asks NVRTC (CuPy's compile_using_nvrtc, which adds no -ftz=true) for a cubin,
    keeps it under CUPY_CACHE_DIR and loads it from there; the same code again (another
    process) is not compiled again, other code or another NVRTC is."""
    compiled: list = []

    def compile_using_nvrtc(code, options, arch):
        compiled.append((code, options[-len(compile_mod.OPTIONS):]))
        return b"cubin of " + code.encode(), {}

    cupy = types.SimpleNamespace(RawModule=lambda path: ("module", path), cuda=types.SimpleNamespace(
        compiler=types.SimpleNamespace(compile_using_nvrtc=compile_using_nvrtc),
        Device=lambda: types.SimpleNamespace(compute_capability="90")))
    monkeypatch.setitem(sys.modules, "cupy", cupy)
    monkeypatch.setenv("CUPY_CACHE_DIR", str(tmp_path / "cache"))
    monkeypatch.setattr(compile_mod, "_nvrtc_version", lambda: (13, 0))
    monkeypatch.setattr(compile_mod, "nvrtc_options", lambda options: ("-Iheaders",) + tuple(options))
    monkeypatch.setattr(compile_mod.nvrtc, "library", lambda: None)  # CuPy's compile
    kind, path = compile_mod.load_module("code a")
    assert compiled == [("code a", compile_mod.OPTIONS)] and kind == "module"
    assert open(path, "rb").read() == b"cubin of code a" and path.startswith(str(tmp_path / "cache"))
    assert compile_mod.load_module("code a")[1] == path and len(compiled) == 1
    assert compile_mod.load_module("code b")[1] != path and len(compiled) == 2
    monkeypatch.setattr(compile_mod, "_nvrtc_version", lambda: (13, 1))
    assert compile_mod.load_module("code a")[1] != path and len(compiled) == 3
    assert sorted(p.suffix for p in (tmp_path / "cache").iterdir()) == [".cubin"] * 3


def test_the_runtimes_own_kernels_are_built_once_into_the_handlers_cache(monkeypatch, tmp_path):
    """compile.runtime_kernel: a fixed kernel of the runtime (the handler's copy kernel)
    is compiled into options.cache_dir(), beside the handler, not into the kernel cache
    a fresh CuPy cache empties; once per process, and once per install."""
    compiled: list = []

    def compile_using_nvrtc(code, options, arch):
        compiled.append(code)
        return b"cubin of " + code.encode(), {}

    class Module:
        def __init__(self, path):
            self.path = path

        def get_function(self, name):
            return (self.path, name)

    cupy = types.SimpleNamespace(RawModule=Module, cuda=types.SimpleNamespace(
        compiler=types.SimpleNamespace(compile_using_nvrtc=compile_using_nvrtc),
        Device=lambda: types.SimpleNamespace(compute_capability="90")))
    monkeypatch.setitem(sys.modules, "cupy", cupy)
    monkeypatch.setenv("CUPY_CACHE_DIR", str(tmp_path / "cupy"))
    monkeypatch.setenv("NIMBLEJAX_CACHE_DIR", str(tmp_path / "nimble"))
    monkeypatch.setattr(compile_mod, "_nvrtc_version", lambda: (13, 0))
    monkeypatch.setattr(compile_mod, "nvrtc_options", tuple)
    monkeypatch.setattr(compile_mod.nvrtc, "library", lambda: None)
    monkeypatch.setattr(compile_mod, "_runtime_modules", {})
    path, name = compile_mod.runtime_kernel("copy code", "copy")
    assert name == "copy" and path.startswith(str(tmp_path / "nimble")) and compiled == ["copy code"]
    assert compile_mod.runtime_kernel("copy code", "copy")[0] == path and len(compiled) == 1
    monkeypatch.setattr(compile_mod, "_runtime_modules", {})  # another process: loads the cubin
    assert compile_mod.runtime_kernel("copy code", "copy")[0] == path and len(compiled) == 1
    assert not (tmp_path / "cupy").exists()


def fake_cupy_loader(monkeypatch, tmp_path, cupy_compiled: list):
    """sys.modules' cupy: RawModule(path=) and a compile_using_nvrtc that records."""
    def compile_using_nvrtc(code, options, arch):
        cupy_compiled.append(code)
        return b"cupy's cubin of " + code.encode(), {}

    cupy = types.SimpleNamespace(RawModule=lambda path: ("module", path), cuda=types.SimpleNamespace(
        compiler=types.SimpleNamespace(compile_using_nvrtc=compile_using_nvrtc, CompileException=CompileException),
        Device=lambda: types.SimpleNamespace(compute_capability="90", id=0)))
    monkeypatch.setitem(sys.modules, "cupy", cupy)
    monkeypatch.setenv("CUPY_CACHE_DIR", str(tmp_path / "cache"))
    monkeypatch.setattr(compile_mod, "nvrtc_options", tuple)
    monkeypatch.setattr(compile_mod, "_cupy_compiles", [])
    monkeypatch.setattr(compile_mod.nvrtc, "library", lambda: object())
    monkeypatch.setattr(compile_mod.nvrtc, "version", lambda: (13, 0))


def test_kernels_compile_through_nvrtc_itself_and_load_through_cupy(monkeypatch, tmp_path):
    """load_module calls NVRTC directly (runtime/nvrtc.py: no CuPy import before the
    cubin exists) for the architecture it is given, and CuPy only loads the cubin."""
    direct, cupy_compiled = [], []
    fake_cupy_loader(monkeypatch, tmp_path, cupy_compiled)
    monkeypatch.setattr(compile_mod.nvrtc, "compile_cubin",
                        lambda code, options, arch: direct.append((code, options, arch)) or b"cubin")
    kind, path = compile_mod.load_module("code a", arch="86")
    assert direct == [("code a", compile_mod.OPTIONS, "86")] and not cupy_compiled
    assert kind == "module" and open(path, "rb").read() == b"cubin"


def test_a_source_nvrtc_refuses_directly_but_cupy_takes_leaves_it_to_cupy(monkeypatch, tmp_path):
    """Where NVRTC called directly refuses what CuPy's compile takes (the two would differ
    in their header folders, say), that and every later kernel compile through CuPy."""
    direct, cupy_compiled = [], []
    fake_cupy_loader(monkeypatch, tmp_path, cupy_compiled)

    def refuse(code, options, arch):
        direct.append(code)
        raise compile_mod.nvrtc.NvrtcError("NVRTC could not compile", "cuda_fp16.h: not found")

    monkeypatch.setattr(compile_mod.nvrtc, "compile_cubin", refuse)
    path = compile_mod.load_module("code a", arch="90")[1]
    assert open(path, "rb").read() == b"cupy's cubin of code a" and direct == ["code a"]
    compile_mod.load_module("code b", arch="90")
    assert direct == ["code a"] and cupy_compiled == ["code a", "code b"]
    assert "cuda_fp16.h" in compile_mod._cupy_compiles[0]


def test_the_architecture_comes_from_the_driver_before_cupy_is_imported(monkeypatch):
    monkeypatch.delitem(sys.modules, "cupy", raising=False)
    monkeypatch.setattr(compile_mod.nvrtc, "_driver_arch", lambda ordinal: {0: "90"}.get(ordinal))
    assert compile_mod.nvrtc.current_arch() == "90"
    monkeypatch.setitem(sys.modules, "cupy", types.SimpleNamespace(cuda=types.SimpleNamespace(
        Device=lambda: types.SimpleNamespace(compute_capability="100"))))
    assert compile_mod.nvrtc.current_arch() == "100"  # CuPy's current device, once imported


@pytest.mark.skipif(compile_mod.nvrtc.library() is None, reason="no libnvrtc")
def test_nvrtc_called_directly_makes_a_cubin_and_reports_what_it_refuses():
    """The real library: a cubin (an ELF file) for sm_90 without a GPU; a source with an
    error raises NvrtcError with NVRTC's log."""
    src = '#include <cuda_fp16.h>\nextern "C" __global__ void k(__half* x) { x[0] = __float2half(1.f); }\n'
    assert compile_mod.nvrtc.compile_cubin(src, compile_mod.OPTIONS, "90")[:4] == b"\x7fELF"
    with pytest.raises(compile_mod.nvrtc.NvrtcError, match="undefined"):
        compile_mod.nvrtc.compile_cubin('extern "C" __global__ void k() { nope(); }', (), "90")


@pytest.mark.skipif(available_compiler() is None, reason="no NVRTC or nvcc")
def test_the_runtimes_own_kernels_compile_with_the_options_load_module_passes():
    """The handler's copy kernel (its C++ header's source) and the batch copier, as
    runtime_kernel compiles them: extern "C", nothing beyond the built-in vector types."""
    import pathlib

    from nimblejax.runtime.io import COPY_MANY

    header = (pathlib.Path(compile_mod.__file__).parent / "ffi" / "copy_kernel.h").read_text()
    copy = header[header.index('R"CUDA(') + len('R"CUDA('):header.index(')CUDA"')]
    for name, source in (("nimble_ffi_copy", copy), ("nimble_copy_many", COPY_MANY)):
        assert f".entry {name}(" in compile_to_ptx(source, name, options=compile_mod.nvrtc_options())


@pytest.mark.skipif(available_compiler() is None, reason="no NVRTC or nvcc")
def test_a_suite_plans_kernels_compile_with_the_options_load_module_passes():
    """The include folders CuPy adds, nimble's options, no -ftz=true: LSTM's kernels
    (half and bfloat16 headers, nimble's math helpers) compile so, without flushing."""
    import nimblejax as nimble

    options = compile_mod.nvrtc_options()
    assert [o for o in options if o in compile_mod.OPTIONS] == list(compile_mod.OPTIONS)
    assert any(o.startswith("-I") for o in options) and not any("ftz" in o for o in options)
    fn, args = MODELS["lstm"].abstract(1, tiny=True)
    plan = nimble.jit(fn, backend="interpret").plan(*args)
    sources = {k.source: k for t in plan.tasks if t.kernel is not None for k in t.kernel.launches}
    ptx = compile_to_ptx("\n".join(sources), "lstm_all.cu", options=options)
    assert all(f".entry {k.name}(" in ptx for k in sources.values())
    # (libdevice's expf keeps its own ex2.approx.ftz: it scales the argument itself)
    assert not re.search(r"\b(fma\.rn|mul|add|sub)(\.rn)?\.ftz\.f32", ptx)


def test_load_module_falls_back_to_a_folder_of_its_own_where_the_cache_is_not_writable(monkeypatch, tmp_path):
    blocked = tmp_path / "blocked"
    blocked.write_text("a file where the cache folder should be")  # makedirs fails under it
    cupy = types.SimpleNamespace(RawModule=lambda path: path, cuda=types.SimpleNamespace(
        compiler=types.SimpleNamespace(compile_using_nvrtc=lambda code, options, arch: ("ptx text", {})),
        Device=lambda: types.SimpleNamespace(compute_capability="90")))
    monkeypatch.setitem(sys.modules, "cupy", cupy)
    monkeypatch.setattr(compile_mod.nvrtc, "library", lambda: None)
    monkeypatch.setenv("CUPY_CACHE_DIR", str(blocked / "cache"))
    monkeypatch.setattr(compile_mod, "_nvrtc_version", lambda: (13, 0))
    monkeypatch.setattr(compile_mod, "nvrtc_options", lambda options: tuple(options))
    monkeypatch.setattr(compile_mod, "_private", [str(tmp_path / "own")])
    path = compile_mod.load_module("code c")
    assert path.startswith(str(tmp_path / "own")) and open(path, "rb").read() == b"ptx text"

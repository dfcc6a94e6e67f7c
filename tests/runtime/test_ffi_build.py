"""Build-level tests of the XLA FFI handler library (no GPU needed).

They compile nimblejax/runtime/ffi/handler.cc with the system compiler, check
the build cache, the exported C API, that the copy-kernel source compiles
with NVRTC and matches the handler's struct layout, and that failures (no
compiler, failing compiler, no libcuda) degrade to warnings, never raise.
"""

from __future__ import annotations

import ctypes
import os
import re
import shutil
import warnings

import pytest

from nimblejax.runtime import ffi as nffi

CXX = shutil.which("c++") or shutil.which("g++")
pytestmark = pytest.mark.skipif(CXX is None, reason="no C++ compiler (c++ or g++) on PATH")

EXPORTS = (
    "NimblePlanCall",
    "nimble_ffi_init",
    "nimble_ffi_last_error",
    "nimble_ffi_register",
    "nimble_ffi_reserve_id",
    "nimble_ffi_unregister",
    "nimble_ffi_copy_kernel_source",
    "nimble_ffi_capture_copy_node",
    "nimble_ffi_set_copy_nodes",
    "nimble_ffi_rest",
    "nimble_ffi_set_inplace",
    "nimble_ffi_set_direct",
    "nimble_ffi_set_segments",
    "nimble_ffi_stats",
)


class CopyTable(ctypes.Structure):
    """Host mirror of the handler's CopyTable (passed by value to the kernel)."""

    _fields_ = [
        ("dst", ctypes.c_ulonglong * 160),
        ("src", ctypes.c_ulonglong * 160),
        ("bytes", ctypes.c_ulonglong * 160),
        ("count", ctypes.c_int),
    ]


def _libcuda_loadable() -> bool:
    try:
        ctypes.CDLL("libcuda.so.1")
    except OSError:
        return False
    return True


@pytest.fixture(scope="module")
def cache_dir(tmp_path_factory):
    return tmp_path_factory.mktemp("ffi_cache")


@pytest.fixture(scope="module")
def built(cache_dir):
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # a working compiler must not warn
        path = nffi.build(cache_dir)
    assert path is not None
    return path


@pytest.fixture(scope="module")
def library(built):
    return nffi.FfiLibrary(ctypes.CDLL(str(built)), built)


def test_build_layout_and_reuse(built, cache_dir):
    import jaxlib.version

    assert built.name == "libnimble_ffi.so" and built.is_file()
    assert built.parent.parent == cache_dir
    version, digest = built.parent.name.rsplit("-", 1)
    assert version == jaxlib.version.__version__
    assert re.fullmatch(r"[0-9a-f]{12}", digest)
    mtime = built.stat().st_mtime_ns
    again = nffi.build(cache_dir)
    assert again == built
    assert built.stat().st_mtime_ns == mtime
    assert [p.name for p in built.parent.iterdir()] == ["libnimble_ffi.so"]  # no temp left


def test_exported_symbols(built):
    lib = ctypes.CDLL(str(built))
    for name in EXPORTS:
        assert getattr(lib, name, None) is not None, name


def test_reserved_plan_ids_are_new_and_distinct(library):
    """A custom call may name its plan before the plan is built (a first call building
    its graph while XLA compiles: runtime/placement.py)."""
    ids = [library.reserve_id() for _ in range(3)]
    assert all(i > 0 for i in ids) and ids == sorted(set(ids))


def test_copy_kernel_source(library):
    src = library.copy_kernel_source()
    assert 'extern "C" __global__ void nimble_ffi_copy(CopyTable t)' in src
    assert "uint4" in src  # the 16-byte path


def test_copy_kernel_compiles_with_nvrtc(library):
    nvrtc = pytest.importorskip("cuda.bindings.nvrtc")

    def check(result):
        err, *rest = result
        assert err == nvrtc.nvrtcResult.NVRTC_SUCCESS, err
        return rest[0] if rest else None

    src = library.copy_kernel_source().encode()
    prog = check(nvrtc.nvrtcCreateProgram(src, b"nimble_ffi_copy.cu", 0, [], []))
    try:
        err, = nvrtc.nvrtcCompileProgram(prog, 1, [b"--gpu-architecture=compute_90"])
        if err != nvrtc.nvrtcResult.NVRTC_SUCCESS:
            size = check(nvrtc.nvrtcGetProgramLogSize(prog))
            log = b" " * size
            check(nvrtc.nvrtcGetProgramLog(prog, log))
            pytest.fail(f"NVRTC failed: {log.decode(errors='replace')}")
        size = check(nvrtc.nvrtcGetPTXSize(prog))
        ptx = b" " * size
        check(nvrtc.nvrtcGetPTX(prog, ptx))
    finally:
        check(nvrtc.nvrtcDestroyProgram(prog))
    ptx = ptx.decode(errors="replace")
    assert ".entry nimble_ffi_copy(" in ptx
    # The kernel's by-value parameter must be exactly the handler's struct.
    param = re.search(r"\.param\s+\.align\s+(\d+)\s+\.b8\s+nimble_ffi_copy_param_0\[(\d+)\]", ptx)
    assert param is not None, ptx[:2000]
    assert int(param.group(1)) == ctypes.alignment(CopyTable)
    assert int(param.group(2)) == ctypes.sizeof(CopyTable)


def test_init_without_libcuda_reports_it(library):
    if _libcuda_loadable():
        pytest.skip("libcuda.so.1 is loadable here")
    with pytest.raises(RuntimeError, match="libcuda"):
        library.init()
    with pytest.raises(RuntimeError, match="libcuda"):  # register inits first
        library.register(1, 1, [0], [4], [0], [4])
    library.unregister(12345)  # unknown id: a no-op, not a crash
    with pytest.raises(RuntimeError, match="libcuda"):
        library.capture_copy_node(1, 0, 0)
    with pytest.raises(RuntimeError, match="libcuda"):
        library.set_copy_nodes(1, 0, 1)
    with pytest.raises(RuntimeError, match="libcuda"):
        library.rest(1, 0)
    with pytest.raises(RuntimeError, match="libcuda"):
        library.set_direct(1, 0, 1)


def test_register_validates_lengths(library):
    with pytest.raises(ValueError):
        library.register(1, 1, [0, 8], [4], [], [])


def test_missing_compiler_warns_and_returns_none(tmp_path):
    with pytest.warns(RuntimeWarning, match=r"no C\+\+ compiler.*falls back"):
        assert nffi.build(tmp_path, compiler="/nonexistent/c++") is None
    assert list(tmp_path.iterdir()) == []


def test_failing_compiler_warns_with_stderr(tmp_path):
    fake = tmp_path / "fake-cxx"
    fake.write_text("#!/bin/sh\necho 'fake-cxx: boom' >&2\nexit 3\n")
    fake.chmod(0o755)
    cache = tmp_path / "cache"
    with pytest.warns(RuntimeWarning, match=r"(?s)status 3.*fake-cxx: boom.*falls back"):
        assert nffi.build(cache, compiler=str(fake)) is None
    leftovers = [p for p in cache.rglob("*") if p.is_file()]
    assert leftovers == []  # the temp output was removed


def test_load_registers_target_without_raising(cache_dir, built, monkeypatch):
    import jax
    import jax.numpy as jnp

    # Force a real load in this process (load() caches its first result).
    monkeypatch.setattr(nffi, "_loaded", False)
    monkeypatch.setattr(nffi, "_library", None)
    with warnings.catch_warnings():
        warnings.simplefilter("error", RuntimeWarning)  # registration must not warn
        lib = nffi.load(cache_dir)
    assert isinstance(lib, nffi.FfiLibrary)
    assert lib.path == built and lib.TARGET == nffi.TARGET == "nimble_plan"
    assert nffi.load("/nonexistent/elsewhere") is lib  # cached once per process
    # The CPU path still works after registering a CUDA target.
    assert float(jax.jit(lambda x: x + 1)(jnp.float32(1))) == 2.0

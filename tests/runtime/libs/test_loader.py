"""CPU tests for nimblejax.runtime.libs.loader: library discovery, loading, errors.

Every search here runs against a fake file tree (tmp_path) with the system loader,
cuda.pathfinder and the toolkit roots stubbed out, so the results do not depend on
what this machine has installed.
"""
from __future__ import annotations

import ctypes
import os
import threading
import time

import pytest

from nimblejax.runtime.libs import cublas, cudnn, loader
from nimblejax.runtime.libs.loader import LibraryError, LibraryNotFoundError

OVERRIDES = ("NIMBLEJAX_LIBCUBLAS", "NIMBLEJAX_LIBCUBLASLT", "NIMBLEJAX_LIBCUDNN")


@pytest.fixture
def nothing_installed(monkeypatch, tmp_path):
    """No override, no wheel, no pathfinder hit, no toolkit, nothing on the system
    loader's path. Returns the (empty) fake `nvidia` namespace directory."""
    for var in OVERRIDES + ("CUDA_PATH", "CUDA_HOME"):
        monkeypatch.delenv(var, raising=False)
    nvidia = tmp_path / "nvidia"
    nvidia.mkdir()
    monkeypatch.setattr(loader, "nvidia_namespace_dirs", lambda: [str(nvidia)])
    monkeypatch.setattr(loader, "_pathfinder", lambda name: (f"pathfinder({name})", None))
    monkeypatch.setattr(loader.options, "cuda_roots", lambda: [str(tmp_path / "toolkit")])
    monkeypatch.setattr(loader.ctypes.util, "find_library", lambda name: None)
    return nvidia


def _touch(path) -> str:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(b"")
    return str(path)


# ---------------------------------------------------------------------------
# found
# ---------------------------------------------------------------------------


@pytest.mark.parametrize("name", loader.NAMES)
def test_found_returns_a_bool_on_this_machine(name) -> None:
    assert isinstance(loader.found(name), bool)


def test_found_never_raises(monkeypatch, nothing_installed) -> None:
    assert loader.found("cudnn") is False
    assert loader.found("no-such-library") is False

    def broken():
        raise RuntimeError("search blew up")
        yield  # a generator, like the real steps

    monkeypatch.setitem(loader._STEPS, "cudnn", broken)
    assert loader.found("cudnn") is False


def test_found_loads_nothing(monkeypatch, nothing_installed) -> None:
    _touch(nothing_installed / "cudnn" / "lib" / "libcudnn.so.9")

    def no_loading(*args, **kwargs):
        raise AssertionError("found() must not load a library")

    monkeypatch.setattr(loader.ctypes, "CDLL", no_loading)
    assert loader.found("cudnn") is True
    assert "cudnn" not in loader._loaded


# ---------------------------------------------------------------------------
# find: overrides
# ---------------------------------------------------------------------------


def test_find_honours_the_override(monkeypatch, nothing_installed, tmp_path) -> None:
    path = _touch(tmp_path / "custom" / "libcudnn.so.9")
    monkeypatch.setenv("NIMBLEJAX_LIBCUDNN", path)
    assert loader.find("cudnn") == path
    assert loader.found("cudnn") is True


def test_override_wins_over_the_wheels(monkeypatch, nothing_installed, tmp_path) -> None:
    _touch(nothing_installed / "cu13" / "lib" / "libcublas.so.13")
    path = _touch(tmp_path / "custom" / "libcublas.so.12")
    monkeypatch.setenv("NIMBLEJAX_LIBCUBLAS", path)
    assert loader.find("cublas") == path


def test_override_may_be_a_bare_soname(monkeypatch, nothing_installed) -> None:
    monkeypatch.setenv("NIMBLEJAX_LIBCUDNN", "libcudnn.so.9")
    assert loader.find("cudnn") == "libcudnn.so.9"  # the system loader resolves it


def test_missing_override_file_is_reported_and_the_search_goes_on(monkeypatch, nothing_installed,
                                                                   tmp_path) -> None:
    missing = str(tmp_path / "gone" / "libcudnn.so.9")
    monkeypatch.setenv("NIMBLEJAX_LIBCUDNN", missing)
    with pytest.raises(LibraryNotFoundError) as info:
        loader.find("cudnn")
    assert f"$NIMBLEJAX_LIBCUDNN={missing} (no such file)" in info.value.tried
    wheel = _touch(nothing_installed / "cudnn" / "lib" / "libcudnn.so.9")
    assert loader.find("cudnn") == wheel


# ---------------------------------------------------------------------------
# find: search order
# ---------------------------------------------------------------------------


def test_cublas_prefers_cuda13_in_any_wheel_dir(nothing_installed) -> None:
    _touch(nothing_installed / "cu13" / "lib" / "libcublas.so.12")
    so13 = _touch(nothing_installed / "cublas" / "lib" / "libcublas.so.13")
    assert loader.find("cublas") == so13


def test_cublas_wheel_dirs_in_order(nothing_installed) -> None:
    cu13 = _touch(nothing_installed / "cu13" / "lib" / "libcublas.so.13")
    _touch(nothing_installed / "cublas" / "lib" / "libcublas.so.13")
    assert loader.find("cublas") == cu13


def test_cublas_pathfinder_then_toolkit_then_system(monkeypatch, nothing_installed, tmp_path) -> None:
    toolkit = _touch(tmp_path / "toolkit" / "lib64" / "libcublas.so.12")
    monkeypatch.setattr(loader, "_pathfinder", lambda name: ("pf", "/pf/libcublas.so.13"))
    assert loader.find("cublas") == "/pf/libcublas.so.13"
    monkeypatch.setattr(loader, "_pathfinder", lambda name: ("pf", None))
    assert loader.find("cublas") == toolkit
    os.remove(toolkit)
    monkeypatch.setattr(loader.ctypes.util, "find_library",
                        lambda name: "libcublas.so.12" if name == "cublas" else None)
    assert loader.find("cublas") == "libcublas.so.12"


def test_cublaslt_lives_next_to_cublas(monkeypatch, nothing_installed, tmp_path) -> None:
    _touch(nothing_installed / "cu13" / "lib" / "libcublas.so.13")
    lt = _touch(nothing_installed / "cu13" / "lib" / "libcublasLt.so.13")
    assert loader.find("cublasLt") == lt
    override = _touch(tmp_path / "custom" / "libcublasLt.so.13")
    monkeypatch.setenv("NIMBLEJAX_LIBCUBLASLT", override)
    assert loader.find("cublasLt") == override


def test_lt_path_next_to_libcublas() -> None:
    assert loader.lt_path_from_cublas("/x/lib/libcublas.so.13") == "/x/lib/libcublasLt.so.13"
    assert loader.lt_path_from_cublas("libcublas.so.12") == "libcublasLt.so.12"


def test_cudnn_first_match_in_cudnn_then_cu13(nothing_installed) -> None:
    cu13 = _touch(nothing_installed / "cu13" / "lib" / "libcudnn.so.9")
    assert loader.find("cudnn") == cu13
    first = _touch(nothing_installed / "cudnn" / "lib" / "libcudnn.so.9")
    _touch(nothing_installed / "cudnn" / "lib" / "libcudnn.so.9.24.0")
    assert loader.find("cudnn") == first


# ---------------------------------------------------------------------------
# find: nothing found
# ---------------------------------------------------------------------------


def test_not_found_lists_everything_tried_and_the_fix(nothing_installed) -> None:
    with pytest.raises(LibraryNotFoundError) as info:
        loader.find("cudnn")
    err = info.value
    assert isinstance(err, OSError)
    message = str(err)
    wheel_dirs = [os.path.join(str(nothing_installed), sub, "libcudnn.so.*")
                  for sub in ("cudnn/lib", "cu13/lib")]
    assert list(err.tried) == wheel_dirs + ["ctypes.util.find_library('cudnn')"]
    assert all(t in message for t in err.tried)
    assert "libcudnn not found" in message
    assert "pip install nvidia-cudnn-cu13" in message and "NIMBLEJAX_LIBCUDNN" in message


def test_cublas_not_found_message(nothing_installed, tmp_path) -> None:
    with pytest.raises(LibraryNotFoundError) as info:
        loader.find("cublas")
    message, tried = str(info.value), info.value.tried
    # CUDA 13 soname in every wheel dir first, then pathfinder, toolkit, system loader.
    assert tried[0].endswith("cu13/lib/libcublas.so.13") and tried[1].endswith("cublas/lib/libcublas.so.13")
    assert tried[2].endswith("cu13/lib/libcublas.so.12")
    assert tried[4:] == ("pathfinder(cublas)",
                         str(tmp_path / "toolkit" / "lib64" / "libcublas.so.13"),
                         str(tmp_path / "toolkit" / "lib64" / "libcublas.so.12"),
                         "ctypes.util.find_library('cublas')")
    assert "pip install nvidia-cublas" in message and "NIMBLEJAX_LIBCUBLAS=" in message


def test_cublaslt_not_found_explains_why(nothing_installed) -> None:
    with pytest.raises(LibraryNotFoundError) as info:
        loader.find("cublasLt")
    message = str(info.value)
    assert "next to libcublas, which was not found" in message
    assert "ctypes.util.find_library('cublas')" in message
    assert "NIMBLEJAX_LIBCUBLASLT" in message


def test_no_wheels_installed_is_said(monkeypatch, nothing_installed) -> None:
    monkeypatch.setattr(loader, "nvidia_namespace_dirs", lambda: [])
    with pytest.raises(LibraryNotFoundError, match="no 'nvidia' package installed"):
        loader.find("cudnn")


def test_unknown_library_name() -> None:
    with pytest.raises(ValueError, match="cublas"):
        loader.find("cufft")


# ---------------------------------------------------------------------------
# load
# ---------------------------------------------------------------------------


@pytest.fixture
def fresh_cache(monkeypatch):
    monkeypatch.setattr(loader, "_loaded", {})
    monkeypatch.setattr(loader, "_declared", set())


def test_load_once_per_process_thread_safe(monkeypatch, fresh_cache) -> None:
    opened, declared = [], []

    def fake_open(name):
        opened.append(name)
        time.sleep(0.05)  # let the other threads pile up on the lock
        return object()

    def declare(lib):
        declared.append(lib)

    monkeypatch.setattr(loader, "_open", fake_open)
    results = []
    threads = [threading.Thread(target=lambda: results.append(loader.load("cudnn", declare)))
               for _ in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert opened == ["cudnn"] and len(results) == 8 and len({id(r) for r in results}) == 1
    assert declared == [results[0]]  # once per declare function
    other = []
    loader.load("cudnn", other.append)
    assert other == [results[0]] and opened == ["cudnn"]


def test_load_failure_is_a_not_found_error(monkeypatch, nothing_installed, fresh_cache, tmp_path) -> None:
    bogus = _touch(tmp_path / "custom" / "libcudnn.so.9")  # an empty file: dlopen fails
    monkeypatch.setenv("NIMBLEJAX_LIBCUDNN", bogus)
    with pytest.raises(LibraryNotFoundError, match=f"cannot load {bogus}.*NIMBLEJAX_LIBCUDNN"):
        loader.load("cudnn")
    assert not loader._loaded


def test_cublas_preloads_cublaslt_globally(monkeypatch, nothing_installed, fresh_cache) -> None:
    lib = _touch(nothing_installed / "cu13" / "lib" / "libcublas.so.13")
    lt = _touch(nothing_installed / "cu13" / "lib" / "libcublasLt.so.13")
    calls = []
    monkeypatch.setattr(loader.ctypes, "CDLL", lambda path, mode=0: calls.append((path, mode)) or path)
    assert loader.load("cublas") == lib
    assert calls == [(lt, ctypes.RTLD_GLOBAL), (lib, ctypes.DEFAULT_MODE)]


def test_cudnn_is_loaded_globally(monkeypatch, nothing_installed, fresh_cache) -> None:
    lib = _touch(nothing_installed / "cudnn" / "lib" / "libcudnn.so.9")
    calls = []
    monkeypatch.setattr(loader.ctypes, "CDLL", lambda path, mode=0: calls.append((path, mode)) or path)
    loader.load("cudnn")
    assert calls == [(lib, ctypes.RTLD_GLOBAL)]


# ---------------------------------------------------------------------------
# errors of library calls
# ---------------------------------------------------------------------------


def test_library_errors_share_one_base() -> None:
    assert issubclass(cublas.CublasError, LibraryError) and issubclass(cudnn.CudnnError, LibraryError)
    assert issubclass(LibraryError, RuntimeError)
    cublas.CublasError.check("cublasCreate_v2", 0)  # success: nothing raised
    with pytest.raises(cublas.CublasError) as info:
        cublas.CublasError.check("cublasCreate_v2", 7)
    err = info.value
    assert (err.function, err.status) == ("cublasCreate_v2", 7)
    assert err.status_name == "CUBLAS_STATUS_INVALID_VALUE"
    assert str(err) == "cublasCreate_v2 failed: CUBLAS_STATUS_INVALID_VALUE (7)"
    assert str(cublas.CublasError("f", 99)) == "f failed: CUBLAS_STATUS_UNKNOWN_99 (99)"
    # Without a status the text is the whole message.
    plain = cudnn.CudnnError("no cuDNN algorithm runs this")
    assert str(plain) == "no cuDNN algorithm runs this" and plain.status is None

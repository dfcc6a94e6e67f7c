"""Finding and loading the CUDA libraries nimblejax calls through ctypes.

The one place that knows where libcublas, libcublasLt and libcudnn live, how to load
them, and what to tell the user when they are missing. Library names: "cublas",
"cublasLt", "cudnn".

- `find(name)`: a path (or a soname for the system loader); raises
  `LibraryNotFoundError` listing everything tried and how to fix it.
- `found(name)`: whether `find` succeeds; never raises. For cuDNN it only searches
  files (no library is loaded); for cuBLAS the cuda.pathfinder step loads the library
  it finds, as pathfinder only offers a load.
- `load(name, declare)`: the library, loaded once per process (thread-safe), with
  `declare(lib)` (ctypes prototypes) applied once per `declare`.

Search order, first hit wins ($NIMBLEJAX_LIB... and the toolkit roots come from
`nimblejax.options`, the only module that reads the environment):

- cublas: $NIMBLEJAX_LIBCUBLAS; the NVIDIA pip wheels (nvidia/cu13/lib,
  nvidia/cublas/lib; libcublas.so.13 in every wheel directory before .so.12);
  cuda.pathfinder (what CuPy uses); <root>/lib64 for $CUDA_PATH, $CUDA_HOME,
  /usr/local/cuda; then ctypes.util.find_library. Loading it first loads (globally) the
  libcublasLt of the same directory, so the wheel's RPATH or LD_LIBRARY_PATH is not
  needed.
- cublasLt: $NIMBLEJAX_LIBCUBLASLT; else the libcublasLt next to libcublas, with the
  same soname suffix (so both come from one CUDA release).
- cudnn: $NIMBLEJAX_LIBCUDNN; the NVIDIA pip wheels (nvidia/cudnn/lib, then
  nvidia/cu13/lib: the first libcudnn.so.* in name order); then
  ctypes.util.find_library. Loaded with RTLD_GLOBAL (its sub-libraries resolve
  symbols against it).

An override names a file, or a bare soname the system loader resolves; one naming a
missing file is reported under "tried" and the search goes on.

Library calls report failures through `LibraryError` subclasses (CublasError,
CudnnError), which name their library's statuses.
"""
from __future__ import annotations

import ctypes
import ctypes.util
import glob
import importlib.util
import os
import threading
from typing import Callable, Iterator, Optional

from nimblejax import options

__all__ = ["LibraryError", "LibraryNotFoundError", "NAMES", "find", "found", "load",
           "lt_path_from_cublas"]

NAMES = ("cublas", "cublasLt", "cudnn")

_CUBLAS_SONAMES = ("libcublas.so.13", "libcublas.so.12")  # CUDA 13 preferred
# NVIDIA pip wheel layouts: CUDA 13 wheels share nvidia/cu13/lib, CUDA 12 wheels
# (and the cuDNN wheels) use one directory per library.
_CUBLAS_WHEEL_DIRS = ("cu13/lib", "cublas/lib")
_CUDNN_WHEEL_DIRS = ("cudnn/lib", "cu13/lib")
_CUDNN_PATTERN = "libcudnn.so.*"

_TITLES = {"cublas": "libcublas (.so.13 or .so.12)", "cublasLt": "libcublasLt",
           "cudnn": "libcudnn"}
_FIXES = {
    "cublas": "pip install nvidia-cublas (CUDA 13; nvidia-cublas-cu12 for CUDA 12), install "
              "a CUDA toolkit, or set {var}=/path/to/libcublas.so.13",
    "cublasLt": "libcublasLt ships with cuBLAS: pip install nvidia-cublas (CUDA 13; "
                "nvidia-cublas-cu12 for CUDA 12), or set {var}=/path/to/libcublasLt.so.13",
    "cudnn": "pip install nvidia-cudnn-cu13 (nvidia-cudnn-cu12 for CUDA 12), or set "
             "{var}=/path/to/libcudnn.so.9",
}


# ---------------------------------------------------------------------------
# Errors
# ---------------------------------------------------------------------------


class LibraryNotFoundError(OSError):
    """A library could not be found or loaded. `tried`: every place searched."""

    def __init__(self, message: str, tried: tuple[str, ...] = ()) -> None:
        super().__init__(message)
        self.tried = tuple(tried)


class LibraryError(RuntimeError):
    """A library call failed: `function` returned `status` (named by `name_of`).

    With no status, `function` is the whole message (a failure that is not one call's
    status, e.g. "no algorithm runs this problem"). Subclasses override `name_of`.
    """

    def __init__(self, function: str, status: Optional[int] = None) -> None:
        self.function = function
        self.status = status
        self.status_name = None if status is None else self.name_of(status)
        super().__init__(function if status is None
                         else f"{function} failed: {self.status_name} ({status})")

    @classmethod
    def name_of(cls, status: int) -> str:
        return f"status {status}"

    @classmethod
    def check(cls, function: str, status: int) -> None:
        """Raise `cls(function, status)` unless status is 0 (success in every library)."""
        if status != 0:
            raise cls(function, status)


# ---------------------------------------------------------------------------
# Search
# ---------------------------------------------------------------------------

# A search step: (what was tried, for the error message; the hit, or None).
_Step = tuple[str, Optional[str]]


def nvidia_namespace_dirs() -> list[str]:
    # `nvidia` is a namespace package spread over site-packages; find_spec imports
    # nothing and returns every portion of it.
    try:
        spec = importlib.util.find_spec("nvidia")
    except (ImportError, ValueError):
        return []
    if spec is None or spec.submodule_search_locations is None:
        return []
    return list(spec.submodule_search_locations)


def _file(path: str) -> _Step:
    return path, (path if os.path.exists(path) else None)


def _no_wheels() -> _Step:
    return "NVIDIA pip wheels (no 'nvidia' package installed)", None


def _system(name: str) -> _Step:
    return f"ctypes.util.find_library({name!r})", ctypes.util.find_library(name)


def _pathfinder(name: str) -> _Step:
    what = f"cuda.pathfinder.load_nvidia_dynamic_lib({name!r})"
    try:
        from cuda.pathfinder import load_nvidia_dynamic_lib
    except ImportError:
        return what + " (cuda-pathfinder not installed)", None
    try:
        # Loads libcublasLt too; pathfinder caches the handle and it must never be
        # closed, so only the path is kept.
        return what, load_nvidia_dynamic_lib(name).abs_path or None
    except Exception:  # pathfinder raises several not-found error types
        return what, None


def _cublas_steps() -> Iterator[_Step]:
    roots = nvidia_namespace_dirs()
    if not roots:
        yield _no_wheels()
    for soname in _CUBLAS_SONAMES:  # the CUDA 13 soname everywhere before CUDA 12's
        for root in roots:
            for sub in _CUBLAS_WHEEL_DIRS:
                yield _file(os.path.join(root, sub, soname))
    yield _pathfinder("cublas")
    for root in options.cuda_roots():
        for soname in _CUBLAS_SONAMES:
            yield _file(os.path.join(root, "lib64", soname))
    yield _system("cublas")


def lt_path_from_cublas(path: str) -> str:
    """libcublasLt lives next to libcublas with the same soname suffix."""
    directory, name = os.path.split(path)
    return os.path.join(directory, name.replace("libcublas.", "libcublasLt.", 1))


def _cublaslt_steps() -> Iterator[_Step]:
    try:
        cublas = find("cublas")
    except LibraryNotFoundError as exc:
        yield "libcublasLt next to libcublas, which was not found (tried: " + \
            "; ".join(exc.tried) + ")", None
        return
    lt = lt_path_from_cublas(cublas)
    yield lt, (lt if not os.path.dirname(lt) or os.path.exists(lt) else None)


def _cudnn_steps() -> Iterator[_Step]:
    roots = nvidia_namespace_dirs()
    if not roots:
        yield _no_wheels()
    for root in roots:
        for sub in _CUDNN_WHEEL_DIRS:
            pattern = os.path.join(root, sub, _CUDNN_PATTERN)
            hits = sorted(glob.glob(pattern))
            yield pattern, (hits[0] if hits else None)
    yield _system("cudnn")


_STEPS: dict[str, Callable[[], Iterator[_Step]]] = {
    "cublas": _cublas_steps, "cublasLt": _cublaslt_steps, "cudnn": _cudnn_steps}


def _fix(name: str) -> str:
    return _FIXES[name].format(var=options.LIBRARY_OVERRIDES[name])


def find(name: str) -> str:
    """A path (or soname for the system loader) for library `name`; see the module
    docstring for the search order. Raises LibraryNotFoundError when nothing is found."""
    if name not in _STEPS:
        raise ValueError(f"unknown library {name!r}; expected one of {NAMES}")
    tried: list[str] = []
    override = options.library_override(name)
    if override:
        if os.path.exists(override) or not os.path.dirname(override):
            return override
        tried.append(f"${options.LIBRARY_OVERRIDES[name]}={override} (no such file)")
    for what, hit in _STEPS[name]():
        if hit:
            return hit
        tried.append(what)
    raise LibraryNotFoundError(
        f"{_TITLES[name]} not found. Tried: {'; '.join(tried)}. To fix: {_fix(name)}.",
        tuple(tried))


def found(name: str) -> bool:
    """Whether `find(name)` succeeds. Never raises."""
    try:
        find(name)
        return True
    except Exception:
        return False


# ---------------------------------------------------------------------------
# Loading
# ---------------------------------------------------------------------------

_loaded: dict[str, ctypes.CDLL] = {}
_declared: set[tuple[str, Callable]] = set()
_lock = threading.RLock()


def _preload_cublaslt(path: str) -> None:
    # libcublas depends on libcublasLt from the same directory; loading it first
    # (globally) avoids relying on the wheel's RPATH or LD_LIBRARY_PATH.
    if not os.path.dirname(path):
        return
    lt_path = lt_path_from_cublas(path)
    if os.path.exists(lt_path):
        ctypes.CDLL(lt_path, mode=ctypes.RTLD_GLOBAL)


def _open(name: str) -> ctypes.CDLL:
    path = find(name)
    try:
        if name == "cublas":
            _preload_cublaslt(path)
        mode = ctypes.RTLD_GLOBAL if name == "cudnn" else ctypes.DEFAULT_MODE
        return ctypes.CDLL(path, mode=mode)
    except OSError as exc:
        raise LibraryNotFoundError(f"cannot load {path}: {exc}. To fix: {_fix(name)}.",
                                   (path,)) from exc


def load(name: str, declare: Optional[Callable[[ctypes.CDLL], None]] = None) -> ctypes.CDLL:
    """Library `name`, loaded on first use (never at import) and cached per process.

    `declare(lib)` sets the caller's ctypes prototypes; it runs once per function
    object, under the same lock, before any caller passing it gets the library.
    """
    with _lock:
        lib = _loaded.get(name)
        if lib is None:
            lib = _open(name)
            _loaded[name] = lib
        if declare is not None and (name, declare) not in _declared:
            declare(lib)
            _declared.add((name, declare))
        return lib

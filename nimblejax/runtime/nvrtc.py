"""NVRTC through ctypes: a generated kernel's source to a cubin without importing CuPy.

Why: a cold first call imported CuPy (0.15 to 0.18 s on the GPU machine) before its
plan's kernels could start compiling, since they compiled through CuPy's
`compile_using_nvrtc`. Called here, NVRTC starts as soon as the plan is made, on the
compile threads (ctypes releases the GIL), while the main thread imports CuPy for the
graph build. The library is the one CuPy loads (cuda.pathfinder's libnvrtc), the
options the ones CuPy's compile passes for a cubin (`-arch=sm_XX`, every function a
device function by default, the header folders that make <cuda_fp16.h> resolve), so a
kernel compiles alike both ways; runtime/compile.py falls back to CuPy's compile where
this one cannot load NVRTC or refuses a source CuPy's compile takes.
"""
from __future__ import annotations

import ctypes
import functools
import os
import sys
from typing import Optional

from nimblejax import options

SUCCESS = 0
CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MAJOR, CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MINOR = 75, 76
# CuPy's compile adds these to a caller's options (cupy/cuda/compiler.py, CuPy 14.2);
# --pch (automatic precompiled headers) from NVRTC 12.8 on.
DEFAULT_OPTIONS = ("--device-as-default-execution-space",)
PCH_SINCE = (12, 8)


COMPILATION_ERROR = 6  # NVRTC_ERROR_COMPILATION: the source has errors (the log says which)


class NvrtcError(RuntimeError):
    """NVRTC refused a source (`log` holds its messages) or failed otherwise (`status`)."""

    def __init__(self, message: str, log: str = "", status: int = 0) -> None:
        super().__init__(message + (f"\n{log}" if log else ""))
        self.log, self.status = log, status


@functools.lru_cache(maxsize=1)
def library() -> Optional[ctypes.CDLL]:
    """libnvrtc as CuPy finds it (cuda.pathfinder), with its prototypes; None where it
    cannot be found or loaded."""
    try:
        from cuda.pathfinder import load_nvidia_dynamic_lib

        lib = ctypes.CDLL(load_nvidia_dynamic_lib("nvrtc").abs_path)
    except Exception:  # no pathfinder, no library: CuPy's compile is the way
        return None
    p, size, cstr = ctypes.c_void_p, ctypes.c_size_t, ctypes.c_char_p
    for name, args in (("nvrtcVersion", [ctypes.POINTER(ctypes.c_int)] * 2),
                       ("nvrtcCreateProgram", [ctypes.POINTER(p), cstr, cstr, ctypes.c_int, p, p]),
                       ("nvrtcCompileProgram", [p, ctypes.c_int, ctypes.POINTER(cstr)]),
                       ("nvrtcGetCUBINSize", [p, ctypes.POINTER(size)]),
                       ("nvrtcGetCUBIN", [p, ctypes.c_char_p]),
                       ("nvrtcGetPTXSize", [p, ctypes.POINTER(size)]),
                       ("nvrtcGetPTX", [p, ctypes.c_char_p]),
                       ("nvrtcGetProgramLogSize", [p, ctypes.POINTER(size)]),
                       ("nvrtcGetProgramLog", [p, ctypes.c_char_p]),
                       ("nvrtcDestroyProgram", [ctypes.POINTER(p)])):
        fn = getattr(lib, name)
        fn.argtypes, fn.restype = args, ctypes.c_int
    return lib


@functools.lru_cache(maxsize=1)
def version() -> tuple:
    """(major, minor) of the library `compile_cubin` uses."""
    major, minor = ctypes.c_int(), ctypes.c_int()
    _check(library().nvrtcVersion(ctypes.byref(major), ctypes.byref(minor)), "nvrtcVersion")
    return major.value, minor.value


def full_options(options: tuple, arch: str) -> tuple:
    """`options` as CuPy's compile passes them for a cubin of compute capability `arch`
    ("90"): its defaults, the architecture and the header folders."""
    pch = ("--pch",) if version() >= PCH_SINCE else ()
    return (tuple(f"-I{d}" for d in include_dirs()) + tuple(options) + (f"-arch=sm_{arch}",)
            + DEFAULT_OPTIONS + pch)


def compile_cubin(code: str, options: tuple, arch: str, name: str = "kern.cu") -> bytes:
    """The cubin of `code` for compute capability `arch`, with the options CuPy's compile
    adds (`full_options`); NvrtcError with NVRTC's log where the source does not compile."""
    return compile_program(code, full_options(options, arch), name)


def compile_program(code: str, options: tuple, name: str = "kern.cu", ptx: bool = False):
    """`code` compiled with `options` as they are: its cubin (bytes), or with `ptx` its
    PTX text (testing/nvrtc_check.py); NvrtcError where NVRTC refuses it."""
    lib = library()
    prog = ctypes.c_void_p()
    _check(lib.nvrtcCreateProgram(ctypes.byref(prog), code.encode(), name.encode(), 0, None, None),
           "nvrtcCreateProgram")
    try:
        opts = [o.encode() for o in options]
        status = lib.nvrtcCompileProgram(prog, len(opts), (ctypes.c_char_p * len(opts))(*opts))
        if status != SUCCESS:
            raise NvrtcError(f"NVRTC could not compile {name} (status {status})", _log(lib, prog), status)
        get_size, get = (lib.nvrtcGetPTXSize, lib.nvrtcGetPTX) if ptx else (lib.nvrtcGetCUBINSize, lib.nvrtcGetCUBIN)
        size = ctypes.c_size_t()
        _check(get_size(prog, ctypes.byref(size)), "nvrtcGetPTXSize" if ptx else "nvrtcGetCUBINSize")
        out = ctypes.create_string_buffer(size.value)
        _check(get(prog, out), "nvrtcGetPTX" if ptx else "nvrtcGetCUBIN")
        return out.value.decode() if ptx else out.raw
    finally:
        lib.nvrtcDestroyProgram(ctypes.byref(prog))


def _log(lib: ctypes.CDLL, prog: ctypes.c_void_p) -> str:
    size = ctypes.c_size_t()
    if lib.nvrtcGetProgramLogSize(prog, ctypes.byref(size)) != SUCCESS:
        return ""
    text = ctypes.create_string_buffer(size.value)
    lib.nvrtcGetProgramLog(prog, text)
    return text.value.decode(errors="replace")


def _check(status: int, call: str) -> None:
    if status != SUCCESS:
        raise NvrtcError(f"{call} failed with NVRTC status {status}")


# ---- the header folders -----------------------------------------------------------------
def _nvidia_wheel_include_dirs() -> list[str]:
    # CUDA 13 wheels put headers in nvidia/cu13/include; CUDA 12 wheels in
    # nvidia/cuda_runtime/include.
    from nimblejax.runtime.libs.loader import nvidia_namespace_dirs

    return [
        os.path.join(root, sub, "include")
        for root in nvidia_namespace_dirs()
        for sub in ("cu13", "cuda_runtime")
    ]


def _pathfinder_include_dir() -> str | None:
    try:
        from cuda.pathfinder import find_nvidia_header_directory
    except ImportError:
        return None
    try:
        return find_nvidia_header_directory("cudart")
    except Exception:  # unsupported name on older pathfinder versions
        return None


def _candidate_include_dirs() -> list[str]:
    candidates = _nvidia_wheel_include_dirs()
    found = _pathfinder_include_dir()
    if found:
        candidates.append(found)
    candidates += [os.path.join(root, "include") for root in options.cuda_roots()]
    return candidates


@functools.lru_cache(maxsize=1)
def include_dirs() -> tuple[str, ...]:
    """Directories that make <cuda_fp16.h> / <cuda_bf16.h> resolve.

    NVRTC ships no CUDA headers of its own, so the first directory holding
    cuda_fp16.h is used (plus its cccl/ subdirectory when present, which
    CUDA 13 headers may reach for). Empty when none is found.
    """
    for directory in _candidate_include_dirs():
        if os.path.isfile(os.path.join(directory, "cuda_fp16.h")):
            dirs = [directory]
            cccl = os.path.join(directory, "cccl")
            if os.path.isdir(cccl):
                dirs.append(cccl)
            return tuple(dirs)
    return ()


# ---- the device NVRTC compiles for ------------------------------------------------------
def current_arch() -> str:
    """The compute capability kernels are compiled for ("90"): CuPy's current device's
    where CuPy is imported, else device 0's (CuPy's default), asked of the driver: a cold
    first call's kernels start compiling before CuPy is imported."""
    try:
        return sys.modules["cupy"].cuda.Device().compute_capability
    except (KeyError, AttributeError):  # not imported, or being imported on another thread
        pass
    arch = _driver_arch(0)
    if arch is None:
        import cupy

        return cupy.cuda.Device().compute_capability
    return arch


def driver_device_count() -> int:
    """GPUs the CUDA driver sees (CUDA_VISIBLE_DEVICES applied); 0 without a driver, or
    with one older than the CUDA release CuPy's wheel was built for (cupy-cuda13x: 13.0),
    which CuPy could not use."""
    drv = _driver()
    count = ctypes.c_int()
    if not _recent_enough(drv) or drv.cuDeviceGetCount(ctypes.byref(count)) != SUCCESS:
        return 0
    return count.value


def driver_present() -> bool:
    """Whether a CUDA driver as recent as CuPy's CUDA release is installed, asked without
    initializing it: the driver reads CUDA_VISIBLE_DEVICES when it initializes, which
    this leaves to the program."""
    return _recent_enough(_libcuda())


def _recent_enough(drv) -> bool:
    """Whether libcuda `drv` (None: none) is as recent as CuPy's CUDA release
    (cuDriverGetVersion needs no cuInit)."""
    version = ctypes.c_int()
    return (drv is not None and drv.cuDriverGetVersion(ctypes.byref(version)) == SUCCESS
            and version.value >= cupy_cuda_release())


@functools.lru_cache(maxsize=1)
def cupy_cuda_release() -> int:
    """The CUDA release CuPy's wheel needs, as the driver reports versions (13000 for
    cupy-cuda13x); 0 where that is not known (a CuPy built from source)."""
    from importlib import metadata

    for major in (13, 12, 11):
        try:
            metadata.version(f"cupy-cuda{major}x")
        except metadata.PackageNotFoundError:
            continue
        return major * 1000
    return 0


@functools.lru_cache(maxsize=None)
def _driver_arch(ordinal: int) -> Optional[str]:
    drv = _driver()
    dev, major, minor = ctypes.c_int(), ctypes.c_int(), ctypes.c_int()
    if (drv is None or drv.cuDeviceGet(ctypes.byref(dev), ordinal) != SUCCESS
            or drv.cuDeviceGetAttribute(ctypes.byref(major), CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MAJOR, dev)
            or drv.cuDeviceGetAttribute(ctypes.byref(minor), CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MINOR, dev)):
        return None
    return f"{major.value}{minor.value}"


@functools.lru_cache(maxsize=1)
def _libcuda() -> Optional[ctypes.CDLL]:
    """libcuda, loaded and not initialized; None where there is no driver."""
    try:
        return ctypes.CDLL("libcuda.so.1")
    except OSError:
        return None


@functools.lru_cache(maxsize=1)
def _driver() -> Optional[ctypes.CDLL]:
    """libcuda, initialized; None where there is no driver or it does not initialize."""
    drv = _libcuda()
    return drv if drv is not None and drv.cuInit(0) == SUCCESS else None

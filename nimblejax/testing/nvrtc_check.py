"""Compile generated CUDA C++ to PTX without a GPU, to catch codegen errors early.

NVRTC (runtime/nvrtc.py, the library the runtime compiles with) is preferred because it
builds the same source on the GPU machine; `nvcc -ptx` is the fallback. Neither
needs a device or a driver. Options mirror CuPy's RawModule defaults (no
`-default-device`), so a kernel that passes here also compiles there: every
helper function must be marked `__device__` explicitly.
"""

from __future__ import annotations

import functools
import os
import re
import shutil
import subprocess
import tempfile

from nimblejax import options
from nimblejax.runtime import nvrtc
from nimblejax.runtime.nvrtc import include_dirs

__all__ = [
    "KernelCompileError",
    "available_compiler",
    "available_compilers",
    "compile_to_ptx",
    "include_dirs",
]

# Forces a backend ('nvrtc' or 'nvcc'); useful to reproduce a fallback path.
_ENV_COMPILER = "NIMBLEJAX_KERNEL_COMPILER"
_CONTEXT_LINES = 3
_MAX_LOCATIONS = 5
_NVCC_TIMEOUT_S = 300


class KernelCompileError(RuntimeError):
    """A kernel failed to compile; the message holds the log and source lines."""

    def __init__(self, name: str, compiler: str, log: str, source: str) -> None:
        self.name = name
        self.compiler = compiler
        self.log = log
        self.source = source
        self.lines = _error_lines(log, _file_name(name))
        excerpt = _excerpt(source, self.lines)
        message = f"{compiler} failed to compile kernel source {name!r}:\n{log.strip()}"
        if excerpt:
            message += "\n\nsource around the error:\n" + excerpt
        super().__init__(message)


# ---------------------------------------------------------------------------
# Error reporting
# ---------------------------------------------------------------------------


def _file_name(name: str) -> str:
    # The name becomes a file name (nvcc) and shows up in the log; keep it safe.
    return re.sub(r"[^A-Za-z0-9_.-]", "_", name) + ".cu"


def _error_lines(log: str, file_name: str) -> list[int]:
    """Line numbers of errors reported against our source (not headers)."""
    pattern = re.compile(
        rf"(?:^|[/\\\s]){re.escape(file_name)}\((\d+)\): (?:catastrophic )?error",
        re.MULTILINE,
    )
    seen: list[int] = []
    for match in pattern.finditer(log):
        line = int(match.group(1))
        if line not in seen:
            seen.append(line)
    return seen[:_MAX_LOCATIONS]


def _excerpt(source: str, lines: list[int]) -> str:
    """Numbered source lines around each error, the error line marked '>>'."""
    src = source.splitlines()
    shown: set[int] = set()
    for line in lines:
        lo, hi = max(1, line - _CONTEXT_LINES), min(len(src), line + _CONTEXT_LINES)
        shown.update(range(lo, hi + 1))
    width = len(str(max(shown, default=1)))
    out: list[str] = []
    previous = 0
    for number in sorted(shown):
        if previous and number != previous + 1:
            out.append("   ...")
        marker = ">>" if number in lines else "  "
        out.append(f"{marker} {number:>{width}} | {src[number - 1]}")
        previous = number
    return "\n".join(out)


# ---------------------------------------------------------------------------
# Backends
# ---------------------------------------------------------------------------


def _nvrtc() -> bool:
    """Whether libnvrtc loads (runtime/nvrtc.py, the library the runtime compiles with)."""
    return nvrtc.library() is not None


@functools.lru_cache(maxsize=1)
def _nvcc_path() -> str | None:
    found = shutil.which("nvcc")
    if found:
        return found
    try:
        from cuda.pathfinder import find_nvidia_binary_utility

        found = find_nvidia_binary_utility("nvcc")
    except Exception:
        found = None
    if found:
        return found
    for root in options.cuda_roots():
        if root and os.access(os.path.join(root, "bin", "nvcc"), os.X_OK):
            return os.path.join(root, "bin", "nvcc")
    return None


def available_compilers() -> tuple[str, ...]:
    """Every usable backend, preferred first."""
    found = []
    if _nvrtc():
        found.append("nvrtc")
    if _nvcc_path() is not None:
        found.append("nvcc")
    return tuple(found)


def available_compiler() -> str | None:
    """The backend compile_to_ptx will use: 'nvrtc', 'nvcc' or None."""
    forced = options.env_value(_ENV_COMPILER)
    compilers = available_compilers()
    if forced:
        return forced if forced in compilers else None
    return compilers[0] if compilers else None


def _options(arch: str, options: tuple[str, ...]) -> list[str]:
    opts = [f"--gpu-architecture={arch}"]
    # Respect a caller-chosen standard instead of passing two.
    if not any(o.startswith(("--std", "-std")) for o in options):
        opts.append("--std=c++17")
    opts.extend(options)
    # Ours go last so caller -I directories win.
    opts.extend(f"-I{d}" for d in include_dirs())
    return opts


def _compile_nvrtc(source: str, name: str, opts: list[str]) -> str:
    try:
        return nvrtc.compile_program(source, tuple(opts), _file_name(name), ptx=True)
    except nvrtc.NvrtcError as e:  # bad options and the like: the status, then the log
        log = e.log if e.status == nvrtc.COMPILATION_ERROR else f"status {e.status}\n{e.log}"
        raise KernelCompileError(name, "nvrtc", log, source) from None


def _compile_nvcc(source: str, name: str, opts: list[str]) -> str:
    nvcc = _nvcc_path()
    assert nvcc is not None
    with tempfile.TemporaryDirectory(prefix="nimblejax-nvcc-") as tmp:
        src_path = os.path.join(tmp, _file_name(name))
        ptx_path = os.path.join(tmp, "out.ptx")
        with open(src_path, "w") as f:
            f.write(source)
        cmd = [nvcc, "-ptx", *opts, "-o", ptx_path, src_path]
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=_NVCC_TIMEOUT_S)
        if proc.returncode != 0:
            # Drop the throwaway temp path so logs read like NVRTC's.
            log = (proc.stderr + proc.stdout).replace(src_path, _file_name(name))
            raise KernelCompileError(name, "nvcc", log, source)
        with open(ptx_path) as f:
            return f.read()


# `-Ofast-compile=max` (CUDA 12.8 and later, NVRTC and nvcc alike).
FAST_OPTIONS = ("-Ofc=max",)


@functools.cache
def _fast_options(backend: str) -> tuple[str, ...]:
    """FAST_OPTIONS where `backend` takes them, else none (an older compiler)."""
    probe = 'extern "C" __global__ void nimble_probe(float* x) { x[0] = 1.0f; }\n'
    try:
        compile_to_ptx(probe, "nimble_probe", options=FAST_OPTIONS, compiler=backend)
    except (KernelCompileError, RuntimeError, subprocess.SubprocessError):
        return ()
    return FAST_OPTIONS


def compile_to_ptx(
    source: str,
    name: str,
    arch: str = "sm_90",
    options: tuple[str, ...] = (),
    *,
    compiler: str | None = None,
    fast: bool = False,
) -> str:
    """Compile CUDA C++ `source` to PTX text; raise KernelCompileError on failure.

    `compiler` picks 'nvrtc' or 'nvcc' explicitly; by default the preferred
    available one (see available_compiler()). `fast` is for a check that the source
    compiles, where the PTX itself is not read: it adds FAST_OPTIONS where the compiler
    takes them (the front end and PTX generation run as before, with fewer of NVVM's
    optimizations: the test suite's 694 kernels in one unit, 87 s → 39 s).
    """
    backend = compiler or available_compiler()
    if backend is None:
        raise RuntimeError(
            "no CUDA compiler: install the 'nvidia-cuda-nvrtc' wheel or put nvcc on PATH"
        )
    if backend not in available_compilers():
        raise RuntimeError(f"compiler {backend!r} is not available here")
    opts = _options(arch, tuple(options) + (_fast_options(backend) if fast else ()))
    if backend == "nvrtc":
        return _compile_nvrtc(source, name, opts)
    return _compile_nvcc(source, name, opts)

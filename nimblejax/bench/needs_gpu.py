"""One check for the programs that only make sense on a GPU (examples/gpu/, the
benchmarks that time kernels): a clear message and exit status 1 where no CUDA GPU is
usable, instead of a CUDA error from deep inside a library.

    from nimblejax.bench.needs_gpu import require_gpu
    require_gpu(__file__)          # first thing, before anything touches CUDA
"""
from __future__ import annotations

import ctypes
import os
import sys
from typing import Optional

INSTEAD = ("Without a GPU: the examples in examples/ run on the CPU with "
           "nimble.jit(f, backend='interpret'), `nimble.explain(f, *args)` prints one plan, "
           "and `python -m nimblejax.bench` prints nimble's plan of every model.")

# CUDA runtime errors that mean "there is no GPU here" rather than a broken one. Without
# any driver CuPy's runtime says cudaErrorInsufficientDriver, which reads as if an old
# driver were installed: gpu_problem looks for the driver library first.
_NO_DEVICE = ("cudaErrorNoDevice",)


def gpu_problem() -> Optional[str]:
    """None where a CUDA GPU is usable, else one line saying why not."""
    if not _driver_loadable():
        return "no GPU is visible: the NVIDIA driver (libcuda.so.1) is not installed here"
    try:
        import cupy
    except Exception as e:  # noqa: BLE001 - not installed, or a broken install
        return f"CuPy cannot be imported: {type(e).__name__}: {_first_line(e)}"
    try:
        count = cupy.cuda.runtime.getDeviceCount()
    except Exception as e:  # noqa: BLE001 - an old driver, no device
        return runtime_reason(f"{type(e).__name__}: {_first_line(e)}")
    if count < 1:
        return runtime_reason("cudaErrorNoDevice")
    return None


def runtime_reason(error: str) -> str:
    """The CUDA runtime's error, said as what it means for the user."""
    if any(name in error for name in _NO_DEVICE):
        return ("no GPU is visible: the NVIDIA driver reports no device (is "
                "CUDA_VISIBLE_DEVICES hiding them?)")
    if "cudaErrorInsufficientDriver" in error:
        return ("the NVIDIA driver is too old for CuPy's CUDA runtime (CUDA 13 needs driver "
                "580 or newer)")
    return error


def require_gpu(script: str, instead: str = INSTEAD) -> None:
    """Exit with status 1 and a message naming `script` where no CUDA GPU is usable."""
    problem = gpu_problem()
    if problem is None:
        return
    sys.stdout.flush()
    raise SystemExit(f"{script_name(script)} needs an NVIDIA GPU with a working CUDA driver "
                     f"({problem}).\n{instead}")


def script_name(script: str) -> str:
    """`script` as the user would type it: relative to the working folder when inside it
    (examples/gpu/x.py from the repository root), else its last two path parts."""
    path = os.path.abspath(script)
    rel = os.path.relpath(path)
    if not rel.startswith(os.pardir):
        return rel
    return os.path.join(os.path.basename(os.path.dirname(path)), os.path.basename(path))


def _driver_loadable() -> bool:
    """Whether the CUDA driver library can be loaded (it is what a GPU needs first)."""
    names = ("nvcuda.dll",) if os.name == "nt" else ("libcuda.so.1", "libcuda.so")
    for name in names:
        try:
            ctypes.CDLL(name)
            return True
        except OSError:
            continue
    return False


def _first_line(e: BaseException) -> str:
    lines = str(e).strip().splitlines()
    return lines[0] if lines else type(e).__name__

"""One check for the programs that only make sense on a GPU (the examples, the
benchmarks that time kernels): a clear message and exit status 1 where no CUDA GPU is
usable, instead of a CUDA error from deep inside a library.

    from nimblejax.bench.needs_gpu import require_gpu
    require_gpu(__file__)          # first thing, before anything touches CUDA
"""
from __future__ import annotations

import os
import sys
from typing import Optional

INSTEAD = ("Without a GPU: `python -m nimblejax.bench` prints nimble's plan of every model, "
           "`nimble.explain(f, *args)` prints one plan, and nimble.jit(f, backend='interpret') "
           "runs a plan on the CPU.")


def gpu_problem() -> Optional[str]:
    """None where a CUDA GPU is usable, else one line saying why not."""
    try:
        import cupy
    except Exception as e:  # noqa: BLE001 - not installed, or a broken install
        return f"CuPy cannot be imported: {type(e).__name__}: {_first_line(e)}"
    try:
        count = cupy.cuda.runtime.getDeviceCount()
    except Exception as e:  # noqa: BLE001 - no driver, an old driver, no device
        return f"{type(e).__name__}: {_first_line(e)}"
    if count < 1:
        return "the CUDA driver reports no device"
    return None


def require_gpu(script: str, instead: str = INSTEAD) -> None:
    """Exit with status 1 and a message naming `script` where no CUDA GPU is usable."""
    problem = gpu_problem()
    if problem is None:
        return
    name = os.path.join(os.path.basename(os.path.dirname(os.path.abspath(script))),
                        os.path.basename(script))
    sys.stdout.flush()
    raise SystemExit(f"{name} needs an NVIDIA GPU with a working CUDA driver, and none is usable "
                     f"here ({problem}).\n{instead}")


def _first_line(e: BaseException) -> str:
    lines = str(e).strip().splitlines()
    return lines[0] if lines else type(e).__name__

"""Compile a plan's generated kernels with CuPy (NVRTC, disk-cached by CuPy).

Identical sources are compiled once per process. A plan's new kernels are compiled in a
few modules, each holding several kernels, on parallel threads: NVRTC parses the headers
every kernel includes (cuda_fp16.h, cuda_bf16.h) once per module instead of once per
kernel, and it releases the GIL while it compiles, so the modules build side by side.
Measured with NVRTC on CI's CPU (source to PTX, `--std=c++17`): ResNet-50's 43 kernels
take 0.77 s as one module against 2.4 s one by one, BERT's 37 kernels 0.68 s against
1.8 s; on the GPU machine (to SASS, 16 cores) ResNet-50's one module took 2.2 s of its
first call. Where a module does not compile (two kernels defining one helper, say), each
of its kernels is compiled alone, with a progress bar when that takes longer than a second.
"""
from __future__ import annotations

import os
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Iterable

from nimblejax.compiler.lowering.task import Kernel

# sqrtf as XLA's kernels compute it: libdevice's approximate square root (sqrt.approx.f32,
# subnormals kept; XLA leaves libdevice's __CUDA_PREC_SQRT unset). Measured on an H200
# (examples/gpu/probe_unary_bits.py): the IEEE sqrt differed from jax.jit's on 97,969 of
# 1.1M inputs, sqrt.approx.f32 on none. Division, erf and tanh: compiler/lowering/xla_math.py.
OPTIONS = ("--std=c++17", "--prec-sqrt=false")
MAX_THREADS = 8  # NVRTC scales to about this many on the GPU machine's 16 cores
MIN_KERNELS_PER_MODULE = 4  # fewer: the header parse costs more than the thread saves,
MIN_MODULE_BYTES = 4096  # unless they are this much source: NVRTC parses the headers in
# about 0.04 s, and compiles a kernel of 8 KB (an LSTM step's gates) in about 0.3 s
# (CI's CPU, to SASS): the suite's LSTM at batch 1, 4 kernels of 23 KB, 0.81 s as one
# module, 0.33 s for the largest alone
_modules: dict[str, object] = {}  # source → cupy.RawModule, shared by every plan


def compile_kernels(kernels: Iterable[Kernel]) -> dict[str, object]:
    """name → cupy function for each kernel."""
    unique = {k.source: k for k in kernels}
    todo = [src for src in unique if src not in _modules]
    if todo:
        _compile_modules(module_split(todo, threads()))
    return {k.name: _modules[k.source].get_function(k.name) for k in unique.values()}


def threads() -> int:
    return max(1, min(MAX_THREADS, os.cpu_count() or 1))


def module_split(sources: list[str], threads: int) -> list[list[str]]:
    """`sources` dealt into at most `threads` modules, each of at least
    MIN_KERNELS_PER_MODULE kernels or MIN_MODULE_BYTES of source (one module where
    there is little), largest first so that the modules come out about equal in size."""
    enough = max(len(sources) // MIN_KERNELS_PER_MODULE, sum(map(len, sources)) // MIN_MODULE_BYTES)
    count = max(1, min(threads, len(sources), enough))
    modules: list[list[str]] = [[] for _ in range(count)]
    sizes = [0] * count
    for src in sorted(sources, key=len, reverse=True):
        i = sizes.index(min(sizes))
        modules[i].append(src)
        sizes[i] += len(src)
    return modules


def _compile_modules(modules: list[list[str]]) -> None:
    """Each module on its own thread, on the caller's device; a module NVRTC refuses is
    compiled kernel by kernel afterwards, on this thread."""
    import cupy

    device = cupy.cuda.Device().id

    def build(sources: list[str]) -> bool:
        with cupy.cuda.Device(device):
            return _compile_together(sources)

    if len(modules) == 1:  # no thread for one module
        built = [_compile_together(modules[0])]
    else:
        with ThreadPoolExecutor(len(modules), thread_name_prefix="nimblejax-nvrtc") as pool:
            built = list(pool.map(build, modules))
    for sources, ok in zip(modules, built):
        if not ok:
            _compile_each(sources)


def _compile_together(sources: list[str]) -> bool:
    """Compile `sources` as one module; False where NVRTC refuses the whole."""
    import cupy

    module = cupy.RawModule(code="\n".join(sources), options=OPTIONS)
    try:
        module.compile()
    except cupy.cuda.compiler.CompileException:
        return False
    _modules.update(dict.fromkeys(sources, module))
    return True


def _compile_each(sources: list[str]) -> None:
    import cupy

    start = time.perf_counter()
    progress = None
    for i, src in enumerate(sources):
        if progress is None and time.perf_counter() - start > 1.0:
            progress = _progress(len(sources))
        module = cupy.RawModule(code=src, options=OPTIONS)
        module.compile()
        _modules[src] = module
        if progress is not None:
            progress.update(i + 1)
    if progress is not None:
        progress.close()


class _progress:
    def __init__(self, total: int) -> None:
        from rich.progress import Progress

        self.bar = Progress(transient=True)
        self.bar.start()
        self.task = self.bar.add_task("nimblejax: compiling kernels", total=total)

    def update(self, done: int) -> None:
        self.bar.update(self.task, completed=done)

    def close(self) -> None:
        self.bar.stop()

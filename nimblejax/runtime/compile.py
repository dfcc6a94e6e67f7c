"""Compile a plan's generated kernels with CuPy (NVRTC, disk-cached by CuPy).

Identical sources are compiled once; a progress bar appears when compiling takes
longer than a second.
"""
from __future__ import annotations

import time
from typing import Iterable

from nimblejax.compiler.lowering.task import Kernel

OPTIONS = ("--std=c++17",)
_modules: dict[str, object] = {}  # source → cupy.RawModule, shared by every plan


def compile_kernels(kernels: Iterable[Kernel]) -> dict[str, object]:
    """name → cupy function for each kernel."""
    import cupy

    unique = {k.source: k for k in kernels}
    todo = [k for src, k in unique.items() if src not in _modules]
    start = time.perf_counter()
    progress = None
    for i, k in enumerate(todo):
        if progress is None and time.perf_counter() - start > 1.0:
            progress = _progress(len(todo))
        module = cupy.RawModule(code=k.source, options=OPTIONS)
        module.compile()
        _modules[k.source] = module
        if progress is not None:
            progress.update(i + 1)
    if progress is not None:
        progress.close()
    return {k.name: _modules[k.source].get_function(k.name) for k in unique.values()}


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

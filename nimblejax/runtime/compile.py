"""Compile a plan's generated kernels with NVRTC, disk-cached beside CuPy's, loaded by CuPy.

Identical sources are compiled once per process. A plan's new kernels are compiled in a
few modules, each holding several kernels, on parallel threads: NVRTC parses the headers
every kernel includes (cuda_fp16.h, cuda_bf16.h) once per module instead of once per
kernel, and it releases the GIL while it compiles, so the modules build side by side.
Measured with NVRTC on CI's CPU (source to PTX, `--std=c++17`): ResNet-50's 43 kernels
take 0.77 s as one module against 2.4 s one by one, BERT's 37 kernels 0.68 s against
1.8 s; on the GPU machine (to SASS, 16 cores) ResNet-50's one module took 2.2 s of its
first call. Where a module does not compile (two kernels defining one helper, say), each
of its kernels is compiled alone, with a progress bar when that takes longer than a second.

Compiling starts in the background (`start_compiling`) as soon as a plan's kernels are
known, and `compile_kernels` waits for what it needs: the graph build prepares cuBLASLt's
and cuDNN's algorithms meanwhile (ResNet-50's cold first call at batch 1 on an H200,
cProfile: NVRTC 0.75 s of wall time, cuBLASLt's algorithm choice 0.26 s, one after the
other before this). NVRTC is called directly (runtime/nvrtc.py), so that compiling can
start before CuPy is imported: a cold first call imports CuPy (0.15 to 0.18 s on the GPU
machine) while its kernels compile. Measured on an H200 (fb03cf4 against 5cbd1fb, one
round each, other machines): cold first calls 0.03 to 0.18 s shorter (MLP at batch 32
0.704 -> 0.644 s, LSTM 0.593 -> 0.565 at batch 1 and 0.599 -> 0.416 at 32).
"""
from __future__ import annotations

import hashlib
import os
import sys
import threading
import time
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Iterable

from nimblejax.compiler.lowering.task import Kernel
from nimblejax.options import cache_dir, kernel_cache_dir
from nimblejax.runtime import nvrtc

# sqrtf as XLA's kernels compute it: libdevice's approximate square root (sqrt.approx.f32,
# subnormals kept; XLA leaves libdevice's __CUDA_PREC_SQRT unset). Measured on an H200
# (examples/gpu/probe_unary_bits.py): the IEEE sqrt differed from jax.jit's on 97,969 of
# 1.1M inputs, sqrt.approx.f32 on none. Division, erf and tanh: compiler/lowering/xla_math.py.
OPTIONS = ("--std=c++17", "--prec-sqrt=false")
CACHE_FORMAT = 1  # part of each cached cubin's name: raise it when load_module's output changes
MAX_THREADS = 8  # NVRTC scales to about this many on the GPU machine's 16 cores
MIN_KERNELS_PER_MODULE = 4  # fewer: the header parse costs more than the thread saves,
MIN_MODULE_BYTES = 4096  # unless they are this much source: NVRTC parses the headers in
# about 0.04 s, and compiles a kernel of 8 KB (an LSTM step's gates) in about 0.3 s
# (CI's CPU, to SASS): the suite's LSTM at batch 1, 4 kernels of 23 KB, 0.81 s as one
# module, 0.33 s for the largest alone
_modules: dict[str, object] = {}  # source → cupy.RawModule, shared by every plan
_pending: dict[str, Future] = {}  # source → its module's compile (True: it compiled)
_lock = threading.Lock()
_pool: list = []  # the one ThreadPoolExecutor, made on first use
_private: list = []  # load_module's folder where the kernel cache is not writable
_runtime_modules: dict[str, object] = {}  # runtime_kernel's: source → cupy.RawModule
_cupy_compiles: list = []  # why NVRTC called directly was left for CuPy's compile, if it was


def _executor() -> ThreadPoolExecutor:
    """The compile threads (call with _lock held)."""
    if not _pool:
        _pool.append(ThreadPoolExecutor(threads(), thread_name_prefix="nimblejax-nvrtc"))
    return _pool[0]


def start_compiling(kernels: Iterable[Kernel]) -> None:
    """Begin compiling the kernels not compiled or compiling yet, on background threads,
    for the current device; returns at once. CuPy need not be imported yet: the threads
    compile through NVRTC itself (runtime/nvrtc.py) and import it only to load."""
    with _lock:
        todo = [src for src in dict.fromkeys(k.source for k in kernels)
                if src not in _modules and src not in _pending]
        if not todo:
            return
        device, arch = _target()
        for module in module_split(todo, threads()):
            future = _executor().submit(_build_on, device, arch, module)
            _pending.update(dict.fromkeys(module, future))


def _target() -> tuple:
    """(CuPy's current device, or None where CuPy is not imported: its default; the
    compute capability to compile for)."""
    try:
        device = sys.modules["cupy"].cuda.Device().id
    except (KeyError, AttributeError):  # not imported, or being imported on another thread
        device = None
    return device, nvrtc.current_arch()


def compile_kernels(kernels: Iterable[Kernel]) -> dict[str, object]:
    """name → cupy function for each kernel: compiled here, or waited for where
    `start_compiling` began it."""
    unique = {k.source: k for k in kernels}
    start_compiling(unique.values())
    refused: list = []
    try:
        for src in unique:
            future = _pending.get(src)
            if future is not None and not future.result():
                refused.append(src)
    finally:  # (a compile that raised is not kept: the next call compiles again)
        with _lock:
            for src in unique:
                _pending.pop(src, None)
    if refused:  # a module NVRTC refused: each of its kernels alone, on this thread
        _compile_each([src for src in refused if src not in _modules])
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


def _build_on(device, arch: str, sources: list[str]) -> bool:
    """One module on a pool thread, for `device` (None: CuPy's default) of `arch`."""
    if device is None:
        return _compile_together(sources, arch)
    import cupy

    with cupy.cuda.Device(device):
        return _compile_together(sources, arch)


def _compile_together(sources: list[str], arch: str | None = None) -> bool:
    """Compile `sources` as one module; False where NVRTC refuses the whole. (CuPy is not
    imported before the compile: the main thread may be importing it meanwhile.)"""
    try:
        module = load_module("\n".join(sources), arch=arch)
    except Exception as e:
        cupy = sys.modules.get("cupy")
        if isinstance(e, nvrtc.NvrtcError) or (
                cupy is not None and isinstance(e, cupy.cuda.compiler.CompileException)):
            return False
        raise
    _modules.update(dict.fromkeys(sources, module))
    return True


def _compile_each(sources: list[str]) -> None:
    start = time.perf_counter()
    progress = None
    for i, src in enumerate(sources):
        if progress is None and time.perf_counter() - start > 1.0:
            progress = _progress(len(sources))
        _modules[src] = load_module(src)
        if progress is not None:
            progress.update(i + 1)
    if progress is not None:
        progress.close()


def runtime_kernel(source: str, name: str):
    """The cupy function `name` of one of the runtime's own fixed kernels (the FFI
    handler's copy kernel, the direct path's batch copier): no plan's kernel, so built
    like the handler, once per install and GPU architecture, its cubin kept with the
    handler in options.cache_dir(); loaded once per process. Through CuPy's RawKernel,
    which preprocesses a source with NVRTC before compiling it into CuPy's cache, the
    copy kernel cost every cold first call 0.23-0.53 s (H200, cProfile, bb71eb1)."""
    with _lock:
        module = _runtime_modules.get(source)
    if module is None:
        module = load_module(source, folder=cache_dir())
        with _lock:
            module = _runtime_modules.setdefault(source, module)
    return module.get_function(name)


def load_module(code: str, options: tuple = OPTIONS, folder: str | None = None,
                arch: str | None = None):
    """A cupy.RawModule of `code` for the current device (of compute capability `arch`,
    else asked), compiled by NVRTC with `options` as they are: CuPy's own compile
    (RawModule(code=...)) appends -ftz=true, which flushes subnormal float32 operands
    and results to zero where XLA's kernels keep them. The cubin is kept in `folder`, by
    default CuPy's kernel cache directory (CUPY_CACHE_DIR), named by a hash of the code,
    the options, NVRTC's version and the architecture. CuPy is imported only to load it."""
    arch = arch or nvrtc.current_arch()
    key = repr((code, options, _nvrtc_version(), arch, CACHE_FORMAT))
    name = f"nimblejax-{hashlib.sha256(key.encode()).hexdigest()}.cubin"
    path = os.path.join(folder or kernel_cache_dir(), name)
    if not os.path.exists(path):
        binary = _cubin(code, options, arch)
        try:
            _write(path, binary)
        except OSError:  # a cache folder not writable here: this process's own folder
            path = os.path.join(_private_folder(), name)
            _write(path, binary)
    import cupy

    return cupy.RawModule(path=path)


def _cubin(code: str, options: tuple, arch: str) -> bytes:
    """`code`'s cubin: NVRTC called directly (runtime/nvrtc.py: the same library and
    options as CuPy's compile, the same cubins, measured on CI's CPU for the kernels of
    four suite models, and no CuPy import); CuPy's compile where NVRTC cannot be loaded
    so, or refuses what CuPy's compile takes (then CuPy's from now on: the two differ
    here, in the header folders say)."""
    refused = None
    if nvrtc.library() is not None and not _cupy_compiles:
        try:
            return nvrtc.compile_cubin(code, options, arch)
        except nvrtc.NvrtcError as e:
            refused = e
    import cupy

    binary = cupy.cuda.compiler.compile_using_nvrtc(code, options=nvrtc_options(options), arch=arch)[0]
    if refused is not None:
        _cupy_compiles.append(str(refused))
    return binary if isinstance(binary, bytes) else binary.encode()


def _write(path: str, binary: bytes) -> None:
    """`binary` at `path`, written beside it and renamed: no reader sees a part of it."""
    os.makedirs(os.path.dirname(path), exist_ok=True)
    part = f"{path}.{os.getpid()}.{threading.get_ident()}"
    with open(part, "wb") as f:
        f.write(binary)
    os.replace(part, path)


def _private_folder() -> str:
    with _lock:
        if not _private:
            import tempfile

            _private.append(tempfile.mkdtemp(prefix="nimblejax-kernels-"))
        return _private[0]


def nvrtc_options(options: tuple = OPTIONS) -> tuple:
    """`options` with the include folders CuPy's own compile adds (its headers, CCCL's,
    the CUDA toolkit's: where cuda_fp16.h is found), and nothing else."""
    from cupy._core import core

    return tuple(core.assemble_cupy_compiler_options(tuple(options)))


def _nvrtc_version() -> tuple:
    if nvrtc.library() is not None:
        return nvrtc.version()
    from cupy_backends.cuda.libs import nvrtc as cupy_nvrtc

    return cupy_nvrtc.getVersion()


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

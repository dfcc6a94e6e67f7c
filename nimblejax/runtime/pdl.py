"""Programmatic dependent launch (Hopper and later): a generated kernel may start while
the kernel before it on its stream is finishing, and waits (`griddepcontrol.wait`) before
its first memory access until that kernel has completed and its writes are visible.

Why: in a captured graph each dependent kernel starts only after its predecessor ends,
a gap of about a microsecond; with a programmatic edge its launch overlaps the
predecessor's tail. Measured on an H200 (`examples/gpu/probe_pdl.py`, GPU µs per kernel):
a chain of 100 tiny kernels 1.033 plain against 0.785 (-0.25 µs an edge), 32 steps of an
RNN at batch 1 5.505 against 5.253. On the suite at batch 1 (nimble's GPU ms, off / on,
two rounds, all eight models): the LSTM 0.135 / 0.126, ResNet-50 0.521 / 0.513, BERT
0.647 / 0.628, EfficientNet-B0 0.481 / 0.457, Inception-v3 0.686 / 0.665; on by default.

How: with `Options.pdl` on, every generated kernel's source gets the wait as the first
statement of each `__global__` function (`waiting`: a new source, compiled apart from
the plain one; with `TRIGGER` also the trigger that lets the kernel after it launch),
and the runtime launches it with `cuLaunchKernelEx` and the programmatic stream
serialization attribute (`Launcher`), so that stream capture records a programmatic edge
from a kernel before it on its stream; so too inside the body of a WHILE or IF node
(conditional.py). Library calls (cuBLASLt, cuDNN) and the conditional nodes' own
copy-and-set kernels keep plain launches, and so plain edges into them; an edge from a
library kernel into a generated one may be programmatic: the wait covers it. The wait
comes before anything the kernel reads or writes, so reuse of a buffer the predecessor
still reads (the arena's memory plan) stays ordered. On GPUs before compute capability
9.0 (and in the CPU emulator of the tests) the wait compiles to nothing, and launches
stay plain.
"""
from __future__ import annotations

import ctypes
import dataclasses
import functools
import re

from nimblejax.compiler.lowering.task import Kernel

# TRIGGER: after its wait a kernel also lets the kernel after it launch
# (`griddepcontrol.launch_dependents`), whose blocks are then placed while this one runs
# and wait in their turn; without it the next kernel launches as this one's blocks exit.
# Off: slower than the wait alone on an H200 (examples/gpu/probe_variants.py, GPU µs at
# batch 1: GPT 190.0 against 173.0, BERT 648.2 against 625.7, ResNet-50 even; an early
# trigger on probe_pdl.py's RNN chain 5.38 against 5.25 µs a step).
TRIGGER = False


def _wait_macro(trigger: bool) -> str:
    body = 'asm volatile("griddepcontrol.wait;" ::: "memory")'
    if trigger:
        body += '; asm volatile("griddepcontrol.launch_dependents;")'
    return ('#ifndef NIMBLE_PDL_WAIT\n'
            '#if defined(__CUDACC__) && defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900\n'
            f'#define NIMBLE_PDL_WAIT() do {{ {body}; }} while (0)\n'
            '#else\n'
            '#define NIMBLE_PDL_WAIT()\n'
            '#endif\n'
            '#endif\n')


_BODY = re.compile(r"(__global__\b[^{;]*\{)")  # a kernel's signature up to its body's brace
PROGRAMMATIC_STREAM_SERIALIZATION = 6  # CU_LAUNCH_ATTRIBUTE_PROGRAMMATIC_STREAM_SERIALIZATION


def waiting_source(source: str) -> str:
    """`source` with the wait as the first statement of every kernel in it."""
    return _waiting_source(source, TRIGGER)


@functools.lru_cache(maxsize=4096)  # a first call asks twice: the early compile, the graph build
def _waiting_source(source: str, trigger: bool) -> str:
    return _wait_macro(trigger) + _BODY.sub(lambda m: m.group(1) + " NIMBLE_PDL_WAIT();", source)


def waiting(kernel: Kernel) -> Kernel:
    """The same kernel (name, launch, arguments), compiled from `waiting_source`."""
    pre = tuple(waiting(k) for k in kernel.pre)
    return dataclasses.replace(kernel, source=waiting_source(kernel.source), pre=pre)


def applies(requested: bool) -> bool:
    """Whether kernels launch programmatically: `requested` (Options.pdl) on a GPU that
    supports it."""
    return requested and supported()


def supported() -> bool:
    """Whether the current GPU takes programmatic launches (compute capability 9.0+);
    asked without importing CuPy (runtime/nvrtc.py), as a plan is made."""
    from nimblejax.runtime import nvrtc

    return int(nvrtc.current_arch()) >= 90


# ---- cuLaunchKernelEx (ABI as declared in NVIDIA's cuda.h) ----------------------------------
class _Value(ctypes.Union):
    _fields_ = [("pad", ctypes.c_char * 64), ("i", ctypes.c_int), ("p", ctypes.c_void_p)]


class LaunchAttribute(ctypes.Structure):
    """CUlaunchAttribute."""

    _fields_ = [("id", ctypes.c_int), ("pad", ctypes.c_char * 4), ("value", _Value)]


class LaunchConfig(ctypes.Structure):
    """CUlaunchConfig."""

    _fields_ = [("grid_x", ctypes.c_uint), ("grid_y", ctypes.c_uint), ("grid_z", ctypes.c_uint),
                ("block_x", ctypes.c_uint), ("block_y", ctypes.c_uint), ("block_z", ctypes.c_uint),
                ("shared_bytes", ctypes.c_uint), ("stream", ctypes.c_void_p),
                ("attrs", ctypes.POINTER(LaunchAttribute)), ("num_attrs", ctypes.c_uint)]


class Launcher:
    """Launches a compiled kernel (a CuPy function) with programmatic stream
    serialization; its arguments are 8-byte values (pointers, then `long long` scalars)."""

    def __init__(self) -> None:
        self.driver = ctypes.CDLL("libcuda.so.1")
        self.driver.cuLaunchKernelEx.argtypes = [ctypes.POINTER(LaunchConfig), ctypes.c_void_p,
                                                 ctypes.POINTER(ctypes.c_void_p), ctypes.c_void_p]
        self.attribute = LaunchAttribute()
        self.attribute.id = PROGRAMMATIC_STREAM_SERIALIZATION
        self.attribute.value.i = 1

    def launch(self, function, grid, block, args, stream_ptr: int) -> None:
        values = (ctypes.c_uint64 * max(1, len(args)))(*(int(a) for a in args))
        params = (ctypes.c_void_p * max(1, len(args)))(
            *(ctypes.addressof(values) + 8 * i for i in range(len(args))))
        config = LaunchConfig(*grid, *block, 0, ctypes.c_void_p(stream_ptr), ctypes.pointer(self.attribute), 1)
        result = self.driver.cuLaunchKernelEx(ctypes.byref(config), ctypes.c_void_p(function.kernel.ptr),
                                              params, None)
        if result != 0:
            text = ctypes.c_char_p()
            self.driver.cuGetErrorString(result, ctypes.byref(text))
            raise RuntimeError(f"cuLaunchKernelEx failed: {result} ({(text.value or b'').decode()})")

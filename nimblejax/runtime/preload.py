"""CuPy imported on a background thread from `import nimblejax`, where a CUDA driver is installed.

A cold first call needs CuPy (streams, memory, the graph capture), and importing it takes
0.4 s on the GPU machine's host; a first call of a fresh install also builds the XLA FFI
handler and the residency check. Imported inside the first call, that was on the call's
critical path and slowed the threads working beside it (NVRTC, the graph build). Started
when nimblejax is imported, it runs while the user's program builds its model and
weights; a first call that comes sooner waits on Python's import lock for the rest.

Measured on an H200 (`bench/first_call.py`, ee7bea7; `.probe`-style timers, CuPy
imported before the call against inside it): MLP at batch 1 0.20 s against 0.33, at
batch 32 0.17 against 0.61, LSTM at batch 1 0.24 against 0.43.

- Only where CuPy is installed and a CUDA driver as recent as CuPy's CUDA release is
  (`nvrtc.driver_present`): on a machine without one nothing is imported. The driver is
  not initialized here (nor by CuPy's import): a program may still set
  CUDA_VISIBLE_DEVICES after `import nimblejax`, as it may after `import jax`.
- `NIMBLE_PRELOAD=0` turns it off (options.preload_enabled).
- Then the FFI handler and the residency check are compiled into the cache if they are
  not there yet (the first call of a fresh install paid 3 to 6 s for them); a first call
  that asks while they build waits for that build.
- A failed import or build is left to the first call, which tries again and reports it.
- `os.fork()` waits for the thread to finish (the import; on a fresh install the builds
  too): a child forked while it held CuPy's import lock, or a build's turn, would never
  get it.
"""
from __future__ import annotations

import importlib.util
import os
import threading
from typing import Optional

_thread: Optional[threading.Thread] = None
_lock = threading.Lock()


def start() -> Optional[threading.Thread]:
    """Start the import once per process (a no-op when turned off); the thread, if any."""
    global _thread
    from nimblejax.options import preload_enabled

    with _lock:
        if _thread is None and preload_enabled():
            _thread = threading.Thread(target=_load, name="nimblejax-preload")
            _thread.start()
        return _thread


def join() -> None:
    """Wait until the background import, if one was started, has finished."""
    thread = _thread
    if thread is not None and thread is not threading.current_thread():
        thread.join()


def _load() -> None:
    try:
        from nimblejax.runtime import nvrtc

        if importlib.util.find_spec("cupy") is not None and nvrtc.driver_present():
            import cupy  # noqa: F401

            _build_helpers()
    except Exception:  # the first call imports CuPy (and builds) again and raises what is wrong
        pass


def _build_helpers() -> None:
    """The XLA FFI handler and the residency check, compiled into the cache once per
    install (a C++ and a C compile, 3 to 6 s in all, outside the GIL): a first call of a
    fresh install finds them built, or waits for the build under way (ffi.build_into)."""
    from nimblejax.options import cache_dir
    from nimblejax.runtime import ffi, residency

    folder = cache_dir()
    ffi.build(folder)
    residency.build(folder)


if hasattr(os, "register_at_fork"):
    os.register_at_fork(before=join)

"""runtime/preload.py: `import nimblejax` imports CuPy on a background thread only where a
CUDA driver is installed, without initializing it; NIMBLE_PRELOAD=0 turns it off, and
fork waits for it. Each case runs in a fresh interpreter (CuPy may be imported in this
one already)."""
from __future__ import annotations

import os
import subprocess
import sys
import textwrap


def run(code: str, **env: str) -> str:
    done = subprocess.run([sys.executable, "-c", textwrap.dedent(code)], capture_output=True, text=True,
                          env={**os.environ, **env}, timeout=120)
    assert done.returncode == 0, done.stderr[-2000:]
    return done.stdout.strip()


def test_import_loads_cupy_exactly_where_a_driver_is():
    out = run("""
        import sys
        import nimblejax
        from nimblejax.runtime import nvrtc, preload
        preload.join()
        print(preload._thread is not None, "cupy" in sys.modules, nvrtc.driver_present())
    """, NIMBLE_PRELOAD="1")
    started, loaded, driver = out.split()
    assert started == "True" and loaded == driver


def test_the_thread_leaves_the_driver_uninitialized():
    """No cuInit (nvrtc._driver, the one place that calls it) from the thread, so that
    CUDA_VISIBLE_DEVICES set after `import nimblejax` still applies."""
    out = run("""
        import os
        import nimblejax
        from nimblejax.runtime import nvrtc, preload
        calls = []
        nvrtc._driver = lambda: calls.append(1)
        nvrtc.driver_present = lambda: True
        os.environ["NIMBLE_PRELOAD"] = "1"
        preload.start().join()
        print(len(calls))
    """, NIMBLE_PRELOAD="0")
    assert out == "0"


def test_preload_off_starts_no_thread_and_imports_no_cupy():
    out = run("""
        import sys, threading
        import nimblejax
        from nimblejax.runtime import preload
        print(preload._thread, "cupy" in sys.modules,
              any(t.name == "nimblejax-preload" for t in threading.enumerate()))
    """, NIMBLE_PRELOAD="0")
    assert out == "None False False"


def test_with_a_gpu_the_thread_imports_cupy_once():
    """A driver that reports a GPU (faked here): the thread imports CuPy, a second start
    is the same thread, and a fork after it finds the import finished."""
    out = run("""
        import os, sys
        import nimblejax
        from nimblejax.runtime import nvrtc, preload
        assert preload._thread is None and "cupy" not in sys.modules
        nvrtc.driver_present = lambda: True
        os.environ["NIMBLE_PRELOAD"] = "1"
        first = preload.start()
        assert preload.start() is first
        pid = os.fork()
        if pid == 0:  # a lock held by the parent's thread would never be released here
            import signal
            signal.alarm(20)
            import cupy
            os._exit(0 if hasattr(cupy, "ndarray") else 3)
        _, status = os.waitpid(pid, 0)
        preload.join()
        print(first.name, "cupy" in sys.modules, os.waitstatus_to_exitcode(status))
    """, NIMBLE_PRELOAD="0")
    assert out == "nimblejax-preload True 0"


def test_the_thread_builds_the_handler_and_the_residency_check(tmp_path):
    """A fresh cache: after the thread, the FFI handler and the residency check are
    there, so a first call builds nothing (fake driver, real compilers)."""
    import shutil

    if not (shutil.which("c++") or shutil.which("g++")) or not (shutil.which("cc") or shutil.which("gcc")):
        import pytest

        pytest.skip("no C/C++ compiler")
    out = run("""
        import os, pathlib
        import nimblejax
        from nimblejax.options import cache_dir
        from nimblejax.runtime import ffi, nvrtc, preload, residency
        nvrtc.driver_present = lambda: True
        os.environ["NIMBLE_PRELOAD"] = "1"
        preload.start().join()
        folder = pathlib.Path(cache_dir())
        print(len(list(folder.rglob("libnimble_ffi.so"))), residency.build_path(str(folder)).is_file())
    """, NIMBLE_PRELOAD="0", NIMBLEJAX_CACHE_DIR=str(tmp_path))
    assert out == "1 True"


def test_threads_building_one_target_take_turns(tmp_path):
    """ffi.build_into: two threads asking for one missing file compile it once."""
    import threading
    import time

    from nimblejax.runtime import ffi

    compiled = []

    def compile_to(tmp):
        compiled.append(tmp)
        time.sleep(0.2)
        tmp.write_bytes(b"built")

    target = tmp_path / "lib.so"
    threads = [threading.Thread(target=ffi.build_into, args=(target, compile_to, "a test file", "no fallback"))
               for _ in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert len(compiled) == 1 and target.read_bytes() == b"built"

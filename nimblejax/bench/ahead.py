"""jax.jit's programs compiled ahead, in a thread pool, for the default GPU run.

On a fresh machine most of the default run used to be XLA compiling and autotuning
jax.jit's programs, one model after another (about 3 of the 5 minutes on an H100).
Here every model × batch's program is compiled from abstract arguments (no weights on
the device) as soon as the run starts, a few at a time: XLA compiles outside the GIL,
so the compiles overlap each other and the bench's own work (building weights, nimble's
first call). Each compile lands in JAX's persistent compilation cache, which the run
has turned on (measure.jax_compile_cache): the model's first jax.jit call waits for its
own compile, then loads the program instead of compiling it.

A compile autotunes on the GPU, so none runs while a row is timed: `quiet()` stops the
pool from starting another and waits for the running ones, and the timings of a row
are taken inside it.
"""
from __future__ import annotations

import contextlib
import os
import threading
import time
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any, Callable, Iterator, Optional

Unit = tuple[str, int]  # (model, batch)


def workers() -> int:
    """Compiles at a time: a quarter of the cores (XLA's compile of one program uses
    several), at least 1, at most 4."""
    return max(1, min(4, (os.cpu_count() or 1) // 4))


def compile_jax(spec: Any, batch: int, dtype: Any, tiny: bool) -> None:
    """jax.jit's program of one model × batch, compiled from abstract arguments."""
    import jax

    from nimblejax.bench.plans import abstract_model

    fn, args = abstract_model(spec, batch, dtype, tiny)
    jax.jit(fn).lower(*args).compile()


class AheadCompiler:
    """Compiles `units` in order on a pool of `n` threads, each by `compile(unit)`."""

    def __init__(self, units: list[Unit], compile: Callable[[Unit], None], n: int) -> None:
        self._compile = compile
        self._cond = threading.Condition()
        self._open = True  # whether a compile may start
        self._running = 0
        self._pool = ThreadPoolExecutor(n, thread_name_prefix="nimblejax-bench-xla")
        self._futures: dict[Unit, Future] = {u: self._pool.submit(self._one, u) for u in units}

    def _one(self, unit: Unit) -> Optional[float]:
        with self._cond:
            self._cond.wait_for(lambda: self._open)
            self._running += 1
        t0 = time.perf_counter()
        try:
            self._compile(unit)
            return time.perf_counter() - t0
        except Exception:  # noqa: BLE001 - the model's own first call reports it
            return None
        finally:
            with self._cond:
                self._running -= 1
                self._cond.notify_all()

    def wait(self, unit: Unit) -> Optional[float]:
        """Seconds `unit`'s compile took once it is done (None: not compiled ahead, or
        it failed: the first call compiles then, and says why if it fails too)."""
        future = self._futures.get(unit)
        return None if future is None else future.result()

    @contextlib.contextmanager
    def quiet(self) -> Iterator[None]:
        """No compile runs inside: none starts, and the running ones are waited for."""
        with self._cond:
            self._open = False
            self._cond.wait_for(lambda: self._running == 0)
        try:
            yield
        finally:
            with self._cond:
                self._open = True
                self._cond.notify_all()

    def close(self) -> None:
        """Drop the compiles not started (a run cut short) and wait for the others."""
        for future in self._futures.values():
            future.cancel()
        self._pool.shutdown(wait=True)

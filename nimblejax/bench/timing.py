"""Timing helpers: medians of end-to-end wall time, and GPU time from CUDA events."""
from __future__ import annotations

import statistics
import time
from typing import Callable, Optional, Sequence

import jax


def median_us(fn: Callable[[], object], calls: int = 500, warmup: int = 10) -> float:
    """Median µs of `fn()` (host wall time; no synchronization added)."""
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(calls):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times) * 1e6


def e2e_us(fn: Callable, args: tuple, calls: int = 300, warmup: int = 5) -> float:
    """Median µs of one call including block_until_ready."""
    for _ in range(warmup):
        jax.block_until_ready(fn(*args))
    times = []
    for _ in range(calls):
        t0 = time.perf_counter()
        jax.block_until_ready(fn(*args))
        times.append(time.perf_counter() - t0)
    return statistics.median(times) * 1e6


def looped_us(fn: Callable, arg_sets: Sequence[tuple], feed: Optional[Callable] = None,
              calls: int = 200, repeats: int = 5) -> float:
    """µs per call of a loop as programs run it: call i gets its own arguments
    (`arg_sets[i % len(arg_sets)]`, distinct objects, so no identity cache can help),
    or, with `feed(args, last_output) -> args`, the previous call's output fed back as
    training state; one block at the end of each loop. Median over `repeats` loops."""
    return looped_and_host_us(fn, arg_sets, feed, calls, repeats)[0]


def looped_and_host_us(fn: Callable, arg_sets: Sequence[tuple], feed: Optional[Callable] = None,
                       calls: int = 200, repeats: int = 5) -> tuple[float, float]:
    """`looped_us`, and the host µs per call of the same loops before their one block
    (the time the caller waits for each call to return): where the host time is well
    below the looped time, the GPU bounds the loop, not the host."""
    args = arg_sets[0]
    out = fn(*args)
    jax.block_until_ready(out)
    looped, host = [], []
    for _ in range(repeats):
        t0 = time.perf_counter()
        for i in range(calls):
            args = feed(args, out) if feed is not None else arg_sets[i % len(arg_sets)]
            out = fn(*args)
        host.append((time.perf_counter() - t0) / calls)
        jax.block_until_ready(out)
        looped.append((time.perf_counter() - t0) / calls)
    return statistics.median(looped) * 1e6, statistics.median(host) * 1e6


def fed_back_us(fn: Callable, state: list, batches: Sequence[tuple], calls: int,
                block_each: bool = False) -> float:
    """µs per call of a training loop: `fn(state[0], *batch) -> (new state, ...)`, the
    new state fed back (and `state[0]` updated, so the next loop goes on from it), a
    fresh batch each call; one block at the end, or after each call with block_each."""
    t0 = time.perf_counter()
    out = None
    for i in range(calls):
        out = fn(state[0], *batches[i % len(batches)])
        state[0] = out[0]
        if block_each:
            jax.block_until_ready(out)
    jax.block_until_ready(out)
    return (time.perf_counter() - t0) / calls * 1e6


def blocked_us(fn: Callable, arg_sets: Sequence[tuple], calls: int = 200, warmup: int = 5) -> float:
    """Median µs of one call including block_until_ready, a fresh argument set each call."""
    for i in range(warmup):
        jax.block_until_ready(fn(*arg_sets[i % len(arg_sets)]))
    times = []
    for i in range(calls):
        args = arg_sets[i % len(arg_sets)]
        t0 = time.perf_counter()
        jax.block_until_ready(fn(*args))
        times.append(time.perf_counter() - t0)
    return statistics.median(times) * 1e6


def throughput_us(fn: Callable, args: tuple, calls: int = 200, repeats: int = 5) -> float:
    """µs per call when calls are issued back to back (median over `repeats` batches).
    For jax.jit this is its GPU time whenever dispatch keeps ahead of the GPU."""
    jax.block_until_ready(fn(*args))
    per = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        out = None
        for _ in range(calls):
            out = fn(*args)
        jax.block_until_ready(out)
        per.append((time.perf_counter() - t0) / calls)
    return statistics.median(per) * 1e6


def cuda_event_us(launch: Callable[[], None], stream, calls: int = 200, repeats: int = 5) -> float:
    """GPU µs per launch from CUDA events around back-to-back launches on `stream`."""
    import cupy

    launch()
    stream.synchronize()
    per = []
    for _ in range(repeats):
        start, stop = cupy.cuda.Event(), cupy.cuda.Event()
        start.record(stream)
        for _ in range(calls):
            launch()
        stop.record(stream)
        stop.synchronize()
        per.append(cupy.cuda.get_elapsed_time(start, stop) * 1e3 / calls)
    return statistics.median(per)


def nimble_gpu_us(nimble_fn, calls: int = 200) -> Optional[float]:
    """GPU time of the compiled plan alone: its graph (or its eager launches)."""
    exes = nimble_fn.executables()
    if not exes:
        return None
    exe = exes[-1]
    import cupy

    # A plan is placed on every GPU it may run on: time it on the one holding exe's
    # streams (events of another device's context cannot be recorded on them).
    with cupy.cuda.Device(exe.device):
        s0 = exe.streams[0]
        if exe.raw_exec:  # captured for the XLA FFI handler, which points it at XLA's
            # buffers: back at the arena alone first; a segmented plan's graphs in a row
            exe.rest()

            def launch():
                for raw in exe.raw_execs:
                    cupy.cuda.runtime.graphLaunch(raw, s0.ptr)
            return cuda_event_us(launch, s0, calls)
        if exe.graph is not None:
            return cuda_event_us(lambda: exe.graph.launch(s0), s0, calls)
        return cuda_event_us(exe.launch_tasks, s0, max(20, calls // 10))


def concurrent_jax(fn: Callable, args: tuple) -> Optional[Callable]:
    """jax.jit compiled with XLA's opt-in concurrent command-buffer scheduling, or None
    where the installed XLA does not accept the option."""
    for mode in ("CONCURRENT", "CONCURRENT_REGIONS"):
        try:
            compiled = jax.jit(fn).lower(*args).compile(
                compiler_options={"xla_gpu_command_buffer_scheduling_mode": mode})
            jax.block_until_ready(compiled(*args))
            return compiled
        except Exception:
            continue
    return None

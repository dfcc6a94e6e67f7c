from __future__ import annotations

import ctypes
import functools
import gc
import os

import pytest

# Every plan a test builds is checked for races (compiler/pipeline.py: verify_plan). Off by
# default for users: it adds 10-16% to planning (NASNet-A: 44 ms on 465 ms, measured).
os.environ.setdefault("NIMBLE_DEBUG", "1")


@functools.cache
def gpu_available() -> bool:
    try:
        import cupy

        return cupy.cuda.runtime.getDeviceCount() > 0
    except Exception:
        return False


# Without a GPU, most of the suite's time is XLA compiling small CPU programs (jax.jit's
# references, and each primitive the interpreter runs). LLVM's optimizations only make
# those programs run faster, which tests on (3, 4) arrays do not need: at level 0 XLA
# compiles 23% faster (60 small programs: 3.1 s → 2.4 s of CPU). Both sides of every
# comparison run under the same flag. Set before JAX starts its CPU client; a GPU
# machine keeps XLA's defaults.
#
# XLA's CPU fusion emitters (its newer MLIR code generator, on by default) take longer
# to compile a small program than the element-wise emitters they replace: 32 → 22 ms a
# program at level 0, and a sample of the suite (test_row_prologue.py, test_primitives.py,
# test_training.py, one process) took 175 s against 216 s. Where this jaxlib does not
# know the flag (XLA aborts on an unknown one), it is left out: the probe is one child
# process, in pytest's first process only (pytest -n's workers inherit XLA_FLAGS).
FAST_COMPILE_FLAGS = ("--xla_backend_optimization_level=0", "--xla_cpu_use_fusion_emitters=false")


def _xla_takes(flags: str) -> bool:
    import subprocess
    import sys

    env = dict(os.environ, XLA_FLAGS=flags, JAX_PLATFORMS="cpu")
    probe = subprocess.run([sys.executable, "-c", "import jax; jax.devices()"], env=env,
                           capture_output=True, timeout=120)
    return probe.returncode == 0


if "xla_backend_optimization_level" not in os.environ.get("XLA_FLAGS", "") and not gpu_available():
    _flags = os.environ.get("XLA_FLAGS", "")
    _with_all = " ".join((_flags, *FAST_COMPILE_FLAGS)).strip()
    os.environ["XLA_FLAGS"] = (_with_all if _xla_takes(_with_all)
                               else " ".join((_flags, FAST_COMPILE_FLAGS[0])).strip())


# The same small programs compile again and again: in each pytest -n worker, after the
# memory limit below empties JAX's caches, and in every process the examples start. XLA
# caches them on disk for the run (a folder removed when the run ends), so each is
# compiled once and loaded after: the interpreter's Inception SGD step took 34.5 s with
# an empty cache and 11.9 s with a filled one. CPU runs only (the GPU machine keeps
# XLA's defaults), and never where the caller chose a cache folder.
_CACHE_VAR = "JAX_COMPILATION_CACHE_DIR"
_OWN_CACHE = "NIMBLEJAX_TEST_JAX_CACHE"  # set by the process that made the folder
if not gpu_available() and not os.environ.get(_CACHE_VAR):
    import tempfile

    os.environ[_CACHE_VAR] = tempfile.mkdtemp(prefix="nimblejax-test-xla-cache-")
    os.environ[_OWN_CACHE] = str(os.getpid())
    os.environ["JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS"] = "0"
    os.environ["JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES"] = "0"


# With NIMBLEJAX_TEST_RSS set, the summary gives each process's peak resident size
# (pytest -n's workers report theirs to the first process).
RSS_REPORT = "NIMBLEJAX_TEST_RSS"
_peaks: dict[str, int] = {}


def pytest_sessionfinish(session, exitstatus):
    if os.environ.get(RSS_REPORT):
        import resource

        peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss << 10  # KiB on Linux
        workeroutput = getattr(session.config, "workeroutput", None)
        if workeroutput is not None:
            workeroutput["peak_rss"] = peak
        else:
            _peaks["main"] = peak
    # The process that made the folder removes it (pytest -n's workers inherit it).
    if os.environ.get(_OWN_CACHE) == str(os.getpid()):
        import shutil

        shutil.rmtree(os.environ.get(_CACHE_VAR, ""), ignore_errors=True)


@pytest.hookimpl(optionalhook=True)
def pytest_testnodedown(node, error):
    peak = getattr(node, "workeroutput", {}).get("peak_rss")
    if peak is not None:
        _peaks[node.gateway.id] = peak


def pytest_terminal_summary(terminalreporter):
    if _peaks:
        terminalreporter.write_line("peak resident size: " + ", ".join(
            f"{name} {peak / 2**30:.2f} GB" for name, peak in sorted(_peaks.items())))


def _dist_chosen(config) -> bool:
    """Whether the command line (or PYTEST_ADDOPTS) names a --dist mode itself."""
    words = [*config.invocation_params.args, *os.environ.get("PYTEST_ADDOPTS", "").split()]
    return any(str(w).startswith("--dist") for w in words)


@pytest.hookimpl(optionalhook=True, tryfirst=True)
def pytest_xdist_make_scheduler(config, log):
    """`pytest -n` hands tests out by work stealing (a worker that runs dry takes half of
    what another still has queued) where no --dist mode was asked for. xdist's default
    ('load') sends the last tests in chunks of a fixed count, and the suite's slow files
    come last (end_to_end/: the library, flax and fuzz tests): on 2 cores one worker
    finished 224 s after the other (777 s run, test times logged per worker)."""
    if config.getvalue("dist") != "load" or _dist_chosen(config):
        return None
    try:
        from xdist.scheduler import WorkStealingScheduling  # pytest-xdist >= 3.2
    except ImportError:
        return None

    return WorkStealingScheduling(config, log)


def pytest_collection_modifyitems(config, items):
    # The longest tests first (stable: the rest keep their order): under pytest -n they
    # start at once, side by side with the short ones, instead of one of them keeping a
    # worker busy after the others have finished.
    items.sort(key=lambda item: "long" not in item.keywords)
    if gpu_available():
        return
    skip = pytest.mark.skip(reason="no CUDA GPU visible")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


@pytest.fixture
def no_matplotlib(monkeypatch):
    """Imports of matplotlib fail, as on a machine without the `bench` extra."""
    import builtins

    real_import = builtins.__import__

    def fake_import(name, *args, **kwargs):
        if name == "matplotlib" or name.startswith("matplotlib."):
            raise ImportError(name)
        return real_import(name, *args, **kwargs)

    monkeypatch.setattr(builtins, "__import__", fake_import)


# JAX keeps every program it compiles (jax.jit's, and each primitive the interpreter runs
# eagerly: about 1.4 MB each) for the life of the process: a worker running
# test_primitives.py alone grew to 3.6 GB, test_flax.py to 3.5 GB. Past this resident
# size, the caches are emptied after the test that crossed it and the freed heap goes
# back to the system (later tests compile again what they need). At 2 GB the largest
# worker of `.ci/run` still peaked at 3.76 GB (one test can add 1.5 GB on top); at
# 1.25 GB it peaked at 2.50 GB, and the suite took 5 min 0 s against 5 min 29 s.
RSS_LIMIT = 5 << 28  # 1.25 GB
_threshold = [RSS_LIMIT]


def resident_bytes() -> int:
    """This process's resident memory now (0 where /proc is not there to tell)."""
    try:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except (OSError, ValueError, IndexError):
        return 0


def _trim_heap() -> None:
    """Give the heap's free pages back to the system (glibc keeps them otherwise)."""
    try:
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except (OSError, AttributeError):
        pass


@pytest.hookimpl(trylast=True)
def pytest_runtest_teardown(item, nextitem):
    if resident_bytes() > _threshold[0]:
        import jax

        jax.clear_caches()
        gc.collect()
        _trim_heap()
        # What the caches did not hold (a module's fixtures, say) stays: the next
        # emptying waits for 512 MB more than that.
        _threshold[0] = max(RSS_LIMIT, resident_bytes() + (512 << 20))

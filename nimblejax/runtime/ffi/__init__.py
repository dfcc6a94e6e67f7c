"""Build and load nimblejax's XLA FFI handler (``handler.cc``).

The handler replays a pre-captured CUDA graph (a nimble plan) as an XLA
custom call on XLA's own stream, so a jitted function that calls a plan needs
no Python per call. The library is compiled on first use with the system C++
compiler and cached on disk: shipping a prebuilt binary would tie nimblejax to
one jaxlib's FFI headers, while the source builds against whichever jaxlib is
installed, with no CUDA toolkit needed (libcuda is opened at run time).

Everything here degrades to ``None`` plus one warning instead of raising:
without the FFI path nimblejax still works through its Python call path.
This module reads no environment variables; callers pass every setting.
"""

from __future__ import annotations

import ctypes
import hashlib
import os
import pathlib
import shutil
import subprocess
import tempfile
import threading
import warnings
from typing import Callable, Sequence

__all__ = ["TARGET", "FfiLibrary", "build", "load", "load_initialized"]

TARGET = "nimble_plan"
"""Name of the XLA custom-call target that runs a registered plan."""

_SOURCE = pathlib.Path(__file__).with_name("handler.cc")
# Headers handler.cc includes from its own folder: part of the build's cache key.
_HEADERS = ("driver.h", "copy_kernel.h", "copy_node.h", "graph_patch.h", "node_exports.h")
_LIB_NAME = "libnimble_ffi.so"
# -fvisibility=hidden: only the symbols handler.cc marks for export are
# visible, so the FFI header templates cannot clash with jaxlib's copies.
# -ldl: dlopen lives in libdl on glibc older than 2.34.
_CFLAGS = ("-O2", "-std=c++17", "-shared", "-fPIC", "-fvisibility=hidden")
_LDFLAGS = ("-ldl",)
_FALLBACK = "nimblejax falls back to its Python call path"
_STDERR_LINES = 8
_BUILD_TIMEOUT_S = 300

_u64_p = ctypes.POINTER(ctypes.c_ulonglong)
_int_p = ctypes.POINTER(ctypes.c_int)

_lock = threading.Lock()  # guards _warned
_load_lock = threading.Lock()  # separate from _lock: load() warns while held
_build_lock = threading.Lock()  # build_into's: one build at a time in a process
_warned: set[str] = set()
_loaded = False
_library: FfiLibrary | None = None


def _warn_once(message: str) -> None:
    """Warn about a failure once per process: it repeats on every plan."""
    with _lock:
        if message in _warned:
            return
        _warned.add(message)
    warnings.warn(message, RuntimeWarning, stacklevel=3)


def _jaxlib_version() -> str:
    """Version of the jaxlib whose FFI headers the build uses."""
    import jaxlib.version

    return jaxlib.version.__version__


def _compile_flags() -> list[str]:
    """Compiler flags; part of the cache key, so a header change rebuilds."""
    import jax

    return [*_CFLAGS, f"-I{jax.ffi.include_dir()}"]


def _build_dir(cache_dir: str | os.PathLike, source: bytes, flags: Sequence[str]) -> pathlib.Path:
    """``<cache_dir>/<jaxlib version>-<sha1(source + flags)[:12]>``."""
    digest = hashlib.sha1(source)
    for flag in [*flags, *_LDFLAGS]:
        digest.update(b"\0" + flag.encode())
    return pathlib.Path(cache_dir) / f"{_jaxlib_version()}-{digest.hexdigest()[:12]}"


def _source_bytes() -> bytes:
    """handler.cc and the headers it includes, as one text (the cache key's part)."""
    return b"\0".join(_SOURCE.with_name(n).read_bytes() for n in (_SOURCE.name, *_HEADERS))


def _find_compiler(compiler: str | None) -> str | None:
    """The explicit compiler if given, else ``c++`` or ``g++`` from PATH."""
    if compiler is not None:
        return shutil.which(compiler)
    return shutil.which("c++") or shutil.which("g++")


def _first_lines(text: str) -> str:
    lines = text.strip().splitlines()[:_STDERR_LINES]
    return "\n".join("    " + line for line in lines)


def _run_compiler(cxx: str, flags: Sequence[str], output: pathlib.Path) -> str | None:
    """Compile handler.cc into ``output``; returns an error text or None."""
    cmd = [cxx, *flags, str(_SOURCE), "-o", str(output), *_LDFLAGS]
    try:
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=_BUILD_TIMEOUT_S)
    except (OSError, subprocess.SubprocessError) as exc:
        return f"could not run {cxx}: {exc}"
    if proc.returncode != 0:
        return f"{cxx} exited with status {proc.returncode}:\n{_first_lines(proc.stderr)}"
    return None


def build(cache_dir: str | os.PathLike, compiler: str | None = None) -> pathlib.Path | None:
    """Compile the FFI handler library, or reuse a cached build.

    The build lands in a directory named after the jaxlib version and a hash
    of the source and flags, so an upgrade of either builds afresh while
    repeated runs cost nothing. The compiler writes a temporary file that is
    renamed into place: two processes building at once both succeed, and no
    one ever loads a half-written library.

    Returns the library's path, or None (after one warning) when no compiler
    is found or the build fails.
    """
    cxx = _find_compiler(compiler)
    if cxx is None:
        wanted = compiler if compiler is not None else "c++ or g++ on PATH"
        _warn_once(f"nimblejax: cannot build its XLA FFI handler: no C++ compiler ({wanted}); {_FALLBACK}.")
        return None
    try:
        flags = _compile_flags()
        target = _build_dir(cache_dir, _source_bytes(), flags) / _LIB_NAME
    except (ImportError, AttributeError) as exc:
        _warn_once(f"nimblejax: cannot build its XLA FFI handler: {exc}; {_FALLBACK}.")
        return None
    return build_into(target, lambda tmp: _run_compiler(cxx, flags, tmp), "its XLA FFI handler", _FALLBACK)


def build_into(target: pathlib.Path, compile_to: Callable[[pathlib.Path], str | None], what: str,
               fallback: str) -> pathlib.Path | None:
    """`target` if it is built already, else `compile_to(a temporary file)` (an error
    text, or None) renamed into place: two processes building at once both succeed, and
    no one loads a half-written file. None, after one warning naming `what` and the
    `fallback`, when the build fails. Threads of one process take turns (runtime/preload.py
    builds while a first call may ask), so a target is compiled once."""
    with _build_lock:
        return _build_into(target, compile_to, what, fallback)


def _build_into(target: pathlib.Path, compile_to: Callable[[pathlib.Path], str | None], what: str,
                fallback: str) -> pathlib.Path | None:
    try:
        if target.is_file():
            return target
        target.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp_name = tempfile.mkstemp(prefix=f".{target.name}.", suffix=".tmp", dir=target.parent)
        os.close(fd)
    except OSError as exc:
        _warn_once(f"nimblejax: cannot build {what} in {target.parent}: {exc}; {fallback}.")
        return None
    tmp = pathlib.Path(tmp_name)
    try:
        error = compile_to(tmp)
        if error is None:
            os.replace(tmp, target)
            return target
    finally:
        tmp.unlink(missing_ok=True)
    _warn_once(f"nimblejax: building {what} failed: {error}\n{fallback}.")
    return None


def _declare(lib: ctypes.CDLL) -> None:
    """Give ctypes the C signatures, so 64-bit handles are not truncated."""
    lib.nimble_ffi_init.argtypes = []
    lib.nimble_ffi_init.restype = ctypes.c_int
    lib.nimble_ffi_last_error.argtypes = []
    lib.nimble_ffi_last_error.restype = ctypes.c_char_p
    lib.nimble_ffi_copy_kernel_source.argtypes = []
    lib.nimble_ffi_copy_kernel_source.restype = ctypes.c_char_p
    lib.nimble_ffi_reserve_id.argtypes = []
    lib.nimble_ffi_reserve_id.restype = ctypes.c_longlong
    lib.nimble_ffi_register.argtypes = [
        ctypes.c_longlong, ctypes.c_int, ctypes.c_void_p, ctypes.c_void_p,
        ctypes.c_int, _u64_p, _u64_p,
        ctypes.c_int, _u64_p, _u64_p,
    ]  # fmt: skip
    lib.nimble_ffi_register.restype = ctypes.c_longlong
    lib.nimble_ffi_register_view.argtypes = [
        ctypes.c_longlong, ctypes.c_longlong, ctypes.c_int, ctypes.c_int, _int_p, _u64_p, _u64_p,
        ctypes.c_int, _int_p, _int_p, _u64_p, _u64_p, _u64_p,
    ]  # fmt: skip
    lib.nimble_ffi_register_view.restype = ctypes.c_longlong
    lib.nimble_ffi_kernel_nodes.argtypes = [ctypes.c_void_p, ctypes.c_longlong, _u64_p, _u64_p]
    lib.nimble_ffi_kernel_nodes.restype = ctypes.c_longlong
    lib.nimble_ffi_kernel_node_params.argtypes = [ctypes.c_void_p, ctypes.c_int, _u64_p]
    lib.nimble_ffi_kernel_node_params.restype = ctypes.c_int
    lib.nimble_ffi_set_inplace.argtypes = [
        ctypes.c_longlong, ctypes.c_int, ctypes.c_int, _u64_p, _int_p, ctypes.c_int,
        _int_p, _int_p, _int_p, _int_p,
    ]  # fmt: skip
    lib.nimble_ffi_set_inplace.restype = ctypes.c_int
    lib.nimble_ffi_capture_copy_node.argtypes = [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int]
    lib.nimble_ffi_capture_copy_node.restype = ctypes.c_int
    lib.nimble_ffi_set_copy_nodes.argtypes = [ctypes.c_longlong, ctypes.c_int, ctypes.c_void_p]
    lib.nimble_ffi_set_copy_nodes.restype = ctypes.c_int
    lib.nimble_ffi_set_direct.argtypes = [ctypes.c_longlong, ctypes.c_int, ctypes.c_void_p]
    lib.nimble_ffi_set_direct.restype = ctypes.c_int
    lib.nimble_ffi_set_segments.argtypes = [ctypes.c_int, ctypes.POINTER(ctypes.c_longlong), ctypes.c_int]
    lib.nimble_ffi_set_segments.restype = ctypes.c_int
    lib.nimble_ffi_rest.argtypes = [ctypes.c_longlong, ctypes.c_int]
    lib.nimble_ffi_rest.restype = ctypes.c_int
    lib.nimble_ffi_stats.argtypes = [ctypes.c_longlong, ctypes.c_int, _u64_p]
    lib.nimble_ffi_stats.restype = ctypes.c_int
    lib.nimble_ffi_unregister.argtypes = [ctypes.c_longlong]
    lib.nimble_ffi_unregister.restype = None


def _u64_array(values: Sequence[int]) -> ctypes.Array:
    return (ctypes.c_ulonglong * len(values))(*(int(v) for v in values))


def _int_array(values: Sequence[int]) -> ctypes.Array:
    return (ctypes.c_int * len(values))(*(int(v) for v in values))


class FfiLibrary:
    """The loaded handler library: plan registry and FFI target.

    A plan is registered once (graph exec, copy kernel, arena slots) and then
    called from XLA as the custom call ``TARGET`` with the int64 attribute
    ``plan`` set to the id that :meth:`register` returned.
    """

    TARGET = TARGET

    def __init__(self, lib: ctypes.CDLL, path: pathlib.Path) -> None:
        _declare(lib)
        self._lib = lib
        self.path = path

    @property
    def handler(self) -> ctypes._CFuncPtr:
        """The ``NimblePlanCall`` FFI handler, for ``jax.ffi.pycapsule``."""
        return self._lib.NimblePlanCall

    def last_error(self) -> str:
        """The message of this thread's last failed call into the library."""
        raw = self._lib.nimble_ffi_last_error()
        return raw.decode(errors="replace") if raw else ""

    def init(self) -> None:
        """Open libcuda and resolve the driver calls; raises RuntimeError.

        Separate from loading so that the library can be built and inspected
        on machines without a GPU driver.
        """
        if self._lib.nimble_ffi_init() != 0:
            raise RuntimeError(f"nimblejax FFI init failed: {self.last_error()}")

    def reserve_id(self) -> int:
        """A new plan id (> 0) for a later `register` or `register_view` to take: a
        custom call can name its plan before the plan is built."""
        return int(self._lib.nimble_ffi_reserve_id())

    def register(
        self,
        graph_exec: int,
        copy_fn: int,
        in_dst: Sequence[int],
        in_bytes: Sequence[int],
        out_src: Sequence[int],
        out_bytes: Sequence[int],
        *,
        plan_id: int = 0,
        device: int = 0,
    ) -> int:
        """Register a plan's copy on device ordinal ``device`` and return the plan's
        id (> 0): a new id when ``plan_id`` is 0, else ``plan_id`` (the same plan on
        another device; XLA passes the handler its device ordinal).

        ``graph_exec`` is the plan's CUgraphExec and ``copy_fn`` the CUfunction
        of the compiled :meth:`copy_kernel_source` (e.g. CuPy's
        ``RawKernel(src, "nimble_ffi_copy").kernel.ptr``); both must outlive
        the registration. Input i is copied to arena address ``in_dst[i]``
        (``in_bytes[i]`` bytes) before the graph runs, output j is copied
        from ``out_src[j]`` afterwards; 0 bytes means "not copied". Needs the
        CUDA context of the graph to be current (the plan's event is made in
        it). Raises ValueError on mismatched lengths, RuntimeError on failure.
        """
        if len(in_dst) != len(in_bytes) or len(out_src) != len(out_bytes):
            raise ValueError("in_dst/in_bytes and out_src/out_bytes must have equal lengths")
        plan_id = self._lib.nimble_ffi_register(
            int(plan_id), int(device), ctypes.c_void_p(graph_exec), ctypes.c_void_p(copy_fn),
            len(in_dst), _u64_array(in_dst), _u64_array(in_bytes),
            len(out_src), _u64_array(out_src), _u64_array(out_bytes),
        )  # fmt: skip
        if plan_id < 0:
            raise RuntimeError(f"nimblejax FFI plan registration failed: {self.last_error()}")
        return plan_id

    def register_view(self, base_id: int, in_index: Sequence[int], in_dst: Sequence[int],
                      in_bytes: Sequence[int], *, view_id: int = 0, device: int = 0,
                      fed_index: Sequence[int] = (), fed_out: Sequence[int] = (),
                      fed_dst: Sequence[int] = (),
                      fed_src: Sequence[int] = (), fed_bytes: Sequence[int] = ()) -> int:
        """Register a view of plan ``base_id`` on ``device``: the same arena, graph and
        outputs, called with the operands of plan inputs ``in_index`` only (copied to
        ``in_dst``, or read in place), and ``fed_bytes[k]`` bytes copied inside the arena
        from ``fed_src[k]`` (an output buffer, still holding the previous call's result)
        to ``fed_dst[k]``, the slot of plan input ``fed_index[k]``, before the graph runs
        (from output buffer ``fed_out[k]``'s last address instead where that result is
        written in place);
        the plan's other inputs stay where earlier calls left them. Returns the view's
        id: a new one when ``view_id`` is 0, else ``view_id`` (the view on another
        device). Calls of a plan and of its views are serialized on one arena."""
        if not len(in_index) == len(in_dst) == len(in_bytes) or \
                not len(fed_index) == len(fed_out) == len(fed_dst) == len(fed_src) == len(fed_bytes):
            raise ValueError("in_index/in_dst/in_bytes and fed_index/fed_out/fed_dst/fed_src/"
                             "fed_bytes must have equal lengths")
        view = self._lib.nimble_ffi_register_view(
            int(view_id), int(base_id), int(device), len(in_dst), _int_array(in_index),
            _u64_array(in_dst), _u64_array(in_bytes), len(fed_dst), _int_array(fed_index),
            _int_array(fed_out), _u64_array(fed_dst), _u64_array(fed_src), _u64_array(fed_bytes))
        if view < 0:
            raise RuntimeError(f"nimblejax FFI view registration failed: {self.last_error()}")
        return view

    def kernel_nodes(self, graph: int) -> list[tuple[int, int]]:
        """(node, CUfunction) of every kernel node of the CUgraph ``graph``."""
        count = self._lib.nimble_ffi_kernel_nodes(ctypes.c_void_p(graph), 0, None, None)
        if count < 0:
            raise RuntimeError(f"nimblejax: listing graph nodes failed: {self.last_error()}")
        nodes, funcs = (ctypes.c_ulonglong * count)(), (ctypes.c_ulonglong * count)()
        self._lib.nimble_ffi_kernel_nodes(ctypes.c_void_p(graph), count, nodes, funcs)
        return list(zip(nodes, funcs))

    def kernel_node_params(self, node: int, n: int) -> tuple[int, ...]:
        """The first ``n`` 8-byte arguments of a kernel node (its kernel takes them)."""
        values = (ctypes.c_ulonglong * n)()
        if self._lib.nimble_ffi_kernel_node_params(ctypes.c_void_p(node), n, values) != 0:
            raise RuntimeError(f"nimblejax: reading a kernel node failed: {self.last_error()}")
        return tuple(values)

    def set_inplace(self, plan_id: int, device: int, nodes: Sequence[int], n_params: Sequence[int],
                    sites: Sequence[tuple[int, int, int, int]]) -> None:
        """Read and write buffers of plan ``plan_id`` in place: each site (node position in
        ``nodes``, argument position, 0 for a plan input or 1 for an output buffer, its
        index) is a kernel argument the handler re-points to XLA's buffer each call."""
        cols = list(zip(*sites)) if sites else [(), (), (), ()]
        rc = self._lib.nimble_ffi_set_inplace(
            int(plan_id), int(device), len(nodes), _u64_array(nodes), _int_array(n_params),
            len(sites), *(_int_array(c) for c in cols))
        if rc != 0:
            raise RuntimeError(f"nimblejax: in-place registration failed: {self.last_error()}")

    def capture_copy_node(self, copy_fn: int, stream: int, which: int) -> None:
        """Launch the copy kernel ``copy_fn`` on ``stream`` while it captures a plan's
        graph, with an empty table marked as the copies in (``which`` 0, before the
        tasks) or out (1, after them): the nodes :meth:`set_copy_nodes` finds."""
        if self._lib.nimble_ffi_capture_copy_node(ctypes.c_void_p(copy_fn), ctypes.c_void_p(stream),
                                                  int(which)) != 0:
            raise RuntimeError(f"nimblejax: capturing a copy node failed: {self.last_error()}")

    def set_copy_nodes(self, plan_id: int, device: int, graph: int) -> int:
        """Make plan ``plan_id`` on ``device`` copy through the marked copy nodes of the
        CUgraph ``graph`` (its graph exec's), setting their tables each call instead of
        launching copy kernels beside the graph. Returns which were found (bit 0: in,
        bit 1: out)."""
        found = self._lib.nimble_ffi_set_copy_nodes(int(plan_id), int(device), ctypes.c_void_p(graph))
        if found < 0:
            raise RuntimeError(f"nimblejax: finding the graph's copy nodes failed: {self.last_error()}")
        return found

    def set_direct(self, plan_id: int, device: int, graph: int) -> bool:
        """Let plan ``plan_id`` on ``device`` launch its one kernel itself on calls with
        nothing to copy, where its CUgraph ``graph`` holds that kernel (re-pointed in
        place) besides the copy nodes alone; True where it does."""
        direct = self._lib.nimble_ffi_set_direct(int(plan_id), int(device), ctypes.c_void_p(graph))
        if direct < 0:
            raise RuntimeError(f"nimblejax: checking for a one-kernel graph failed: {self.last_error()}")
        return direct == 1

    def set_segments(self, plan_ids: Sequence[int], device: int = 0) -> None:
        """Make the registered plans ``plan_ids`` on ``device`` the segments of one plan
        (compiler/segments.py): the handler refuses a call of segment k unless segment
        k - 1 of the same call (or, for k = 0, the last segment of the previous call) was
        the last one called."""
        ids = (ctypes.c_longlong * len(plan_ids))(*map(int, plan_ids))
        if self._lib.nimble_ffi_set_segments(len(plan_ids), ids, int(device)) != 0:
            raise RuntimeError(f"nimblejax: marking a plan's segments failed: {self.last_error()}")

    def rest(self, plan_id: int, device: int = 0) -> None:
        """Point plan ``plan_id``'s graph exec on ``device`` back at its arena alone (no
        copies, no XLA buffers), so that Python may launch it to time it; the next call
        re-points what it needs."""
        if self._lib.nimble_ffi_rest(int(plan_id), int(device)) != 0:
            raise RuntimeError(f"nimblejax: resting a plan's graph failed: {self.last_error()}")

    def stats(self, plan_id: int, device: int = 0) -> dict:
        """Counters of a plan's arena on ``device``: calls, copy kernels launched beside
        the graph, kernel nodes re-pointed, host nanoseconds in the handler and, of those,
        in setting kernel nodes (re-pointed and copy nodes), launching copy kernels and
        launching the graph; copies made by the graph's own copy nodes, and how often
        those nodes' tables were set, and the calls that launched the plan's one kernel
        directly, no graph (shared with its views)."""
        out = (ctypes.c_ulonglong * 10)()
        if self._lib.nimble_ffi_stats(int(plan_id), int(device), out) != 0:
            raise KeyError(f"plan {plan_id} is not registered for device {device}")
        names = ("calls", "copy_launches", "nodes_set", "handler_ns", "set_nodes_ns", "copy_launch_ns",
                 "graph_launch_ns", "graph_copies", "copy_node_sets", "direct_launches")
        return dict(zip(names, out))

    def unregister(self, plan_id: int) -> None:
        """Forget a plan on every device; a call already running on it finishes first."""
        self._lib.nimble_ffi_unregister(plan_id)

    def copy_kernel_source(self) -> str:
        """CUDA C source of ``nimble_ffi_copy``, the kernel given to register."""
        return self._lib.nimble_ffi_copy_kernel_source().decode()


def _register_target(library: FfiLibrary) -> bool:
    """Register ``TARGET`` for CUDA with jax; False (and a warning) on failure.

    Without a CUDA plugin jax only queues the registration for a backend that
    never appears, which is harmless to the CPU path.
    """
    try:
        import jax

        capsule = jax.ffi.pycapsule(library.handler)
        jax.ffi.register_ffi_target(TARGET, capsule, platform="CUDA")
    except Exception as exc:  # any jax failure just disables the FFI path
        _warn_once(f"nimblejax: registering XLA FFI target {TARGET!r} failed: {exc!r}; {_FALLBACK}.")
        return False
    return True


def _load_uncached(cache_dir: str | os.PathLike, compiler: str | None) -> FfiLibrary | None:
    path = build(cache_dir, compiler=compiler)
    if path is None:
        return None
    try:
        library = FfiLibrary(ctypes.CDLL(str(path)), path)
    except (OSError, AttributeError) as exc:
        _warn_once(f"nimblejax: cannot load its XLA FFI handler {path}: {exc}; {_FALLBACK}.")
        return None
    return library if _register_target(library) else None


def load(cache_dir: str | os.PathLike, compiler: str | None = None) -> FfiLibrary | None:
    """Build (if needed) and load the handler, and register its FFI target.

    Done once per process: jax's target registry is process-wide, so later
    calls return the first result (``None`` included) whatever their
    arguments. Does not touch the GPU; call :meth:`FfiLibrary.init` for that.
    """
    global _loaded, _library
    with _load_lock:
        if not _loaded:
            _library = _load_uncached(cache_dir, compiler)
            _loaded = True
        return _library


def load_initialized(cache_dir: str | os.PathLike, required: bool = False) -> FfiLibrary | None:
    """`load`, then open libcuda (`FfiLibrary.init`): the handler ready to run plans, or
    None (after a warning) where it cannot be built, loaded or initialized; `required`
    (call_path="ffi") turns that into a RuntimeError."""
    library = load(cache_dir)
    if library is not None:
        try:
            library.init()
        except RuntimeError as e:
            warnings.warn(f"nimblejax: {e}; using the Python call path", RuntimeWarning, stacklevel=5)
            library = None
    if library is None and required:
        raise RuntimeError("call_path='ffi': the XLA FFI handler could not be built or loaded "
                           "(see the warning above); use call_path='auto' to fall back")
    return library

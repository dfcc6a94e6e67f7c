"""Resident operands of the XLA call path: which leaves of a top-level call JAX is handed.

xla_path.py `_call_xla` holds the previous call's `Record`: its leaves and flat results (held,
so their ids stay theirs), the leaves' signatures and where each operand came from.
A new call's leaf is
- HELD: the very jax.Array of the previous call (a parameter in a serving loop), of
  jax's concrete array type, not deleted, and not always passed. Its data is still in
  the resident runner's arena, where an earlier call copied it;
- j >= 0: the very jax.Array the previous call returned as flat output j (training
  state fed back), where j is feedable (a buffer of its own in the arena), the leaf is
  not always passed and not deleted. It is copied inside the arena from j's buffer;
- PASSED: every other leaf, and JAX dispatches only those.
A jax.Array is immutable and the record holds the previous call's leaves and results,
so the same object means the same data, and its id cannot be reused. numpy arrays
(mutable) are always passed, and so is a deleted array (JAX then says so). A leaf that
is not held must keep its signature, else the plan changes (the decision is None).
Always passed: the plan's pass-through inputs and donated leaves (see `_make_resident`
in xla_path.py for why).

The per-call check comes twice, deciding alike (tests/runtime/test_residency.py):
residency.c, a CPython extension built on first use with the system C compiler and
cached on disk per Python version and source hash (as runtime/ffi builds its handler),
and `steady_python`/`decide_python` below, used where no C compiler or Python headers
are found (after one warning) or with NIMBLE_RESIDENCY=python. A steady-state call is
then one C call (`steady_call`: the walk of the call's arguments down to their leaves,
the decision, the jitted call over the PASSED leaves, the record's update) and
tree_unflatten. The walk takes builtin containers (tuple, list, dict, None) and leaves of
the concrete array type, float, int and bool, and compares the call's structure with the
record's (`structure`, checked against jax's own flatten when the record is made); a
call with another type (a registered pytree node, a numpy array) is flattened by jax,
then checked in C as before (`steady`).
"""
from __future__ import annotations

import hashlib
import importlib.util
import os
import pathlib
import shutil
import subprocess
import sys
import sysconfig
import threading
from types import ModuleType
from typing import Any, Callable, NamedTuple, Optional

import jax

from nimblejax.arguments import is_array_like, signature
from nimblejax.runtime.ffi import _first_lines, _warn_once, build_into
from nimblejax.runtime.runner import HELD, PASSED
from jax._src.array import ArrayImpl  # the concrete jax.Array type

_SOURCE = pathlib.Path(__file__).with_name("residency.c")
_MODULE = "_nimble_residency"
_CFLAGS = ("-O2", "-shared", "-fPIC")
_BUILD_TIMEOUT_S = 120
_FALLBACK = "its XLA call path checks residency in Python (slower per call)"


class _ConfigPrecision:
    """jax.config's matmul precision, where jax has no State object for it."""

    @property
    def value(self) -> Any:
        return jax.config.jax_default_matmul_precision


def _precision_state() -> Any:
    # jax's State reads the setting in C++ and sees `with jax.default_matmul_precision`
    # and jax.config.update alike, at a third of jax.config's attribute lookup.
    try:
        from jax._src import config as jax_config

        state = jax_config.default_matmul_precision
        state.value
        return state
    except (ImportError, AttributeError):
        return _ConfigPrecision()


PRECISION = _precision_state()
"""`PRECISION.value`: the default matmul precision now (part of a resident call's key)."""


class Record:
    """The XLA path's previous call; `sources`, `passed` (the PASSED indices) and `fn`
    (the jitted call over the PASSED leaves) belong to one tuple of sources. The C
    check reads `leaves`, `outs`, `sources`, `sigs`, `holdable`, `out_feedable`, `avals`
    and `fn`, and writes `leaves`, `outs` and `avals`."""

    __slots__ = ("in_tree", "statics", "precision", "sigs", "always_passed", "feedable", "out_tree",
                 "sources", "passed", "fn", "leaves", "outs", "holdable", "out_feedable", "avals",
                 "structure")

    def __init__(self, in_tree, statics, precision, sigs: tuple, always_passed: frozenset,
                 feedable: frozenset, out_tree, sources: list, fn: Callable, leaves: list) -> None:
        self.in_tree, self.statics, self.precision, self.sigs = in_tree, statics, precision, sigs
        self.always_passed, self.feedable = always_passed, feedable
        self.out_tree, self.sources, self.fn, self.leaves = out_tree, sources, fn, leaves
        self.passed = [i for i, src in enumerate(sources) if src == PASSED]
        self.outs: list = []
        # Per leaf: 1 where it may be held or fed back (not always passed); per result:
        # 1 where it may be fed back. Bytes, so that the C check reads them directly.
        self.holdable = bytes(i not in always_passed for i in range(len(sigs)))
        self.out_feedable = bytes(j in feedable for j in range(max(feedable, default=-1) + 1))
        # Per leaf: the last aval that matched its signature (the C check's shortcut).
        self.avals: list = [None] * len(sigs)
        # The call's structure as the C walk codes it (`structure`), or None: jax flattens.
        self.structure: Optional[tuple] = None


def new_record(leaves: list, in_tree, statics, decided: Optional[tuple], last: Optional[Record],
               made: dict, make: Callable) -> Optional[tuple[Record, list]]:
    """(a record for the sources `decided` says, the PASSED leaves); every leaf passed
    when `decided` is None (a first call, a new signature). `make(in_tree, statics, sigs,
    sources)` makes the jitted call, cached in `made`. None: take the full path."""
    if decided is None:
        if any(isinstance(x, jax.core.Tracer) or not is_array_like(x) for x in leaves):
            return None  # under a transformation, or a bad argument: the full path says
        sigs, sources, passed = tuple(signature(x) for x in leaves), [PASSED] * len(leaves), leaves
    else:
        sigs, (sources, passed) = last.sigs, decided
    precision = PRECISION.value
    key = (in_tree, statics, sigs, tuple(sources), precision)
    entry = made.get(key)
    if entry is None:
        entry = made[key] = make(in_tree, statics, sigs, tuple(sources))
    if entry is False:
        return None
    fn, always_passed, feedable, out_tree = entry
    record = Record(in_tree, statics, precision, sigs, always_passed, feedable, out_tree(),
                    list(sources), fn, leaves)
    return record, passed


# ---- the check in Python (the C extension's twin) ------------------------------------
def same_signature(x: Any, sig: tuple) -> bool:
    """Whether leaf x (not held) still has signature `sig`."""
    if type(x) is ArrayImpl:
        return x.shape == sig[0] and x.dtype == sig[1] and x.weak_type == sig[2]
    return not isinstance(x, jax.core.Tracer) and is_array_like(x) and signature(x) == sig


def sources_python(leaves: list, last: Record) -> Optional[list]:
    """Where each leaf's data comes from this call (PASSED, HELD or a previous result),
    or None when a leaf that is not held changed its signature (the plan changes)."""
    if len(leaves) != len(last.leaves):
        return None
    sources = [HELD if (h and a is b and type(a) is ArrayImpl) else PASSED
               for a, b, h in zip(leaves, last.leaves, last.holdable)]
    if any(map(ArrayImpl.is_deleted, [a for a, s in zip(leaves, sources) if s == HELD])):
        sources = [PASSED if s == HELD and a.is_deleted() else s for a, s in zip(leaves, sources)]
    passed = [i for i, s in enumerate(sources) if s == PASSED]
    if passed and last.feedable:
        out_ids = {id(o): j for j, o in enumerate(last.outs) if j in last.feedable}
        for i in passed:
            x = leaves[i]
            j = out_ids.get(id(x))
            if j is not None and last.outs[j] is x and last.holdable[i] and not x.is_deleted():
                sources[i] = j
    for i, src in enumerate(sources):
        if src != HELD and not same_signature(leaves[i], last.sigs[i]):
            return None
    return sources


def steady_python(leaves: list, last: Record) -> Optional[list]:
    """The results of `last.fn` over the PASSED leaves when this call's sources are
    `last.sources` (then `last` holds these leaves and results), else None."""
    if sources_python(leaves, last) != last.sources:
        return None
    outs = last.fn(*[leaves[i] for i in last.passed])
    last.leaves, last.outs = leaves, outs
    return outs


def decide_python(leaves: list, last: Record) -> Optional[tuple[list, list]]:
    """(this call's sources, its PASSED leaves), or None when a signature changed; the
    sources are `last.sources` itself when they are the same."""
    sources = sources_python(leaves, last)
    if sources is None:
        return None
    if sources == last.sources:
        sources = last.sources
    return sources, [x for x, s in zip(leaves, sources) if s == PASSED]


# ---- the C extension ---------------------------------------------------------------
_lock = threading.Lock()
_extension: dict[str, Optional[ModuleType]] = {}  # cache dir -> the loaded module or None


class Check(NamedTuple):
    """A residency check: `steady` and `decide` take the flat leaves; `walker`, where the
    C extension is used, also walks a call's arguments itself (`steady_call`), so jax
    need not flatten a steady call; None otherwise."""

    steady: Callable
    decide: Callable
    walker: Optional[ModuleType] = None


PYTHON_CHECK = Check(steady_python, decide_python)


def implementation(choice: str, cache_dir: str) -> Check:
    """The check for Options.residency `choice`: "python", "c" (RuntimeError where the
    extension cannot be built) or "auto" (the extension, else Python)."""
    if choice == "python":
        return PYTHON_CHECK
    ext = load_extension(cache_dir)
    if ext is None:
        if choice == "c":
            raise RuntimeError("residency='c': nimblejax's residency check could not be built "
                               "(see the warning above); use residency='auto' or 'python'")
        return PYTHON_CHECK
    return Check(ext.steady, ext.decide, ext)


def structure(walker: Optional[ModuleType], args: tuple, kwargs: dict, leaves: list) -> Optional[tuple]:
    """The structure codes of a call for `walker.steady_call`, or None: no walker, a type
    the walk does not take, or leaves that are not jax's own, in jax's order."""
    made = None if walker is None else walker.structure(args, kwargs)
    if made is None:
        return None
    codes, walked = made
    if len(walked) != len(leaves) or any(a is not b for a, b in zip(walked, leaves)):
        return None
    return codes


def load_extension(cache_dir: str, compiler: Optional[str] = None) -> Optional[ModuleType]:
    """The residency extension, built (or found cached) and initialized once per process
    and cache dir; None (after one warning) where it cannot be built or loaded."""
    with _lock:
        if cache_dir not in _extension:
            path = build(cache_dir, compiler)
            _extension[cache_dir] = None if path is None else _load(path)
        return _extension[cache_dir]


def _load(path: pathlib.Path) -> Optional[ModuleType]:
    try:
        spec = importlib.util.spec_from_file_location(_MODULE, path)
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
        module.init(ArrayImpl, ArrayImpl.is_deleted, same_signature, PASSED, HELD)
    except (ImportError, OSError, AttributeError, TypeError) as exc:
        _warn_once(f"nimblejax: cannot load its residency check {path}: {exc}; {_FALLBACK}.")
        return None
    return module


def _flags() -> list[str]:
    return [*_CFLAGS, f"-I{sysconfig.get_paths()['include']}"]


def build_path(cache_dir: str) -> pathlib.Path:
    """``<cache_dir>/residency-<python tag>-<sha1(source, flags, ABI)[:12]>/<module>``."""
    suffix = sysconfig.get_config_var("EXT_SUFFIX") or ".so"
    digest = hashlib.sha1(_SOURCE.read_bytes())
    for part in [*_flags(), suffix]:
        digest.update(b"\0" + part.encode())
    tag = f"residency-{sys.implementation.cache_tag}-{digest.hexdigest()[:12]}"
    return pathlib.Path(cache_dir) / tag / f"{_MODULE}{suffix}"


def build(cache_dir: str, compiler: Optional[str] = None) -> Optional[pathlib.Path]:
    """Compile residency.c, or reuse a cached build: the path of the module, or None
    (after one warning) without a compiler or Python headers or when the build fails.
    The compiler writes a temporary file renamed into place, so processes building at
    once both succeed and no one loads a half-written module."""
    cc = shutil.which(compiler) if compiler else shutil.which("cc") or shutil.which("gcc")
    if cc is None:
        _warn_once(f"nimblejax: no C compiler ({compiler or 'cc or gcc on PATH'}) to build its "
                   f"residency check; {_FALLBACK}.")
        return None
    include = sysconfig.get_paths()["include"]
    if not os.path.isfile(os.path.join(include, "Python.h")):
        _warn_once(f"nimblejax: no Python headers (Python.h in {include}; a python3-dev package) "
                   f"to build its residency check; {_FALLBACK}.")
        return None
    return build_into(build_path(cache_dir), lambda tmp: _compile(cc, tmp), "its residency check",
                      _FALLBACK)


def _compile(cc: str, output: pathlib.Path) -> Optional[str]:
    """Compile residency.c into `output`; an error text, or None."""
    try:
        proc = subprocess.run([cc, *_flags(), str(_SOURCE), "-o", str(output)], capture_output=True,
                              text=True, timeout=_BUILD_TIMEOUT_S)
    except (OSError, subprocess.SubprocessError) as exc:
        return f"could not run {cc}: {exc}"
    if proc.returncode != 0:
        return f"{cc} exited with status {proc.returncode}:\n{_first_lines(proc.stderr)}"
    return None

"""Options: the single place nimblejax reads environment variables.

A frozen `Options` record is resolved once per `nimble.jit(...)`: keyword arguments (or an
`options=` record) override the environment, the environment overrides the defaults. The
whole record is part of every plan's cache key, so two functions built under different
settings never share a stale plan.

| field        | environment          | values                      | changes       |
|--------------|----------------------|-----------------------------|---------------|
| gemm         | NIMBLE_GEMM          | "lt" (cuBLASLt) / "cublas"  | the plan      |
| conv         | NIMBLE_CONV          | "auto" / "cudnn" / "im2col" | the plan      |
| cudnn        | (a file search)      | whether libcudnn is found   | the plan      |
| eager        | NIMBLE_EAGER         | launch tasks one by one     | runtime       |
| max_streams  | NIMBLE_MAX_STREAMS   | stream cap (None: 64)       | the plan      |
| debug        | NIMBLE_DEBUG         | 0 / 1 / 2 / 3 (below)       | checks        |
| call_path    | NIMBLE_CALL_PATH     | "auto" / "ffi" / "python"   | runtime       |
| residency    | NIMBLE_RESIDENCY     | "auto" / "c" / "python"     | runtime       |
| small_gemm   | NIMBLE_SMALL_GEMM    | True / False (0 turns off)  | the plan      |
| tc_gemm      | NIMBLE_TC_GEMM       | True / False (0 turns off)  | the plan      |
| horizontal   | NIMBLE_HORIZONTAL    | True / False (0 turns off)  | the plan      |
| split_k      | NIMBLE_SPLIT_K       | True / False (0 turns off)  | the plan      |
| fallback     | NIMBLE_FALLBACK      | "xla" / "error"             | unsupported   |
| loops        | NIMBLE_LOOPS         | "graph" / "unroll"          | the plan      |
| segments     | NIMBLE_SEGMENTS      | graphs a call runs as (1)   | runtime       |
| pdl          | NIMBLE_PDL           | True / False (0 turns off)  | runtime       |
| defer_build  | NIMBLE_DEFER_BUILD   | True / False (0 turns off)  | runtime       |

`gemm`: plain cuBLAS computes no GEMM epilogue, so its plans keep a GEMM's bias add and
activation as kernels (compiler/epilogue.py).

`max_streams`: None means the compiler's own cap, `STREAM_CAP` (64) in
compiler/streams/schedule.py, which says why.

`small_gemm`: small-M float GEMMs (an RNN's recurrent `h @ W_hh`) run as a generated
kernel instead of the library call (compiler/lowering/gemm_small.py says which, and why).

`tc_gemm`: small and medium TF32 float32 GEMMs (M = 32 to 128 rows) run as a generated
tensor-core kernel instead of cuBLASLt, epilogue included (compiler/lowering/gemm_tc.py
says which, and why).

`horizontal`: independent small elementwise kernels of one level are packed into one
launch (compiler/fusion_horizontal.py says which, and why).

`split_k`: a float32 GEMM with few output tiles and a long K, read only by adds and
multiplies, runs as partial products over slices of K summed in the kernel that reads
it, not by a reduction kernel of its own (compiler/canonicalize/split_k.py says which,
and why).

`pdl`: generated kernels are launched with programmatic dependent launch (Hopper): each
may start while the kernel before it on its stream ends, and waits before its first
memory access (runtime/pdl.py says how, and what it saved). On GPUs before Hopper
launches stay plain.

`defer_build`: a first call on the XLA path builds its new graph while XLA compiles the
call, not before (runtime/placement.py says how, and what it saved).

`debug`: 1 verifies every plan (no races between streams); 2 also prints the program
after every compiler pass to stderr: the stages `NimbleFunction.stages` returns
(compiler/stages.py); 3 also prints one line per call: its path, plan cache hit or miss,
and the leaves held, fed back or passed (nimblejax/calllog.py).

`residency`: which implementation of the XLA call path's residency check runs
(runtime/residency.py): "c" the C extension built on first use, "python" the pure-Python
one, "auto" the C one where it can be built (else Python, after one warning). Both
decide alike; "python" is for debugging and for machines without a C compiler.

`fallback`: what a function holding equations nimble cannot lower does. "xla" (default)
runs it with co-execution (runtime/coexec.py): nimble plans the regions it supports, the
rest stays with XLA inside the same jax.jit, with one warning naming the primitives;
"error" raises UnsupportedPrimitiveError naming the primitive and the user's line.

`loops`: "graph" (default) keeps a `while` with a run-time trip count, and a scan too
long to unroll, as a WHILE task and costly conds as SWITCH tasks, whose bodies are plans
of their own (compiler/loops.py); "unroll" unrolls scans and counter loops and turns
cond into a select where it can, and leaves the rest to co-execution (XLA runs it). The CPU interpreter runs them; on the
GPU they need CUDA conditional nodes (runtime/conditional.py).

`segments`: inside a JAX program (the XLA call path: a shard_map's per-device step, a
call inside the caller's jax.jit), n > 1 cuts the plan into up to n graphs launched one
after another as separate custom calls, each handing back the outputs it has finished
(compiler/segments.py says where the cuts fall), so that XLA can start on those, an
all-reduce of the last layers' gradients, while the rest computes. Operands and results
are then copied, not re-pointed; a call from Python runs one graph.

Whether a convolution goes to cuDNN is decided in one place from `conv`, `cudnn` and the
convolution: `use_cudnn` in compiler/canonicalize/conv_path.py.

Library discovery (where libcublas, libcublasLt and libcudnn are) reads its own variables
through `library_override` and `cuda_roots` below, also only here. The benchmark reads its
own command-line settings (bench/cli.py), and bench/measure.py its two variables
(CUPY_CACHE_DIR, pointed at an empty folder for cold compiles; NIMBLEJAX_BENCH_TRACEBACK).
"""
from __future__ import annotations

import dataclasses
import os
from dataclasses import dataclass
from typing import Any, Callable, Optional

GEMM_LIBRARIES = ("lt", "cublas")
CONV_PATHS = ("auto", "cudnn", "im2col")
CALL_PATHS = ("auto", "ffi", "python")
RESIDENCY_CHECKS = ("auto", "c", "python")
FALLBACKS = ("xla", "error")
LOOPS = ("unroll", "graph")
_ENV = {"gemm": "NIMBLE_GEMM", "conv": "NIMBLE_CONV", "eager": "NIMBLE_EAGER",
        "max_streams": "NIMBLE_MAX_STREAMS", "debug": "NIMBLE_DEBUG", "call_path": "NIMBLE_CALL_PATH",
        "residency": "NIMBLE_RESIDENCY", "small_gemm": "NIMBLE_SMALL_GEMM",
        "tc_gemm": "NIMBLE_TC_GEMM", "horizontal": "NIMBLE_HORIZONTAL", "split_k": "NIMBLE_SPLIT_K", "fallback": "NIMBLE_FALLBACK", "loops": "NIMBLE_LOOPS",
        "segments": "NIMBLE_SEGMENTS", "pdl": "NIMBLE_PDL", "defer_build": "NIMBLE_DEFER_BUILD"}


@dataclass(frozen=True)
class Options:
    gemm: str = "lt"
    conv: str = "auto"
    cudnn: bool = False
    eager: bool = False
    max_streams: Optional[int] = None
    debug: int = 0
    call_path: str = "auto"
    residency: str = "auto"
    small_gemm: bool = True
    tc_gemm: bool = True
    horizontal: bool = True
    split_k: bool = True
    fallback: str = "xla"
    loops: str = "graph"
    segments: int = 1
    pdl: bool = True
    defer_build: bool = True

    def __post_init__(self) -> None:
        _check_choice("gemm", self.gemm, GEMM_LIBRARIES)
        _check_choice("conv", self.conv, CONV_PATHS)
        _check_choice("call_path", self.call_path, CALL_PATHS)
        _check_choice("residency", self.residency, RESIDENCY_CHECKS)
        for switch in ("small_gemm", "tc_gemm", "horizontal", "split_k", "pdl", "defer_build"):
            _check_switch(switch, getattr(self, switch))
        _check_choice("fallback", self.fallback, FALLBACKS)
        _check_choice("loops", self.loops, LOOPS)
        if self.max_streams is not None and (not isinstance(self.max_streams, int)
                                             or isinstance(self.max_streams, bool)
                                             or self.max_streams < 1):
            raise ValueError(f"max_streams must be a positive int or None, got {self.max_streams!r}")
        if not isinstance(self.segments, int) or isinstance(self.segments, bool) or self.segments < 1:
            raise ValueError(f"segments must be a positive int, got {self.segments!r} "
                             f"(environment variable {_ENV['segments']} or nimble.jit(..., segments=...))")

    @property
    def verify(self) -> bool:
        return self.debug > 0

    @property
    def print_passes(self) -> bool:
        return self.debug >= 2

    def replace(self, **changes: Any) -> "Options":
        return dataclasses.replace(self, **changes)


def changed(options: Options) -> dict[str, Any]:
    """The fields of `options` that differ from the defaults (what a run records)."""
    default = Options()
    return {f.name: getattr(options, f.name) for f in dataclasses.fields(Options)
            if getattr(options, f.name) != getattr(default, f.name)}


def _check_switch(name: str, value: object) -> None:
    """An on/off option must be a bool; the error names its variable and keyword."""
    if not isinstance(value, bool):
        raise ValueError(f"{name} must be True or False, got {value!r} (environment variable "
                         f"{_ENV[name]}=0/1 or nimble.jit(..., {name}=...))")


def _check_choice(name: str, value: Any, allowed: tuple) -> None:
    if value not in allowed:
        raise ValueError(f"{name} must be one of {allowed}, got {value!r} "
                         f"(environment variable {_ENV[name]} or nimble.jit(..., {name}=...))")


def from_env(base: Optional[Options] = None, *, probe_cudnn: Optional[Callable[[], bool]] = None,
             **overrides: Any) -> Options:
    """The environment's options, then `base`'s non-default fields, then `overrides`
    (None means "not given"). `probe_cudnn()` says whether libcudnn can be found, where
    `cudnn` is not given (api.py passes the loader's search; this module imports no
    other nimblejax module); without it, cuDNN counts as not found."""
    env = os.environ
    values: dict[str, Any] = {
        "gemm": env.get(_ENV["gemm"], "lt"),
        "conv": env.get(_ENV["conv"], "auto"),
        "eager": _flag(env.get(_ENV["eager"], "")),
        "max_streams": _int_or_none(env.get(_ENV["max_streams"], ""), "max_streams"),
        "debug": _int_or_none(env.get(_ENV["debug"], ""), "debug") or 0,
        "call_path": env.get(_ENV["call_path"], "auto"),
        "residency": env.get(_ENV["residency"], "auto"),
        "small_gemm": _flag(env.get(_ENV["small_gemm"], "1")),
        "tc_gemm": _flag(env.get(_ENV["tc_gemm"], "1")),
        "horizontal": _flag(env.get(_ENV["horizontal"], "1")),
        "split_k": _flag(env.get(_ENV["split_k"], "1")),
        "fallback": env.get(_ENV["fallback"], "xla"),
        "loops": env.get(_ENV["loops"], "graph"),
        "segments": _int_or_none(env.get(_ENV["segments"], ""), "segments") or 1,
        "pdl": _flag(env.get(_ENV["pdl"], "1")),
        "defer_build": _flag(env.get(_ENV["defer_build"], "1")),
    }
    if base is not None:
        values.update(changed(base))
    values.update({k: v for k, v in overrides.items() if v is not None})
    unknown = set(values) - {f.name for f in dataclasses.fields(Options)}
    if unknown:
        raise TypeError(f"unknown nimblejax option(s) {sorted(unknown)}; "
                        f"known: {[f.name for f in dataclasses.fields(Options)]}")
    if "cudnn" not in values:
        values["cudnn"] = probe_cudnn is not None and probe_cudnn()
    return Options(**values)


def _flag(text: str) -> bool:
    return text not in ("", "0", "false", "False")


def _int_or_none(text: str, name: str) -> Optional[int]:
    if text == "":
        return None
    try:
        return int(text)
    except ValueError:
        raise ValueError(f"{_ENV[name]}={text!r} is not an integer") from None


# ---- library discovery and tools (read here so that no other module reads the env) ----
LIBRARY_OVERRIDES = {"cublas": "NIMBLEJAX_LIBCUBLAS", "cublasLt": "NIMBLEJAX_LIBCUBLASLT",
                     "cudnn": "NIMBLEJAX_LIBCUDNN"}


def library_override(name: str) -> Optional[str]:
    """$NIMBLEJAX_LIB<NAME>: an explicit path for library `name` (cublas, cublasLt, cudnn)."""
    return os.environ.get(LIBRARY_OVERRIDES[name]) or None


def cuda_roots() -> list[str]:
    """CUDA toolkit roots to search: $CUDA_PATH, $CUDA_HOME, /usr/local/cuda."""
    roots = [os.environ.get("CUDA_PATH"), os.environ.get("CUDA_HOME"), "/usr/local/cuda"]
    return [r for r in roots if r]


def preload_enabled() -> bool:
    """$NIMBLE_PRELOAD: whether `import nimblejax` imports CuPy on a background thread
    where a CUDA driver is installed (runtime/preload.py); 0 turns that off."""
    return _flag(os.environ.get("NIMBLE_PRELOAD", "1"))


def env_value(name: str) -> Optional[str]:
    """Any other variable a helper needs (the NVRTC test helper's compiler choice)."""
    return os.environ.get(name) or None


def kernel_cache_dir() -> str:
    """Where generated kernels' cubins are cached (runtime/compile.py): CuPy's kernel cache
    folder, $CUPY_CACHE_DIR else ~/.cupy/kernel_cache, so that a fresh CuPy cache is a
    fresh kernel cache for nimble too."""
    return os.environ.get("CUPY_CACHE_DIR") or os.path.join(os.path.expanduser("~"), ".cupy", "kernel_cache")


def cache_dir() -> str:
    """Where built artifacts (the XLA FFI handler, the residency check) are cached:
    $NIMBLEJAX_CACHE_DIR, else $XDG_CACHE_HOME/nimblejax, else ~/.cache/nimblejax."""
    explicit = os.environ.get("NIMBLEJAX_CACHE_DIR")
    if explicit:
        return explicit
    xdg = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return os.path.join(xdg, "nimblejax")

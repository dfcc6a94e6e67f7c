"""`nimble.jit`: flatten arguments, cache one plan per input signature, run it.

Calling conventions follow jax.jit: pytrees in and out, static_argnums/static_argnames
hashed into the cache key, Python scalars weakly typed.
"""
from __future__ import annotations

import functools
import importlib.util
import threading
from typing import Any, Callable, Optional, Sequence

import jax

from nimblejax import options as options_mod
from nimblejax.aot import Lowered
from nimblejax.arguments import (as_tuple as _as_tuple, check_hashable as _check_hashable,
                                 check_leaf as _check_leaf, donated_leaves, is_array_like as _is_array_like,
                                 name_like as _name_like, named_leaves as _named_leaves,
                                 signature as _signature, spec as _spec,
                                 split_statics as _split_statics,
                                 static_positions as _static_positions,
                                 warn_at_user_line as _warn_at_user_line)
from nimblejax.compiler.pipeline import Stages, compile_function, trace_stages
from nimblejax.compiler.plan import Plan
from nimblejax.options import Options
from nimblejax.runtime import choose, residency
from nimblejax.runtime.runner import DIRECT, Compiled
from nimblejax.xla_path import XlaPath

BACKENDS = ("cuda", "interpret", "jax")
OUTPUTS = ("jax", "cupy", "numpy")
_warned_no_gpu = False
_PRECISION = residency.PRECISION  # `.value`: the matmul precision now, read cheaply


def gpu_available() -> bool:
    """CuPy installed and a GPU the CUDA driver sees. The driver is asked, not CuPy, whose
    import (0.15-0.18 s) a cold first call then makes while its kernels compile."""
    from nimblejax.runtime import nvrtc

    return importlib.util.find_spec("cupy") is not None and nvrtc.driver_device_count() > 0


def default_backend() -> str:
    global _warned_no_gpu
    if gpu_available():
        return "cuda"
    if not _warned_no_gpu:
        _warn_at_user_line("nimblejax: no CUDA GPU is visible; nimble.jit falls back to jax.jit "
                           "(backend='jax'). Pass backend='interpret' to check a plan on the CPU.")
        _warned_no_gpu = True
    return "jax"


@functools.cache
def _cudnn_found() -> bool:
    """Whether libcudnn can be found (a file search, once per process): it decides
    whether convolutions may take the cuDNN path, so it is part of the options."""
    from nimblejax.runtime.libs import loader

    return loader.found("cudnn")


def jit(fun: Optional[Callable] = None, *, static_argnums: int | Sequence[int] = (),
        static_argnames: str | Sequence[str] = (), donate_argnums: int | Sequence[int] = (),
        backend: Optional[str] = None, output: str = "jax", options: Optional[Options] = None,
        **option_overrides: Any) -> Any:
    """Compile `fun` into one frozen multi-stream CUDA graph per input signature.

    Usable as ``@nimble.jit`` or ``@nimble.jit(static_argnums=...)``. ``backend`` is
    ``"cuda"`` (default where a GPU is visible), ``"interpret"`` (the CPU plan
    interpreter) or ``"jax"`` (plain jax.jit). ``output`` picks the type of returned
    arrays: ``"jax"`` (default), ``"numpy"``, or ``"cupy"`` (cuda backend only).

    Compiler and runtime options (``max_streams``, ``eager``, ``conv``, ``gemm``,
    ``debug``, ``call_path``, ``residency``, ``small_gemm``, ``tc_gemm``, ``horizontal``,
    ``fallback``, ``loops``, ``segments``, ``pdl``, ``defer_build``; see nimblejax.options) come from the environment when the function is decorated,
    overridden by ``options=Options(...)`` and then by keyword arguments:
    ``nimble.jit(f, max_streams=1)``.
    """
    kwargs = dict(static_argnums=static_argnums, static_argnames=static_argnames,
                  donate_argnums=donate_argnums, backend=backend, output=output,
                  options=options, **option_overrides)
    if fun is None:
        return functools.partial(jit, **kwargs)
    return NimbleFunction(fun, **kwargs)


class NimbleFunction(XlaPath):
    def __init__(self, fun: Callable, *, static_argnums=(), static_argnames=(), donate_argnums=(),
                 backend: Optional[str] = None, output: str = "jax",
                 options: Optional[Options] = None, **option_overrides: Any) -> None:
        if not callable(fun):
            raise TypeError(f"nimble.jit expects a function, got {type(fun).__name__}")
        if backend is not None and backend not in BACKENDS:
            raise ValueError(f"backend must be one of {BACKENDS}, got {backend!r}")
        if output not in OUTPUTS:
            raise ValueError(f"output must be one of {OUTPUTS}, got {output!r}")
        if options is not None and not isinstance(options, Options):
            raise TypeError(f"options must be a nimblejax.Options, got {type(options).__name__}")
        self.options = options_mod.from_env(options, probe_cudnn=_cudnn_found, **option_overrides)
        self.fun = fun
        functools.update_wrapper(self, fun)
        self.static_argnums, self.static_argnames = _static_positions(
            fun, _as_tuple(static_argnums), _as_tuple(static_argnames))
        self.donate_argnums = _as_tuple(donate_argnums)
        self.backend = backend
        self.output = output
        # The one call-spec cache: (body key, operand signatures) → runner.Compiled (the
        # plan, the output tree, its runners by arena), for every call path.
        self._specs: dict[Any, Compiled] = {}
        self._lock = threading.Lock()
        self._jax_fn: Optional[Callable] = None
        self._resolved_backend: Optional[str] = None  # checked on the first call
        # The last call's (treedef, leaves, signatures): leaves that are the very same
        # objects as last time (model parameters) keep their signature without a look.
        self._last: Optional[tuple] = None
        self._hit: Optional[tuple] = None  # (key, Compiled) of the last direct call
        self._entry: Optional[Callable] = None  # what a call runs, chosen on the first call
        self._resident: Optional[residency.Record] = None  # the XLA path's last call
        self._resident_fns: dict = {}  # (tree, statics, sigs, sources, precision) -> jitted call
        self._has_statics = bool(self.static_argnums or self.static_argnames)
        self._direct_ok = True  # calls may go straight to the jitted operation (_call_xla)
        self._checked = False  # a call ran the residency check
        self._warned: set = set()  # co-execution's warnings given so far (once each)

    def __call__(self, *args, **kwargs):
        try:
            return (self._entry or self._choose_entry())(*args, **kwargs)
        except (TypeError, ValueError):
            self._explain_bad_call(args, kwargs)  # nimble's message where it is clearer
            raise

    def _explain_bad_call(self, args: tuple, kwargs: dict) -> None:
        """Raise nimble's own TypeError for an unhashable static or a non-array argument."""
        statics, dyn_args, dyn_kwargs = self._split_statics(args, kwargs)
        _check_hashable(statics, self.fun)
        leaves = jax.tree_util.tree_leaves((dyn_args, dyn_kwargs))
        if not all(map(_is_array_like, leaves)):
            self._raise_bad_leaf(dyn_args, dyn_kwargs)

    def __get__(self, obj, objtype=None):
        """As a method: bind `self` as a static first argument (functools.partial of
        jax.jit with static_argnums=0, as jax users write it)."""
        if obj is None:
            return self
        return functools.partial(self._method_view(), obj)

    def _method_view(self) -> "NimbleFunction":
        view = getattr(self, "_as_method", None)
        if view is None:
            view = self._as_method = NimbleFunction(
                self.fun, static_argnums=(0,) + tuple(i + 1 for i in self.static_argnums),
                static_argnames=self.static_argnames, donate_argnums=self.donate_argnums,
                backend=self.backend, output=self.output, options=self.options)
        return view

    def _call_direct(self, *args, **kwargs):
        """The Python call path: flatten, look up the call spec, run its direct runner."""
        backend = self._resolved_backend
        leaves, key, in_tree, statics = self._flatten(args, kwargs)
        hit = self._hit
        # Same key object as last call (every leaf identical): skip hashing the key.
        compiled = hit[1] if hit is not None and hit[0] is key else self._specs.get(key)
        if compiled is None:
            with self._lock:
                compiled = self._specs.get(key) or self._direct(key, leaves, in_tree, statics, backend)
        self._hit = (key, compiled)
        outs = compiled.call(leaves)
        return jax.tree_util.tree_unflatten(compiled.out_tree, outs)

    def plan(self, *args, **kwargs) -> Plan:
        """The launch plan for these arguments (traced and planned, not compiled).
        Arguments may be jax.ShapeDtypeStruct: planning needs no data."""
        leaves, _key, in_tree, statics = self._flatten(args, kwargs, abstract_ok=True)
        return self._trace(leaves, in_tree, statics)[0]

    def partition(self, *args, **kwargs):
        """Co-execution's regions and XLA equations for these arguments (partition.py)."""
        from nimblejax.runtime import coexec

        leaves, _key, in_tree, statics = self._flatten(args, kwargs, abstract_ok=True)
        return coexec.partition_function(self._flat_fun(in_tree, statics, []), leaves, self.options)

    @property
    def cache_size(self) -> int:
        """Plans made so far (one per signature; grad and vmap add their own)."""
        return len(self._specs)

    @property
    def call_path(self) -> Optional[str]:
        """"xla" (a JAX operation), "python" (the direct path) or "jax" (plain jax.jit),
        once the first call has chosen."""
        return getattr(self, "_path", None)

    def runners(self) -> list:
        """Every runner made so far (runtime/runner.py), of every cached plan."""
        return [r for c in list(self._specs.values()) for r in c.runners.values()]

    def executables(self) -> list:
        """The plans built on a GPU so far: runtime/graph.py's DeviceGraph objects (one
        per runner and device), each with a `stats` dict of calls, graph launches and
        task launches (calls and input copies on the Python path)."""
        return [g for r in self.runners() for g in r.graphs()]

    def _choose_entry(self) -> Callable:
        with self._lock:
            if self._entry is None:
                backend = self._resolved_backend or self._resolve_backend()
                self._path, self._entry = self._pick_path(backend)
                if self.options.debug >= 3:  # one line per call (calllog.py)
                    from nimblejax import calllog

                    self._direct_ok = False
                    self._entry = calllog.logged(self, self._entry, self._path)
        return self._entry

    def _pick_path(self, backend: str) -> tuple[str, Callable]:
        if backend == "jax":
            return "jax", self._jax()
        path = self.options.call_path
        direct_only = self.output != "jax" or (backend == "cuda" and self.options.eager)
        if path == "ffi" and (direct_only or backend != "cuda"):
            raise ValueError("call_path='ffi' needs backend='cuda', output='jax' and eager=False")
        if path == "python" or direct_only:
            if self.donate_argnums and backend != "cuda":
                raise ValueError("donate_argnums on the interpret backend needs the XLA call path "
                                 "(call_path='auto'); the Python path cannot donate there")
            return "python", self._call_direct
        if backend == "cuda":
            from nimblejax.runtime import ffi

            self._library = ffi.load_initialized(options_mod.cache_dir(), required=path == "ffi")
            if self._library is None:
                return "python", self._call_direct
        self._op_jit_fn = self._op_jit()
        self._steady, self._decide, self._walker = residency.implementation(
            self.options.residency, options_mod.cache_dir())
        return "xla", self._call_xla

    def _resolve_backend(self) -> str:
        backend = self.backend or default_backend()
        if backend == "cuda" and not gpu_available():
            raise RuntimeError("nimble.jit(..., backend='cuda'): no CUDA GPU is visible on this "
                               "machine (no driver, or CUDA_VISIBLE_DEVICES hides every GPU); use "
                               "backend='interpret' to run the plan on the CPU or backend='jax'")
        if backend == "interpret" and self.output == "cupy":
            raise ValueError("output='cupy' needs backend='cuda' (the interpreter runs on the CPU)")
        self._resolved_backend = backend
        return backend

    def _plan_flat(self, flat_fun: Callable, specs) -> tuple[Plan, list]:
        """The XLA path's planner: (plan, the flat results' shapes, from the same trace).
        On the GPU its kernels start compiling at once, while JAX traces and compiles the
        rest of the call (runtime/compile.py)."""
        plan, out_shapes = compile_function(flat_fun, specs, self.options)
        if self._resolved_backend == "cuda":
            from nimblejax.runtime import pdl
            from nimblejax.runtime.compile import start_compiling
            from nimblejax.runtime.launch import plan_kernels

            # The sources the graph build will ask for (programmatic-launch forms included):
            # anything else would be compiled twice, the second time after the wait.
            start_compiling(plan_kernels(plan, pdl.applies(self.options.pdl), nested=True))
        return plan, out_shapes

    def _make_runner(self) -> Callable:
        return choose.runner_maker(self._resolved_backend, self.options, getattr(self, "_library", None))

    def _jax(self) -> Callable:
        if self._jax_fn is None:
            self._jax_fn = jax.jit(self.fun, static_argnums=self.static_argnums,
                                   static_argnames=self.static_argnames,
                                   donate_argnums=self.donate_argnums)
        return self._jax_fn

    def _flatten(self, args: tuple, kwargs: dict, abstract_ok: bool = False):
        statics, args, kwargs = self._split_statics(args, kwargs)
        if statics:
            _check_hashable(statics, self.fun)
        leaves, in_tree = jax.tree_util.tree_flatten((args, kwargs))
        last, head = self._last, (DIRECT, in_tree, statics, _PRECISION.value)
        # A leaf that is the same immutable jax.Array as last call keeps its signature
        # without a look (a numpy array may have been reshaped in place since).
        if last is not None and last[0] == in_tree and len(last[1]) == len(leaves):
            same = [a is b and isinstance(a, jax.Array) for a, b in zip(leaves, last[1])]
            if last[3][0] == head and all(same):
                return leaves, last[3], in_tree, statics
            sigs = [sig if s else None for s, sig in zip(same, last[2])]
        else:
            sigs = [None] * len(leaves)
        for i, sig in enumerate(sigs):
            if sig is None:
                if not (_is_array_like(leaves[i]) or
                        (abstract_ok and isinstance(leaves[i], jax.ShapeDtypeStruct))):
                    self._raise_bad_leaf(args, kwargs, abstract_ok)
                sigs[i] = _signature(leaves[i])
        key = (head, tuple(sigs))  # the call spec
        self._last = (in_tree, leaves, sigs, key)
        return leaves, key, in_tree, statics

    def _raise_bad_leaf(self, args, kwargs, abstract_ok: bool = False) -> None:
        """The first non-array leaf of the dynamic arguments, named as jax.jit would
        (`f.plan` also takes jax.ShapeDtypeStruct leaves)."""
        for name, leaf in _named_leaves(self.fun, args, kwargs, self.static_argnums):
            if not (abstract_ok and isinstance(leaf, jax.ShapeDtypeStruct)):
                _check_leaf(name, leaf, self.fun)

    def _split_statics(self, args: tuple, kwargs: dict) -> tuple:
        return _split_statics(self.static_argnums, self.static_argnames, args, kwargs)

    def _flat_fun(self, in_tree, statics, out_tree_box: list) -> Callable:
        """f with its statics bound, on flat leaves; records its output tree."""
        static_pos = dict((k, v) for k, v in statics if isinstance(k, int))
        static_kw = dict((k, v) for k, v in statics if isinstance(k, str))

        def full_args(flat) -> tuple[list, dict]:
            dyn_args, dyn_kwargs = jax.tree_util.tree_unflatten(in_tree, flat)
            it = iter(dyn_args)
            n = len(dyn_args) + len(static_pos)
            return ([static_pos[i] if i in static_pos else next(it) for i in range(n)],
                    dict(dyn_kwargs, **static_kw))

        def flat_fun(*flat):
            args, kwargs = full_args(flat)
            out = self.fun(*args, **kwargs)
            out_leaves, out_tree = jax.tree_util.tree_flatten(out)
            out_tree_box.append(out_tree)
            return out_leaves

        _name_like(flat_fun, self.fun, in_tree.num_leaves, *full_args(list(range(in_tree.num_leaves))),
                   self.static_argnums, self.static_argnames)
        return flat_fun

    def _trace(self, leaves, in_tree, statics):
        out_tree_box: list = []
        flat_fun = self._flat_fun(in_tree, statics, out_tree_box)
        plan, out_shapes = compile_function(flat_fun, [_spec(x) for x in leaves], self.options)
        return plan, out_tree_box[-1], out_shapes

    def _direct(self, key, leaves, in_tree, statics, backend) -> Compiled:
        """The direct path's entry for call spec `key` (its own: the key starts with
        DIRECT): its plan and runner (`call`: the runner, with typed PRNG keys crossing
        as their key data)."""
        from nimblejax.runtime import xla_op

        plan, out_tree, out_shapes = self._trace(leaves, in_tree, statics)
        run = choose.make_runner(plan, backend=backend, direct=True, options=self.options, output=self.output,
                              donated=self._donated_leaves(in_tree))
        compiled = Compiled(plan, out_tree, {DIRECT: run})
        compiled.call = xla_op.runner_on_key_data(run, leaves, out_shapes, self.output)
        self._specs[key] = compiled
        return compiled

    def _donated_leaves(self, in_tree) -> frozenset[int]:
        return donated_leaves(in_tree, self.donate_argnums, self.static_argnums)

    def stages(self, *args, **kwargs) -> Stages:
        """The program after each compiler pass for these arguments (which may be
        jax.ShapeDtypeStruct): pass name → Stage, printed as NIMBLE_DEBUG=2 prints it."""
        leaves, _key, in_tree, statics = self._flatten(args, kwargs, abstract_ok=True)
        return trace_stages(self._flat_fun(in_tree, statics, []), [_spec(x) for x in leaves], self.options)

    def lower(self, *args, **kwargs) -> Lowered:
        """Trace and plan these arguments (jax.ShapeDtypeStruct allowed) ahead of time, as
        jax.jit(f).lower does; `.compile()` builds the executable (nimblejax/aot.py)."""
        return Lowered(self, args, kwargs, self.stages(*args, **kwargs))

    def _prepare(self) -> str:
        """Resolve the backend and choose the call path now; the path's name."""
        self._choose_entry()
        return self._path

"""The XLA call path of a `nimble.jit` function (the default for jax.Array outputs): the
function's flat body as one `nimble_call` inside a jax.jit (`_op_call`), and a top-level
call that hands JAX only the leaves not resident in the runner's arena (`_call_xla`,
runtime/residency.py). `api.NimbleFunction` takes these methods from `XlaPath`; the state
they use is set in its constructor and `_pick_path`."""
from __future__ import annotations

from typing import Callable

import jax

from nimblejax.arguments import warn_at_user_line as _warn_at_user_line
from nimblejax.compiler.errors import UnsupportedPrimitiveError
from nimblejax.compiler.kinds import OutputKind
from nimblejax.runtime import placement, residency
from nimblejax.runtime import runner as runner_mod
from nimblejax.runtime.runner import RESIDENT

_tree_flatten, _tree_unflatten = jax.tree_util.tree_flatten, jax.tree_util.tree_unflatten
_PRECISION = residency.PRECISION  # `.value`: the matmul precision now, read cheaply
# XLA's compiler options for the jitted nimble calls (DebugOptions fields, as jax.jit's
# `compiler_options` takes them; None: XLA's defaults). Such a program is the plan's custom
# call and little else, so XLA's optimizing passes find nothing to do in it, while its
# compile is on a cold first call's path (0.13 to 0.18 s of the MLP's 0.29 s at batch 1,
# H200, f0ac4f5). examples/gpu/probe_wrapper_compile.py times candidates.
WRAPPER_COMPILER_OPTIONS: "dict | None" = None
# With this many leaves or fewer, f(x) is its jitted nimble operation (JAX's C++ dispatch):
# residency would save less than its check costs (H100: 9 µs against a 42 µs call).
DIRECT_MAX_LEAVES = 2


class XlaPath:
    def _call_xla(self, *args, **kwargs):
        """A top-level call on the XLA path, handing JAX only the leaves that are not
        resident in the runner's arena (runtime/residency.py says which, and why).
        Calls under a JAX transformation, and calls whose signature changed, pass every
        leaf. The steady state is tree_flatten, one call of the residency check (which
        also runs the jitted call) and tree_unflatten; where the C walk takes the call's
        arguments (builtin containers of arrays), one C call without tree_flatten."""
        last = self._resident
        if last is not None and last.structure is not None:
            with self._lock:
                if self._resident is last and last.precision == _PRECISION.value:
                    outs = self._walker.steady_call(args, kwargs, last.structure, last)
                    if outs is not None:
                        return self._steady_results(last, outs)
        if self._has_statics:
            statics, dyn_args, dyn_kwargs = self._split_statics(args, kwargs)
            leaves, in_tree = _tree_flatten((dyn_args, dyn_kwargs))
        else:
            statics, (leaves, in_tree) = (), _tree_flatten((args, kwargs))
        if not self._checked and len(leaves) <= DIRECT_MAX_LEAVES and self._direct_ok:
            self._entry = self._op_jit_fn  # from now on: f(x) is the jitted call itself
            return placement.first_run(self._op_jit_fn, args, kwargs, self.options.defer_build)
        self._checked = True
        with self._lock:
            last, decided = self._resident, None
            if (last is not None and last.in_tree == in_tree and last.statics == statics
                    and last.precision == _PRECISION.value):
                outs = self._steady(leaves, last)
                if outs is not None:
                    return self._steady_results(last, outs)
                decided = self._decide(leaves, last)
            made = residency.new_record(leaves, in_tree, statics, decided, last, self._resident_fns,
                                        self._make_resident)
            if made is None:
                self._resident = None
                return self._op_jit_fn(*args, **kwargs)
            record, passed = made
            record.outs = outs = placement.first_run(record.fn, passed, None, self.options.defer_build)
            if not self._has_statics:
                record.structure = residency.structure(self._walker, args, kwargs, leaves)
            self._resident = record
        return _tree_unflatten(record.out_tree, outs)

    def _steady_results(self, last: residency.Record, outs: list):
        if len(last.passed) == len(last.leaves) and self._direct_ok:  # twice nothing resident
            self._entry = self._op_jit_fn  # (fresh or donated): JAX's own call from now on
        return _tree_unflatten(last.out_tree, outs)

    def _make_resident(self, in_tree, statics, sigs, sources):
        """(the jitted call passing the PASSED leaves, the leaves always passed, the
        feedable outputs, the out tree), or False where this signature takes the full
        path (typed PRNG keys in or out)."""
        from nimblejax.runtime import xla_op

        specs = [jax.ShapeDtypeStruct(shape, dtype, weak_type=weak) for shape, dtype, weak in sigs]
        if any(xla_op.key_impl(s) is not None for s in specs):
            return False
        out_tree_box: list = []
        flat_fun = self._flat_fun(in_tree, statics, out_tree_box)
        donated = self._donated_leaves(in_tree)
        precision = _PRECISION.value
        body = xla_op.Body((id(self), in_tree, statics, donated, precision), flat_fun,
                           self._plan_flat, self._make_runner(), self._specs, donated,
                           arena=RESIDENT, options=self.options)
        avals = tuple(jax.core.ShapedArray(s.shape, s.dtype, weak_type=s.weak_type) for s in specs)
        try:  # the plan's trace gives the results' shapes: the function is traced once
            entry = body.compiled(avals)
        except UnsupportedPrimitiveError:  # co-execution: the full path (_op_call)
            if self.options.fallback == "error":
                raise
            return False
        if any(xla_op.key_impl(s) is not None for s in entry.out_shapes):
            return False
        if not out_tree_box:  # planned before, under other sources: trace for the tree
            jax.eval_shape(flat_fun, *specs)
        plan = entry.plan
        # Always passed: a leaf the plan returns as it is (XLA hands it back), and a donated
        # leaf (XLA writes a result into it; fed back, every result was a fresh XLA
        # allocation: H100, 96 state leaves, 1062 µs against 516 µs passed).
        slots = plan.output_slots
        always_passed = frozenset(s.index for s in slots if s.kind is OutputKind.INPUT) | donated
        feedable = frozenset(j for j, s in enumerate(slots) if s.kind is OutputKind.BUFFER)
        layout = xla_op.Residency(sources, avals)
        positions = [i for i, src in enumerate(sources) if src == runner_mod.PASSED]
        donate = tuple(k for k, i in enumerate(positions) if i in donated)
        fn = jax.jit(lambda *xs: xla_op.resident_call(body, layout, list(xs)), donate_argnums=donate,
                     compiler_options=WRAPPER_COMPILER_OPTIONS)
        return fn, always_passed, feedable, lambda: out_tree_box[-1]

    def _op_jit(self) -> Callable:
        return jax.jit(self._op_call, static_argnums=self.static_argnums,
                       static_argnames=self.static_argnames, donate_argnums=self.donate_argnums,
                       compiler_options=WRAPPER_COMPILER_OPTIONS)

    def _op_call(self, *args, **kwargs):
        """Traced by jax.jit once per signature: f's flat body as one nimble_call."""
        from nimblejax.runtime import coexec, xla_op

        statics, dyn_args, dyn_kwargs = self._split_statics(args, kwargs)
        leaves, in_tree = jax.tree_util.tree_flatten((dyn_args, dyn_kwargs))
        out_tree_box: list = []
        flat_fun = self._flat_fun(in_tree, statics, out_tree_box)
        donated = self._donated_leaves(in_tree)
        precision = jax.config.jax_default_matmul_precision
        fallback = None if self.options.fallback == "error" else coexec.fallback
        body = xla_op.Body((id(self), in_tree, statics, donated, precision), flat_fun,
                           self._plan_flat, self._make_runner(), self._specs, donated,
                           fallback=fallback, owned=True, options=self.options)
        try:
            outs = xla_op.call(body, leaves)
        except UnsupportedPrimitiveError:
            if self.options.fallback == "error":
                raise
            outs = self._coexec(body, leaves)
        if not out_tree_box:
            jax.eval_shape(flat_fun, *leaves)
        return jax.tree_util.tree_unflatten(out_tree_box[-1], outs)

    def _coexec(self, body, leaves: list) -> list:
        """Co-execution (runtime/coexec.py) inside this jax.jit; warns once per message."""
        from nimblejax.runtime import coexec

        return coexec.run(body, leaves, self._warned, _warn_at_user_line)

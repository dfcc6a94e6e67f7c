"""A nimble plan as a JAX operation: the `nimble_call` primitive.

`nimble.jit(f)` wraps f's flat body in one primitive inside a `jax.jit`, so JAX's own C++
dispatch does the per-call work (flattening, the signature cache, donation, asynchronous
dispatch, result arrays) and no nimble Python runs in a steady-state call.

- abstract eval: the shapes of f's outputs (jax.eval_shape; the plan itself is made
  once per signature, here, so that errors name the user's line);
- lowering: emit the runner's computation for the operand shapes:
  - on the cuda backend, an XLA FFI custom call to runtime/ffi/handler.cc
    (runtime/ffi_runner.py): the captured graph launched on XLA's stream, reading and
    writing XLA's buffers in place where only generated kernels touch them
    (runtime/inplace.py) and copying the others into and out of the plan's arena;
  - on the interpret backend, a host callback into the CPU plan interpreter (the
    callback of `jax.pure_callback`, without its copy of the operands onto a JAX device);
- batching (vmap): the same primitive over the batched function, planned as a whole;
- differentiation: a custom VJP whose backward pass is itself a nimble plan (the VJP of
  f, recomputing the forward inside the backward plan).
"""
from __future__ import annotations

import dataclasses
import threading
from dataclasses import dataclass, field
from typing import Any, Callable, Optional

import jax
import jax.numpy as jnp
import numpy as np
from jax.extend.core import Primitive
from jax.interpreters import batching, mlir

from nimblejax.compiler.errors import UnsupportedPrimitiveError
from nimblejax.compiler.plan import Plan
from nimblejax.runtime.runner import OPERATION, Compiled, Runner

nimble_call_p = Primitive("nimble_call")
nimble_call_p.multiple_results = True


@dataclass(frozen=True, eq=False)
class Body:
    """What one `nimble_call` runs. A primitive param, so hashable: equal bodies (same
    function, tree, statics and transformation) share their plans.

    `flat_fun` maps flat operands to flat results; `plan_fn(flat_fun, specs)` plans it
    (the owning NimbleFunction's options) and returns (plan, the flat results' shapes);
    `make_runner(plan, donated)` makes the runner for the backend; `specs` is the owner's one call-spec cache (call spec →
    runner.Compiled); `donated` are flat operand indices whose buffers jax.jit donates
    (results may alias them)."""

    key: tuple
    flat_fun: Callable = field(compare=False)
    plan_fn: Callable = field(compare=False)
    make_runner: Callable = field(compare=False)
    specs: dict = field(compare=False)
    donated: frozenset = frozenset()
    # Names the arena: bodies that differ only here share plans but not runners (the
    # resident path's arena holds operands between calls; nothing else may write it).
    arena: str = field(default=OPERATION, compare=False)
    # `fallback(body, operands)`: what runs where this body cannot be planned (a VJP or
    # a batched body holding a primitive nimble cannot lower): runtime/coexec.py's
    # partitioned evaluation. None: the planner's error is raised. `owned`: the caller
    # (api.py) handles this body's own failure; the bodies derived from it fall back.
    fallback: Optional[Callable] = field(default=None, compare=False)
    owned: bool = field(default=False, compare=False)
    # The owner's Options: co-execution classifies equations under them (a `while` is a
    # WHILE task in a region under loops="graph"). Planning itself goes through plan_fn.
    options: Any = field(default=None, compare=False)

    def __hash__(self) -> int:
        return hash(self.key)

    def __eq__(self, other) -> bool:
        return isinstance(other, Body) and self.key == other.key

    def derive(self, tag: tuple, flat_fun: Callable) -> "Body":
        return Body(self.key + (tag,), flat_fun, self.plan_fn, self.make_runner, self.specs,
                    fallback=self.fallback, options=self.options)

    def compiled(self, avals) -> Compiled:
        """The call spec's entry for these operand types, its plan made once. Made at
        trace time (abstract eval), so that the user's frames are on the stack and errors
        name their lines."""
        specs = tuple(jax.ShapeDtypeStruct(a.shape, a.dtype, weak_type=a.weak_type) for a in avals)
        key = (self.key, tuple((s.shape, np.dtype(s.dtype), s.weak_type) for s in specs))
        with _lock:
            found = self.specs.get(key)
            if found is None:
                plan, shapes = self.plan_fn(self.flat_fun, specs)
                found = self.specs[key] = Compiled(plan, out_shapes=shapes)
        return found

    def plan(self, avals) -> Plan:
        return self.compiled(avals).plan

    def runner(self, avals) -> Runner:
        """The runner of the plan for these operand types (at lowering), made once."""
        entry = self.compiled(avals)
        with _lock:
            found = entry.runners.get(self.arena)
            if found is None:
                found = entry.runners[self.arena] = self.make_runner(entry.plan, self.donated)
        return found


_lock = threading.RLock()  # plans and runners are made once, whichever thread asks first


@nimble_call_p.def_abstract_eval
def _abstract(*avals, body: Body):
    # The results' shapes come from the plan's own trace: the function is not traced again.
    return [jax.core.ShapedArray(s.shape, s.dtype, weak_type=getattr(s, "weak_type", False))
            for s in body.compiled(avals).out_shapes]


@nimble_call_p.def_impl
def _impl(*args, body: Body):
    return jax.jit(lambda *xs: nimble_call_p.bind(*xs, body=body))(*args)


def _lowering(ctx, *args, body: Body, residency: "Residency | None" = None):
    """Both primitives' lowering: `nimble_call` passes every operand, a resident call
    (`residency`) only those its sources say PASSED."""
    avals = ctx.avals_in if residency is None else residency.avals
    runner = body.runner(avals)
    runner.place(lowering_devices(ctx))
    return runner.lower(ctx, *args, sources=None if residency is None else residency.sources)


def lowering_devices(ctx) -> list:
    """The devices the computation being lowered may run on: its device assignment
    (jit), the mesh of a shard_map, or else every local device."""
    axis = ctx.module_context.axis_context
    devices = getattr(axis, "device_assignment", None)
    if not devices and getattr(axis, "mesh", None) is not None:
        devices = tuple(axis.mesh.devices.flat)
    if not devices:
        devices = jax.local_devices()
    return [d for d in devices if d.process_index == jax.process_index()]


mlir.register_lowering(nimble_call_p, _lowering)


def _batched(args, dims, *, body: Body):
    """vmap plans the batched function as a whole (one graph), not a loop."""
    size = next(a.shape[d] for a, d in zip(args, dims) if d is not None)
    moved = [a if d is None else jnp.moveaxis(a, d, 0) for a, d in zip(args, dims)]
    in_axes = tuple(None if d is None else 0 for d in dims)
    vmapped = body.derive(("vmap", in_axes, size), jax.vmap(body.flat_fun, in_axes=in_axes))
    outs = _bind(vmapped, moved)
    return outs, [0] * len(outs)


batching.primitive_batchers[nimble_call_p] = _batched


# ---- resident operands ------------------------------------------------------------------
# A top-level call of a nimble function passes XLA only the leaves that changed since
# its previous call (api.py decides which); the others are still in the arena, where
# an earlier call of the same runner copied them. Only api.py binds this primitive, on
# concrete arrays, so it needs no batching or differentiation rule.
nimble_resident_p = Primitive("nimble_resident_call")
nimble_resident_p.multiple_results = True




@dataclass(frozen=True)
class Residency:
    """Where each flat operand of a resident call comes from (`sources`): PASSED (an
    operand of the call), HELD (still in the arena from an earlier call) or j >= 0 (the
    previous call's flat output j, still in the arena's output buffer: a training loop
    feeding its state back); and every operand's type."""

    sources: tuple
    avals: tuple


def resident_call(body: Body, residency: Residency, fresh_leaves: list) -> list:
    return nimble_resident_p.bind(*fresh_leaves, body=body, residency=residency)


@nimble_resident_p.def_abstract_eval
def _resident_abstract(*avals, body: Body, residency: Residency):
    return _abstract(*residency.avals, body=body)


mlir.register_lowering(nimble_resident_p, _lowering)


def call(body: Body, leaves: list) -> list:
    """Bind `nimble_call` on `leaves`, differentiable through a custom VJP. Typed PRNG
    key arrays cross as their uint32 key data, unwrapped here and wrapped back."""
    in_impls = [key_impl(x) for x in leaves]
    out_impls = [key_impl(s) for s in jax.eval_shape(body.flat_fun, *leaves)]
    if not any(i is not None for i in in_impls + out_impls):
        return _call(body, leaves)
    tag = ("keys", tuple(None if i is None else i.name for i in in_impls + out_impls))
    on_data = dataclasses.replace(body, key=body.key + (tag,),
                                  flat_fun=on_key_data(body.flat_fun, in_impls, out_impls))
    return from_key_data(_call(on_data, to_key_data(leaves, in_impls)), out_impls)


def key_impl(x) -> Any:
    """The PRNG implementation of a typed key array (or its shape), else None."""
    dtype = getattr(x, "dtype", None)
    if dtype is None or not jax.dtypes.issubdtype(dtype, jax.dtypes.prng_key):
        return None
    return getattr(dtype, "_impl", None) or dtype.impl  # `impl` before JAX 0.4.16


def runner_on_key_data(run: Callable, leaves: list, out_shapes, output: str) -> Callable:
    """The direct path's `run` (api.py) for typed PRNG key arrays: a plan takes and makes
    their key data; key results come back as keys for output="jax", else as key data."""
    in_impls = [key_impl(x) for x in leaves]
    out_impls = [key_impl(s) if output == "jax" else None for s in out_shapes]
    if all(i is None for i in in_impls + out_impls):
        return run
    return lambda xs: from_key_data(run(to_key_data(xs, in_impls)), out_impls)


def to_key_data(xs, impls) -> list:
    return [x if i is None else jax.random.key_data(x) for x, i in zip(xs, impls)]


def from_key_data(xs, impls) -> list:
    return [x if i is None else jax.random.wrap_key_data(x, impl=i) for x, i in zip(xs, impls)]


def on_key_data(fun: Callable, in_impls: list, out_impls: list) -> Callable:
    """`fun` on key data: typed key operands and results as their uint32 data."""

    def physical(*xs):
        return to_key_data(fun(*from_key_data(xs, in_impls)), out_impls)

    return physical


def _call(body: Body, leaves: list) -> list:
    @jax.custom_vjp
    def run(*xs):
        return _bind(body, xs)

    def fwd(*xs):
        return run(*xs), xs

    def bwd(xs, cts):
        differentiable = [_is_float(x) for x in xs]
        float_cts = [c for c in cts if _is_float(c)]
        grads = iter(_bind(_vjp_body(body, len(xs)), list(xs) + float_cts))
        return tuple(next(grads) if d else np.zeros(np.shape(x), jax.dtypes.float0)
                     for x, d in zip(xs, differentiable))

    run.defvjp(fwd, bwd)
    return run(*leaves)


def _bind(body: Body, operands) -> list:
    """nimble_call on `operands`, or the body's fallback where it cannot be planned (the
    plan is made, or its error raised, when the primitive is bound)."""
    if body.fallback is None or body.owned:
        return nimble_call_p.bind(*operands, body=body)
    try:
        body.plan(tuple(jax.typeof(x) for x in operands))
    except UnsupportedPrimitiveError:
        return body.fallback(body, list(operands))
    return nimble_call_p.bind(*operands, body=body)


def _is_float(x) -> bool:
    return jnp.issubdtype(x.dtype, jnp.inexact)


def _vjp_body(body: Body, n: int) -> Body:
    """The backward plan: (operands, cotangents of float results) → gradients of the
    float operands."""

    def backward(*args):
        xs, float_cts = args[:n], iter(args[n:])
        outs, pull = jax.vjp(body.flat_fun, *xs)
        cts = [next(float_cts) if _is_float(o) else np.zeros(o.shape, jax.dtypes.float0) for o in outs]
        return [g for g, x in zip(pull(cts), xs) if _is_float(x)]

    return body.derive(("vjp", n), backward)

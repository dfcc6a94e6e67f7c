"""Random numbers → the threefry2x32 uint32 arithmetic JAX defines for them.

Expanded while tracing (compiler/trace.py calls `expand` for every equation named in
RANDOM_PRIMITIVES or touching a PRNG key array), so that the graph checked, fused and
lowered holds plain uint32 arithmetic only:

- a typed key array (dtype key<fry>, shape S) is its key data, a uint32 value of shape
  S + (2,); random_wrap, random_unwrap and random_clone are identities on it;
- random_seed, random_split, random_fold_in and random_bits are the PRNG implementation's
  own functions (`impl.seed`, `impl.split`, ...), traced at plan time with JAX's
  iterated vmap over the key axes: the same jaxpr jax.jit lowers, which also honors
  `jax_threefry_partitionable` as it is set when the function is planned;
- threefry2x32 (which those emit) is its 20 rounds of uint32 add / rotate / xor,
  the unrolled form of JAX's `_threefry2x32_lowering`; iota_2x32_shape is an iota;
- any other primitive applied to key arrays (slice, squeeze, concatenate, select_n,
  gather, ...) is the same primitive vmapped over the trailing key-data axis.

Only the threefry2x32 implementation is supported; the others (rbg, unsafe_rbg) are
built on XLA's RngBitGenerator and raise NotImplementedError.
"""
from __future__ import annotations

import functools
import math
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from nimblejax.compiler.errors import UnsupportedPrimitiveError
from nimblejax.compiler.ir import Atom, Node
from nimblejax.compiler.jaxprs import open_jaxpr

KEY_PRIMITIVES = frozenset({"random_seed", "random_split", "random_fold_in", "random_bits"})
IDENTITIES = frozenset({"random_wrap", "random_unwrap", "random_clone"})
RANDOM_PRIMITIVES: frozenset[str] = KEY_PRIMITIVES | IDENTITIES | {"threefry2x32", "iota_2x32_shape",
                                                                   "random_gamma"}
SUPPORTED_IMPL = "threefry2x32"


# ---- key arrays ----------------------------------------------------------------------
def is_key(dtype: Any) -> bool:
    # numpy dtypes first: called for every value traced
    return not isinstance(dtype, np.dtype) and jax.dtypes.issubdtype(dtype, jax.dtypes.prng_key)


def key_impl(dtype: Any) -> Any:
    """The PRNG implementation of a key dtype (jax.random.wrap_key_data takes it);
    `_impl` since JAX 0.4.16, `impl` before."""
    return getattr(dtype, "_impl", None) or dtype.impl


def physical(aval: Any) -> tuple[tuple[int, ...], np.dtype]:
    """(shape, dtype) of a value as the graph holds it: key arrays as their key data."""
    shape = tuple(int(d) for d in aval.shape)
    if is_key(aval.dtype):
        return shape + _key_shape(aval.dtype), np.dtype(np.uint32)
    return shape, np.dtype(aval.dtype)


@functools.lru_cache(maxsize=None)
def _key_shape(dtype: Any) -> tuple[int, ...]:
    return tuple(jax.eval_shape(jax.random.key_data, jax.ShapeDtypeStruct((), dtype)).shape)


def key_data(value: Any) -> Any:
    """A constant of the traced function as the graph holds it."""
    dtype = getattr(value, "dtype", None)
    return jax.random.key_data(value) if dtype is not None and is_key(dtype) else value


def touches_keys(eqn: Any) -> bool:
    return any(is_key(v.aval.dtype) for v in list(eqn.invars) + list(eqn.outvars))


# ---- expansion -----------------------------------------------------------------------
def expand(builder: Any, eqn: Any, ins: list[Atom], source: str) -> list[Atom]:
    """The graph values of `eqn`'s results, its arithmetic added to `builder`
    (a trace.GraphBuilder) in plain uint32 primitives."""
    name = eqn.primitive.name
    avals = [v.aval for v in eqn.invars]
    if name in IDENTITIES:
        return list(ins)
    if name in KEY_PRIMITIVES:
        fn = _key_function(name, eqn.params, avals, source)
    elif name == "threefry2x32":
        fn = functools.partial(threefry2x32, shape=tuple(eqn.outvars[0].aval.shape))
    elif name == "iota_2x32_shape":
        fn = functools.partial(iota_2x32, shape=tuple(eqn.params["shape"]), source=source)
    elif name == "random_gamma":
        fn = _gamma_function(eqn, avals, source)
    else:
        fn = _on_key_data(eqn, avals, source)
    closed = jax.make_jaxpr(fn)(*[jax.ShapeDtypeStruct(*physical(a)) for a in avals])
    jaxpr, consts = open_jaxpr(closed)
    start = len(builder.nodes)
    outs = builder.inline(jaxpr, [builder.const(c) for c in consts] + list(ins), source)
    # The user's line, not this file's, on every node (errors name it). `stack` (which
    # threefry_split emits) and `unstack` stay: canonicalization rewrites them
    # (canonicalize/stacking.py) wherever they come from.
    builder.nodes[start:] = [Node(n.primitive, n.inputs, n.outputs, n.params, source, n.effectful)
                             for n in builder.nodes[start:]]
    return outs


def _key_function(name: str, params: dict, avals: list, source: str):
    """The implementation's function for one key primitive, over key data, vmapped over
    the key axes as JAX's own lowering of the primitive does (jax random/prng.py)."""
    impl = params["impl"] if name == "random_seed" else key_impl(avals[0].dtype)
    _check_impl(impl, name, source)
    if name == "random_seed":
        return _vmapped(impl.seed, avals[0].ndim)
    if name == "random_split":
        return _vmapped(lambda k: impl.split(k, tuple(params["shape"])), avals[0].ndim)
    if name == "random_bits":
        bits = lambda k: impl.random_bits(k, params["bit_width"], tuple(params["shape"]))  # noqa: E731
        return _vmapped(bits, avals[0].ndim)
    keys, msgs = avals  # random_fold_in: broadcasting over the key axes
    shape = tuple(np.broadcast_shapes(keys.shape, msgs.shape))

    def fold_in(k, m):
        k = jnp.broadcast_to(k, shape + k.shape[keys.ndim:])
        return _vmapped(impl.fold_in, len(shape))(k, jnp.broadcast_to(m, shape))

    return fold_in


def _gamma_function(eqn: Any, avals: list, source: str):
    """random_gamma over key data: JAX's own implementation (a rejection loop per value,
    vmapped as JAX's GPU lowering runs it), whose key operations and `while_loop` the
    trace then expands like any other (the loop becomes a WHILE task)."""
    impl = key_impl(avals[0].dtype)
    _check_impl(impl, "random_gamma", source)
    gamma = functools.partial(eqn.primitive.impl, log_space=eqn.params["log_space"], use_vmap=True)

    def fn(key_data, a):
        return gamma(jax.random.wrap_key_data(key_data, impl=impl.name), a)

    return fn


def _vmapped(f, n: int):
    for _ in range(n):
        f = jax.vmap(f)
    return f


def _check_impl(impl: Any, name: str, source: str) -> None:
    if impl.name != SUPPORTED_IMPL:
        raise UnsupportedPrimitiveError(
            f"nimblejax supports only the {SUPPORTED_IMPL} PRNG implementation; '{name}' "
            f"(from {source}) uses a key of the '{impl.name}' implementation. Use "
            f"jax.random.key(..., impl='threefry2x32') or nimble.jit(..., backend=\"jax\").")


def _on_key_data(eqn: Any, avals: list, source: str):
    """A non-random primitive on key arrays, vmapped over the key-data axis."""
    keyed = [is_key(a.dtype) for a in avals]
    if not any(keyed) or not all(is_key(v.aval.dtype) for v in eqn.outvars) or any(
            len(_key_shape(a.dtype)) != 1 for a, k in zip(avals, keyed) if k):
        raise UnsupportedPrimitiveError(
            f"nimblejax cannot apply '{eqn.primitive.name}' to PRNG key arrays (from "
            f"{source}). Use nimble.jit(..., backend=\"jax\").")

    def fn(*xs):
        return eqn.primitive.bind(*xs, **eqn.params)

    return jax.vmap(fn, in_axes=tuple(-1 if k else None for k in keyed), out_axes=-1)


# ---- threefry2x32 and its counters ----------------------------------------------------
ROTATIONS = ((13, 15, 26, 6), (17, 29, 16, 24))
KS_PARITY = 0x1BD11BDA  # Threefry's key schedule constant


def threefry2x32(k1, k2, x1, x2, *, shape: tuple[int, ...]) -> list:
    """Threefry-2x32 with 20 rounds (Salmon et al. 2011), as JAX computes it: operands
    broadcast to `shape` (right-aligned, as JAX's GPU lowering does), all uint32."""
    k1, k2, x1, x2 = (jnp.broadcast_to(a, shape) for a in (k1, k2, x1, x2))
    ks = (k1, k2, k1 ^ k2 ^ np.uint32(KS_PARITY))
    x = [x1 + ks[0], x2 + ks[1]]
    for block in range(5):
        for r in ROTATIONS[block % 2]:
            x[0] = x[0] + x[1]
            x[1] = _rotate_left(x[1], r) ^ x[0]
        x[0] = x[0] + ks[(block + 1) % 3]
        x[1] = x[1] + ks[(block + 2) % 3] + np.uint32(block + 1)
    return x


def _rotate_left(x, r: int):
    return lax.shift_left(x, np.uint32(r)) | lax.shift_right_logical(x, np.uint32(32 - r))


def iota_2x32(*, shape: tuple[int, ...], source: str) -> tuple:
    """(high, low) 32-bit halves of a 64-bit iota of `shape`: arrays of 2**32 elements or
    more are beyond a uint32 iota."""
    if math.prod(shape) >= 2 ** 32:
        raise UnsupportedPrimitiveError(
            f"nimblejax: random numbers for 2**32 or more elements (from {source}). "
            f"Use nimble.jit(..., backend=\"jax\").")
    low = lax.iota(np.uint32, math.prod(shape)).reshape(shape)
    return jnp.zeros(shape, np.uint32), low

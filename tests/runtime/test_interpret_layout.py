"""The interpreter's NumPy moves of data (runtime/interpret_layout.py) give JAX's bytes."""
from __future__ import annotations

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest
from jax import lax

from nimblejax.runtime import interpret_layout

r = np.random.default_rng(0)


def values(shape, dtype):
    """Random values of `dtype` with a NaN of an unusual payload and a negative zero."""
    if np.dtype(dtype).kind in "iu":
        return r.integers(-100, 100, shape).astype(dtype)
    x = r.standard_normal(shape).astype(np.float32)
    flat = x.reshape(-1)
    flat[0] = np.uint32(0x7FC01234).view(np.float32)
    flat[-1] = -0.0
    return x.astype(dtype)


PROGRAMS = {
    "slice": lambda x: x[:, 1:3, ::2],
    "broadcast_in_dim": lambda x: jnp.broadcast_to(x[:, :1, :, None], (2, 3, 4, 5)),
    "reshape": lambda x: x.reshape(6, 4),
    "transpose": lambda x: x.transpose(2, 0, 1),
    "squeeze": lambda x: lax.squeeze(x[:1, :, :1], (0, 2)),
    "rev": lambda x: lax.rev(x, (0, 2)),
    "concatenate": lambda x: lax.concatenate([x, x[:, :1], x], 1),
    "iota": lambda x: lax.broadcasted_iota(x.dtype, (3, 4), 1) if x.dtype.kind != "f" else lax.iota(x.dtype, 7),
}


def each_equation(fn, x):
    """(equation, its operands' values, JAX's results) for every equation of fn(x)."""
    jaxpr = jax.make_jaxpr(fn)(x)
    env = {jaxpr.jaxpr.invars[0]: x}
    for eqn in jaxpr.eqns:
        vals = [np.asarray(v.val, dtype=v.aval.dtype) if hasattr(v, "val") else env[v] for v in eqn.invars]
        outs = eqn.primitive.bind(*vals, **eqn.params)
        outs = outs if eqn.primitive.multiple_results else [outs]
        yield eqn, vals, outs
        env.update(zip(eqn.outvars, outs))


def bits(a) -> bytes:
    a = np.ascontiguousarray(np.asarray(a))
    return a.dtype.str.encode() + str(a.shape).encode() + a.tobytes()


@pytest.mark.parametrize("dtype", [np.float32, ml_dtypes.bfloat16, np.int32, np.uint8], ids=str)
@pytest.mark.parametrize("name", sorted(PROGRAMS))
def test_numpy_gives_jaxs_bytes(name, dtype):
    x = values((2, 3, 4), dtype)
    covered = 0
    for eqn, vals, outs in each_equation(PROGRAMS[name], x):
        got = interpret_layout.evaluate(eqn.primitive.name, [np.asarray(v) for v in vals], eqn.params)
        if eqn.primitive.name == name:
            assert got is not None, eqn
            covered += 1
        if got is not None:
            assert bits(got) == bits(outs[0]), eqn
    assert covered


def test_what_it_leaves_to_jax():
    x = values((2, 3), np.float32)
    assert interpret_layout.evaluate("add", [x, x], {}) is None
    assert interpret_layout.evaluate("broadcast_in_dim", [1.0], {"shape": (2,), "broadcast_dimensions": (),
                                                                  "sharding": None}) is None  # Python number
    assert interpret_layout.evaluate("reshape", [x], {"new_sizes": (3, 2), "dimensions": (1, 0),
                                                      "sharding": None}) is None
    assert interpret_layout.evaluate("transpose", [x], {"permutation": (1, 0), "a_new_param": 1}) is None
    assert interpret_layout.evaluate("concatenate", [x, np.zeros((2, 3), np.int32)], {"dimension": 0}) is None


def test_jax_arrays_and_numpy_scalars_are_operands():
    x = jnp.arange(6, dtype=jnp.float32).reshape(2, 3)
    got = interpret_layout.evaluate("transpose", [x], {"permutation": (1, 0)})
    assert isinstance(got, np.ndarray) and bits(got) == bits(np.asarray(x).T)
    got = interpret_layout.evaluate("broadcast_in_dim", [np.float32(2.5)],
                                    {"shape": (2, 2), "broadcast_dimensions": (), "sharding": None})
    assert got.dtype == np.float32 and (got == 2.5).all()

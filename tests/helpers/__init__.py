"""What several test files share: model and program zoos, the primitive table and its
records, the C++ kernel emulator, graph evaluation helpers."""

import jax as _jax

from nimblejax.bench.models.layers import on_device


# `values` (NumPy's draws) as a jax.Array of `dtype`, cast by NumPy: the primitive table's
# arguments were 312 programs, 5.7 s of CPU, through jnp.asarray, against 0.1 s so; the
# same bits (float32, bfloat16 and float16 from float64, integers wrapping the same way:
# checked for every record).
on_host = on_device


def jit_init(model, key, *args, **kwargs):
    """A flax `model.init(key, *args, **kwargs)` as one jitted program: run eagerly, it
    compiles each of its operations (4.9 s of the Inception training step's 19 s test,
    one process)."""
    import functools

    return _jax.jit(functools.partial(model.init, **kwargs))(key, *args)

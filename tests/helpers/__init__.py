"""What several test files share: model and program zoos, the primitive table and its
records, the C++ kernel emulator, graph evaluation helpers."""

import jax as _jax
import numpy as _np


def on_host(values, dtype):
    """`values` (NumPy's draws) as a jax.Array of `dtype`: cast by NumPy, then put on the
    device. `jnp.asarray(values, dtype)` runs a small XLA program (a copy, and a convert
    where the dtype changes), compiled once per shape and dtype in each process and again
    after conftest.py empties JAX's caches: the primitive table's arguments were 312
    programs, 5.7 s of CPU, against 0.1 s so. The same bits (float32, bfloat16 and
    float16 from float64, integers wrapping the same way: checked for every record)."""
    return _jax.device_put(_np.asarray(values).astype(dtype))


def jit_init(model, key, *args, **kwargs):
    """A flax `model.init(key, *args, **kwargs)` as one jitted program: run eagerly, it
    compiles each of its operations (4.9 s of the Inception training step's 19 s test,
    one process)."""
    import functools

    return _jax.jit(functools.partial(model.init, **kwargs))(key, *args)

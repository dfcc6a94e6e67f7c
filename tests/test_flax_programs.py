"""flax.linen / optax programs (flax_programs.py) under nimble.jit against jax.jit:
the plan interpreter on the CPU, the GPU under `-m gpu`."""
from __future__ import annotations

import jax
import pytest

import nimblejax as nimble
from models import assert_tree_close

flax_programs = pytest.importorskip("flax_programs", reason="flax and optax are test extras")
PROGRAMS = flax_programs.PROGRAMS


def _data(tree):
    """Typed PRNG keys compare by their key data."""
    return jax.tree_util.tree_map(
        lambda a: jax.random.key_data(a) if jax.dtypes.issubdtype(a.dtype, jax.dtypes.prng_key) else a,
        tree)


def check(name: str, backend: str) -> None:
    fn, args = PROGRAMS[name]()
    want = jax.jit(fn)(*args)
    got = nimble.jit(fn, backend=backend)(*args)
    assert_tree_close(_data(got), _data(want))


@pytest.mark.parametrize("name", sorted(PROGRAMS))
def test_program_interpret(name):
    check(name, "interpret")


@pytest.mark.gpu
@pytest.mark.parametrize("name", sorted(PROGRAMS))
def test_program_cuda(name):
    check(name, "cuda")

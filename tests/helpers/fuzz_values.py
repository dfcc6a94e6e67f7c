"""The pieces of the fuzzer's random programs (tests/helpers/fuzz_programs.py): the value
pool's records, a program as source text with its random inputs, and the builder the
ops draw through. See fuzz_programs.py for what is drawn and why."""
from __future__ import annotations

import math
from dataclasses import dataclass, field

import jax
import jax.numpy as jnp
import numpy as np
from hypothesis import strategies as st

FLOATS = ("float32", "float16", "bfloat16")
INTS = ("int32", "uint32")
DTYPES = FLOATS + INTS + ("bool",)
DIMS = (1, 1, 2, 3, 4, 5, 7, 8, 16, 33)
BIG_DIMS = (64, 127, 256, 300)  # rarely: unrolled loops, tiled transposes, split reductions
MAX_SIZE = 1 << 17
SMALL = 4096  # ops that multiply the size (broadcasts, dots) stay under this


@dataclass
class Value:
    name: str
    shape: tuple[int, ...]
    dtype: str
    exact: bool = True

    @property
    def size(self) -> int:
        return math.prod(self.shape)

    @property
    def ndim(self) -> int:
        return len(self.shape)


@dataclass
class Program:
    inputs: list[Value] = field(default_factory=list)
    lines: list[str] = field(default_factory=list)
    outputs: list[str] = field(default_factory=list)
    seed: int = 0
    max_streams: int | None = None  # nimble's option: fewer streams, other events and reuse
    tf32: bool = False  # holds a float32 dot at default precision (TF32 on the GPU)
    # Holds a half-precision value: XLA may skip its rounding (excess precision), so
    # float32 results made from it are only as close as halves.
    halves: bool = False

    @property
    def source(self) -> str:
        args = ", ".join(v.name for v in self.inputs)
        body = "".join(f"    {line}\n" for line in self.lines)
        return f"def f({args}):\n{body}    return ({', '.join(self.outputs)},)\n"

    def function(self):
        scope = {"jnp": jnp, "lax": jax.lax, "jax": jax, "np": np}
        exec(compile(self.source, "<fuzz program>", "exec"), scope)
        return scope["f"]

    def args(self) -> list[np.ndarray]:
        return make_args([(v.shape, v.dtype) for v in self.inputs], self.seed)

    def __repr__(self) -> str:  # what hypothesis prints for a falsifying example
        specs = ", ".join(f"({v.shape}, {v.dtype!r})" for v in self.inputs)
        return (f"\n{self.source}# inputs: [{specs}], seed={self.seed}, "
                f"max_streams={self.max_streams}\n")


def make_args(specs, seed: int) -> list[np.ndarray]:
    """Random inputs (never zeros): floats in [-1.5, 1.5], ints in [-20, 20)."""
    r = np.random.default_rng(seed)
    out = []
    for shape, dtype in specs:
        if dtype in FLOATS:
            # Cast by NumPy: jnp.asarray(x, dtype) compiles an XLA program for each
            # drawn shape (the same bits: tests/helpers/__init__.py, on_host).
            a = r.uniform(-1.5, 1.5, shape).astype(jnp.dtype(dtype))
        elif dtype == "int32":
            a = r.integers(-20, 20, shape).astype(np.int32)
        elif dtype == "uint32":
            a = r.integers(0, 2 ** 32 - 1, shape, dtype=np.uint64).astype(np.uint32)
        else:
            a = r.random(shape) > 0.5
        out.append(np.asarray(a))
    return out


class Skip(Exception):
    """The drawn op does not apply to the drawn operand."""


class Builder:
    def __init__(self, draw, big_odds: int = 10) -> None:
        self.draw = draw
        self.big_odds = big_odds  # one shape in this many gets a big axis
        self.p = Program()
        self.pool: list[Value] = []

    # ---- values ----------------------------------------------------------------------
    def new_input(self, shape, dtype) -> Value:
        v = Value(f"a{len(self.p.inputs)}", tuple(shape), dtype)
        self.p.halves |= dtype in FLOATS[1:]
        self.p.inputs.append(v)
        self.pool.append(v)
        return v

    def emit(self, expr: str, shape, dtype, exact: bool) -> Value:
        v = Value(f"v{len(self.p.lines)}", tuple(int(d) for d in shape), dtype, exact)
        self.p.halves |= dtype in FLOATS[1:]
        self.p.lines.append(f"{v.name} = {expr}")
        self.pool.append(v)
        return v

    def pick(self) -> Value:
        # Mostly a recent value (long chains), sometimes an older one (several consumers).
        recent = self.draw(st.booleans())
        k = len(self.pool)
        i = self.draw(st.integers(max(0, k - 2), k - 1) if recent else st.integers(0, k - 1))
        return self.pool[i]

    def other(self, x: Value, dtypes=None) -> str:
        """A second operand for x: an existing value of x's shape, a fresh input of a shape
        that broadcasts to x's (unit or dropped leading axes), or a Python scalar."""
        dtypes = dtypes or (x.dtype,)
        same = [v for v in self.pool if v.shape == x.shape and v.dtype in dtypes and v is not x]
        how = self.draw(st.sampled_from(["same", "fresh", "broadcast", "scalar"]))
        if how == "same" and same:
            return self.draw(st.sampled_from(same)).name
        if how == "scalar" and x.dtype in FLOATS:
            return repr(self.draw(st.sampled_from([0.5, -1.25, 2.0])))
        if how == "scalar" and x.dtype == "int32":
            return repr(self.draw(st.sampled_from([3, -2, 7])))
        shape = x.shape
        if how == "broadcast" and x.ndim:
            drop = self.draw(st.integers(0, x.ndim))
            shape = tuple(1 if self.draw(st.booleans()) else d for d in x.shape[drop:])
        return self.new_input(shape, self.draw(st.sampled_from(dtypes))).name

    # ---- shapes ----------------------------------------------------------------------
    def shape(self, max_rank: int = 4, big: bool = True) -> tuple[int, ...]:
        rank = self.draw(st.integers(0, max_rank))
        dims = [self.draw(st.sampled_from(DIMS)) for _ in range(rank)]
        if big and rank and self.draw(st.integers(1, self.big_odds)) == 1:
            dims[self.draw(st.integers(0, rank - 1))] = self.draw(st.sampled_from(BIG_DIMS))
        while math.prod(dims) > MAX_SIZE:
            dims[dims.index(max(dims))] = 3
        return tuple(dims)

    def axes(self, x: Value, min_size: int = 0) -> tuple[int, ...]:
        return tuple(sorted(self.draw(st.sets(st.integers(0, x.ndim - 1), min_size=min_size,
                                              max_size=x.ndim)))) if x.ndim else ()

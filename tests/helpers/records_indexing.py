"""Primitive records for rules_indexing (see primitive_table.py): gather and the scatter
family in every mode (promise_in_bounds, clip, fill_or_drop with out-of-range indices),
1-D and multi-D index vectors, batching dims, windows, dtypes; and dynamic slices with
traced, out-of-range starts."""
from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from tests.helpers import on_host
from tests.helpers.primitive_table import rec, f32, dt, i32, u32, boolean  # noqa: F401

GD, SD = lax.GatherDimensionNumbers, lax.ScatterDimensionNumbers
CLIP, FILL, PROMISE = (lax.GatherScatterMode.CLIP, lax.GatherScatterMode.FILL_OR_DROP,
                       lax.GatherScatterMode.PROMISE_IN_BOUNDS)


def idx(*shape, lo, hi, dtype=jnp.int32):
    return lambda r: on_host(r.integers(lo, hi, shape), dtype)


def every(lo, hi, *shape):
    """Each index in [lo, hi) at least once (the edges of the valid range included),
    shuffled, then random ones up to `shape`."""
    def make(r):
        n = int(np.prod(shape))
        vals = np.concatenate([r.permutation(np.arange(lo, hi)), r.integers(lo, hi, max(0, n - (hi - lo)))])
        return on_host(r.permutation(vals[:n]).reshape(shape), jnp.int32)
    return make


def perm(n, k):
    """k distinct indices below n (scatter overwrite: no duplicates, so any order wins)."""
    return lambda r: on_host(r.permutation(n)[:k], jnp.int32)


def near_one(*shape, dtype=jnp.float32):
    return lambda r: on_host(r.uniform(0.8, 1.25, shape), dtype)


# ---- gather ----------------------------------------------------------------------------
rec("gather", lambda x, i: x[i], f32(10, 6), idx(7, lo=-10, hi=10), label="rows-negative")
rec("gather", lambda x, i: x[i] * 2.0 + 1.0, f32(10, 6), idx(3, 5, lo=0, hi=10), label="fused-2d-idx")
rec("gather", lambda x, i: x[:, i], f32(4, 9), idx(5, lo=0, hi=9), label="columns")
rec("gather", lambda x, i: jnp.take(x, i, axis=0, mode="fill", fill_value=-7.0), f32(8, 3),
    every(-12, 12, 24), label="fill")
rec("gather", lambda x, i: jnp.take(x, i, axis=1, mode="fill"), f32(3, 8),
    idx(9, lo=-3, hi=12), label="fill-nan")
rec("gather", lambda x, i: jnp.take(x, i, axis=0, mode="fill"), i32(8, 3),
    idx(9, lo=-3, hi=12), label="fill-i32")
rec("gather", lambda x, i: jnp.take(x, i, axis=0, mode="clip"), f32(8, 3),
    idx(9, lo=-5, hi=14), label="clip")
rec("gather", lambda x, i: x[i], dt(jnp.bfloat16, 12, 5), idx(6, lo=0, hi=12), label="bf16")
rec("gather", lambda x, i: x[i], i32(12, 5), idx(6, lo=0, hi=12), label="i32")
rec("gather", lambda x, i: x[i], boolean(12, 5), idx(6, lo=0, hi=12), label="bool")
rec("gather", lambda x, i: x[i], f32(12, 5), idx(6, lo=0, hi=12, dtype=jnp.uint8), label="u8-index")
rec("gather", lambda x, i: jnp.take_along_axis(x, i[:, None], axis=1)[:, 0], f32(6, 11),
    idx(6, lo=0, hi=11), label="take-along-axis")
rec("gather", lambda x, i: x[i[:, 0], :, i[:, 1]], f32(5, 4, 6), idx(3, 2, lo=0, hi=5),
    label="two-axes")
rec("gather", lambda x, i: lax.gather(
        x, i, GD(offset_dims=(2, 3), collapsed_slice_dims=(0,), start_index_map=(0, 2)),
        slice_sizes=(1, 2, 3), mode=CLIP),
    f32(5, 6, 7), every(-4, 9, 3, 4, 2), label="window-clip")
rec("gather", lambda x, i: lax.gather(
        x, i, GD(offset_dims=(2, 3), collapsed_slice_dims=(0,), start_index_map=(0, 2)),
        slice_sizes=(1, 2, 3), mode=FILL, fill_value=0.5),
    f32(5, 6, 7), every(-2, 8, 3, 4, 2), label="window-fill")
rec("gather", lambda x, i: lax.gather(
        x, i, GD(offset_dims=(1, 2), collapsed_slice_dims=(), start_index_map=(0,)),
        slice_sizes=(2, 4), mode=PROMISE),
    f32(7, 4), idx(5, 1, lo=0, hi=6), label="window-promise")
rec("gather", lambda x, i: lax.gather(
        x, i, GD(offset_dims=(2,), collapsed_slice_dims=(1,), start_index_map=(1,),
                 operand_batching_dims=(0,), start_indices_batching_dims=(0,)),
        slice_sizes=(1, 1, 5), mode=CLIP),
    f32(4, 6, 5), every(-2, 8, 4, 3, 1), label="batching")
rec("gather", jax.vmap(lambda x, i: x[i]), dt(jnp.bfloat16, 3, 7, 4), idx(3, 5, lo=0, hi=7),
    label="vmap")


def _cross_entropy(logits, labels):
    """optax.softmax_cross_entropy_with_integer_labels, written out."""
    logz = jax.nn.logsumexp(logits, axis=-1)
    picked = jnp.take_along_axis(logits, labels[:, None], axis=-1)[:, 0]
    return jnp.mean(logz - picked)


rec("gather", jax.value_and_grad(_cross_entropy), f32(8, 13), idx(8, lo=0, hi=13),
    label="cross-entropy-grad")


# ---- scatter family --------------------------------------------------------------------
rec("scatter", lambda x, i, u: x.at[i].set(u), f32(10, 4), perm(10, 6), f32(6, 4))
rec("scatter", lambda x, i, u: x.at[i].set(u, mode="clip"), f32(10), perm(10, 4), f32(4), label="clip")
rec("scatter", lambda x, i, u: x.at[i].set(u), dt(jnp.bfloat16, 9, 3), perm(9, 5),
    dt(jnp.bfloat16, 5, 3), label="bf16")
rec("scatter", lambda x, i, u: x.at[i].set(u), boolean(9), perm(9, 5), boolean(5), label="bool")
rec("scatter", lambda x, i, u: x.at[i].set(u, mode="drop"), i32(9), perm(14, 5), i32(5),
    label="drop-i32")
rec("scatter-add", lambda x, i, u: x.at[i].add(u), f32(10, 4), idx(12, lo=-10, hi=10), f32(12, 4))
rec("scatter-add", lambda x, i, u: x.at[i].add(u, mode="drop"), f32(6, 3), every(-9, 9, 20),
    f32(20, 3), label="drop")
rec("scatter-add", lambda x, i, u: x.at[i].add(u, mode="clip"), f32(6, 3), every(-9, 9, 20),
    f32(20, 3), label="clip")
rec("scatter-add", lambda x, i, u: x.at[i].add(u, mode="promise_in_bounds"), f32(6, 3),
    idx(12, lo=0, hi=6), f32(12, 3), label="promise")
rec("scatter-add", lambda x, i, u: x.at[i].add(u), dt(jnp.bfloat16, 7, 4), idx(9, lo=0, hi=7),
    dt(jnp.bfloat16, 9, 4), label="bf16")
rec("scatter-add", lambda x, i, u: x.at[i].add(u), dt(jnp.float16, 7, 4), idx(9, lo=0, hi=7),
    dt(jnp.float16, 9, 4), label="f16")
rec("scatter-add", lambda x, i, u: x.at[i].add(u), i32(7, 4), idx(9, lo=0, hi=7), i32(9, 4),
    label="i32")
rec("scatter-add", lambda x, i, u: x.at[i].add(u), u32(7), idx(9, lo=0, hi=7), u32(9), label="u32")
rec("scatter-add", lambda x, i, u: x.at[i].add(u), dt(jnp.uint8, 7, lo=0, hi=200),
    idx(9, lo=0, hi=7), dt(jnp.uint8, 9, lo=0, hi=200), label="u8")
# scatter-sub is rewritten to a negation and a scatter-add (canonicalize/scatter_sub.py).
rec("scatter-sub", lambda x, i, u: x.at[i].subtract(u), f32(10, 4), idx(12, lo=-10, hi=10), f32(12, 4))
rec("scatter-sub", lambda x, i, u: x.at[i].subtract(u), i32(7, 4), idx(9, lo=0, hi=7), i32(9, 4),
    label="i32")
rec("scatter-sub", lambda x, i, u: x.at[i].subtract(u), dt(jnp.uint8, 7, lo=0, hi=200),
    idx(9, lo=0, hi=7), dt(jnp.uint8, 9, lo=0, hi=200), label="u8-wraps")
rec("scatter-sub", lambda x, i, u: x.at[i].subtract(3.0) + u.sum(), f32(6, 3), every(-9, 9, 20),
    f32(20, 3), label="literal")
rec("scatter-add", lambda x, i, u: x.at[i[:, 0], i[:, 1]].add(u), f32(5, 6), idx(10, 2, lo=-6, hi=6),
    f32(10), label="two-axes")
rec("scatter-add", lambda x, i, u: lax.scatter_add(
        x, i, u, SD(update_window_dims=(1, 2), inserted_window_dims=(), scatter_dims_to_operand_dims=(0,)),
        mode=FILL),
    f32(8, 5), every(-2, 10, 12, 1), f32(12, 2, 5), label="window-drop")
rec("scatter-add", lambda x, i, u: lax.scatter_add(
        x, i, u, SD(update_window_dims=(1, 2), inserted_window_dims=(), scatter_dims_to_operand_dims=(0,)),
        mode=CLIP),
    f32(8, 5), every(-3, 11, 14, 1), f32(14, 2, 5), label="window-clip")
rec("scatter-add", lambda x, i, u: lax.scatter_add(
        x, i, u, SD(update_window_dims=(2,), inserted_window_dims=(1,), scatter_dims_to_operand_dims=(1,),
                    operand_batching_dims=(0,), scatter_indices_batching_dims=(0,)),
        mode=FILL),
    f32(3, 7, 4), every(-1, 9, 3, 5, 1), f32(3, 5, 4), label="batching")
rec("scatter-add", jax.vmap(lambda x, i, u: x.at[i].add(u)), dt(jnp.bfloat16, 3, 7, 4),
    idx(3, 5, lo=0, hi=7), dt(jnp.bfloat16, 3, 5, 4), label="vmap")
rec("scatter-add", jax.grad(lambda x, i: jnp.sum(jnp.sin(x[i]))), f32(9, 4), idx(11, lo=0, hi=9),
    label="grad-of-gather")
rec("scatter-mul", lambda x, i, u: x.at[i].multiply(u), f32(8, 3), idx(10, lo=-8, hi=8),
    near_one(10, 3))
rec("scatter-mul", lambda x, i, u: x.at[i].multiply(u), dt(jnp.bfloat16, 8), idx(10, lo=0, hi=8),
    near_one(10, dtype=jnp.bfloat16), label="bf16")
rec("scatter-mul", lambda x, i, u: x.at[i].multiply(u, mode="clip"), i32(8, lo=-9, hi=9),
    idx(10, lo=-3, hi=11), i32(10, lo=-3, hi=4), label="i32-clip")
rec("scatter-mul", lambda x, i, u: x.at[i].multiply(u), dt(jnp.int8, 8, lo=-9, hi=9),
    idx(10, lo=0, hi=8), dt(jnp.int8, 10, lo=-3, hi=4), label="i8")
rec("scatter-min", lambda x, i, u: x.at[i].min(u), f32(8, 3), idx(10, lo=-8, hi=8), f32(10, 3))
rec("scatter-min", lambda x, i, u: x.at[i].min(u), dt(jnp.bfloat16, 8, 3), idx(10, lo=0, hi=8),
    dt(jnp.bfloat16, 10, 3), label="bf16")
rec("scatter-min", lambda x, i, u: x.at[i].min(u), i32(8), idx(10, lo=0, hi=8), i32(10), label="i32")
rec("scatter-min", lambda x, i, u: x.at[i].min(u), dt(jnp.int16, 8, lo=-300, hi=300),
    idx(10, lo=0, hi=8), dt(jnp.int16, 10, lo=-300, hi=300), label="i16")
rec("scatter-min", lambda x, i, u: lax.scatter_min(x, i[:, None], u, SD((), (0,), (0,))),
    boolean(8), idx(10, lo=0, hi=8), boolean(10), label="bool")
rec("scatter-max", lambda x, i, u: x.at[i].max(u), f32(8, 3), idx(10, lo=-8, hi=8), f32(10, 3))
rec("scatter-max", lambda x, i, u: x.at[i].max(u, mode="clip"), dt(jnp.float16, 8), idx(10, lo=-2, hi=11),
    dt(jnp.float16, 10), label="f16-clip")
rec("scatter-max", lambda x, i, u: x.at[i].max(u), u32(8), idx(10, lo=0, hi=8), u32(10), label="u32")
rec("scatter-max", lambda x, i, u: x.at[i].max(u), dt(jnp.uint8, 8, lo=0, hi=250),
    idx(10, lo=0, hi=8), dt(jnp.uint8, 10, lo=0, hi=250), label="u8")
rec("scatter-max", lambda x, i, u: lax.scatter_max(x, i[:, None], u, SD((), (0,), (0,))),
    boolean(8), idx(10, lo=0, hi=8), boolean(10), label="bool")

# ---- dynamic slices with traced starts, out-of-range ones clamped ----------------------
rec("dynamic_slice", lambda x, i, j: lax.dynamic_slice(x, (i, j), (3, 2)), f32(6, 7),
    lambda r: jnp.int32(r.integers(-9, -1)), lambda r: jnp.int32(r.integers(7, 20)),
    label="clamped-both")
rec("dynamic_slice", lambda x, i: lax.dynamic_slice_in_dim(x, i, 4, axis=1), dt(jnp.bfloat16, 3, 9),
    lambda r: jnp.int32(r.integers(2, 5)), label="bf16")
rec("dynamic_update_slice", lambda x, u, i, j: lax.dynamic_update_slice(x, u, (i, j)), f32(6, 7),
    f32(2, 3), lambda r: jnp.int32(r.integers(5, 20)), lambda r: jnp.int32(r.integers(-9, -1)),
    label="clamped-both")
rec("dynamic_update_slice", lambda x, u, i: lax.dynamic_update_slice_in_dim(x, u, i, axis=0),
    i32(5, 3), i32(2, 3), lambda r: jnp.int32(r.integers(1, 4)), label="i32")

"""XLA's GPU argmax/argmin, simulated literally: JAX's reducer (jax/_src/lax/lax.py,
_ArgMinMaxReducer) applied to (value, index) pairs in the combination structure of the
fusion XLA emits (nimblejax/compiler/lowering/xla_reduce_order.py describes and arranges
it): each thread's loop with the accumulator first, shuffle-down trees with the own
lane first (a lane past the warp reads its own value), the cross-warp step with init
values in the lanes past the warp count, inits in the padding of split reductions.
The tests compare it with the GPU data and with the rank model the kernel uses."""
from __future__ import annotations

import math

from nimblejax.compiler.lowering.xla_reduce_order import WARP, Arrangement


def reducer(is_max: bool):
    def red(op, acc):
        (ov, oi), (av, ai) = op, acc
        better = ov > av if is_max else ov < av
        pick_val = better or ov != ov
        pick_idx = pick_val or (ov == av and oi < ai)
        return (ov if pick_val else av, oi if pick_idx else ai)
    return red


def rows_reducer(is_max: bool):
    """`reducer` applied to many rows at once: each value and index a NumPy array (one
    element per row), the same choice made in every element (`ov != ov` is isnan)."""
    import numpy as np

    def red(op, acc):
        (ov, oi), (av, ai) = op, acc
        better = ov > av if is_max else ov < av
        pick_val = better | np.isnan(ov)
        pick_idx = pick_val | ((ov == av) & (oi < ai))
        return np.where(pick_val, ov, av), np.where(pick_idx, oi, ai)
    return red


def _shuffle_tree(lanes, red, max_dist):
    lanes = list(lanes)
    d = max_dist
    while d > 0:
        lanes = [red(lanes[l], lanes[l + d] if l + d < len(lanes) else lanes[l])
                 for l in range(len(lanes))]
        d //= 2
    return lanes[0]


def simulate(p: Arrangement, elems, red, init):
    """elems: (value, index) pairs of one reduced axis; returns the reduced pair."""
    r = len(elems)
    if p.kind == "seq":
        acc = init
        for e in elems:
            acc = red(acc, e)
        return acc
    if p.kind == "row":
        nvec = r // p.vec
        per_thread = []
        for t in range(p.threads):
            acc = init
            for s1 in range(p.tile):
                q = s1 * p.threads + t
                if q < nvec:
                    for s2 in range(p.vec):
                        acc = red(acc, elems[q * p.vec + s2])
            per_thread.append(acc)
        warps = [_shuffle_tree(per_thread[w:w + WARP], red, WARP // 2)
                 for w in range(0, p.threads, WARP)]
        if len(warps) == 1:
            return warps[0]
        return _shuffle_tree(warps + [init] * (WARP - len(warps)), red, WARP // 2)
    if p.kind == "col":
        s = p.threads
        slots = []
        for g in range(s):
            acc = init
            for i in range(g, r, s):
                acc = red(acc, elems[i])
            slots.append(acc)
        return _shuffle_tree(slots, red, s // 2)
    assert p.kind == "split"
    padded = list(elems) + [init] * (p.k1 * p.k2 - r)
    inner = [simulate(p.inner, padded[g * p.k2:(g + 1) * p.k2], red, init) for g in range(p.k1)]
    return simulate(p.outer, inner, red, init)


def xla_gpu_argminmax(x, axis: int, is_max: bool, order: Arrangement, init_value):
    """x: a numpy array; the int64 indices XLA's GPU fusion returns."""
    import numpy as np
    x = np.moveaxis(np.asarray(x), axis, -1)
    rows = x.reshape(-1, x.shape[-1]) if x.size else x.reshape(0, x.shape[-1])
    red = reducer(is_max)
    out = [simulate(order, [(v, i) for i, v in enumerate(row.tolist())], red, (init_value, 0))[1]
           for row in rows]
    return np.asarray(out, np.int64).reshape(x.shape[:-1])


def first_nan_by_rank(x, axis: int, is_max: bool, order: Arrangement):
    """The same from the rank model: the lowest-ranked NaN, else the best value's
    lowest index."""
    import numpy as np
    from nimblejax.compiler.lowering.xla_reduce_order import nan_rank
    x = np.moveaxis(np.asarray(x), axis, -1)
    n = x.shape[-1]
    rows = x.reshape(-1, n)
    rank = np.array([nan_rank(order, n, i) for i in range(n)])
    out = []
    for row in rows.astype(np.float64):
        nan = np.isnan(row)
        if nan.any():
            out.append(int(np.flatnonzero(nan)[np.argmin(rank[nan])]))
        else:
            out.append(int(np.argmax(row) if is_max else np.argmin(row)))
    return np.asarray(out, np.int64).reshape(x.shape[:-1])


del math

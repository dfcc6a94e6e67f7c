"""Where a nimble.jit call's host time goes (run on the GPU machine).

    PYTHONPATH=. python3 examples/gpu/profile_call.py
"""
from __future__ import annotations

import cProfile
import pstats

import jax
import jax.numpy as jnp
import numpy as np

import nimblejax as nimble
from nimblejax.bench.needs_gpu import require_gpu
from nimblejax.bench.timing import median_us
from tests.helpers.models import branchy_args, branchy_mlp




def main() -> None:
    require_gpu(__file__)
    import cupy

    args = branchy_args(np.random.default_rng(0), branches=8, layers=6, width=256, batch=1)
    f = nimble.jit(branchy_mlp, backend="cuda", call_path="python")  # the direct path's pieces below
    jax.block_until_ready(f(*args))
    (exe,) = f.runners()  # runtime/direct_runner.py's DirectRunner
    leaves = jax.tree_util.tree_leaves(args)
    s0 = exe.graph.streams[0]
    rows = {
        "whole call + block": lambda: jax.block_until_ready(f(*args)),
        "tree_flatten": lambda: jax.tree_util.tree_flatten((args, {})),
        "NimbleFunction._flatten": lambda: f._flatten(args, {}),
        "bind inputs (unchanged)": lambda: exe._bind_inputs(leaves),
        "graph.launch + sync": lambda: (exe.graph.graph.launch(s0), s0.synchronize()),
        "outputs (alloc + copy) + sync": lambda: (exe._outputs(leaves), s0.synchronize()),
        "outputs + sync + wrap": lambda: [exe._wrap(o, np.float32) for o in (exe._outputs(leaves), s0.synchronize())[0]],
        "runner call": lambda: exe(leaves),
    }
    arr = cupy.ones(256, dtype=cupy.float32)
    rows["jnp.asarray(cupy)"] = lambda: jnp.asarray(arr)
    rows["jax.dlpack.from_dlpack(cupy)"] = lambda: jax.dlpack.from_dlpack(arr)
    rows["cupy.empty"] = lambda: cupy.empty(256, dtype=np.uint8)
    x = jnp.ones(256)
    rows["x.__dlpack__(stream)"] = lambda: x.__dlpack__(stream=s0.ptr)
    rows["copy_in one changed input"] = lambda: exe._bind_inputs(
        [jnp.asarray(l) if i == len(leaves) - 1 else l for i, l in enumerate(leaves)])
    for name, fn in rows.items():
        print(f"{name:36s} {median_us(fn):8.1f} µs")
    # The trivial function: one input, one output.
    x = jnp.asarray(np.random.default_rng(1).standard_normal(256), jnp.float32)
    g = nimble.jit(lambda a: a * 2.0 + 1.0, backend="cuda", call_path="python")
    jax.block_until_ready(g(x))
    (ge,) = g.runners()
    gs0 = ge.graph.streams[0]
    outs = ge._outputs([x])
    gs0.synchronize()
    trivial = {
        "trivial: whole call + block": lambda: jax.block_until_ready(g(x)),
        "trivial: whole call, output=cupy": None,
        "trivial: _flatten": lambda: g._flatten((x,), {}),
        "trivial: bind": lambda: ge._bind_inputs([x]),
        "trivial: graph.launch": lambda: ge.graph.graph.launch(gs0),
        "trivial: _outputs": lambda: ge._outputs([x]),
        "trivial: synchronize": lambda: gs0.synchronize(),
        "trivial: wrap as jax": lambda: ge._wrap(outs[0], np.float32),
        "trivial: runner call": lambda: ge([x]),
        "trivial: whole call, no block": lambda: g(x),
    }
    y = g(x)
    trivial["block_until_ready(nimble output)"] = lambda: y.block_until_ready()
    z = jax.jit(lambda a: a + 1)(x)
    trivial["block_until_ready(XLA output)"] = lambda: z.block_until_ready()
    trivial["weakref.finalize"] = lambda: __import__("weakref").finalize(y, print)
    gc = nimble.jit(lambda a: a * 2.0 + 1.0, backend="cuda", output="cupy")
    gc(x)
    trivial["trivial: whole call, output=cupy"] = lambda: gc(x).data.ptr
    for name, fn in trivial.items():
        print(f"{name:36s} {median_us(fn):8.1f} µs")
    prof = cProfile.Profile()
    prof.enable()
    for _ in range(300):
        jax.block_until_ready(f(*args))
    prof.disable()
    pstats.Stats(prof).sort_stats("cumulative").print_stats(22)
    print("input copies after all calls:", exe.stats["input_copies"], "calls:", exe.stats["calls"])


if __name__ == "__main__":
    main()

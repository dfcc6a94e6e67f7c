"""nimble.jit on a function with independent branches, what `nimble.explain` shows about
its plan, and the result against jax.jit.

    python examples/basics.py [--timeline plan.png]

Runs anywhere: on a GPU as one multi-stream CUDA graph, elsewhere with the CPU plan
interpreter (backend="interpret"), which runs the same plan's tasks in an order its
streams and events allow.
"""
import argparse

import jax
import jax.numpy as jnp

import nimblejax as nimble

BACKEND = "cuda" if jax.default_backend() == "gpu" else "interpret"
# On a GPU both sides multiply float32 matrices in TF32 (JAX's default precision), with
# different kernels summing in different orders: agreement to ~1e-3, not 1e-6.
TOL = 5e-3 if BACKEND == "cuda" else 1e-4


def block(x, branches):
    # Four branches that do not depend on each other, as in an Inception block: each
    # gets its own CUDA stream, and the sum waits for them with events.
    return jax.nn.relu(sum(jnp.tanh(x @ w1) @ w2 for w1, w2 in branches))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--timeline", metavar="OUT.png", help="draw the plan's streams (needs matplotlib)")
    opts = ap.parse_args()

    keys = jax.random.split(jax.random.key(0), 9)
    branches = [(jax.random.normal(keys[2 * i], (256, 256)) / 16,
                 jax.random.normal(keys[2 * i + 1], (256, 256)) / 16) for i in range(4)]
    x = jax.random.normal(keys[8], (8, 256))

    fast = nimble.jit(block, backend=BACKEND)
    y = fast(x, branches)  # planned on the first call for these shapes, then one launch
    report = nimble.explain(fast, x, branches)  # a Report: print it, or str() it
    print(report)
    print(f"backend {BACKEND}: {report.num_tasks} tasks on {report.num_streams} streams, "
          f"{report.num_events} events, arena {report.arena_bytes / 2**20:.1f} MiB")

    want = jax.jit(block)(x, branches)
    err = float(jnp.max(jnp.abs(y - want)))
    print(f"max difference from jax.jit: {err:.1e}")
    assert err < TOL, err

    if opts.timeline:
        from nimblejax.bench.timeline import draw_timeline

        try:  # from a cost model's estimated task times (measured ones need the GPU)
            draw_timeline(fast.plan(x, branches), opts.timeline)
        except ImportError as e:  # no matplotlib: its message says what to install
            raise SystemExit(str(e)) from None
        print(f"wrote {opts.timeline}")


if __name__ == "__main__":
    main()

"""The host cost of the XLA call path's wrapper (xla_path.py `_call_xla`) alone, on the CPU.

The resident record's jitted call (`record.fn`) is replaced by a Python function that
returns ready-made results, so what is timed is nimble's own work per call: flattening,
the residency decision, the bookkeeping after the call and unflattening. Three steady
states, for 1, 10 and 100 leaves:
- held:   the same arrays every call (model parameters in a serving loop);
- fed:    the previous call's results passed back (training state);
- passed: new arrays every call (a fresh batch).
Each row is timed for both residency checks (Options.residency "c" and "python"), in
turns, and the best of the repeats is kept (a shared machine's noise only adds).

    python -m nimblejax.bench.resident_wrapper
"""
from __future__ import annotations

import dataclasses
import gc
import time

import jax
import jax.numpy as jnp
import numpy as np

import nimblejax as nimble

KINDS = ("held", "fed", "passed")


def double(xs: list) -> list:
    return [x * 2.0 for x in xs]


def arrays(n: int, seed: int) -> list:
    r = np.random.default_rng(seed)
    return [jnp.asarray(r.normal(size=4), jnp.float32) for _ in range(n)]


def per_call_us(call, number: int = 1000) -> float:
    """The mean time of `number` calls in µs, without the cyclic garbage collector (as
    timeit does: its passes grow with whatever earlier cases left alive)."""
    gc.collect()
    gc.disable()
    try:
        start = time.perf_counter()
        for _ in range(number):
            call()
        return (time.perf_counter() - start) / number * 1e6
    finally:
        gc.enable()


def steady_call(kind: str, n: int, residency: str | None):
    """A call in steady state `kind` with `n` leaves, record.fn stubbed."""
    extra = {"residency": residency} if residency else {}
    f = nimble.jit(double, backend="interpret", **extra)
    # Time the check itself: keep it even where nimble would hand the call straight to
    # JAX's dispatch (few leaves, or nothing resident: xla_path.DIRECT_MAX_LEAVES).
    f._direct_ok = False
    pools = [arrays(n, s) for s in range(4)]
    state = pools[0]
    for i in range(3):  # real calls: the steady state's record is made
        state = f(pools[0] if kind == "held" else state if kind == "fed" else pools[i & 1])
    turn = [0]

    def fake_fn(*passed):  # stands in for the jitted call: fresh results, no work
        turn[0] ^= 1
        return pools[2 + turn[0]]

    f._resident.fn = fake_fn
    if kind == "held":
        call = lambda: f(pools[0])  # noqa: E731
    elif kind == "fed":
        box = [f(state)]
        call = lambda: box.__setitem__(0, f(box[0]))  # noqa: E731
    else:
        batches = iter(range(1, 1 << 62))  # the warm-up's last call took pools[0]
        call = lambda: f(pools[next(batches) & 1])  # noqa: E731
    call()
    call()
    if f._resident.fn is not fake_fn:  # the sources changed: a real call would be timed
        raise RuntimeError(f"resident_wrapper: the {kind} case left its steady state")
    return call


def main(repeats: int = 7) -> None:
    has_choice = "residency" in {f.name for f in dataclasses.fields(nimble.Options)}
    checks = ("c", "python") if has_choice else (None,)
    print(f"jax {jax.__version__}; µs per call of the wrapper alone (record.fn stubbed), "
          f"best of {repeats}")
    print(f"{'leaves':>6} " + " ".join(f"{k + '/' + (c or 'before'):>14}" for k in KINDS for c in checks))
    for n in (1, 10, 100):
        calls = {(k, c): steady_call(k, n, c) for k in KINDS for c in checks}
        times: dict = {key: [] for key in calls}
        for _ in range(repeats):  # in turns: a burst of load elsewhere hits every case alike
            for key, call in calls.items():
                times[key].append(per_call_us(call))
        best = {key: min(ts) for key, ts in times.items()}
        print(f"{n:>6} " + " ".join(f"{best[k, c]:14.2f}" for k in KINDS for c in checks))


if __name__ == "__main__":
    main()

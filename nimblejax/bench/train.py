"""Train steps of the suite's models: nimble.jit against jax.jit on one GPU.

    PYTHONPATH=. python3 -m nimblejax.bench.train [--models resnet50,mobilenet_v2]
        [--batch 32] [--rounds 5] [--calls 20] [--profile] [--json out.json]

One SGD step (softmax cross-entropy, `value_and_grad`, `p - lr * g`) with the parameters
donated and fed back each call and a fresh batch each call, as a training loop runs it.
Both sides are measured in alternating rounds in one process (the host is shared);
reported: looped µs per step (one block per round: the headline), blocked µs per step,
nimble's graph GPU time (CUDA events), and with --profile nimble's GPU time by task
family (nimblejax.bench.profile), so a loss can be named.
"""
from __future__ import annotations

import argparse
import json
import statistics
from typing import Callable, Sequence

import jax
import numpy as np


def make_step(apply: Callable, lr: float = 0.01) -> Callable:
    """step(params, x, labels) -> (params, loss)."""
    from nimblejax.bench.data_parallel import cross_entropy

    grad = jax.value_and_grad(cross_entropy(apply))

    def step(params, x, labels):
        loss, g = grad(params, x, labels)
        return jax.tree_util.tree_map(lambda p, d: p - lr * d, params, g), loss

    return step


def measure(model: str, batch: int, rounds: int, calls: int, profile: bool) -> dict:
    import nimblejax as nimble
    from nimblejax.bench.data_parallel import build, rel_err
    from nimblejax.bench.timing import fed_back_us, nimble_gpu_us

    rng = np.random.default_rng(0)
    apply, params, x, labels = build(model, batch, rng)
    batches = [(x + 0.01 * i, labels) for i in range(4)]
    step = make_step(apply)
    fns = {"jax": jax.jit(step, donate_argnums=0), "nimble": nimble.jit(step, donate_argnums=0)}
    # The same start for both, checked against each other before timing.
    first = {k: f(jax.tree_util.tree_map(lambda p: p + 0, params), x, labels) for k, f in fns.items()}
    err = rel_err(first["nimble"], first["jax"])
    states = {k: [first[k][0]] for k in fns}
    for k, f in fns.items():  # warm-up
        fed_back_us(f, states[k], batches, 3)
    looped: dict = {k: [] for k in fns}
    blocked: dict = {k: [] for k in fns}
    for _ in range(rounds):
        for k, f in fns.items():
            looped[k].append(fed_back_us(f, states[k], batches, calls))
            blocked[k].append(fed_back_us(f, states[k], batches, max(5, calls // 2), block_each=True))
    row = dict(model=model, batch=batch, max_rel_err=err)
    for k in fns:
        row[f"{k}_looped_us"] = statistics.median(looped[k])
        row[f"{k}_blocked_us"] = statistics.median(blocked[k])
    row["speedup_looped"] = row["jax_looped_us"] / row["nimble_looped_us"]
    row["speedup_blocked"] = row["jax_blocked_us"] / row["nimble_blocked_us"]
    row["nimble_gpu_us"] = nimble_gpu_us(fns["nimble"], calls=20)
    plan = fns["nimble"].plan(states["nimble"][0], x, labels)
    row.update(tasks=len(plan.tasks), streams=plan.schedule.num_streams)
    if profile:
        row["families"] = _families(fns["nimble"])
    return row


def _families(f) -> list:
    """nimble's serial GPU time by task family: [(family, tasks, µs)], largest first."""
    from nimblejax.bench.profile import group, task_times

    return [list(t) for t in group(task_times(f.executables()[-1], repeats=3), "family")]


def main(argv: Sequence[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--models", default="resnet50,mobilenet_v2")
    ap.add_argument("--batch", default="32")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--calls", type=int, default=20)
    ap.add_argument("--profile", action="store_true", help="nimble's GPU time by task family")
    ap.add_argument("--json")
    opts = ap.parse_args(argv)
    from nimblejax.bench.needs_gpu import require_gpu

    require_gpu("python -m nimblejax.bench.train")
    print(f"{jax.devices()[0].device_kind}; jax {jax.__version__}")
    print("| model | batch | jax.jit looped µs | nimble looped µs | speedup looped | jax.jit blocked µs "
          "| nimble blocked µs | nimble GPU µs | tasks | streams | max rel err |")
    print("|---|---|---|---|---|---|---|---|---|---|---|")
    rows = []
    for model in opts.models.split(","):
        for b in [int(v) for v in opts.batch.split(",")]:
            r = measure(model, b, opts.rounds, opts.calls, opts.profile)
            rows.append(r)
            print(f"| {model} | {b} | {r['jax_looped_us']:.0f} | {r['nimble_looped_us']:.0f} "
                  f"| {r['speedup_looped']:.2f}× | {r['jax_blocked_us']:.0f} | {r['nimble_blocked_us']:.0f} "
                  f"| {r['nimble_gpu_us']:.0f} | {r['tasks']} | {r['streams']} | {r['max_rel_err']:.1e} |", flush=True)
            for fam, n, us in r.get("families", [])[:8]:
                print(f"|   {fam} | {n} tasks | {us:.0f} µs serial |")
    if opts.json:
        with open(opts.json, "w") as f:
            json.dump(dict(device=jax.devices()[0].device_kind, rows=rows), f, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

"""Where each benchmark model's GPU time goes, task by task (run on the GPU machine).

    PYTHONPATH=. python3 examples/gpu/profile_models.py --models all --batch 1,32 --json out.json

For each model: jax.jit's GPU time (back-to-back calls), nimble's graph GPU time on one
stream and on many, the serial sum of its tasks, and the slowest kernel families and
tasks (nimblejax.bench.profile).
"""
from __future__ import annotations

import argparse
import gc
import json

import jax
import numpy as np

import nimblejax as nimble
from nimblejax.bench.needs_gpu import require_gpu
from nimblejax.bench import timing
from nimblejax.bench.models import MODELS
from nimblejax.bench.profile import summarize, task_times


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--models", default="all")
    ap.add_argument("--batch", default="1,32")
    ap.add_argument("--calls", type=int, default=30)
    ap.add_argument("--json")
    opts = ap.parse_args()
    require_gpu(__file__)
    names = list(MODELS) if opts.models == "all" else opts.models.split(",")
    report = []
    for batch in [int(b) for b in opts.batch.split(",")]:
        for name in names:
            fn, args = MODELS[name].build(batch, rng=np.random.default_rng(0))
            jitted = jax.jit(fn)
            want = jax.block_until_ready(jitted(*args))
            xla_us = timing.throughput_us(jitted, args, calls=opts.calls)
            f = nimble.jit(fn)
            got = jax.block_until_ready(f(*args))
            err = max(float(np.max(np.abs(np.asarray(g) - np.asarray(w))) / (np.max(np.abs(np.asarray(w))) + 1e-30))
                      for g, w in zip(jax.tree_util.tree_leaves(got), jax.tree_util.tree_leaves(want)))
            exe = f.executables()[-1]
            multi_us = timing.nimble_gpu_us(f, calls=opts.calls)
            one = nimble.jit(fn, max_streams=1)
            jax.block_until_ready(one(*args))
            one_us = timing.nimble_gpu_us(one, calls=opts.calls)
            rows = task_times(exe)
            print(flush=True)
            print(f"\n=== {name} batch {batch}: xla {xla_us:.0f} µs, nimble graph 1-stream {one_us:.0f} µs, "
                  f"{exe.plan.schedule.num_streams}-stream {multi_us:.0f} µs, rel err {err:.1e}")
            print(summarize(rows))
            report.append({"model": name, "batch": batch, "xla_us": xla_us, "one_stream_us": one_us,
                           "multi_stream_us": multi_us, "max_rel_err": err, "tasks": rows})
            f = one = exe = jitted = None
            gc.collect()
            if opts.json:  # after every model: a time limit still leaves the ones done
                with open(opts.json, "w") as fh:
                    json.dump(report, fh, indent=1)


if __name__ == "__main__":
    main()

"""Programmatic dependent launch on whole plans: the suite's models with plain launches,
with each kernel waiting (the default), and with each kernel also triggering the next
one's launch right after its wait (`runtime/pdl.py`'s TRIGGER); run on the GPU machine.

    PYTHONPATH=. python3 examples/gpu/probe_pdl_plans.py --models bert,lstm --batch 1

One process: each model planned three times (the trigger is part of a kernel's source,
so it is set before each plan's first call), then GPU µs of each plan's graph (CUDA
events around back-to-back launches) and looped µs (a fresh input each call), the three
settings alternating in rounds; medians. Each setting's results are checked bit for bit
against plain launches.
"""
from __future__ import annotations

import argparse
import json
import pathlib
import statistics

import jax
import numpy as np

from nimblejax.bench.needs_gpu import require_gpu

SETTINGS = (("plain", False, False), ("wait", True, False), ("wait+trigger", True, True))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--models", default="bert,lstm,resnet50,mobilenet_v2,efficientnet_b0,inception_v3")
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--json", default="", help="write the medians here too")
    opts = ap.parse_args()
    require_gpu(__file__)
    import nimblejax as nimble
    from nimblejax.bench import timing
    from nimblejax.bench.models import MODELS
    from nimblejax.bench.models.layers import on_device
    from nimblejax.runtime import pdl

    results = {}
    for name in opts.models.split(","):
        fn, args = MODELS[name].build(opts.batch, np.float32, np.random.default_rng(0), tiny=False)
        fresh = np.random.default_rng(1)
        x = args[-1]
        arg_sets = [args[:-1] + (on_device(fresh.standard_normal(x.shape), x.dtype),) for _ in range(8)]
        fns, outs = {}, {}
        for label, on, trigger in SETTINGS:
            pdl.TRIGGER = trigger
            fns[label] = nimble.jit(fn, pdl=on)
            outs[label] = [np.asarray(o) for o in jax.tree_util.tree_leaves(fns[label](*arg_sets[0]))]
        pdl.TRIGGER = False
        same = {label: all(np.array_equal(a, b) for a, b in zip(outs[label], outs["plain"])) for label in fns}
        gpu, looped = ({label: [] for label in fns} for _ in range(2))
        for _ in range(opts.rounds):
            for label, f in fns.items():
                gpu[label].append(timing.nimble_gpu_us(f))
                looped[label].append(timing.looped_us(f, arg_sets, calls=100, repeats=3))
        row = {label: {"gpu_us": statistics.median(gpu[label]), "looped_us": statistics.median(looped[label]),
                       "same_as_plain": same[label]} for label in fns}
        results[f"{name} b{opts.batch}"] = row
        print(f"{name:16s} b{opts.batch}  " + "  ".join(
            f"{label}: GPU {r['gpu_us']:7.1f} looped {r['looped_us']:7.1f}{'' if r['same_as_plain'] else ' DIFFERS'}"
            for label, r in row.items()), flush=True)
    if opts.json:
        pathlib.Path(opts.json).write_text(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()

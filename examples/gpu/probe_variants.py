"""Variants of nimble's plans side by side in one process: a `nimble.jit` option or a
module constant set per variant, each model's GPU and looped µs per variant in
alternating rounds, and whether each variant's results equal the first one's bit for
bit; run on the GPU machine.

    PYTHONPATH=. python3 examples/gpu/probe_variants.py --models bert,gpt --batch 1 \\
        'plain:pdl=False' 'default:' 'trigger:nimblejax.runtime.pdl.TRIGGER=True' \\
        'warm-timing:nimblejax.runtime.libs.fill.COLD=False'

`--loops NAME` adds the programs of benchmark_loops.py whose name holds NAME (any case;
"SGD": the `fori_loop` of 100 SGD steps), each called with its own fresh arguments.

A variant is `label:assignments`, comma-separated; a dotted name is a module constant,
set while the variant's plan is made and its first call runs (kernel sources and library
choices are fixed then) and put back after; any other name is an option of `nimble.jit`.
GPU µs: the plan's graph alone, CUDA events around back-to-back launches; looped µs: a
fresh input each call, the parameters the same objects.
"""
from __future__ import annotations

import argparse
import ast
import contextlib
import importlib
import json
import pathlib
import statistics

import jax
import numpy as np

from nimblejax.bench.needs_gpu import require_gpu


def parse(variant: str) -> tuple[str, dict, dict]:
    """'label:a.b.C=1,opt=x' → (label, {module constant: value}, {option: value})."""
    label, _, rest = variant.partition(":")
    constants, options = {}, {}
    for item in filter(None, (s.strip() for s in rest.split(","))):
        name, _, text = item.partition("=")
        try:
            value = ast.literal_eval(text)
        except (ValueError, SyntaxError):
            value = text
        (constants if "." in name else options)[name] = value
    return label, constants, options


@contextlib.contextmanager
def constants_set(constants: dict):
    old = []
    try:
        for dotted, value in constants.items():
            module, _, name = dotted.rpartition(".")
            mod = importlib.import_module(module)
            old.append((mod, name, getattr(mod, name)))
            setattr(mod, name, value)
        yield
    finally:
        for mod, name, value in reversed(old):
            setattr(mod, name, value)


def programs(opts, models, on_device):
    """(name, function, argument sets): the suite models asked for (a fresh last
    argument per set, the parameters the same objects), then the loop programs."""
    for name in filter(None, opts.models.split(",")):
        fn, args = models[name].build(opts.batch, np.float32, np.random.default_rng(0), tiny=False)
        fresh = np.random.default_rng(1)
        x = args[-1]
        yield (f"{name} b{opts.batch}", fn,
               [args[:-1] + (on_device(fresh.standard_normal(x.shape), x.dtype),) for _ in range(8)])
    if opts.loops:
        import benchmark_loops  # beside this file

        for name, fn, arg_sets in benchmark_loops.cases(np.random.default_rng(0)):
            if opts.loops.lower() in name.lower():
                yield name, fn, arg_sets


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("variants", nargs="*", default=["default:", "plain:pdl=False"],
                    help="label:assignments (see above); default: 'default:' 'plain:pdl=False'")
    ap.add_argument("--models", default="bert", help="suite models ('' for none)")
    ap.add_argument("--loops", default="", help="benchmark_loops.py programs whose name holds this")
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--json", default="", help="write the medians here too")
    opts = ap.parse_args()
    require_gpu(__file__)
    import nimblejax as nimble
    from nimblejax.bench import timing
    from nimblejax.bench.models import MODELS
    from nimblejax.bench.models.layers import on_device

    variants = [parse(v) for v in opts.variants]
    results = {}
    for name, fn, arg_sets in programs(opts, MODELS, on_device):
        fns, outs = {}, {}
        for label, constants, options in variants:
            with constants_set(constants):
                fns[label] = nimble.jit(fn, **options)
                outs[label] = [np.asarray(o) for o in jax.tree_util.tree_leaves(fns[label](*arg_sets[0]))]
        first = outs[variants[0][0]]
        gpu, looped = ({label: [] for label in fns} for _ in range(2))
        for _ in range(opts.rounds):
            for label, f in fns.items():
                gpu[label].append(timing.nimble_gpu_us(f))
                looped[label].append(timing.looped_us(f, arg_sets, calls=100, repeats=3))
        row = {label: {"gpu_us": statistics.median(gpu[label]), "looped_us": statistics.median(looped[label]),
                       "same_bits_as_first": all(np.array_equal(a, b) for a, b in zip(outs[label], first))}
               for label in fns}
        results[name] = row
        print(name, flush=True)
        for label, r in row.items():
            print(f"  {label:16s} GPU {r['gpu_us']:8.1f} µs  looped {r['looped_us']:8.1f} µs"
                  f"{'' if r['same_bits_as_first'] else '  (bits differ from the first)'}", flush=True)
    if opts.json:
        pathlib.Path(opts.json).write_text(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()

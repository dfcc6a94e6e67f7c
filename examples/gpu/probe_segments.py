"""Where nimble's segments cut a training step's plan, and how XLA schedules the
segments' custom calls and the all-reduces of a data-parallel step around them
(nimble.jit's `segments`, issue 34; run on a machine with 2 GPUs for the schedule).

    PYTHONPATH=. python3 examples/gpu/probe_segments.py [--models resnet50,mlp]
        [--per-device-batch 32] [--segments 2,3,4] [--schedule 4] [--hlo out.txt]

Per model, the per-device plan of `jax.value_and_grad` of the data-parallel bench's
loss (`nimblejax.bench.data_parallel`): for each segment count, each segment's tasks,
its share of the estimated cost (compiler/costs.py) and the outputs and MB it hands
back. With `--schedule N` (and 2 devices), the data-parallel step with the plan in N
segments is compiled and its scheduled entry computation read back: the order of the
segments' custom calls and the all-reduces' starts and dones, and which segments each
all-reduce reads.
"""
from __future__ import annotations

import argparse
import re

import jax
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

import nimblejax as nimble
from nimblejax.bench import data_parallel as dp
from nimblejax.bench.needs_gpu import require_gpu


def cuts(model: str, per_device: int, counts: list) -> None:
    from nimblejax.compiler.costs import estimate_us
    from nimblejax.compiler.segments import plan_segments

    apply, params, x, labels = dp.build(model, per_device, np.random.default_rng(0))
    plan = nimble.jit(jax.value_and_grad(dp.cross_entropy(apply))).plan(params, x, labels)
    total = sum(estimate_us(t) for t in plan.schedule.order)
    outs = plan.output_buffers
    print(f"{model}: {len(plan.schedule.order)} tasks on {plan.schedule.num_streams} streams, "
          f"{len(outs)} outputs, {sum(a.nbytes for a in outs) / 1e6:.1f} MB")
    for n in counts:
        parts = [f"{len(s.tasks)} tasks, {sum(estimate_us(t) for t in s.tasks) / total:.0%} of the cost, "
                 f"{len(s.outputs)} outputs, {sum(outs[j].nbytes for j in s.outputs) / 1e6:.1f} MB"
                 for s in plan_segments(plan, n)]
        print(f"  {n} segments: " + " | ".join(parts))


def schedule(model: str, per_device: int, n: int, hlo_path: str = "") -> None:
    devices = jax.devices()[:2]
    mesh = Mesh(np.array(devices), ("data",))
    apply, params, x, labels = dp.build(model, per_device * len(devices), np.random.default_rng(0))
    step = dp.dp_step(nimble.jit(jax.value_and_grad(dp.cross_entropy(apply)), segments=n), mesh)
    data = NamedSharding(mesh, P("data"))
    args = (jax.device_put(params, NamedSharding(mesh, P())), jax.device_put(x, data),
            jax.device_put(labels, data))
    text = step.lower(*args).compile().as_text()
    if hlo_path:
        with open(hlo_path, "w") as f:
            f.write(text)
    entry = text[text.index("ENTRY"):]
    entry = entry[:entry.index("\n}\n")]
    defs = dict(re.findall(r"^\s*(?:ROOT )?(%[\w.\-]+) = (.*)$", entry, flags=re.M))
    calls = [name for name, d in defs.items() if 'custom_call_target="nimble' in d]
    print(f"{model} on {len(devices)} devices, {n} segments; the entry computation's order:")
    for name, d in defs.items():
        if name in calls:
            print(f"  segment {calls.index(name) + 1} ({name})")
        elif re.search(r"all-reduce-(start|done)\(", d):
            kind = "start" if "all-reduce-start(" in d else "done"
            mb = sum(np.prod([int(v) for v in dims.split(",") if v]) * 4
                     for dims in re.findall(r"f32\[([\d,]*)\]", d.split("all-reduce")[0])) / 1e6
            reads = sorted({calls.index(c) + 1 for c in _reads(defs, name, calls)})
            print(f"  all-reduce {kind} {name}: {mb:.1f} MB" + (f", reads segments {reads}" if kind == "start" else ""))


def _reads(defs: dict, name: str, calls: list, depth: int = 0) -> set:
    """The nimble custom calls whose results instruction `name` reads (through a few
    levels of fusions, bitcasts and tuple elements)."""
    if name in calls:
        return {name}
    if depth > 8 or name not in defs:
        return set()
    body = defs[name].split("(", 1)[1] if "(" in defs[name] else ""
    found: set = set()
    for operand in set(re.findall(r"%[\w.\-]+", body)):
        found |= _reads(defs, operand, calls, depth + 1)
    return found


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--models", default="resnet50,mlp")
    ap.add_argument("--per-device-batch", type=int, default=32)
    ap.add_argument("--segments", default="2,3,4", help="segment counts to show the cuts of")
    ap.add_argument("--schedule", type=int, default=0, help="compile the 2-GPU step in this many segments")
    ap.add_argument("--hlo", default="", help="write the compiled step's HLO here (with --schedule)")
    opts = ap.parse_args()
    require_gpu(__file__)
    counts = [int(c) for c in opts.segments.split(",") if c]
    for model in opts.models.split(","):
        cuts(model, opts.per_device_batch, counts)
        if opts.schedule and len(jax.devices()) >= 2:
            schedule(model, opts.per_device_batch, opts.schedule, opts.hlo)


if __name__ == "__main__":
    main()

"""Data-parallel training across the GPUs of one host: a nimble plan as the per-device
body of `jax.shard_map`, JAX's own collectives (NCCL on GPUs) between devices.

    PYTHONPATH=. python3 -m nimblejax.bench.data_parallel [--models mlp,resnet50]
        [--per-device-batch 32] [--devices 1,2] [--calls 30] [--rounds 5]
        [--backend cuda] [--json out.json] [--floor] [--segments N] [--processes]

For each model and device count n, one SGD step over a global batch of n x per-device
batch: per-device loss and gradients (nimble.jit or jax.jit), `lax.pmean` of them over
the data axis, parameters updated (donated). Four loops per row, all built and warmed
up first: each step with its pmean, and each without it (each device keeps its own
gradients; the same shard_map otherwise). They alternate in rounds in one process (the
host is shared), `--calls` steps a loop (the new parameters fed back, a batch from a
pool of distinct ones each call, one block at the end); medians over the rounds.
Reports samples/s of both steps, nimble / jax.jit, each one's scaling from the first
device count to n, and each step's µs with what its pmean costs (the step less the step
without it), so that a missed scaling or speed target shows where the time goes; with
--floor, also the same step with no model, its update `p - lr * p` (JAX's dispatch of a
step over that parameter tree on n devices), in the same rounds. The
JSON keeps every round's µs and how far the two steps' updates differ. With
--segments N, also nimble's step with its plan cut into up to N graphs (nimble.jit's
`segments`: XLA all-reduces the gradients the first graphs hand back while the later
ones compute), timed in the same rounds.

With --processes, each row of n devices runs as n processes of one GPU each
(`jax.distributed` on this host, the way multi-GPU training is launched with one process a
GPU): each process dispatches its own device's step, so JAX's per-step host work, which
one process pays once per device, is paid in parallel. The row's times are process 0's
(the pmean keeps the processes in step).
"""
from __future__ import annotations

import argparse
import json
import os
import socket
import statistics
import subprocess
import sys
import tempfile
from typing import Callable, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P


def shard_map(f: Callable, mesh: Mesh, in_specs, out_specs, check: bool = True) -> Callable:
    """jax.shard_map (jax ≥ 0.7) or its experimental predecessor. check=False: outputs
    declared replicated need not be (each device keeps its own)."""
    sm = getattr(jax, "shard_map", None)
    if sm is None:
        from jax.experimental.shard_map import shard_map as sm

        return sm(f, mesh=mesh, in_specs=in_specs, out_specs=out_specs, check_rep=check)
    return sm(f, mesh=mesh, in_specs=in_specs, out_specs=out_specs, check_vma=check)


def cross_entropy(apply: Callable) -> Callable:
    """loss(params, x, labels): mean softmax cross-entropy of `apply(params, x)`."""

    def loss(params, x, labels):
        logits = apply(params, x).astype(jnp.float32)
        logp = jax.nn.log_softmax(logits.reshape(logits.shape[0], -1))
        onehot = jax.nn.one_hot(labels, logp.shape[-1], dtype=logp.dtype)
        return -jnp.mean(jnp.sum(onehot * logp, axis=-1))

    return loss


def dp_step(grad_fn: Callable, mesh: Mesh, lr: float = 0.01, axis: str = "data",
            reduce: bool = True) -> Callable:
    """step(params, x, labels) -> (params, loss): `grad_fn(params, x, labels) -> (loss,
    grads)` on each device's shard of the batch, gradients averaged with pmean, the
    parameters donated. reduce=False leaves the pmean out (each device keeps its own
    gradients and parameters): the same program less its collective."""

    def local(params, x, labels):
        loss, grads = grad_fn(params, x, labels)
        if reduce:
            loss, grads = jax.lax.pmean((loss, grads), axis)
        return jax.tree_util.tree_map(lambda p, g: p - lr * g, params, grads), loss

    # Replication checks off for both variants: with them on, jax.grad of the replicated
    # params over a sharded batch psums each gradient itself (the transpose of the
    # implicit pvary), so jax.jit's step would all-reduce every leaf inside the backward
    # pass and again in the pmean (n x the mean gradient), while nimble's plan, opaque to
    # that, reduces once. Off, both reduce once, and only where the pmean is.
    step = shard_map(local, mesh, in_specs=(P(), P(axis), P(axis)), out_specs=(P(), P()), check=False)
    return jax.jit(step, donate_argnums=(0,))


def build(model: str, batch: int, rng: np.random.Generator):
    """(apply, params, x, labels) of a benchmark model at a global batch."""
    from nimblejax.bench.models import MODELS

    fn, (params, x) = MODELS[model].build(batch=batch, dtype=jnp.float32, rng=rng)
    classes = int(np.prod(jax.eval_shape(fn, params, x).shape[1:]))
    labels = jnp.asarray(rng.integers(0, classes, (batch,)), jnp.int32)
    return fn, params, x, labels


def global_array(value, sharding: NamedSharding) -> jax.Array:
    """`value` (the same on every process) as one global array laid out by `sharding`:
    device_put with one process, each process's own shards with several."""
    host = np.asarray(value)
    return jax.make_array_from_callback(host.shape, sharding, lambda index: host[index])


def rel_err(got, want) -> float:
    """Largest |got - want| of any leaf, relative to that leaf's largest |want|."""
    return max(float(jnp.max(jnp.abs(g - w)) / (jnp.max(jnp.abs(w)) + 1e-30))
               for g, w in zip(jax.tree_util.tree_leaves(got), jax.tree_util.tree_leaves(want)))


def measure(model: str, n_devices: int, per_device: int, calls: int = 30,
            backend: str = "cuda", rounds: int = 5, floor: bool = False, segments: int = 1) -> dict:
    """One row: jax.jit's and nimble's step, and each without its pmean, all four built
    and warmed up first, then looped in alternating rounds in this process (the host is
    shared, so drift hits all four alike); medians over the rounds. With `floor`, a fifth
    loop: the same step whose gradients are the parameters themselves (no model), what
    JAX's dispatch of a step over this parameter tree costs on n devices."""
    import nimblejax as nimble
    from nimblejax.bench.timing import fed_back_us

    devices = jax.devices()[:n_devices]
    mesh = Mesh(np.array(devices), ("data",))
    rng = np.random.default_rng(0)
    batch = per_device * n_devices
    apply, params, x, labels = build(model, batch, rng)
    loss = cross_entropy(apply)
    data = NamedSharding(mesh, P("data"))
    # Distinct batch objects, so that no cache keyed on argument identity can help.
    batches = [(global_array(np.asarray(x) + 0.01 * i, data), global_array(labels, data)) for i in range(4)]
    start = jax.tree_util.tree_map(lambda p: global_array(p, NamedSharding(mesh, P())), params)
    grads = {"jax": jax.value_and_grad(loss), "nimble": nimble.jit(jax.value_and_grad(loss), backend=backend)}
    if segments > 1:
        grads["segmented"] = nimble.jit(jax.value_and_grad(loss), backend=backend, segments=segments)
    variants = [(f"{name}_{variant}_us", grad_fn, reduce) for name, grad_fn in grads.items()
                for variant, reduce in (("step", True), ("local", False))]
    if floor:
        variants.append(("floor_us", lambda p, x, labels: (jnp.sum(x), p), False))
    loops: dict = {}
    for key, grad_fn, reduce in variants:
        step = dp_step(grad_fn, mesh, reduce=reduce)
        state = [jax.tree_util.tree_map(jnp.copy, start)]  # each loop donates its own
        fed_back_us(step, state, batches, 3)  # compile and warm up
        loops[key] = (step, state)
    row = dict(model=model, devices=n_devices, per_device_batch=per_device, calls=calls, rounds=rounds)
    # Same start, same batches: after the warm-up both steps must have moved the params
    # alike (a step that reduced twice would show as an error of about 1 - 1/n).
    moved = {k: jax.tree_util.tree_map(jnp.subtract, loops[k][1][0], start) for k in loops if k.endswith("step_us")}
    row["max_rel_err"] = max(rel_err(moved[k], moved["jax_step_us"]) for k in moved if k != "jax_step_us")
    times: dict = {key: [] for key in loops}
    order = list(loops)
    for r in range(rounds):
        for key in order if r % 2 == 0 else order[::-1]:  # no loop always runs first
            step, state = loops[key]
            times[key].append(fed_back_us(step, state, batches, calls))
    for key, values in times.items():
        row[key] = statistics.median(values)
    for name in grads:
        row[f"{name}_collective_us"] = row[f"{name}_step_us"] - row[f"{name}_local_us"]
        row[f"{name}_samples_per_s"] = batch / (row[f"{name}_step_us"] * 1e-6)
    row["speedup"] = row["jax_step_us"] / row["nimble_step_us"]
    if segments > 1:
        row["segments"] = segments
        row["segmented_speedup"] = row["jax_step_us"] / row["segmented_step_us"]
    row["rounds_us"] = times  # every round's µs/call, to judge the noise
    return row


HEADER = ("| model | GPUs | jax.jit samples/s | nimble samples/s | nimble / jax | jax.jit scaling "
          "| nimble scaling | jax.jit step µs (of which pmean) | nimble step µs (of which pmean) |\n"
          "|---|---|---|---|---|---|---|---|---|")


def table_row(row: dict) -> str:
    """One markdown row; the pmean's share is the step less the step without it."""
    n = row.get("processes")
    gpus = f"{n} ({n} process{'es' if n > 1 else ''})" if n else row["devices"]
    return (f"| {row['model']} | {gpus} | {row['jax_samples_per_s']:.0f} "
            f"| {row['nimble_samples_per_s']:.0f} | {row['speedup']:.2f}x | {row['jax_scaling']:.2f}x "
            f"| {row['nimble_scaling']:.2f}x | {row['jax_step_us']:.0f} ({row['jax_collective_us']:.0f}) "
            f"| {row['nimble_step_us']:.0f} ({row['nimble_collective_us']:.0f}) |")


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def measure_in_processes(model: str, n: int, argv: Sequence[str], timeout_s: float = 900) -> dict:
    """One row measured by n processes of one device each: this module run again with
    the parent's arguments `argv`, for `model`, as --worker; process 0's row."""
    port = free_port()
    with tempfile.TemporaryDirectory() as folder:
        out = os.path.join(folder, "row.json")
        procs = [subprocess.Popen([sys.executable, "-m", "nimblejax.bench.data_parallel", *argv,
                                   "--models", model, "--worker", f"{rank},{n},{port},{out}"])
                 for rank in range(n)]
        try:
            codes = [p.wait(timeout=timeout_s) for p in procs]
        finally:
            for p in procs:
                if p.poll() is None:  # a worker left waiting for one that failed
                    p.kill()
        if any(codes):
            raise RuntimeError(f"data-parallel workers of {model} on {n} processes exited with {codes}")
        with open(out) as f:
            return json.load(f)


def worker(spec: str, opts: argparse.Namespace) -> int:
    """Process `rank` of n: joins the others through jax.distributed (coordinator on this
    host), one local device each, then measures the row over all n devices together."""
    rank, n, port, out = spec.split(",", 3)
    rank, n = int(rank), int(n)
    if opts.backend == "cuda":
        jax.distributed.initialize(f"127.0.0.1:{port}", n, rank, local_device_ids=[rank])
    else:  # a CPU check: one host device a process, collectives through gloo
        jax.config.update("jax_cpu_collectives_implementation", "gloo")
        jax.distributed.initialize(f"127.0.0.1:{port}", n, rank)
    row = measure(opts.models, n, opts.per_device_batch, opts.calls, opts.backend, opts.rounds,
                  opts.floor, opts.segments)
    row["processes"] = n
    if rank == 0:
        with open(out, "w") as f:
            json.dump(row, f)
    jax.distributed.shutdown()
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--models", default="mlp,resnet50")
    ap.add_argument("--per-device-batch", type=int, default=32)
    ap.add_argument("--devices", default=None, help="device counts, e.g. 1,2 (default: 1 and all)")
    ap.add_argument("--calls", type=int, default=30, help="steps per timed loop")
    ap.add_argument("--rounds", type=int, default=5, help="alternating rounds (medians over them)")
    ap.add_argument("--backend", default="cuda", help="nimble backend (interpret: a CPU check)")
    ap.add_argument("--json", default=None)
    ap.add_argument("--floor", action="store_true",
                    help="also time each row's dispatch floor (a step with no model: the update p - lr * p)")
    ap.add_argument("--segments", type=int, default=1,
                    help="also time nimble's step with its plan cut into up to N graphs (nimble.jit's segments)")
    ap.add_argument("--processes", action="store_true",
                    help="run each row of n devices as n processes of one device each (jax.distributed)")
    ap.add_argument("--worker", default=None, help=argparse.SUPPRESS)  # rank,n,port,out: one of those processes
    argv = list(sys.argv[1:] if argv is None else argv)
    opts = ap.parse_args(argv)
    if opts.worker:
        return worker(opts.worker, opts)
    total = len(jax.devices())
    counts = [int(c) for c in opts.devices.split(",")] if opts.devices else sorted({1, total})
    rows = []
    print(f"{jax.devices()[0].device_kind} x{total}; per-device batch {opts.per_device_batch}, "
          f"{opts.rounds} rounds of {opts.calls} steps")
    print(HEADER)
    for model in opts.models.split(","):
        base: dict = {}  # samples/s at the first device count, what scaling is relative to
        for n in counts:
            if n > total and not (opts.processes and jax.default_backend() == "cpu"):  # CPU processes: any n
                print(f"| {model} | {n} | (only {total} device(s)) | | | | | | |")
                continue
            if opts.processes:
                row = measure_in_processes(model, n, argv)
            else:
                row = measure(model, n, opts.per_device_batch, opts.calls, opts.backend, opts.rounds,
                              opts.floor, opts.segments)
            for name in ("jax", "nimble") + (("segmented",) if opts.segments > 1 else ()):
                base.setdefault(name, row[f"{name}_samples_per_s"])
                row[f"{name}_scaling"] = row[f"{name}_samples_per_s"] / base[name]
            rows.append(row)
            print(table_row(row) + (f"  (dispatch floor {row['floor_us']:.0f} µs)" if opts.floor else ""),
                  flush=True)
            if opts.segments > 1:
                print(f"  (nimble in up to {opts.segments} segments: step {row['segmented_step_us']:.0f} µs, "
                      f"of which pmean {row['segmented_collective_us']:.0f}; {row['segmented_speedup']:.2f}x "
                      f"jax.jit's; scaling {row['segmented_scaling']:.2f}x)", flush=True)
            if row["max_rel_err"] > 0.05:  # loose: TF32 matmuls on GPUs differ by ~1e-3
                print(f"  ({model} on {n}: jax.jit's and nimble's updates differ by "
                      f"{row['max_rel_err']:.2g} relative; not the same step)")
    if opts.json:
        with open(opts.json, "w") as f:
            json.dump(dict(device=jax.devices()[0].device_kind, devices=total, rows=rows), f, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

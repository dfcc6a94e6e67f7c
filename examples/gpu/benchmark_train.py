"""Train-step and per-convolution benchmark: nimble.jit against jax.jit on one GPU.

    PYTHONPATH=. python3 examples/gpu/benchmark_train.py [--json out.json]

1. A full SGD-with-momentum train step of the CIFAR ResNet-style and MobileNetV2-style
   models (tests/helpers/train_models.py) at batch 32, 64 and 128.
2. Each convolution shape of ResNet-50 at batch 32: GPU µs of nimble's chosen path
   against XLA's (cuDNN) for the same convolution.
"""
from __future__ import annotations

import argparse
import json

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

import nimblejax as nimble
from nimblejax.bench.needs_gpu import require_gpu
from nimblejax.bench.timing import e2e_us, nimble_gpu_us, throughput_us
from tests.helpers.train_models import TRAIN_MODELS, batch, make_train_step

# (input H=W, Cin, Cout, kernel, stride) of ResNet-50's convolutions (one per distinct shape).
RESNET50_CONVS = [
    (224, 3, 64, 7, 2), (56, 64, 64, 1, 1), (56, 64, 64, 3, 1), (56, 64, 256, 1, 1),
    (56, 256, 64, 1, 1), (56, 256, 128, 1, 1), (56, 128, 128, 3, 2), (28, 128, 512, 1, 1),
    (56, 256, 512, 1, 2), (28, 512, 128, 1, 1), (28, 128, 128, 3, 1), (28, 512, 256, 1, 1),
    (28, 256, 256, 3, 2), (14, 256, 1024, 1, 1), (28, 512, 1024, 1, 2), (14, 1024, 256, 1, 1),
    (14, 256, 256, 3, 1), (14, 1024, 512, 1, 1), (14, 512, 512, 3, 2), (7, 512, 2048, 1, 1),
    (14, 1024, 2048, 1, 2), (7, 2048, 512, 1, 1), (7, 512, 512, 3, 1),
]


def train_rows(batches=(32, 64, 128)):
    rows = []
    for name, (init, apply) in TRAIN_MODELS.items():
        step = make_train_step(apply)
        for n in batches:
            rng = np.random.default_rng(0)
            params = init(rng)
            vel = jax.tree_util.tree_map(lambda p: p * 0.0, params)
            x, labels = batch(rng, n)
            args = (params, vel, x, labels)
            j = jax.jit(step)
            f = nimble.jit(step, backend="cuda")
            want = jax.tree_util.tree_leaves(j(*args))
            got = jax.tree_util.tree_leaves(f(*args))
            err = max(float(np.max(np.abs(np.asarray(g) - np.asarray(w))) / (np.max(np.abs(np.asarray(w))) + 1e-30))
                      for g, w in zip(got, want))
            tj, tn = e2e_us(j, args, calls=50), e2e_us(f, args, calls=50)
            plan = f.plan(*args)
            rows.append(dict(model=name, batch=n, jax_us=tj, nimble_us=tn, speedup=tj / tn,
                             nimble_gpu_us=nimble_gpu_us(f, calls=50), max_rel_err=err,
                             tasks=len(plan.tasks), streams=plan.schedule.num_streams))
            print(f"| {name} | {n} | {tj:.0f} | {tn:.0f} | {tj / tn:.2f}x | {rows[-1]['nimble_gpu_us']:.0f} "
                  f"| {len(plan.tasks)} | {plan.schedule.num_streams} | {err:.1e} |", flush=True)
    return rows


def conv_rows(n=32, grad: str = "forward"):
    """Per ResNet-50 convolution shape, nimble's GPU µs against XLA's for the forward
    convolution, or its filter ("filter") or input ("input") gradient alone."""
    rows = []
    for size, cin, cout, k, s in RESNET50_CONVS:
        rng = np.random.default_rng(0)
        x = jnp.asarray(rng.standard_normal((n, size, size, cin)), jnp.float32)
        w = jnp.asarray(rng.standard_normal((k, k, cin, cout)) * 0.05, jnp.float32)

        def forward(x, w, s=s):
            return lax.conv_general_dilated(x, w, (s, s), "SAME", dimension_numbers=("NHWC", "HWIO", "NHWC"))

        if grad == "forward":
            conv = forward
        else:
            dy = jnp.asarray(rng.standard_normal(jax.eval_shape(forward, x, w).shape), jnp.float32)
            at = 1 if grad == "filter" else 0
            conv = lambda x, w, dy=dy, fwd=forward, at=at: jax.vjp(fwd, x, w)[1](dy)[at]  # noqa: E731
        f = nimble.jit(conv, backend="cuda")
        f(x, w)
        gpu = nimble_gpu_us(f, calls=50)
        xla = throughput_us(jax.jit(conv), (x, w), calls=50)
        path = "+".join(t.name.split("_")[1] if t.kind == "kernel" else t.kind for t in f.plan(x, w).tasks)
        rows.append(dict(shape=f"{size}x{size}x{cin}->{cout} k{k} s{s}", nimble_us=gpu, xla_us=xla,
                         ratio=gpu / xla, path=path))
        print(f"| {rows[-1]['shape']} | {path} | {gpu:.0f} | {xla:.0f} | {gpu / xla:.2f} |", flush=True)
    return rows


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--json")
    ap.add_argument("--skip-convs", action="store_true")
    ap.add_argument("--skip-train", action="store_true")
    ap.add_argument("--conv-grads", action="store_true",
                    help="also each convolution's filter and input gradient alone, against XLA's")
    opts = ap.parse_args()
    require_gpu(__file__)
    import cupy

    dev = cupy.cuda.runtime.getDeviceProperties(0)["name"].decode()
    print(f"GPU: {dev}; jax {jax.__version__}")
    print("| model | batch | jax.jit µs | nimble µs | speedup | nimble GPU µs | tasks | streams | max rel err |")
    print("|---|---|---|---|---|---|---|---|---|")
    out = {"gpu": dev, "train": [] if opts.skip_train else train_rows()}
    for grad in ["forward"] * (not opts.skip_convs) + ["filter", "input"] * opts.conv_grads:
        print(f"| ResNet-50 conv, {grad} (batch 32, f32) | nimble path | nimble GPU µs | XLA µs | ratio |")
        print("|---|---|---|---|---|")
        out[f"convs_{grad}"] = conv_rows(grad=grad)
    if opts.json:
        with open(opts.json, "w") as fh:
            json.dump(out, fh, indent=1)


if __name__ == "__main__":
    main()

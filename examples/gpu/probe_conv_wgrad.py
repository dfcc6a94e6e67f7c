"""A filter gradient with few input channels (ResNet-50's first convolution: 3 channels,
7×7, stride 2), jax.jit's kernels against nimble's paths: as planned (one GEMM over the
forward convolution's patches), cuDNN's backward-filter call (conv="cudnn"), also with
the input's channels padded with zeros to 4 or 8 (the gradient sliced back), and the
filter-gradient convolution's own im2col and GEMM (conv="im2col"): which kernels each
runs and their GPU time per call, from JAX's profiler (run on the GPU machine).

    PYTHONPATH=. python3 examples/gpu/probe_conv_wgrad.py [--batch 32] [--calls 10]
"""
from __future__ import annotations

import argparse

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

import nimblejax as nimble
from nimblejax.bench.needs_gpu import require_gpu


def conv(x, w, stride: int, pad: int):
    return lax.conv_general_dilated(x, w, (stride, stride), [(pad, pad)] * 2,
                                    dimension_numbers=("NHWC", "HWIO", "NHWC"))


def filter_grad(stride: int, pad: int, channels: int | None):
    """dW of conv(x, w) at dy; with `channels`, x and w padded with zeros to that many
    input channels first and dW sliced back."""

    def f(x, w, dy):
        c = x.shape[-1]
        if channels is not None:
            x = jnp.pad(x, ((0, 0),) * 3 + ((0, channels - c),))
            w = jnp.pad(w, ((0, 0),) * 2 + ((0, channels - c), (0, 0)))
        dw = jax.vjp(lambda w: conv(x, w, stride, pad), w)[1](dy)[0]
        return dw[:, :, :c, :]

    return f


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--batch", type=int, default=32)
    ap.add_argument("--calls", type=int, default=10)
    opts = ap.parse_args()
    require_gpu(__file__)
    from trace_kernels import kernel_times  # this folder's (a script's folder is on its path)

    rng = np.random.default_rng(0)
    n, hw, c, k, r, stride, pad = opts.batch, 224, 3, 64, 7, 2, 3
    x = jnp.asarray(rng.standard_normal((n, hw, hw, c)), jnp.float32)
    w = jnp.asarray(rng.standard_normal((r, r, c, k)) * 0.1, jnp.float32)
    dy = jnp.asarray(rng.standard_normal((n, hw // stride, hw // stride, k)), jnp.float32)
    want = jax.jit(filter_grad(stride, pad, None))(x, w, dy)
    sides = {"jax.jit": jax.jit(filter_grad(stride, pad, None))}
    sides["nimble as planned"] = nimble.jit(filter_grad(stride, pad, None), backend="cuda")
    for channels in (None, 4, 8):
        sides[f"nimble, cuDNN, C={channels or c}"] = nimble.jit(filter_grad(stride, pad, channels),
                                                               backend="cuda", conv="cudnn")
    sides["nimble, its own im2col + GEMM"] = nimble.jit(filter_grad(stride, pad, None), backend="cuda",
                                                        conv="im2col")
    for name, fn in sides.items():
        got = fn(x, w, dy)
        err = float(jnp.max(jnp.abs(got - want)) / jnp.max(jnp.abs(want)))
        times = kernel_times(fn, (x, w, dy), opts.calls)
        total = sum(sum(d) for d in times.values()) / opts.calls
        print(f"\n{name}: {total:.1f} µs of kernels a call, max rel err {err:.1e}")
        for kname, durs in sorted(times.items(), key=lambda kv: -sum(kv[1]))[:6]:
            print(f"    {sum(durs) / opts.calls:8.1f} µs {len(durs) / opts.calls:4.1f}×  {kname[:110]}")


if __name__ == "__main__":
    main()

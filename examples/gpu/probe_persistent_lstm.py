"""A persistent LSTM recurrence: every step of an LSTM layer in one cooperative kernel,
each block keeping its slice of the recurrent weights in registers for all the steps,
against nimble's plan of today (one kernel a step: the 32x2048x512 TF32 GEMM with the
cell in its epilogue, `compiler/fusion_gemm_gates.py`). GPU µs from CUDA events (run on
the GPU machine):

    PYTHONPATH=. python3 examples/gpu/probe_persistent_lstm.py [--batch 32] [--json out.json]

The question behind it (issue 31): the suite's LSTM at batch 32 is nimble's one model
below jax.jit in GPU time (H200, 5cbd1fb: 0.205 against 0.159 ms; about 6.4 µs a step
against XLA's 5.0), and each step's kernel reads its 4 MB of `W_hh` from L2 again. Here
block (j, i) owns hidden units [8j, 8j + 8) of every gate and batch rows [16i, 16i + 16):
its 512 x 32 slice of `W_hh` (rounded to TF32 once, as XLA's TF32 GEMM rounds it) stays in
registers, 64 a thread; a step stages its rows of h (L2 reads: other blocks wrote them),
sums the product over 8 parts of K, adds the input projection and the bias, runs the cell
for its (row, unit) pairs (c stays in a register) and writes its part of h; a grid-wide
barrier (cooperative launch) separates the steps. Printed: each variant's GPU µs, µs a
step, and the largest difference from jax.jit's recurrence (TF32) and from float64.

Measured (H200, ee7bea7): 5.07 µs a step, XLA's own step time. There each step read its
input projection and bias from global memory after the product, on the step's critical
path; the "prefetched" variant loads them at the step's start, timed beside it.
"""
import argparse
import json

import numpy as np

from nimblejax.bench.needs_gpu import require_gpu

ROWS, UNITS, KQ, THREADS = 16, 8, 8, 256  # a block: 16 rows x 8 units x 4 gates = 32 columns

SRC = r'''
#include <cooperative_groups.h>
namespace cg = cooperative_groups;
#define HID {hid}
#define BATCH {batch}
#define STEPS {steps}
#define ROWS {rows}
#define UNITS {units}
#define COLS (4 * UNITS)
#define KQ {kq}
#define KP (HID / KQ)
#define PREFETCH {prefetch}
#define NZ ((ROWS * COLS + {threads} - 1) / {threads})  // z elements a thread sums

__device__ __forceinline__ float tf32(float x) {{
  unsigned r;
  asm("cvt.rna.tf32.f32 %0, %1;" : "=r"(r) : "f"(x));
  return __uint_as_float(r);
}}
__device__ __forceinline__ float sigm(float x) {{ return 1.f / (1.f + expf(-x)); }}

// xproj (BATCH, STEPS, 4*HID): x_t @ W_ih for every step; w (HID, 4*HID); bias (4*HID);
// h0, c0, h_out, c_out (BATCH, HID); hbuf (2, BATCH, HID) scratch.
extern "C" __global__ void __launch_bounds__({threads}, 1)
lstm_persistent(const float* __restrict__ xproj, const float* __restrict__ w,
                const float* __restrict__ bias, const float* __restrict__ h0,
                const float* __restrict__ c0, float* hbuf, float* h_out, float* c_out) {{
  cg::grid_group grid = cg::this_grid();
  const int G = 4 * HID;
  __shared__ __align__(16) float hs[ROWS * HID];
  const int unit0 = blockIdx.x * UNITS, row0 = blockIdx.y * ROWS;
  const int tid = threadIdx.x, col = tid % COLS, kq = tid / COLS;
  const int gcol = (col / UNITS) * HID + unit0 + col % UNITS;
  float wr[KP];
#pragma unroll
  for (int k = 0; k < KP; ++k) wr[k] = tf32(w[(size_t)(kq * KP + k) * G + gcol]);
  const int cr = tid / UNITS, cu = tid % UNITS;  // the cell's (row, unit), tid < ROWS*UNITS
  const bool cell = tid < ROWS * UNITS;
  float c = cell ? c0[(size_t)(row0 + cr) * HID + unit0 + cu] : 0.f;
  const float* hprev = h0;
  for (int t = 0; t < STEPS; ++t) {{
#if PREFETCH
    // This step's input projection and bias, loaded now: in flight while h is staged and
    // the product runs, instead of read after it.
    float xb[NZ];
#pragma unroll
    for (int j = 0; j < NZ; ++j) {{
      int o = tid + j * {threads};
      if (o < ROWS * COLS) {{
        int r = o / COLS, cc = o % COLS, gc = (cc / UNITS) * HID + unit0 + cc % UNITS;
        xb[j] = __ldg(xproj + ((size_t)(row0 + r) * STEPS + t) * G + gc) + __ldg(bias + gc);
      }}
    }}
#endif
    for (int i = tid * 4; i < ROWS * HID; i += {threads} * 4) {{
      int r = i / HID, k = i % HID;
      float4 v = __ldcg(reinterpret_cast<const float4*>(hprev + (size_t)(row0 + r) * HID + k));
      v.x = tf32(v.x); v.y = tf32(v.y); v.z = tf32(v.z); v.w = tf32(v.w);
      *reinterpret_cast<float4*>(hs + r * HID + k) = v;
    }}
    __syncthreads();
    float acc[ROWS];
#pragma unroll
    for (int r = 0; r < ROWS; ++r) acc[r] = 0.f;
#pragma unroll
    for (int k = 0; k < KP; k += 4) {{
#pragma unroll
      for (int r = 0; r < ROWS; ++r) {{
        float4 hv = *reinterpret_cast<const float4*>(hs + r * HID + kq * KP + k);
        acc[r] = fmaf(hv.x, wr[k], acc[r]);
        acc[r] = fmaf(hv.y, wr[k + 1], acc[r]);
        acc[r] = fmaf(hv.z, wr[k + 2], acc[r]);
        acc[r] = fmaf(hv.w, wr[k + 3], acc[r]);
      }}
    }}
    __syncthreads();  // every read of hs is done: it holds the partial sums now
    float* red = hs;  // [KQ][ROWS][COLS]
    float* z = hs + KQ * ROWS * COLS;  // [ROWS][COLS]
#pragma unroll
    for (int r = 0; r < ROWS; ++r) red[(kq * ROWS + r) * COLS + col] = acc[r];
    __syncthreads();
#pragma unroll
    for (int j = 0; j < NZ; ++j) {{
      int o = tid + j * {threads};
      if (o >= ROWS * COLS) break;
      int r = o / COLS, cc = o % COLS;
      float s = 0.f;
#pragma unroll
      for (int q = 0; q < KQ; ++q) s += red[(q * ROWS + r) * COLS + cc];
#if PREFETCH
      z[o] = s + xb[j];
#else
      int gc = (cc / UNITS) * HID + unit0 + cc % UNITS;
      z[o] = s + xproj[((size_t)(row0 + r) * STEPS + t) * G + gc] + bias[gc];
#endif
    }}
    __syncthreads();
    float* hnext = hbuf + (size_t)(t & 1) * BATCH * HID;
    if (cell) {{
      const float* zr = z + cr * COLS;
      float ig = sigm(zr[cu]), fg = sigm(zr[UNITS + cu]);
      float gg = tanhf(zr[2 * UNITS + cu]), og = sigm(zr[3 * UNITS + cu]);
      c = fg * c + ig * gg;
      float h = og * tanhf(c);
      size_t at = (size_t)(row0 + cr) * HID + unit0 + cu;
      hnext[at] = h;
      if (t == STEPS - 1) {{ h_out[at] = h; c_out[at] = c; }}
    }}
    grid.sync();
    hprev = hnext;
  }}
}}
'''


def recurrence(xproj, w, b, h, c):
    """The bench LSTM's steps after its input projection (bench/models/lstm.py)."""
    import jax.numpy as jnp

    hd = w.shape[0]
    for t in range(xproj.shape[1]):
        z = xproj[:, t, :] + h @ w + b
        i, f, g, o = (z[:, k * hd:(k + 1) * hd] for k in range(4))
        c = 1 / (1 + jnp.exp(-f)) * c + 1 / (1 + jnp.exp(-i)) * jnp.tanh(g)
        h = 1 / (1 + jnp.exp(-o)) * jnp.tanh(c)
    return h, c


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--batch", type=int, default=32)
    ap.add_argument("--hidden", type=int, default=512)
    ap.add_argument("--steps", type=int, default=32)
    ap.add_argument("--calls", type=int, default=100)
    ap.add_argument("--json", default=None)
    opts = ap.parse_args()
    require_gpu(__file__)
    import cupy
    import jax
    import jax.numpy as jnp

    import nimblejax as nimble
    from nimblejax.bench.models import MODELS
    from nimblejax.bench.timing import cuda_event_us, nimble_gpu_us

    B, H, T = opts.batch, opts.hidden, opts.steps
    assert B % ROWS == 0 and H % UNITS == 0 and H % (KQ * 4) == 0 and H <= 512, "shape"
    rng = np.random.default_rng(0)
    xproj = rng.standard_normal((B, T, 4 * H)).astype(np.float32)
    w = (rng.standard_normal((H, 4 * H)) / np.sqrt(H)).astype(np.float32)
    b = rng.standard_normal(4 * H).astype(np.float32) * 0.1
    h0 = np.zeros((B, H), np.float32)
    rows = {}

    # jax.jit's recurrence (TF32, as the model's), and float64
    want_h, _ = jax.jit(recurrence)(*(jnp.asarray(a) for a in (xproj, w, b, h0, h0)))
    want_h = np.asarray(want_h)
    h64 = np.zeros((B, H)); c64 = np.zeros((B, H))
    for t in range(T):
        z = xproj[:, t, :].astype(np.float64) + h64 @ w.astype(np.float64) + b
        i, f, g, o = (z[:, k * H:(k + 1) * H] for k in range(4))
        c64 = 1 / (1 + np.exp(-f)) * c64 + 1 / (1 + np.exp(-i)) * np.tanh(g)
        h64 = 1 / (1 + np.exp(-o)) * np.tanh(c64)

    # the persistent kernel: as first measured, and with each step's input projection
    # loaded before its product (PREFETCH)
    d = [cupy.asarray(a) for a in (xproj, w, b, h0, h0)]
    grid = (H // UNITS, B // ROWS)
    stream = cupy.cuda.Stream(non_blocking=True)
    for label, prefetch in (("persistent", 0), ("persistent, prefetched", 1)):
        src = SRC.format(hid=H, batch=B, steps=T, rows=ROWS, units=UNITS, kq=KQ, threads=THREADS,
                         prefetch=prefetch)
        kernel = cupy.RawKernel(src, "lstm_persistent", options=("--std=c++17",),
                                enable_cooperative_groups=True)
        hbuf, h_out, c_out = cupy.zeros((2, B, H), cupy.float32), cupy.empty((B, H), cupy.float32), \
            cupy.empty((B, H), cupy.float32)

        def launch():
            kernel(grid, (THREADS,), (*d, hbuf, h_out, c_out), stream=stream)

        with stream:
            us = cuda_event_us(launch, stream, opts.calls)
        got = cupy.asnumpy(h_out)
        rows[label] = {"gpu_us": us, "us_per_step": us / T, "blocks": grid[0] * grid[1],
                       "max_abs_vs_jax": float(np.abs(got - want_h).max()),
                       "max_abs_vs_f64": float(np.abs(got - h64).max()),
                       "jax_vs_f64": float(np.abs(want_h - h64).max())}
    us = min(rows["persistent"]["gpu_us"], rows["persistent, prefetched"]["gpu_us"])

    # nimble's plan of the whole model (the input projection GEMM and one kernel a step),
    # and of its input projection alone
    if B == 32 and H == 512 and T == 32:
        fn, (params, x) = MODELS["lstm"].build(B, jnp.float32, rng)
        f = nimble.jit(fn)
        jax.block_until_ready(f(params, x))
        rows["nimble_model"] = {"gpu_us": nimble_gpu_us(f, opts.calls)}
        proj = nimble.jit(lambda xs, w_ih: jnp.einsum("btf,fg->btg", xs, w_ih))
        jax.block_until_ready(proj(x, params["w_ih"]))
        rows["nimble_input_projection"] = {"gpu_us": nimble_gpu_us(proj, opts.calls)}
        rows["persistent_model_estimate"] = {
            "gpu_us": rows["nimble_input_projection"]["gpu_us"] + us}
    for name, row in rows.items():
        print(f"{name:28s} " + "  ".join(f"{k} {v:.4g}" if isinstance(v, float) else f"{k} {v}"
                                         for k, v in row.items()))
    if opts.json:
        with open(opts.json, "w") as fh:
            json.dump({"batch": B, "hidden": H, "steps": T, "rows": rows}, fh, indent=1)


if __name__ == "__main__":
    main()

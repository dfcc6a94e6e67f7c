"""A whole `fori_loop` of SGD steps in one thread block: benchmark_loops.py's 100 steps
of an MLP 64x128x10 at batch 32, the parameters and every intermediate in shared memory,
each step's five products on tensor cores (TF32 `mma.sync`, as XLA's default precision
computes them), against jax.jit and nimble.jit of the same loop (run on the GPU machine):

    PYTHONPATH=. python3 examples/gpu/probe_block_loop.py [--json out.json]

The question behind it (issue 32): nimble runs this loop at 1.27x jax.jit (H200,
a971dc0): five kernels a step, four on the critical path, 7.4 µs of GPU time a step,
where the target is 3x. A step's work is 0.65M multiply-adds on 45 KB of state: one SM
holds all of it. If one block runs the whole loop in a few µs a step, a plan could run a
loop whose carried state and body fit one SM as one such kernel (a "block program");
this measures what that would give before anything is built. Printed: µs per call of
each, µs a step, and the largest difference of the weights from jax.jit's.

Measured (H200, ee7bea7): the plain layout took 17.8 µs a step (jax.jit 13.1, nimble.jit
10.5, blocked). Its fragment loads meet 2 to 8 lanes to a shared-memory bank (`LAYOUTS`
says why), so the padded layout, at most 2 to a bank, is timed beside it.
"""
import argparse
import json

import numpy as np

from nimblejax.bench.needs_gpu import require_gpu

THREADS = 512  # 16 warps
STEPS = 100  # benchmark_loops.sgd_loop's
FEATURES, HIDDEN, OUT, BATCH, OUT_PAD = 64, 128, 10, 32, 16

SRC = r'''
#define F {features}
#define H {hidden}
#define O {out}
#define OP {out_pad}
#define B {batch}
#define XS {xs}
#define W1S {w1s}
#define HS {hs}
#define W2S {w2s}
#define DS {ds}
#define DAS {das}

__device__ __forceinline__ unsigned tf32(float x) {{
  unsigned r;
  asm("cvt.rna.tf32.f32 %0, %1;" : "=r"(r) : "f"(x));
  return r;
}}

// C (M x N) = A (M x K) @ B (K x N) on tensor cores, A(m, k) = A[m * sam + k * sak],
// B(k, n) = B[k * sbk + n * sbn], columns n >= nvalid read as 0; each warp takes 16 x 8
// tiles in turn and hands each element to epi(m, n, value).
template <int M, int N, int K, class Epi>
__device__ __forceinline__ void block_gemm(const float* A, int sam, int sak, const float* Bm,
                                           int sbk, int sbn, int nvalid, Epi epi) {{
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32, warps = blockDim.x / 32;
  const int g = lane >> 2, t = lane & 3;
  constexpr int TN = N / 8, TILES = (M / 16) * TN;
  for (int tile = warp; tile < TILES; tile += warps) {{
    const int m0 = (tile / TN) * 16, n0 = (tile % TN) * 8, n = n0 + g;
    float c0 = 0.f, c1 = 0.f, c2 = 0.f, c3 = 0.f;
#pragma unroll
    for (int k0 = 0; k0 < K; k0 += 8) {{
      unsigned a0 = tf32(A[(m0 + g) * sam + (k0 + t) * sak]);
      unsigned a1 = tf32(A[(m0 + g + 8) * sam + (k0 + t) * sak]);
      unsigned a2 = tf32(A[(m0 + g) * sam + (k0 + t + 4) * sak]);
      unsigned a3 = tf32(A[(m0 + g + 8) * sam + (k0 + t + 4) * sak]);
      unsigned b0 = n < nvalid ? tf32(Bm[(k0 + t) * sbk + n * sbn]) : 0u;
      unsigned b1 = n < nvalid ? tf32(Bm[(k0 + t + 4) * sbk + n * sbn]) : 0u;
      asm volatile("mma.sync.aligned.m16n8k8.row.col.f32.tf32.tf32.f32 "
                   "{{%0, %1, %2, %3}}, {{%4, %5, %6, %7}}, {{%8, %9}}, {{%0, %1, %2, %3}};"
                   : "+f"(c0), "+f"(c1), "+f"(c2), "+f"(c3)
                   : "r"(a0), "r"(a1), "r"(a2), "r"(a3), "r"(b0), "r"(b1));
    }}
    epi(m0 + g, n0 + 2 * t, c0);
    epi(m0 + g, n0 + 2 * t + 1, c1);
    epi(m0 + g + 8, n0 + 2 * t, c2);
    epi(m0 + g + 8, n0 + 2 * t + 1, c3);
  }}
}}

// steps of: h = tanh(x @ w1); d = 2 (h @ w2 - y) / (B * O); g2 = h^T @ d;
// da = (d @ w2^T) * (1 - h^2); w1 -= lr * x^T @ da; w2 -= lr * g2.
// Row strides in shared memory: XS (x), W1S (w1), HS (h), W2S (w2, H x OP used), DS (d,
// B x OP used), DAS (da); g2 is H x OP.
extern "C" __global__ void __launch_bounds__({threads}, 1)
sgd_loop(const float* __restrict__ xg, const float* __restrict__ yg, const float* __restrict__ w1g,
         const float* __restrict__ w2g, float* w1o, float* w2o, int steps, float lr) {{
  extern __shared__ float sm[];
  float* x = sm;                  // B x F, stride XS
  float* y = x + B * XS;          // B x O
  float* w1 = y + B * O;          // F x H, stride W1S
  float* w2 = w1 + F * W1S;       // H x OP, stride W2S (columns O.. are 0)
  float* h = w2 + H * W2S;        // B x H, stride HS
  float* d = h + B * HS;          // B x OP, stride DS (columns O.. are 0)
  float* da = d + B * DS;         // B x H, stride DAS
  float* g2 = da + B * DAS;       // H x OP
  const int tid = threadIdx.x, n = blockDim.x;
  for (int i = tid; i < B * F; i += n) x[(i / F) * XS + i % F] = xg[i];
  for (int i = tid; i < B * O; i += n) y[i] = yg[i];
  for (int i = tid; i < F * H; i += n) w1[(i / H) * W1S + i % H] = w1g[i];
  for (int i = tid; i < H * OP; i += n) w2[(i / OP) * W2S + i % OP] = i % OP < O ? w2g[(i / OP) * O + i % OP] : 0.f;
  for (int i = tid; i < B * DS; i += n) d[i] = 0.f;
  __syncthreads();
  const float scale = 2.f / (B * O);
  for (int s = 0; s < steps; ++s) {{
    block_gemm<B, H, F>(x, XS, 1, w1, W1S, 1, H, [&](int m, int c, float v) {{ h[m * HS + c] = tanhf(v); }});
    __syncthreads();
    block_gemm<B, OP, H>(h, HS, 1, w2, W2S, 1, O, [&](int m, int c, float v) {{
      if (c < O) d[m * DS + c] = (v - y[m * O + c]) * scale; }});
    __syncthreads();
    block_gemm<H, OP, B>(h, 1, HS, d, DS, 1, OP, [&](int m, int c, float v) {{ g2[m * OP + c] = v; }});
    block_gemm<B, H, OP>(d, DS, 1, w2, 1, W2S, H, [&](int m, int c, float v) {{
      float hv = h[m * HS + c]; da[m * DAS + c] = v * (1.f - hv * hv); }});
    __syncthreads();
    block_gemm<F, H, B>(x, 1, XS, da, DAS, 1, H, [&](int m, int c, float v) {{ w1[m * W1S + c] -= lr * v; }});
    for (int i = tid; i < H * OP; i += n) if (i % OP < O) w2[(i / OP) * W2S + i % OP] -= lr * g2[i];
    __syncthreads();
  }}
  for (int i = tid; i < F * H; i += n) w1o[i] = w1[(i / H) * W1S + i % H];
  for (int i = tid; i < H * O; i += n) w2o[i] = w2[(i / O) * W2S + i % O];
}}
'''
# Row strides (XS, W1S, HS, W2S, DS, DAS) of the shared arrays. "plain": the arrays as
# they are, where a warp's mma fragment loads (lane (g, t) reads row g, column t, or row t,
# column g) fall 2 to 8 to a bank; "padded": rows padded so that each such load meets at
# most 2 to a bank (a stride = 4 mod 32 spreads row-g loads, 8 or 24 mod 32 row-t ones).
LAYOUTS = {
    "one block": (FEATURES, HIDDEN, HIDDEN, OUT_PAD, OUT_PAD, HIDDEN),
    "one block, padded": (68, 136, 132, 24, 24, 136),
}


def shared_floats(xs: int, w1s: int, hs: int, w2s: int, ds: int, das: int) -> int:
    return (BATCH * xs + BATCH * OUT + FEATURES * w1s + HIDDEN * w2s + BATCH * hs + BATCH * ds
            + BATCH * das + HIDDEN * OUT_PAD)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--calls", type=int, default=100)
    ap.add_argument("--json", default=None)
    opts = ap.parse_args()
    require_gpu(__file__)
    import cupy
    import jax
    import jax.numpy as jnp

    import nimblejax as nimble
    from benchmark_loops import sgd_loop as loop  # (this script's folder) the 100 steps

    from nimblejax.bench.timing import blocked_us, cuda_event_us

    rng = np.random.default_rng(0)
    r = lambda *s: rng.standard_normal(s).astype(np.float32)  # noqa: E731
    sets = [((r(FEATURES, HIDDEN) * 0.1, r(HIDDEN, OUT) * 0.1), r(BATCH, FEATURES), r(BATCH, OUT))
            for _ in range(8)]
    jsets = [jax.tree_util.tree_map(jnp.asarray, s) for s in sets]
    rows = {}
    for name, fn in (("jax.jit", jax.jit(loop)), ("nimble.jit", nimble.jit(loop))):
        rows[name] = {"blocked_us": blocked_us(fn, jsets, opts.calls)}
    want = jax.jit(loop)(*jsets[0])

    (w1, w2), x, y = sets[0]
    w1, w2, x, y = (cupy.asarray(a) for a in (w1, w2, x, y))
    stream = cupy.cuda.Stream(non_blocking=True)
    for label, strides in LAYOUTS.items():
        xs, w1s, hs, w2s, ds, das = strides
        src = SRC.format(features=FEATURES, hidden=HIDDEN, out=OUT, out_pad=OUT_PAD, batch=BATCH,
                         threads=THREADS, xs=xs, w1s=w1s, hs=hs, w2s=w2s, ds=ds, das=das)
        kernel = cupy.RawKernel(src, "sgd_loop", options=("--std=c++17",))
        smem = shared_floats(*strides) * 4
        kernel.max_dynamic_shared_size_bytes = smem
        w1o, w2o = cupy.empty_like(w1), cupy.empty_like(w2)

        def launch():
            kernel((1,), (THREADS,), (x, y, w1, w2, w1o, w2o, np.int32(STEPS), np.float32(0.01)),
                   shared_mem=smem, stream=stream)

        with stream:
            us = cuda_event_us(launch, stream, opts.calls)
        stream.synchronize()
        diffs = [float(np.abs(cupy.asnumpy(g) - np.asarray(w)).max()) for g, w in zip((w1o, w2o), want)]
        rows[label] = {"gpu_us": us, "us_per_step": us / STEPS, "max_abs_vs_jax": max(diffs),
                       "largest_weight": float(max(np.abs(np.asarray(w)).max() for w in want))}
    for name, row in rows.items():
        print(f"{name:12s} " + "  ".join(f"{k} {v:.4g}" for k, v in row.items()))
    if opts.json:
        with open(opts.json, "w") as fh:
            json.dump({"steps": STEPS, "rows": rows}, fh, indent=1)


if __name__ == "__main__":
    main()

"""Programmatic dependent launch (PDL, Hopper) inside a captured CUDA graph: a chain of
dependent kernels launched plainly, against `cuLaunchKernelEx` with programmatic stream
serialization (each kernel's `griddepcontrol.wait` before it reads its predecessor's
output; the next kernel's launch overlaps the previous one's tail). GPU µs per kernel
from CUDA events around graph launches (run on the GPU machine):

    PYTHONPATH=. python3 examples/gpu/probe_pdl.py [--json out.json]

Two chains: 100 tiny kernels (x += 1 on 1024 floats, checked), and 32 steps of an RNN at
batch 1 (tanh(W h), W 512 x 2048 in L2, each block's slice of W loaded before the wait),
also with `griddepcontrol.launch_dependents` early; its results compared bit for bit
with the plain chain's. The question behind it: what PDL would save on a plan's
dependent kernels (nimble's graphs are captured with plain launches).
"""
import argparse
import ctypes
import json
import statistics

import numpy as np

from nimblejax.bench.needs_gpu import require_gpu
from nimblejax.runtime.pdl import PROGRAMMATIC_STREAM_SERIALIZATION, LaunchAttribute, LaunchConfig

SRC = r'''
extern "C" __global__ void tiny(float* x, int n, int pdl) {
  if (pdl) asm volatile("griddepcontrol.wait;" ::: "memory");
  int i = blockIdx.x * blockDim.x + threadIdx.x;
  if (i < n) x[i] += 1.0f;
}
// An RNN step at batch 1: h' = tanh(W h), W 512 x 2048 read (2048 outputs, 16 per block
// of 256 threads). The block's slice of W is loaded before the wait (its prologue): it
// does not depend on the predecessor.
extern "C" __global__ void rnn(const float* __restrict__ w, const float* __restrict__ h,
                               float* __restrict__ out, int pdl, int trigger) {
  const int cols = 16, k = 512;
  int c0 = blockIdx.x * cols;
  int t = threadIdx.x;               // 256 threads: 16 columns x 16 lanes of k
  int col = c0 + t / 16, part = t % 16;
  float wv[32];
  #pragma unroll
  for (int j = 0; j < 32; ++j) wv[j] = w[(size_t)(part * 32 + j) * 2048 + col];
  if (pdl) asm volatile("griddepcontrol.wait;" ::: "memory");
  if (trigger) asm volatile("griddepcontrol.launch_dependents;");
  float acc = 0.f;
  #pragma unroll
  for (int j = 0; j < 32; ++j) acc = fmaf(wv[j], h[(part * 32 + j) % k], acc);
  #pragma unroll
  for (int o = 8; o > 0; o /= 2) acc += __shfl_xor_sync(0xffffffff, acc, o, 16);
  if (part == 0 && col < k) out[col] = tanhf(acc);
  else if (part == 0) out[col] = acc * 1e-3f;
}
'''
vp = ctypes.c_void_p
cuda = cupy = None  # libcuda and CuPy, loaded in main (after the GPU check)


def check(r, what):
    if r != 0:
        s = ctypes.c_char_p()
        cuda.cuGetErrorString(r, ctypes.byref(s))
        raise RuntimeError(f"{what}: {r} {s.value}")


def launch(fn, grid, block, stream, args, pdl):
    holders = [a if isinstance(a, ctypes._SimpleCData) else ctypes.c_void_p(a) for a in args]
    params = (vp * len(holders))(*[ctypes.cast(ctypes.pointer(h), vp) for h in holders])
    attr = LaunchAttribute()
    attr.id = PROGRAMMATIC_STREAM_SERIALIZATION
    attr.value.i = 1
    cfg = LaunchConfig(grid, 1, 1, block, 1, 1, 0, vp(stream), ctypes.pointer(attr), 1 if pdl else 0)
    check(cuda.cuLaunchKernelEx(ctypes.byref(cfg), vp(fn), params, None), "cuLaunchKernelEx")


def graph_of(stream, body):
    check(cuda.cuStreamBeginCapture_v2(vp(stream), 2), "begin capture")
    body()
    g = vp()
    check(cuda.cuStreamEndCapture(vp(stream), ctypes.byref(g)), "end capture")
    e = vp()
    check(cuda.cuGraphInstantiateWithFlags(ctypes.byref(e), g, ctypes.c_ulonglong(0)), "instantiate")
    return e


def time_graph(e, stream, s, reps=20, rounds=7):
    out = []
    for _ in range(rounds):
        a, b = cupy.cuda.Event(), cupy.cuda.Event()
        a.record(s)
        for _ in range(reps):
            check(cuda.cuGraphLaunch(e, vp(stream)), "launch")
        b.record(s)
        b.synchronize()
        out.append(cupy.cuda.get_elapsed_time(a, b) * 1000 / reps)
    return statistics.median(out)


def main():
    global cuda, cupy
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--json", default="", help="write the rows here too")
    opts = ap.parse_args()
    require_gpu(__file__)
    import cupy
    cuda = ctypes.CDLL("libcuda.so.1")
    mod = cupy.RawModule(code=SRC, options=("-arch=sm_90",))
    tiny, rnn = mod.get_function("tiny"), mod.get_function("rnn")
    s = cupy.cuda.Stream(non_blocking=True)
    st = s.ptr
    rows = {}
    n_chain = 100
    for mode in ("plain", "pdl"):
        x = cupy.zeros(1024, cupy.float32)
        pdl = mode == "pdl"
        e = graph_of(st, lambda: [launch(tiny.kernel.ptr, 4, 256, st, [x.data.ptr, ctypes.c_int(1024), ctypes.c_int(int(pdl))], pdl and i > 0) for i in range(n_chain)])
        check(cuda.cuGraphLaunch(e, vp(st)), "warm"); s.synchronize()
        us = time_graph(e, st, s)
        x[:] = 0; check(cuda.cuGraphLaunch(e, vp(st)), "check"); s.synchronize()
        ok = bool((x == n_chain).all())
        rows[f"tiny {mode}"] = dict(us_per_kernel=us / n_chain, graph_us=us, correct=ok)
        print(f"tiny chain of {n_chain}, {mode}: {us / n_chain:.3f} µs a kernel (graph {us:.1f} µs), correct {ok}", flush=True)
    w = cupy.random.standard_normal((512, 2048), dtype=cupy.float32) * 0.05
    steps = 32
    ref = None
    for mode, pdl, trig in (("plain", 0, 0), ("pdl", 1, 0), ("pdl+trigger", 1, 1)):
        h0 = cupy.random.default_rng(1).standard_normal(2048, dtype=cupy.float32)
        bufs = [h0.copy(), cupy.zeros(2048, cupy.float32)]
        def body():
            for t in range(steps):
                launch(rnn.kernel.ptr, 128, 256, st, [w.data.ptr, bufs[t % 2].data.ptr, bufs[(t + 1) % 2].data.ptr,
                                               ctypes.c_int(pdl), ctypes.c_int(trig)], bool(pdl) and t > 0)
        e = graph_of(st, body)
        check(cuda.cuGraphLaunch(e, vp(st)), "warm"); s.synchronize()
        us = time_graph(e, st, s)
        bufs[0][:] = h0; bufs[1][:] = 0
        check(cuda.cuGraphLaunch(e, vp(st)), "check"); s.synchronize()
        got = cupy.asnumpy(bufs[steps % 2])
        if ref is None:
            ref = got
        same = bool(np.array_equal(got, ref))
        rows[f"rnn {mode}"] = dict(us_per_step=us / steps, graph_us=us, same_as_plain=same)
        print(f"rnn chain of {steps} steps (W 512x2048 in L2), {mode}: {us / steps:.3f} µs a step (graph {us:.1f} µs), bit-identical to plain {same}", flush=True)
    if opts.json:
        with open(opts.json, "w") as f:
            json.dump(rows, f, indent=1)


if __name__ == "__main__":
    main()

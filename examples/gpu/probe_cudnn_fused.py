"""cuDNN's fused convolution, bias, residual and relu (cudnnConvolutionBiasActivationForward,
what a ConvCall with an epilogue runs) against the convolution followed by a batch-norm
kernel, on ResNet-50's and Inception-v3's shapes (run on the GPU machine).

    PYTHONPATH=. python3 examples/gpu/probe_cudnn_fused.py

GPU µs per call from a CUDA graph of 20 captured calls (so no host cost), median of 5
launches: the convolution alone (cudnnConvolutionForward, nimble's measured algorithm),
then with a CuPy kernel `max(y * s + b (+ r), 0)` after it, then the fused call (also
with IMPLICIT_PRECOMP_GEMM, the one algorithm cuDNN's identity activation allows); the
fused result's relative error against the two-step one.
"""
from __future__ import annotations

import dataclasses

from nimblejax.bench.needs_gpu import require_gpu

# (batch, size, in channels, out channels, kernel rows, kernel cols, stride)
SHAPES = [(32, 56, 64, 64, 3, 3, 1), (32, 28, 128, 128, 3, 3, 1), (32, 14, 256, 256, 3, 3, 1),
          (32, 7, 512, 512, 3, 3, 1), (32, 35, 64, 96, 3, 3, 1), (32, 17, 160, 160, 1, 7, 1),
          (32, 17, 160, 192, 7, 1, 1), (32, 224, 3, 64, 7, 7, 2), (8, 28, 128, 128, 3, 3, 1)]
PRECOMP_GEMM = 1


def graph_us(stream, fn, reps: int = 20) -> float:
    import cupy as cp

    with stream:
        fn()
        stream.synchronize()
        stream.begin_capture()
        for _ in range(reps):
            fn()
        g = stream.end_capture()
        g.launch(stream)
        stream.synchronize()
        times = []
        for _ in range(5):
            e0, e1 = cp.cuda.Event(), cp.cuda.Event()
            e0.record(stream)
            g.launch(stream)
            e1.record(stream)
            e1.synchronize()
            times.append(cp.cuda.get_elapsed_time(e0, e1) * 1000 / reps)
    return sorted(times)[2]


def probe(shape, stream, handle) -> str:
    import cupy as cp
    from nimblejax.compiler.lowering.task import ConvCall, Epilogue
    from nimblejax.runtime.libs import cudnn

    n, hw, c, k, r, s, stride = shape
    ph, pw = r // 2, s // 2
    oh, ow = (hw + 2 * ph - r) // stride + 1, (hw + 2 * pw - s) // stride + 1
    base = ConvCall((n, hw, hw, c), (k, r, s, c), (n, oh, ow, k), (ph, pw), (stride, stride), (1, 1), 1,
                    "float32", "float32", "tf32")
    plain = cudnn.Conv(base, handle)
    fused = cudnn.Conv(dataclasses.replace(base, epilogue=Epilogue(bias=True, activation="relu", residual=True)),
                       handle)
    rng = cp.random.default_rng(0)
    x = rng.standard_normal(base.x_shape, dtype=cp.float32)
    w = rng.standard_normal(base.w_shape, dtype=cp.float32) * 0.1
    y = cp.empty(base.y_shape, cp.float32)
    res = rng.standard_normal(base.y_shape, dtype=cp.float32)
    scale, bias = cp.ones(k, cp.float32), rng.standard_normal(k, dtype=cp.float32)
    ws = cp.empty(max(plain.workspace, fused.workspace) + (64 << 20), cp.uint8)
    bn = cp.ElementwiseKernel("float32 y, float32 s, float32 b", "float32 o", "o = fmaxf(y * s + b, 0.f)", "bn_relu")
    bn_res = cp.ElementwiseKernel("float32 y, float32 s, float32 b, float32 r", "float32 o",
                                  "o = fmaxf(y * s + b + r, 0.f)", "bn_res_relu")

    def conv():
        plain.run(handle, x.data.ptr, w.data.ptr, y.data.ptr, None, None, ws.data.ptr, plain.workspace)

    def conv_fused(residual: bool, algo=None):
        keep = fused.algo
        fused.algo = keep if algo is None else algo
        size = fused.workspace if algo is None else ws.nbytes
        fused.run(handle, x.data.ptr, w.data.ptr, y.data.ptr, bias.data.ptr, res.data.ptr if residual else None,
                  ws.data.ptr, size)
        fused.algo = keep

    t = [graph_us(stream, conv), graph_us(stream, lambda: (conv(), bn(y, scale, bias, y))),
         graph_us(stream, lambda: conv_fused(False)),
         graph_us(stream, lambda: (conv(), bn_res(y, scale, bias, res, y))),
         graph_us(stream, lambda: conv_fused(True)), graph_us(stream, lambda: conv_fused(True, PRECOMP_GEMM))]
    with stream:
        conv()
        bn_res(y, scale, bias, res, y)
        want = y.copy()
        conv_fused(True)
        stream.synchronize()
    err = float(cp.max(cp.abs(y - want)) / cp.max(cp.abs(want)))
    return (f"| {n}×{hw}²×{c} → {k}, {r}×{s}/{stride} | {plain.algo} | {t[0]:.1f} | {t[1]:.1f} | {t[2]:.1f} | "
            f"{t[3]:.1f} | {t[4]:.1f} | {t[5]:.1f} | {err:.1e} |")


def main() -> None:
    require_gpu(__file__)
    import cupy as cp
    from nimblejax.runtime.libs import cudnn

    stream = cp.cuda.Stream(non_blocking=True)
    handle = cudnn.Handle(stream.ptr)
    print("| shape | algo | conv | + kernel | fused | + residual kernel | fused, residual | "
          "fused, precomp GEMM | rel. error |")
    print("|---|---|---|---|---|---|---|---|---|")
    for shape in SHAPES:
        print(probe(shape, stream, handle), flush=True)


if __name__ == "__main__":
    main()

"""Which formula XLA's GPU code uses for each float function, bit for bit (run on the
GPU machine): jax.jit and nimble.jit over the same inputs, and candidate CUDA forms.

    PYTHONPATH=. python3 examples/gpu/probe_unary_bits.py [--n 4194304]

For each function: how many of the inputs nimble's result differs from jax.jit's in
(NaNs compare equal), and the largest difference in units in the last place. For the
functions in CANDIDATES, the same count for each candidate CUDA expression compiled with
NVRTC's default options (nimble's), which shows which form XLA's matches.
Inputs: float32 values spread over the exponents (random bit patterns with |x| in
[2^-20, 2^6]), the specials, and every bfloat16 value (as float32, and as bfloat16).
"""
from __future__ import annotations

import argparse

import cupy
import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

import nimblejax as nimble
from nimblejax.bench.needs_gpu import require_gpu

FUNCS = {
    "erf": lax.erf, "tanh": jnp.tanh, "rsqrt": lax.rsqrt, "exp": jnp.exp, "log": jnp.log,
    "logistic": jax.nn.sigmoid, "expm1": jnp.expm1, "log1p": jnp.log1p, "sqrt": jnp.sqrt,
    "sin": jnp.sin, "cos": jnp.cos, "tan": jnp.tan, "atan": jnp.arctan, "sinh": jnp.sinh,
    "cosh": jnp.cosh, "asinh": jnp.arcsinh, "erfc": lax.erfc, "erf_inv": lax.erf_inv,
    "cbrt": jnp.cbrt, "exp2": jnp.exp2, "log2": jnp.log2,
}

_ERF = """
    float ax = fabsf(x), x2 = x * x;
    float p = fmaf(x2, 0.00022905065861350646f, 0.0034082910107109506f);
    p = fmaf(x2, p, 0.050955695062380861f); p = fmaf(x2, p, 0.18520832239976145f);
    p = fmaf(x2, p, 1.128379143519084f); p = x * p;
    float q = fmaf(x2, -1.1791602954361697e-7f, 0.000023547966471313185f);
    q = fmaf(x2, q, 0.0010179625278914885f); q = fmaf(x2, q, 0.014070470171167667f);
    q = fmaf(x2, q, 0.11098505178285362f); q = fmaf(x2, q, 0.49746925110067538f);
    q = fmaf(x2, q, 1.0f);
    y = (3.832506856900711f <= ax) ? copysignf(1.0f, x) : {DIV};
"""
_TANH = """
    float c = fminf(fmaxf(x, -{CLAMP}), {CLAMP}), c2 = c * c;
    float n = -2.76076847742355e-16f;
    n = {MA}(c2, n, 2.00018790482477e-13f); n = {MA}(c2, n, -8.60467152213735e-11f);
    n = {MA}(c2, n, 5.12229709037114e-08f); n = {MA}(c2, n, 1.48572235717979e-05f);
    n = {MA}(c2, n, 6.37261928875436e-04f); n = {MA}(c2, n, 4.89352455891786e-03f);
    n = c * n;
    float d = 1.19825839466702e-06f;
    d = {MA}(c2, d, 1.18534705686654e-04f); d = {MA}(c2, d, 2.26843463243900e-03f);
    d = {MA}(c2, d, 4.89352518554385e-03f);
    float t = (fabsf(x) < 0.0004f || x != x) ? x : n / d;
    y = (fabsf(x) < 20.0f || x != x) ? t : copysignf(1.0f, x);
"""
_MUL_ADD = "#define MUL_ADD(a, b, c) __fadd_rn(__fmul_rn(a, b), c)\n"  # not contracted to an fma
CANDIDATES = {
    "erf": {"erff": "y = erff(x);", "xla-poly div.rn": _ERF.replace("{DIV}", "p / q"),
            "xla-poly div.full": _ERF.replace("{DIV}", "__fdividef(p, q)")},
    "tanh": {"tanhf": "y = tanhf(x);",
             **{f"xla-rational {ma} clamp {clamp}": _MUL_ADD + _TANH.replace("{MA}", ma).replace("{CLAMP}", clamp)
                for ma in ("MUL_ADD", "fmaf") for clamp in ("7.90531110763549805f", "7.99881172180175781f")}},
    "rsqrt": {"1/sqrtf": "y = 1.0f / sqrtf(x);", "rsqrtf": "y = rsqrtf(x);"},
    "logistic": {"1/(1+expf(-x))": "y = 1.0f / (1.0f + expf(-x));",
                 "1/(1+__expf(-x))": "y = 1.0f / (1.0f + __expf(-x));"},
}


def inputs(n: int, rng) -> np.ndarray:
    exps = rng.uniform(-20, 6, n)
    mags = np.exp2(exps).astype(np.float32)
    signs = np.where(rng.integers(0, 2, n) == 1, -1, 1).astype(np.float32)
    specials = np.array([0.0, -0.0, np.inf, -np.inf, np.nan, 1e-38, -1e-40, 3.832506856900711,
                         7.90531110763549805, 7.99881172180175781, 20.0, 0.0004, 1.0, -1.0,
                         0.5, 88.7, -88.7, 1e30], np.float32)
    every_bf16 = (np.arange(65536, dtype=np.uint32) << 16).view(np.float32)
    return np.concatenate([mags * signs, specials, every_bf16])


def compare(a: np.ndarray, b: np.ndarray) -> tuple[int, int]:
    """(how many differ, the largest distance in units in the last place)."""
    a, b = np.asarray(a).astype(np.float32), np.asarray(b).astype(np.float32)
    both_nan = np.isnan(a) & np.isnan(b)
    differ = (a.view(np.int32) != b.view(np.int32)) & ~both_nan
    if not differ.any():
        return 0, 0
    ia, ib = a.view(np.int32).astype(np.int64), b.view(np.int32).astype(np.int64)
    ia = np.where(ia < 0, -(ia & 0x7FFFFFFF), ia)  # sign-magnitude to a monotone line
    ib = np.where(ib < 0, -(ib & 0x7FFFFFFF), ib)
    return int(differ.sum()), int(np.abs(ia - ib)[differ].max())


def candidate(body: str):
    prelude, code = ("", body)
    if body.startswith("#define"):  # a macro line first, outside the kernel
        prelude, code = body.split("\n", 1)
        prelude += "\n"
    src = (prelude + 'extern "C" __global__ void k(const float* xs, float* ys, int n) {\n'
           "  int i = blockIdx.x * blockDim.x + threadIdx.x; if (i >= n) return;\n"
           "  float x = xs[i], y;\n" + code + "\n  ys[i] = y;\n}\n")
    return cupy.RawModule(code=src, backend="nvrtc").get_function("k")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--n", type=int, default=1 << 22)
    ap.add_argument("--funcs", default=",".join(FUNCS))
    args = ap.parse_args()
    require_gpu(__file__)
    rng = np.random.default_rng(0)
    xs = inputs(args.n, rng)
    x_dev = jnp.asarray(xs)
    print(f"{len(xs)} float32 inputs; jax {jax.__version__}, {jax.devices()[0].device_kind}")
    print(f"{'function':<10} {'dtype':<9} {'form':<42} {'differ':>9} {'max ulp':>8}")
    for name in args.funcs.split(","):
        fn = FUNCS[name]
        for dtype in (jnp.float32, jnp.bfloat16):
            x = x_dev.astype(dtype)
            want = np.asarray(jax.jit(fn)(x).astype(jnp.float32))
            got = np.asarray(nimble.jit(fn)(x).astype(jnp.float32))
            d, u = compare(got, want)
            print(f"{name:<10} {jnp.dtype(dtype).name:<9} {'nimble':<42} {d:>9} {u:>8}")
        special = jnp.asarray(np.array([np.nan, -np.nan, np.inf, -np.inf, 0.0, -0.0], np.float32))
        print(f"{name:<10} jax.jit at nan, -nan, inf, -inf, 0, -0: {np.asarray(jax.jit(fn)(special))}")
        for form, body in CANDIDATES.get(name, {}).items():
            kernel = candidate(body)
            xin = cupy.asarray(xs)
            out = cupy.empty_like(xin)
            kernel(((len(xs) + 255) // 256,), (256,), (xin, out, np.int32(len(xs))))
            want = np.asarray(jax.jit(fn)(x_dev))
            d, u = compare(cupy.asnumpy(out), want)
            print(f"{name:<10} {'float32':<9} {form:<42} {d:>9} {u:>8}")


if __name__ == "__main__":
    main()

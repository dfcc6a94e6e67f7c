"""Which formula XLA's GPU code uses for each float function, bit for bit (run on the
GPU machine): jax.jit and nimble.jit over the same inputs, and candidate CUDA forms.

    PYTHONPATH=. python3 examples/gpu/probe_unary_bits.py [--n 4194304]

For each function: how many of the inputs nimble's result differs from jax.jit's in
(NaNs compare equal), and the largest difference in units in the last place, over all
inputs, over the inputs that are not subnormal, and over those whose results are not
subnormal either. For the functions in CANDIDATES, the same counts for each candidate
CUDA expression compiled with NVRTC's default options (no flush to zero, unless the form
says --ftz), which shows which form XLA's
matches; a form's division is named (div.rn: CUDA C's `/`; div.full: the PTX
instruction; __fdividef).
Inputs: float32 values spread over the exponents (|x| from 2^-20 to 2^6), the specials,
and every bfloat16 value (as float32, and as bfloat16); division's divisors are the
same values shuffled.
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
from nimblejax.runtime.compile import load_module

FUNCS = {
    "erf": lax.erf, "tanh": jnp.tanh, "rsqrt": lax.rsqrt, "exp": jnp.exp, "log": jnp.log,
    "logistic": jax.nn.sigmoid, "expm1": jnp.expm1, "log1p": jnp.log1p, "sqrt": jnp.sqrt,
    "sin": jnp.sin, "cos": jnp.cos, "tan": jnp.tan, "atan": jnp.arctan, "sinh": jnp.sinh,
    "cosh": jnp.cosh, "asinh": jnp.arcsinh, "erfc": lax.erfc, "erf_inv": lax.erf_inv,
    "cbrt": jnp.cbrt, "exp2": jnp.exp2, "log2": jnp.log2,
    "gelu_tanh": lambda x: jax.nn.gelu(x, approximate=True),
    "gelu_erfc": lambda x: jax.nn.gelu(x, approximate=False),
}
BINARY = {"div": jnp.divide}  # w: the inputs shuffled

_ERF = """
    float ax = fabsf(x), x2 = x * x;
    float p = fmaf(x2, 0.00022905065861350646f, 0.0034082910107109506f);
    p = fmaf(x2, p, 0.050955695062380861f); p = fmaf(x2, p, 0.18520832239976145f);
    p = fmaf(x2, p, 1.128379143519084f); p = x * p;
    float q = fmaf(x2, -1.1791602954361697e-7f, 0.000023547966471313185f);
    q = fmaf(x2, q, 0.0010179625278914885f); q = fmaf(x2, q, 0.014070470171167667f);
    q = fmaf(x2, q, 0.11098505178285362f); q = fmaf(x2, q, 0.49746925110067538f);
    q = fmaf(x2, q, 1.0f);
    y = (3.832506856900711f <= ax) ? copysignf(1.0f, x) : DIV(p, q);
"""
_TANH = """
    float c = fminf(fmaxf(x, -{CLAMP}), {CLAMP}), c2 = c * c;
    float nu = -2.76076847742355e-16f;
    nu = {MA}(c2, nu, 2.00018790482477e-13f); nu = {MA}(c2, nu, -8.60467152213735e-11f);
    nu = {MA}(c2, nu, 5.12229709037114e-08f); nu = {MA}(c2, nu, 1.48572235717979e-05f);
    nu = {MA}(c2, nu, 6.37261928875436e-04f); nu = {MA}(c2, nu, 4.89352455891786e-03f);
    nu = c * nu;
    float de = 1.19825839466702e-06f;
    de = {MA}(c2, de, 1.18534705686654e-04f); de = {MA}(c2, de, 2.26843463243900e-03f);
    de = {MA}(c2, de, 4.89352518554385e-03f);
    float t = (fabsf(x) < 0.0004f || x != x) ? x : DIV(nu, de);
    y = (fabsf(x) < 20.0f || x != x) ? t : copysignf(1.0f, x);
"""
HEADER = """__device__ __forceinline__ float div_full(float a, float b) {
  float r; asm("div.full.f32 %0, %1, %2;" : "=f"(r) : "f"(a), "f"(b)); return r; }
#define MUL_ADD(a, b, c) __fadd_rn(__fmul_rn(a, b), c)
__device__ __forceinline__ float R(float v) {  // rounded to bfloat16, to nearest even
  unsigned u = __float_as_uint(v);
  if ((u & 0x7fffffffu) > 0x7f800000u) return v;
  return __uint_as_float((u + 0x7fffu + ((u >> 16) & 1u)) & 0xffff0000u); }
"""
DIVS = {"div.rn": "((a) / (b))", "div.full": "div_full(a, b)", "__fdividef": "__fdividef(a, b)"}
# function -> form -> the body (x, w in; y out; DIV(a, b) the division of the form's name)
CANDIDATES = {
    "erf": {"erff": "y = erff(x);", **{f"xla-poly {d}": _ERF + "//" + d for d in DIVS},
            "xla-poly div.full, result clamped to ±1":
                _ERF.replace("DIV(p, q)", "fminf(fmaxf(DIV(p, q), -1.0f), 1.0f)") + "//div.full",
            # XLA's MLIR float-op expansion (its expand_float_ops pass): x clamped to
            # ±3.7439211627767994 (erf⁻¹(1 − 2⁻²³)), then the same rational form
            "xla-poly div.full, x clamped to ±3.7439":
                "x = (x != x) ? x : fminf(fmaxf(x, -3.7439211627767994f), 3.7439211627767994f);"
                + _ERF.replace("(3.832506856900711f <= ax) ? copysignf(1.0f, x) : ", "") + "//div.full"},
    "tanh": {"tanhf": "y = tanhf(x);",
             **{f"xla-rational {ma} clamp {clamp[:6]} {d}": _TANH.replace("{MA}", ma).replace("{CLAMP}", clamp) + "//" + d
                for ma in ("MUL_ADD", "fmaf") for clamp in ("7.90531110763549805f", "7.99881172180175781f")
                for d in ("div.rn", "div.full")}},
    "rsqrt": {"rsqrtf": "y = rsqrtf(x);", **{f"1/sqrtf {d}": "y = DIV(1.0f, sqrtf(x));//" + d for d in DIVS}},
    "logistic": {f"1/(1+expf(-x)) {d}": "y = DIV(1.0f, 1.0f + expf(-x));//" + d for d in DIVS},
    "div": {d: "y = DIV(x, w);//" + d for d in DIVS},
    "sqrt": {"sqrtf": "y = sqrtf(x);", "sqrtf --ftz --prec-sqrt=false": "y = sqrtf(x);",
             "sqrt.approx.f32": 'asm("sqrt.approx.f32 %0, %1;" : "=f"(y) : "f"(x));',
             "sqrt.approx.ftz.f32": 'asm("sqrt.approx.ftz.f32 %0, %1;" : "=f"(y) : "f"(x));'},
    "sin": {"sinf": "y = sinf(x);", "sinf --ftz": "y = sinf(x);"},
    "log": {"logf": "y = logf(x);", "logf --ftz": "y = logf(x);"},
    "exp": {"expf": "y = expf(x);", "expf --ftz": "y = expf(x);"},
    "exp2": {"exp2f": "y = exp2f(x);", "expf(x * ln2)": "y = expf(__fmul_rn(x, 0.693147182f));"},
    "log2": {"log2f": "y = log2f(x);", "logf(x) / ln2 div.full": "y = DIV(logf(x), 0.693147182f);//div.full",
             "logf(x) * (1 / ln2)": "y = __fmul_rn(logf(x), 1.44269502f);"},
}
# Forms in bfloat16: x is a bfloat16 value, R(v) rounds to bfloat16 (a step of XLA's
# in the type, or not where its excess precision keeps float32 between two steps).
CANDIDATES_BF16 = {
    "exp2": {"R(exp(R(ln2·x)))": "y = R(expf(R(__fmul_rn(0.69140625f, x))));",
             "R(exp(ln2·x))": "y = R(expf(__fmul_rn(0.69140625f, x)));",
             "R(exp2f(x))": "y = R(exp2f(x));"},
    "log2": {"R(R(log x) · f32(1/ln2))": "y = R(__fmul_rn(R(logf(x)), 1.44632769f));",
             "R(R(log x) · R(1/ln2))": "y = R(__fmul_rn(R(logf(x)), 1.4453125f));",
             "R(log x · f32(1/ln2))": "y = R(__fmul_rn(logf(x), 1.44632769f));",
             "R(R(log x) / ln2) div.full": "y = R(DIV(R(logf(x)), 0.69140625f));//div.full",
             "R(log2f(x))": "y = R(log2f(x));"},
    "logistic": {"every step rounded (nimble's)": "y = R(DIV(1.0f, R(1.0f + R(expf(-x)))));//div.full",
                 "R(1 + exp) only": "y = R(DIV(1.0f, R(1.0f + expf(-x))));//div.full",
                 "rounded at the end": "y = R(DIV(1.0f, 1.0f + expf(-x)));//div.full"},
}
# A form whose name holds --ftz (--prec-sqrt=false) compiles with NVRTC's --ftz=true
# (--prec-sqrt=false).
OPTION_FLAGS = {"--ftz": "--ftz=true", "--prec-sqrt=false": "--prec-sqrt=false"}


def inputs(n: int, rng) -> np.ndarray:
    exps = rng.uniform(-20, 6, n)
    mags = np.exp2(exps).astype(np.float32)
    signs = np.where(rng.integers(0, 2, n) == 1, -1, 1).astype(np.float32)
    specials = np.array([0.0, -0.0, np.inf, -np.inf, np.nan, 1e-38, -1e-40, 3.832506856900711,
                         7.90531110763549805, 7.99881172180175781, 20.0, 0.0004, 1.0, -1.0,
                         0.5, 88.7, -88.7, 1e30], np.float32)
    every_bf16 = (np.arange(65536, dtype=np.uint32) << 16).view(np.float32)
    return np.concatenate([mags * signs, specials, every_bf16])


def compare(a: np.ndarray, b: np.ndarray, keep=None) -> tuple[int, int]:
    """(how many differ, the largest distance in units in the last place), over the
    inputs where `keep` is true (all without it)."""
    a, b = np.asarray(a).astype(np.float32), np.asarray(b).astype(np.float32)
    both_nan = np.isnan(a) & np.isnan(b)
    differ = (a.view(np.int32) != b.view(np.int32)) & ~both_nan
    if keep is not None:
        differ &= keep
    if not differ.any():
        return 0, 0
    ia, ib = a.view(np.int32).astype(np.int64), b.view(np.int32).astype(np.int64)
    ia = np.where(ia < 0, -(ia & 0x7FFFFFFF), ia)  # sign-magnitude to a monotone line
    ib = np.where(ib < 0, -(ib & 0x7FFFFFFF), ib)
    return int(differ.sum()), int(np.abs(ia - ib)[differ].max())


def not_subnormal(v) -> np.ndarray:
    v = np.asarray(v, np.float32)
    return ~((np.abs(v) < np.finfo(np.float32).tiny) & (v != 0))


def row(got: np.ndarray, want: np.ndarray, x: np.ndarray) -> str:
    """The table's counts: over all inputs, over the inputs that are not subnormal, and
    over those whose results (both) are not subnormal either."""
    normal_in = not_subnormal(x)
    normal_out = normal_in & not_subnormal(got) & not_subnormal(want)
    counts = [compare(got, want), compare(got, want, normal_in), compare(got, want, normal_out)]
    return " ".join(f"{d:>9} {u:>8}" for d, u in counts)


def candidate(body: str, form: str):
    code, _, div = body.rpartition("//")
    if not code:
        code, div = body, "div.rn"
    src = (HEADER + f"#define DIV(a, b) {DIVS[div]}\n"
           'extern "C" __global__ void k(const float* xs, const float* ws, float* ys, int count) {\n'
           "  int i = blockIdx.x * blockDim.x + threadIdx.x; if (i >= count) return;\n"
           "  float x = xs[i], w = ws[i], y;\n" + code + "\n  ys[i] = y;\n}\n")
    options = tuple(flag for word, flag in OPTION_FLAGS.items() if word in form.split())
    # As nimble compiles (runtime/compile.py): CuPy's RawModule(code=...) would append
    # --ftz=true to every form.
    return load_module(src, options).get_function("k")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--n", type=int, default=1 << 22)
    ap.add_argument("--funcs", default=",".join([*FUNCS, *BINARY]))
    args = ap.parse_args()
    require_gpu(__file__)
    rng = np.random.default_rng(0)
    xs = inputs(args.n, rng)
    x_dev = jnp.asarray(xs)
    print(f"{len(xs)} float32 inputs; jax {jax.__version__}, {jax.devices()[0].device_kind}")
    print("normal: the same over the inputs that are not subnormal; norm out: and whose"
          " results are not either")
    print(f"{'function':<10} {'dtype':<9} {'form':<42} {'differ':>9} {'max ulp':>8}"
          f" {'normal':>9} {'max ulp':>8} {'norm out':>9} {'max ulp':>8}")
    w_host = rng.permutation(xs)
    w_dev = jnp.asarray(w_host)
    for name in args.funcs.split(","):
        fn = BINARY.get(name) or FUNCS[name]
        call = (lambda f, a, b: f(a, b)) if name in BINARY else (lambda f, a, b: f(a))
        for dtype in (jnp.float32, jnp.bfloat16):
            x, w = x_dev.astype(dtype), w_dev.astype(dtype)
            want = np.asarray(call(jax.jit(fn), x, w).astype(jnp.float32))
            got = np.asarray(call(nimble.jit(fn), x, w).astype(jnp.float32))
            x_in = np.asarray(x.astype(jnp.float32))
            print(f"{name:<10} {jnp.dtype(dtype).name:<9} {'nimble':<42}", row(got, want, x_in),
                  flush=True)
        want = np.asarray(call(jax.jit(fn), x_dev, w_dev))
        if name == "erf":  # where XLA's erf leaves the formula: its bits below the clamp
            band = np.linspace(3.70, 3.84, 15, dtype=np.float32)
            print("erf near its clamp, x: jax.jit's bits - 1.0f's:", ", ".join(
                f"{b:.4f}: {int(v.view(np.int32)) - 0x3F800000}"
                for b, v in zip(band, np.asarray(jax.jit(fn)(jnp.asarray(band))))))
        for form, body in CANDIDATES.get(name, {}).items():
            kernel = candidate(body, form)
            xin, win = cupy.asarray(xs), cupy.asarray(w_host)
            out = cupy.empty_like(xin)
            kernel(((len(xs) + 255) // 256,), (256,), (xin, win, out, np.int32(len(xs))))
            print(f"{name:<10} {'float32':<9} {form:<42}", row(cupy.asnumpy(out), want, xs),
                  flush=True)
        x_bf16 = x_dev.astype(jnp.bfloat16)
        want = np.asarray(call(jax.jit(fn), x_bf16, w_dev.astype(jnp.bfloat16)).astype(jnp.float32))
        xb = np.asarray(x_bf16.astype(jnp.float32))
        for form, body in CANDIDATES_BF16.get(name, {}).items():
            xin = cupy.asarray(xb)
            out = cupy.empty_like(xin)
            candidate(body, form)(((len(xb) + 255) // 256,), (256,), (xin, xin, out, np.int32(len(xb))))
            print(f"{name:<10} {'bfloat16':<9} {form:<42}", row(cupy.asnumpy(out), want, xb),
                  flush=True)


if __name__ == "__main__":
    main()

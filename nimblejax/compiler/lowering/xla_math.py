"""Float arithmetic as XLA's GPU code does it, where that differs from CUDA C's: division,
erf, tanh, erfc and erf_inv, as `__device__` helpers in the source of each kernel that
calls one, so that nimble's results are jax.jit's bit for bit.

- Division: XLA compiles its kernels with LLVM's `-nvptx-prec-divf32=1`, so a float32
  division is `div.full.f32` (within 2 ulp, subnormal results flushed to zero), not the
  IEEE `div.rn.f32` of CUDA C's `/` (measured on an H200, jax 0.11.2: of 2.2M erf
  results, 182,345 differ with `div.rn`, 2,567 with `__fdividef`). bfloat16 and float16
  divide in float32 the same way.
- erf: XLA's elemental emitter computes it by a rational approximation (Eigen's), not by
  libdevice's `erff`: |x| at or beyond erf⁻¹(1 − ½ulp) is ±1, otherwise x·P(x²)/Q(x²),
  the polynomials by fused multiply-adds. CUDA's `erff` differs from it on about half of
  all inputs (964,192 of 2.2M).
- tanh: likewise a rational approximation: |x| below 0.0004 is x itself, from 20 on ±1,
  otherwise x·P(x²)/Q(x²) of x clamped to ±7.99881172180175781, the polynomials' steps
  fused multiply-adds (of eight forms measured, only this one with div.full matched all
  2.2M results; CUDA's `tanhf` differs on 892,880).
- rsqrt is libdevice's approximate `rsqrtf` (`rsqrt.approx`), not 1 / sqrt (which
  differs on 368,948 of 2.2M); logistic is XLA's expansion 1 / (1 + exp(−x)), and in
  bfloat16 and float16 each of its steps is rounded to the type, as XLA's expansion into
  16-bit operations does (`elementwise.unary_template`).

- erfc: JAX's `erfc` (the exact form of `jax.nn.gelu`) is decomposed before XLA's
  kernels are made (stablehlo's CHLO legalization, Cephes's form): 1 − x·T(x²) for
  |x| < 1, else exp(−x²)/|x| · P(1/x²) below 2 and R(1/x²) from 2 on (0 past
  exp's range, 2 minus it for negative x). Its polynomials are HLO multiplies and adds,
  which XLA's GPU code rounds each (no fused multiply-add: measured on an H200, 0 of
  1.1M normal results differ so, 39,450 with the steps fused).
- erf_inv (jax.random.normal's): likewise decomposed (Giles's single-precision form):
  w = −log1p(−x²) (libdevice's log1pf, as XLA's log1p), below 5 a polynomial in w − 2.5,
  else in √w − 3, each step a multiply and an add; ±inf at ±1 (0 of 1.1M normal results
  differ; 6,447 fused).

The other functions are libdevice's, as CUDA C's `expf` and the like are; sqrt is its
approximate form (runtime/compile.py's --prec-sqrt=false).

Measured and not matched yet (probe_unary_bits.py, 1.1M float32 inputs): erf just below
its clamp (jax.jit's erf is exactly ±1 from |x| ≈ 3.75 on and 1 to 5 ulp below 1 at 3.70
to 3.74, about 1,150 inputs; the formula's result clamped to ±1 does not match either);
a subnormal input to most functions (256 inputs) and subnormal results of erfc (731)
and erf_inv (34), measured while CuPy's compile flushed every kernel's subnormal numbers
to zero (runtime/compile.py: no longer; not measured again since);
exp2 and log2 in bfloat16 (JAX's exp(ln2·x) and log(x)/ln2, elementwise.unary_template:
51 and 24,545 inputs differ by one bfloat16 ulp; float32 matches); logistic in bfloat16
(161 inputs, 1 ulp).
`examples/gpu/probe_unary_bits.py` compares every float function with jax.jit on the GPU
and shows which candidate form matches. The CPU emulator of the tests
(tests/helpers/kernel_emulator.py) skips the NIMBLE_XLA_DIV block for its own
`nimble_div`, with IEEE rounding, as XLA's CPU code divides.
A kernel that calls these carries MATH after its headers (`codegen.with_prelude`).
"""
from __future__ import annotations

import re


def horner(name: str, var: str, coefficients: tuple[str, ...], fused: bool = True) -> str:
    """C lines computing the polynomial `name` in `var`, highest coefficient first, each
    step name = name * var + c: one fused multiply-add (`fused`, as Eigen's forms in XLA's
    emitter are written), or a multiply and an add rounded each (JAX's decompositions:
    XLA's GPU code does not fuse an HLO multiply into the add that reads it).
    A coefficient is a C expression."""
    first, *rest = coefficients
    step = "fmaf({n}, {v}, {c})" if fused else "__fmul_rn({n}, {v}) + {c}"
    steps = [f"  {name} = {step.format(n=name, v=var, c=c)};" for c in rest]
    return "\n".join([f"  float {name} = {first};", *steps])


def _floats(*decimals: str) -> tuple[str, ...]:
    """Double literals rounded to float, as the decompositions' C++ float arrays round them."""
    return tuple(f"(float){d}" for d in decimals)


# erf (XLA's emitter): x·P(x²)/Q(x²).
ERF_P = ("0.00022905065861350646f", "0.0034082910107109506f", "0.050955695062380861f",
         "0.18520832239976145f", "1.128379143519084f")
ERF_Q = ("-1.1791602954361697e-7f", "0.000023547966471313185f", "0.0010179625278914885f",
         "0.014070470171167667f", "0.11098505178285362f", "0.49746925110067538f", "1.0f")
# tanh (XLA's emitter): c·N(c²)/D(c²) of the clamped c.
TANH_N = ("-2.76076847742355e-16f", "2.00018790482477e-13f", "-8.60467152213735e-11f",
          "5.12229709037114e-08f", "1.48572235717979e-05f", "6.37261928875436e-04f",
          "4.89352455891786e-03f")
TANH_D = ("1.19825839466702e-06f", "1.18534705686654e-04f", "2.26843463243900e-03f",
          "4.89352518554385e-03f")
# erfc (Cephes): P for 1 <= |x| < 2 and R from 2 on, in 1/x²; T for |x| < 1, in x².
ERFC_P = _floats("2.326819970068386E-2", "-1.387039388740657E-1", "3.687424674597105E-1",
                 "-5.824733027278666E-1", "6.210004621745983E-1", "-4.944515323274145E-1",
                 "3.404879937665872E-1", "-2.741127028184656E-1", "5.638259427386472E-1")
ERFC_R = _floats("-1.047766399936249E+1", "1.297719955372516E+1", "-7.495518717768503E+0",
                 "2.921019019210786E+0", "-1.015265279202700E+0", "4.218463358204948E-1",
                 "-2.820767439740514E-1", "5.641895067754075E-1")
ERFC_T = _floats("7.853861353153693E-5", "-8.010193625184903E-4", "5.188327685732524E-3",
                 "-2.685381193529856E-2", "1.128358514861418E-1", "-3.761262582423300E-1",
                 "1.128379165726710E+0")
# erf_inv (Giles): the coefficients below w = 5 and from 5 on, chosen per element.
ERF_INV_LOW = ("2.81022636e-08f", "3.43273939e-07f", "-3.5233877e-06f", "-4.39150654e-06f",
               "0.00021858087f", "-0.00125372503f", "-0.00417768164f", "0.246640727f",
               "1.50140941f")
ERF_INV_HIGH = ("-0.000200214257f", "0.000100950558f", "0.00134934322f", "-0.00367342844f",
                "0.00573950773f", "-0.0076224613f", "0.00943887047f", "1.00167406f",
                "2.83297682f")

MATH = f"""#ifndef NIMBLE_XLA_DIV
#define NIMBLE_XLA_DIV
static __device__ __forceinline__ float nimble_div(float a, float b) {{
  float r;
  asm("div.full.f32 %0, %1, %2;" : "=f"(r) : "f"(a), "f"(b));
  return r;
}}
#endif  // NIMBLE_XLA_DIV
#ifndef NIMBLE_XLA_MATH
#define NIMBLE_XLA_MATH
static __device__ __forceinline__ float nimble_erf(float x) {{
  float x2 = x * x;
{horner("p", "x2", ERF_P)}
{horner("q", "x2", ERF_Q)}
  return 3.832506856900711f <= fabsf(x) ? copysignf(1.0f, x) : nimble_div(x * p, q);
}}
static __device__ __forceinline__ float nimble_tanh(float x) {{
  if (x != x || fabsf(x) < 0.0004f) return x;
  if (fabsf(x) >= 20.0f) return copysignf(1.0f, x);
  float c = fminf(fmaxf(x, -7.99881172180175781f), 7.99881172180175781f), c2 = c * c;
{horner("n", "c2", TANH_N)}
{horner("d", "c2", TANH_D)}
  return nimble_div(c * n, d);
}}
static __device__ __forceinline__ float nimble_erfc(float x) {{
  float x2 = x * x, z = -x2, ax = fabsf(x);
  float e = expf(z) * nimble_div(1.0f, ax), r = nimble_div(1.0f, x2);
{horner("p", "r", ERFC_P, fused=False)}
{horner("q", "r", ERFC_R, fused=False)}
  float big = z < (float)-88.72283905206835 ? 0.0f : e * (ax < 2.0f ? p : q);
  big = x < 0.0f ? 2.0f - big : big;
{horner("t", "x2", ERFC_T, fused=False)}
  return ax < 1.0f ? 1.0f - __fmul_rn(x, t) : big;
}}
static __device__ __forceinline__ float nimble_erf_inv(float x) {{
  float w = -log1pf(x * -x);
  bool lt = w < 5.0f;
  w = lt ? w - 2.5f : sqrtf(w) - 3.0f;
{horner("p", "w", tuple(f"(lt ? {a} : {b})" for a, b in zip(ERF_INV_LOW, ERF_INV_HIGH)), fused=False)}
  return fabsf(x) == 1.0f ? x * __int_as_float(0x7f800000) : p * x;
}}
#endif
"""
HELPERS = tuple(re.findall(r"float (nimble_\w+)\(", MATH))


def helpers_for(source: str) -> str:
    """MATH where `source` calls one of its functions, else nothing."""
    return MATH if any(f"{h}(" in source for h in HELPERS) else ""

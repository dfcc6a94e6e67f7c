"""The float functions that XLA's GPU code computes by its own formulas rather than by
CUDA's math library, as `__device__` helpers every kernel's prelude carries, so that
nimble's results are jax.jit's bit for bit.

XLA's elemental emitter for GPUs computes `erf` and `tanh` of float32 (and of bfloat16 and
float16, widened to float32 and rounded once at the end) by rational approximations
(Eigen's), not by libdevice's `erff` and `tanhf`; the other functions are libdevice calls,
which CUDA's `erff`-style functions are too. The approximations differ from the library's
by one or two units in the last place on about half of all inputs, and cost fewer
instructions.

- erf: |x| at or beyond erf⁻¹(1 − ½ulp) is ±1; otherwise x·P(x²)/Q(x²), both evaluated
  by fused multiply-adds, divided with IEEE rounding. NaN stays NaN.
- tanh: |x| below 0.0004 is x itself; |x| from 20 on is ±1; otherwise x·P(x²)/Q(x²) of x
  clamped to ±7.90531110763549805 (where the approximation reaches ±1), the
  polynomials' steps fused into multiply-adds as LLVM's NVPTX backend fuses them.

`examples/gpu/probe_unary_bits.py` compares these with jax.jit on the GPU, bit for bit.
Every kernel's source starts with PRELUDE (codegen.py), which ends with MATH.
"""
from __future__ import annotations

MATH = """#ifndef NIMBLE_XLA_MATH
#define NIMBLE_XLA_MATH
static __device__ __forceinline__ float nimble_erf(float x) {
  float x2 = x * x;
  float p = fmaf(x2, 0.00022905065861350646f, 0.0034082910107109506f);
  p = fmaf(x2, p, 0.050955695062380861f);
  p = fmaf(x2, p, 0.18520832239976145f);
  p = fmaf(x2, p, 1.128379143519084f);
  p = x * p;
  float q = fmaf(x2, -1.1791602954361697e-7f, 0.000023547966471313185f);
  q = fmaf(x2, q, 0.0010179625278914885f);
  q = fmaf(x2, q, 0.014070470171167667f);
  q = fmaf(x2, q, 0.11098505178285362f);
  q = fmaf(x2, q, 0.49746925110067538f);
  q = fmaf(x2, q, 1.0f);
  return 3.832506856900711f <= fabsf(x) ? copysignf(1.0f, x) : p / q;
}
static __device__ __forceinline__ float nimble_tanh(float x) {
  if (x != x || fabsf(x) < 0.0004f) return x;
  if (fabsf(x) >= 20.0f) return copysignf(1.0f, x);
  float c = fminf(fmaxf(x, -7.90531110763549805f), 7.90531110763549805f), c2 = c * c;
  float n = fmaf(c2, -2.76076847742355e-16f, 2.00018790482477e-13f);
  n = fmaf(c2, n, -8.60467152213735e-11f);
  n = fmaf(c2, n, 5.12229709037114e-08f);
  n = fmaf(c2, n, 1.48572235717979e-05f);
  n = fmaf(c2, n, 6.37261928875436e-04f);
  n = fmaf(c2, n, 4.89352455891786e-03f);
  n = c * n;
  float d = fmaf(c2, 1.19825839466702e-06f, 1.18534705686654e-04f);
  d = fmaf(c2, d, 2.26843463243900e-03f);
  d = fmaf(c2, d, 4.89352518554385e-03f);
  return n / d;
}
#endif
"""

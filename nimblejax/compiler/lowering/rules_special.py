"""Special functions (digamma, polygamma, zeta, igamma, igammac, igamma_grad_a, betainc,
bessel_i0e/i1e) and mulhi.

Each special function is a C block computing `r` (a double) from its double operands
(`x`, or `a`, `x`, or `a`, `b`, `x`, ...): series, continued fractions and asymptotic
expansions evaluated in double, so a float32 result is the correctly rounded value
(within JAX's test tolerances of XLA's float32 algorithms, which are themselves
checked against SciPy), and float16/bfloat16 results round once at the end, as XLA's
upcast to float32 does. The blocks are plain C (only <math.h> functions that CUDA
has in double), so tests compile them for the host too and compare with JAX.
The rule emits the block in braces inside the fused kernel: it fuses like any
elementwise op, in every kernel template, with no file-scope helper needed.

zeta and polygamma follow XLA's CHLO expansion term for term, in double: its values,
edge cases included, are what jax.jit returns. Where XLA's answers on the CPU and on the
GPU could differ, these are the CPU's: XLA keeps its first ten terms alone where the
rest is below the smallest denormal, a test that never passes on the CPU, which flushes
denormals (on a GPU that does not flush, zeta(inf, 1) would be 1; it is NaN on the CPU
and here).
"""
from __future__ import annotations

from fractions import Fraction
from math import comb, factorial

from nimblejax.compiler import dtypes
from nimblejax.compiler.ir import Node
from nimblejax.compiler.kinds import RuleKind
from nimblejax.compiler.lowering.codegen import Index, KernelBuilder
from nimblejax.compiler.lowering.registry import register

_NAN = "(0.0 / 0.0)"
_INF = "(1.0 / 0.0)"

# digamma: reflection below 1/2, recurrence up to 10, asymptotic series there.
DIGAMMA = f"""
double s = 0.0, y = x;
if (x != x || x == -1.0 / 0.0 || (x <= 0.0 && x == floor(x))) {{ r = {_NAN}; }}
else {{
  if (y < 0.5) {{
    double f = y - floor(y + 0.5);  /* tan(pi y) has period 1; f is exact */
    s = -3.141592653589793 / tan(3.141592653589793 * f);
    y = 1.0 - y;
  }}
  while (y < 10.0) {{ s -= 1.0 / y; y += 1.0; }}
  double z = 1.0 / (y * y);
  double t = z * (1.0 / 12 - z * (1.0 / 120 - z * (1.0 / 252 - z * (1.0 / 240 - z * (1.0 / 132
             - z * (691.0 / 32760 - z * (1.0 / 12)))))));
  r = s + log(y) - 0.5 / y - t;
}}
"""


def _bernoulli(n: int) -> list[Fraction]:
    """B_0 .. B_n, from sum_{k<=m} C(m+1, k) B_k = 0 (so B_1 = -1/2)."""
    b = [Fraction(1)]
    for m in range(1, n + 1):
        b.append(-sum(comb(m + 1, k) * b[k] for k in range(m)) / (m + 1))
    return b


# Hurwitz zeta(x, q) = sum_{n>=0} (q + n)^-x by Euler-Maclaurin at a = q + 10: the first
# ten terms, the rest's integral a^(1-x)/(x-1), half the term at a, and the Bernoulli
# terms sum_{k=1..12} B_2k/(2k)! x(x+1)...(x+2k-2) a^(-x-2k+1), nested from k = 12 down.
# As XLA's CHLO expansion (what jax.jit returns): the same 10 + 12 terms for every q (for
# q < -10 that is not the function's value, nor is XLA's), then, each overriding the
# last: NaN for x < 1; NaN for q <= 0 and x not an integer; at an integer q <= 0, inf
# for an even integer x and NaN otherwise; inf for x = 1 (whatever q). Where XLA's
# float32 overflows and double does not, jax.jit's answer is NaN or inf and this one the
# value: zeta of x above about 1e3 (XLA's product of the (x + j) overflows; zeta(1e4, 1)
# is NaN there, 1 here) and polygamma of m >= 35 (m! overflows).
_ZETA_TAIL = [float(_bernoulli(24)[2 * k] / factorial(2 * k)) for k in range(1, 13)]
_HORNER = "".join(f"  h = (x + {2 * k - 3}.0) * (x + {2 * k - 2}.0) * ia2 * ({c!r} + h);\n"
                  for k, c in reversed(list(enumerate(_ZETA_TAIL, 1))) if k > 1)
ZETA = f"""
if (x == 1.0) {{ r = {_INF}; }}
else if (q <= 0.0 && q == floor(q)) {{
  r = (x == floor(x) && fmod(x, 2.0) == 0.0) ? {_INF} : {_NAN};
}}
else if (x < 1.0 || (q <= 0.0 && x != floor(x))) {{ r = {_NAN}; }}
else {{
  double s = 0.0, a = q;
  for (int n = 0; n < 10; ++n) {{ s += pow(a, -x); a += 1.0; }}
  double b = pow(a, -x), ia2 = 1.0 / (a * a), h = 0.0;
{_HORNER}  r = s + b * a / (x - 1.0) + b * (0.5 + x / a * ({_ZETA_TAIL[0]!r} + h));
}}
"""

# polygamma(m, x) = (-1)^(m+1) m! zeta(m + 1, x), digamma(x) at m = 0, NaN for m not a
# natural number, as XLA's expansion (whose m! = exp(lgamma(m + 1)) in float32 errs by up
# to 9e-7 for m <= 3: 3! is 6.0000052 there; here m! is tgamma(m + 1) in double).
POLYGAMMA = f"""
if (m != floor(m) || m < 0.0) {{ r = {_NAN}; }}
else if (m == 0.0) {{ {DIGAMMA} }}
else {{
  double z;
  {{ const double q = x; const double x = m + 1.0; double r; {ZETA} z = r; }}
  r = (fmod(m, 2.0) == 0.0 ? -z : z) * tgamma(m + 1.0);
}}
"""

# exp(-|x|) I_nu(|x|), nu = 0 or 1: the power series up to 30, the asymptotic one above.
_BESSEL = """
double ax = fabs(x), q = 0.25 * ax * ax;
if (x != x) { r = x; }
else if (ax <= 30.0) {
  double term = NU == 0 ? 1.0 : 0.5 * ax, sum = term;
  for (int k = 1; k < 200 && term > 1e-17 * sum; ++k) {
    term *= q / ((double)k * (double)(k + NU));
    sum += term;
  }
  r = sum * exp(-ax);
} else {
  double mu = 4.0 * NU * NU, term = 1.0, sum = 1.0;
  for (int k = 1; k < 60; ++k) {
    double next = term * ((2.0 * k - 1.0) * (2.0 * k - 1.0) - mu) / (8.0 * k * ax);
    if (fabs(next) >= fabs(term)) break;  /* the asymptotic series starts to diverge */
    term = next;
    sum += term;
    if (fabs(term) < 1e-17 * fabs(sum)) break;
  }
  r = sum / sqrt(6.283185307179586 * ax);
}
if (NU == 1 && x < 0.0) r = -r;
"""
BESSEL_I0E = _BESSEL.replace("NU", "0")
BESSEL_I1E = _BESSEL.replace("NU", "1")

# P(a, x) = igamma, Q(a, x) = igammac: the series of P below x = a + 1, the continued
# fraction of Q (modified Lentz) above; the other one is the complement.
_IGAMMA = f"""
if (x != x || a != a || x < 0.0 || a < 0.0 || a == 1.0 / 0.0 || (a == 0.0 && x == 0.0)) {{
  r = {_NAN};
}}
else if (x == 0.0) {{ r = LOWER ? 0.0 : 1.0; }}
else if (a == 0.0 || x == 1.0 / 0.0) {{ r = LOWER ? 1.0 : 0.0; }}
else {{
  double pre = exp(a * log(x) - x - lgamma(a));
  if (x < a + 1.0) {{
    double ap = a, del = 1.0 / a, sum = del;
    for (int n = 0; n < 5000 && fabs(del) > 1e-17 * fabs(sum); ++n) {{
      ap += 1.0; del *= x / ap; sum += del;
    }}
    double p = sum * pre;
    r = LOWER ? p : 1.0 - p;
  }} else {{
    double b = x + 1.0 - a, c = 1e300, d = 1.0 / b, h = d;
    for (int i = 1; i < 5000; ++i) {{
      double an = -i * (i - a);
      b += 2.0;
      d = an * d + b; if (fabs(d) < 1e-300) d = 1e-300;
      c = b + an / c; if (fabs(c) < 1e-300) c = 1e-300;
      d = 1.0 / d;
      double del = d * c;
      h *= del;
      if (fabs(del - 1.0) < 1e-16) break;
    }}
    double q = h * pre;
    r = LOWER ? 1.0 - q : q;
  }}
}}
"""
IGAMMA = _IGAMMA.replace("LOWER", "1")
IGAMMAC = _IGAMMA.replace("LOWER", "0")

# dP(a, x)/da (the gradient of igamma in a): P = pre * S with pre = x^a e^-x / Gamma(a),
# so dP/da = pre * ((log x - digamma(a)) S + dS/da); S is the series of P below
# x = a + 1, and 1 - Q (Q's continued fraction, differentiated in forward mode) above.
IGAMMA_GRAD_A = f"""
if (x != x || a != a || x < 0.0 || a <= 0.0 || x == 1.0 / 0.0) {{ r = {_NAN}; }}  /* as JAX */
else if (x == 0.0 || a == 1.0 / 0.0) {{ r = 0.0; }}
else {{
  double psi;
  {{ const double x = a; double r; {DIGAMMA} psi = r; }}
  double pre = exp(a * log(x) - x - lgamma(a)), dlpre = log(x) - psi;
  if (x < a + 1.0) {{
    double ap = a, del = 1.0 / a, g = -1.0 / a, sum = del, dsum = del * g;
    for (int n = 0; n < 5000; ++n) {{
      ap += 1.0; del *= x / ap; g -= 1.0 / ap; sum += del; dsum += del * g;
      if (fabs(del) <= 1e-17 * fabs(sum) && fabs(del * g) <= 1e-17 * fabs(dsum)) break;
    }}
    r = pre * (dlpre * sum + dsum);
  }} else {{
    double b = x + 1.0 - a, db = -1.0, c = 1e300, dc = 0.0;
    double d = 1.0 / b, dd = -db * d * d, h = d, dh = dd;
    for (int i = 1; i < 5000; ++i) {{
      double an = -i * (i - a), dan = i;
      b += 2.0;
      double D = an * d + b, dD = dan * d + an * dd + db;
      if (fabs(D) < 1e-300) {{ D = 1e-300; dD = 0.0; }}
      double C = b + an / c, dC = db + dan / c - an * dc / (c * c);
      if (fabs(C) < 1e-300) {{ C = 1e-300; dC = 0.0; }}
      d = 1.0 / D; dd = -dD * d * d;
      c = C; dc = dC;
      double del = d * c, ddel = dd * c + d * dc;
      dh = dh * del + h * ddel;
      h *= del;
      if (fabs(del - 1.0) < 1e-16 && fabs(h * ddel) <= 1e-16 * fabs(dh)) break;
    }}
    r = -pre * (dlpre * h + dh);
  }}
}}
"""

# I_x(a, b): the continued fraction (modified Lentz) of I_x(a, b) or of 1 - I_{1-x}(b, a),
# whichever converges fast.
BETAINC = f"""
if (a != a || b != b || x != x || a < 0.0 || b < 0.0 || x < 0.0 || x > 1.0
    || (a == 0.0 && b == 0.0)) {{ r = {_NAN}; }}
else if (x == 0.0 || b == 0.0) {{ r = (a == 0.0 && b != 0.0) ? 1.0 : 0.0; }}
else if (x == 1.0 || a == 0.0) {{ r = 1.0; }}
else {{
  int flip = x >= (a + 1.0) / (a + b + 2.0);
  double pa = flip ? b : a, pb = flip ? a : b, px = flip ? 1.0 - x : x;
  double lx = flip ? log1p(-x) : log(x), l1x = flip ? log(x) : log1p(-x);
  double front = exp(lgamma(pa + pb) - lgamma(pa) - lgamma(pb) + pa * lx + pb * l1x) / pa;
  double c = 1.0, d = 1.0 - (pa + pb) * px / (pa + 1.0);
  if (fabs(d) < 1e-300) d = 1e-300;
  d = 1.0 / d;
  double h = d;
  for (int m = 1; m < 5000; ++m) {{
    double m2 = 2.0 * m;
    double aa = m * (pb - m) * px / ((pa + m2 - 1.0) * (pa + m2));
    d = 1.0 + aa * d; if (fabs(d) < 1e-300) d = 1e-300;
    c = 1.0 + aa / c; if (fabs(c) < 1e-300) c = 1e-300;
    d = 1.0 / d; h *= d * c;
    aa = -(pa + m) * (pa + pb + m) * px / ((pa + m2) * (pa + m2 + 1.0));
    d = 1.0 + aa * d; if (fabs(d) < 1e-300) d = 1e-300;
    c = 1.0 + aa / c; if (fabs(c) < 1e-300) c = 1e-300;
    d = 1.0 / d;
    double del = d * c;
    h *= del;
    if (fabs(del - 1.0) < 1e-16) break;
  }}
  r = flip ? 1.0 - front * h : front * h;
}}
"""

# primitive → (operand names in order, C block).
BLOCKS = {
    "digamma": (("x",), DIGAMMA),
    "polygamma": (("m", "x"), POLYGAMMA),
    "zeta": (("x", "q"), ZETA),
    "bessel_i0e": (("x",), BESSEL_I0E),
    "bessel_i1e": (("x",), BESSEL_I1E),
    "igamma": (("a", "x"), IGAMMA),
    "igammac": (("a", "x"), IGAMMAC),
    "igamma_grad_a": (("a", "x"), IGAMMA_GRAD_A),
    "regularized_incomplete_beta": (("a", "b", "x"), BETAINC),
}


@register(*sorted(BLOCKS), kind=RuleKind.ELEMENTWISE)
def special(b: KernelBuilder, node: Node, idx: Index) -> str:
    out = node.outputs[0]
    if not dtypes.is_float(out.dtype):
        raise NotImplementedError(f"{node.name} is not supported for {out.dtype} "
                                  f"(from {node.source})")
    names, block = BLOCKS[node.name]
    values = [b.value(v, idx) for v in node.inputs]
    r = b.tmp("double", "0.0")
    b.open("")
    for n, v in zip(names, values):
        b.emit(f"const double {n} = (double){v};")
    b.emit("double r;")
    for line in block.strip().splitlines():
        b.emit(line)
    b.emit(f"{r} = r;")
    b.close()
    return b.tmp("float", dtypes.round_to(out.dtype, f"(float){r}"))


# ---- mulhi: the high half of the double-width product --------------------------------
_BITS = {"int8": 8, "int16": 16, "uint8": 8, "uint16": 16}


@register("mulhi", kind=RuleKind.ELEMENTWISE)
def mulhi(b: KernelBuilder, node: Node, idx: Index) -> str:
    x, y = node.inputs
    p, q = b.value(x, idx), b.value(y, idx)
    name = dtypes.name(x.dtype)
    if name == "int32":
        expr = f"__mulhi({p}, {q})"
    elif name == "uint32":
        expr = f"__umulhi({p}, {q})"
    elif name in _BITS:
        # Operands are sign- or zero-extended into 32 bits, so the product is exact;
        # >> of a negative int is arithmetic in CUDA C.
        ctype = dtypes.compute_type(x.dtype)
        expr = f"({ctype})(({p} * {q}) >> {_BITS[name]})"
    else:
        raise NotImplementedError(f"mulhi is not supported for {x.dtype} (from {node.source})")
    return b.tmp(dtypes.compute_type(node.outputs[0].dtype), expr)

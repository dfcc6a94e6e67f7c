"""Small dense linear algebra in the graph: `cholesky`, `triangular_solve` and `lu` on
float32 matrices of at most MAX_DIM (32) rows and columns, where they were measured
faster than XLA's library calls (numpyro's multivariate normals,
lineax's and optimistix's small systems). Larger ones, and other dtypes, are not taken
(`accepts` says why): co-execution leaves them to XLA's cuSOLVER and cuBLAS calls.

One block per matrix (a grid-stride loop over a batch), the matrix in shared memory:

- cholesky: right-looking, column j: its diagonal's square root, the column below it
  scaled by its reciprocal, the trailing lower triangle updated; LAPACK's potrf
  contract: the lower triangle holds L, the upper keeps the operand's values, and a
  matrix that is not positive definite (a diagonal ≤ 0 or NaN on the way) is all NaN
  (JAX's lowering: info ≠ 0). Its operand's elementwise producers are computed where
  it is read (`fuses`): jnp.linalg.cholesky's symmetrization `(a + aᵀ) / 2`.
- triangular_solve: each right-hand vector (a column of b on the left, a row on the
  right) by one thread, forward or back substitution against op(a) in shared memory;
  a unit diagonal is not read.
- lu: LAPACK's getf2, partial pivoting: the pivot is the first row of largest magnitude
  at or below the diagonal (isamax), rows swapped across the matrix, the column below
  scaled by the pivot's reciprocal (none when the pivot is 0: a singular matrix keeps
  going, as getrf does), the trailing block updated; pivots and the permutation
  (`lu_pivots_to_permutation`) as int32.

Each result matches XLA's library calls within float32 rounding (other orders of the
same sums), pivots and permutations exactly where no two candidates tie.
"""
from __future__ import annotations

import math
from typing import Mapping, Optional

from nimblejax.compiler import dtypes
from nimblejax.compiler.ir import Node, Var
from nimblejax.compiler.kinds import RuleKind
from nimblejax.compiler.lowering.codegen import MAX_BLOCKS, KernelBuilder
from nimblejax.compiler.lowering.registry import register
from nimblejax.compiler.lowering.task import Kernel

# Rows and columns of a matrix the kernels take. Measured on an H100 (examples/gpu/
# benchmark_linalg.py, looped µs against the same function with its linear algebra left to
# XLA's cuSOLVER): 256 Cholesky factors of 16×16 40.0 against 68.6, a multivariate
# normal's log density and gradient at 16 dimensions 71.3 against 292.0, a 32×32 solve
# 69.8 against 106.0; but one 64×64 Cholesky 113.9 against 64.1 and a 64×64 cho_solve
# 199.2 against 103.6: a column step is three barriers of a block, 192 at 64.
MAX_DIM = 32
THREADS = 128  # a block: four warps share a matrix's columns or elements


def accepts(node: Node) -> Optional[str]:
    """None when the kernels below take `node`, else why not (XLA keeps it)."""
    matrix = node.inputs[0]
    if dtypes.name(matrix.dtype) != "float32":
        return f"small-matrix linear algebra is float32 only, not {matrix.dtype}"
    if max(matrix.shape[-2:]) > MAX_DIM:
        return (f"a {matrix.shape[-2]}×{matrix.shape[-1]} matrix: the generated kernels take "
                f"at most {MAX_DIM}×{MAX_DIM} (larger ones are cuSOLVER's)")
    return None


def _batch(var: Var) -> int:
    return math.prod(var.shape[:-2])


def _grid(count: int) -> int:
    return max(1, min(count, MAX_BLOCKS))


def _load_matrix(b: KernelBuilder, a: Var, base: str, shared: str, transpose: bool = False) -> None:
    """shared[i * cols + j] = a[mat][i][j] (or [j][i] with `transpose`), all threads,
    then a barrier. `base` names the matrix's batch index; the batch multi-index is
    rebuilt so that fused producers (b.value) can read any operand."""
    rows, cols = a.shape[-2:]
    batch_idx = b.index_vars(base, a.shape[:-2]) if a.ndim > 2 else ()
    b.open(f"for (int e = threadIdx.x; e < {rows * cols}; e += {THREADS})")
    i, j = f"(e / {cols})", f"(e % {cols})"
    value = b.value(a, (*batch_idx, i, j))
    target = f"{j} * {rows} + {i}" if transpose else "e"
    b.emit(f"{shared}[{target}] = {value};")
    b.close()
    b.forget()
    b.emit("__syncthreads();")


# ---- cholesky --------------------------------------------------------------------------
@register("cholesky", kind=RuleKind.KERNEL, fuses=(0,), accepts=accepts)
def cholesky(node: Node, inlined: Mapping[Var, Node] = {}) -> Kernel:
    a, out = node.inputs[0], node.outputs[0]
    n = a.shape[-1]
    b = KernelBuilder(inlined)
    b.ops = ["cholesky"]
    b.output(out)
    b.emit(f"__shared__ float s[{n * n}];")
    b.emit("__shared__ int bad;")
    b.open(f"for (long long mat = blockIdx.x; mat < {_batch(a)}LL; mat += gridDim.x)")
    b.emit("if (threadIdx.x == 0) bad = 0;")
    _load_matrix(b, a, "mat", "s")
    b.open(f"for (int j = 0; j < {n}; ++j)")
    b.open("if (threadIdx.x == 0)")
    b.emit(f"const float d = s[j * {n} + j];")
    b.emit("if (!(d > 0.0f)) bad = 1;  // not positive definite (or NaN): potrf's info > 0")
    b.emit(f"s[j * {n} + j] = sqrtf(d);")
    b.close()
    b.emit("__syncthreads();")
    b.emit(f"const float r = 1.0f / s[j * {n} + j];")
    b.emit(f"for (int i = j + 1 + threadIdx.x; i < {n}; i += {THREADS}) s[i * {n} + j] *= r;")
    b.emit("__syncthreads();")
    b.emit(f"const int m = {n} - 1 - j;  // the trailing lower triangle, row-major pairs")
    b.open(f"for (int e = threadIdx.x; e < m * m; e += {THREADS})")
    b.emit("const int i = j + 1 + e / m, k = j + 1 + e % m;")
    b.emit(f"if (k <= i) s[i * {n} + k] -= s[i * {n} + j] * s[k * {n} + j];")
    b.close()
    b.emit("__syncthreads();")
    b.close()
    b.emit(f"for (int e = threadIdx.x; e < {n * n}; e += {THREADS}) "
           f"{b.output(out)}[mat * {n * n}LL + e] = bad ? (0.0f / 0.0f) : s[e];")
    b.emit("__syncthreads();  // the next matrix overwrites s and bad")
    b.close()
    return b.finish("cholesky", out, _grid(_batch(a)), THREADS)


# ---- triangular_solve ------------------------------------------------------------------
@register("triangular_solve", kind=RuleKind.KERNEL, accepts=accepts)
def triangular_solve(node: Node) -> Kernel:
    """op(a) x = b (left_side) or x op(a) = b: every right-hand vector solves
    E y = r with E = op(a) on the left and op(a)ᵀ on the right."""
    a, rhs = node.inputs
    out = node.outputs[0]
    p = node.params
    m = a.shape[-1]
    left = bool(p["left_side"])
    transposed = bool(p["transpose_a"]) != (not left)  # E is a's transpose
    lower = bool(p["lower"]) != transposed             # E is lower triangular
    unit = bool(p["unit_diagonal"])
    vectors = rhs.shape[-1] if left else rhs.shape[-2]
    # Element i of vector v within its matrix: a column of b on the left, a row on the right.
    at = f"i * {vectors} + v" if left else f"v * {m} + i"
    chunks = -(-vectors // THREADS)
    b = KernelBuilder()
    b.ops = ["triangular_solve"]
    b.output(out)
    ain, bin_ = b.input(a), b.input(rhs)
    b.emit(f"__shared__ float s[{m * m}];")
    b.emit(f"float y[{m}];")
    b.open(f"for (long long w = blockIdx.x; w < {_batch(a) * chunks}LL; w += gridDim.x)")
    b.emit(f"const long long mat = w / {chunks};")
    b.emit(f"const int v = (int)(w % {chunks}) * {THREADS} + threadIdx.x;")
    b.emit("__syncthreads();  // the previous matrix's solves are done with s")
    b.open(f"for (int e = threadIdx.x; e < {m * m}; e += {THREADS})")
    b.emit(f"s[e] = {ain}[mat * {m * m}LL + {f'(e % {m}) * {m} + e / {m}' if transposed else 'e'}];")
    b.close()
    b.emit("__syncthreads();")
    b.open(f"if (v < {vectors})")
    b.emit(f"const long long base = mat * {m * vectors}LL;")
    order = f"int i = 0; i < {m}; ++i" if lower else f"int i = {m} - 1; i >= 0; --i"
    inner = "int j = 0; j < i; ++j" if lower else f"int j = i + 1; j < {m}; ++j"
    b.open(f"for ({order})")
    b.emit(f"float acc = {bin_}[base + {at}];")
    b.emit(f"for ({inner}) acc -= s[i * {m} + j] * y[j];")
    b.emit("y[i] = acc;" if unit else f"y[i] = acc / s[i * {m} + i];")
    b.emit(f"{b.output(out)}[base + {at}] = y[i];")
    b.close()
    b.close()
    b.close()
    return b.finish("trisolve", out, _grid(_batch(a) * chunks), THREADS)


# ---- lu --------------------------------------------------------------------------------
@register("lu", kind=RuleKind.KERNEL, accepts=accepts)
def lu(node: Node) -> Kernel:
    a = node.inputs[0]
    out, pivots, perm = node.outputs
    rows, cols = a.shape[-2:]
    k = min(rows, cols)
    b = KernelBuilder()
    b.ops = ["lu"]
    for o in node.outputs:
        b.output(o)
    ain = b.input(a)
    b.emit(f"__shared__ float s[{rows * cols}];")
    b.emit(f"__shared__ int piv[{k}];")
    b.open(f"for (long long mat = blockIdx.x; mat < {_batch(a)}LL; mat += gridDim.x)")
    b.emit("__syncthreads();  // the previous matrix is written out")
    b.emit(f"for (int e = threadIdx.x; e < {rows * cols}; e += {THREADS}) "
           f"s[e] = {ain}[mat * {rows * cols}LL + e];")
    b.emit("__syncthreads();")
    b.open(f"for (int j = 0; j < {k}; ++j)")
    _pivot_search(b, rows, cols)
    b.emit("const int p = piv[j];")
    b.open(f"if (p != j) for (int c = threadIdx.x; c < {cols}; c += {THREADS})")
    b.emit(f"const float t = s[j * {cols} + c]; s[j * {cols} + c] = s[p * {cols} + c]; "
           f"s[p * {cols} + c] = t;")
    b.close()
    b.emit("__syncthreads();")
    b.emit(f"const float d = s[j * {cols} + j];")
    b.emit("// A zero pivot: getrf goes on unscaled (info > 0).")
    b.open("if (d != 0.0f)")
    b.emit("const float r = 1.0f / d;")
    b.emit(f"for (int i = j + 1 + threadIdx.x; i < {rows}; i += {THREADS}) s[i * {cols} + j] *= r;")
    b.close()
    b.emit("__syncthreads();")
    b.emit(f"const int h = {rows} - 1 - j, w = {cols} - 1 - j;  // the trailing block")
    b.open(f"for (int e = threadIdx.x; e < h * w; e += {THREADS})")
    b.emit("const int i = j + 1 + e / w, c = j + 1 + e % w;")
    b.emit(f"s[i * {cols} + c] -= s[i * {cols} + j] * s[j * {cols} + c];")
    b.close()
    b.emit("__syncthreads();")
    b.close()
    b.emit(f"for (int e = threadIdx.x; e < {rows * cols}; e += {THREADS}) "
           f"{b.output(out)}[mat * {rows * cols}LL + e] = s[e];")
    b.emit(f"for (int e = threadIdx.x; e < {k}; e += {THREADS}) "
           f"{b.output(pivots)}[mat * {k}LL + e] = piv[e];")
    b.emit("// lu_pivots_to_permutation")
    b.open("if (threadIdx.x == 0)")
    b.emit(f"int* q = {b.output(perm)} + mat * {rows}LL;")
    b.emit(f"for (int i = 0; i < {rows}; ++i) q[i] = i;")
    b.emit(f"for (int i = 0; i < {k}; ++i) {{ const int t = q[i]; q[i] = q[piv[i]]; q[piv[i]] = t; }}")
    b.close()
    b.close()
    return b.finish("lu", out, _grid(_batch(a)), THREADS)


@register("lu_pivots_to_permutation", kind=RuleKind.KERNEL)
def lu_pivots_to_permutation(node: Node) -> Kernel:
    """jax.scipy.linalg.lu_solve's permutation: the identity with the pivots' row swaps
    applied in order, one thread per matrix; a pivot out of range swaps nothing."""
    pivots, perm = node.inputs[0], node.outputs[0]
    k, m = pivots.shape[-1], perm.shape[-1]
    batch = math.prod(pivots.shape[:-1])
    b = KernelBuilder()
    b.ops = ["lu_pivots_to_permutation"]
    q, p = b.output(perm), b.input(pivots)
    b.open(f"for (long long mat = blockIdx.x * (long long)blockDim.x + threadIdx.x; mat < {batch}LL; "
           f"mat += (long long)gridDim.x * blockDim.x)")
    b.emit(f"int* o = {q} + mat * {m}LL;")
    b.emit(f"const int* v = {p} + mat * {k}LL;")
    b.emit(f"for (int i = 0; i < {m}; ++i) o[i] = i;")
    b.emit("// A pivot outside [0, m) swaps nothing, as in XLA's GPU kernel (and the graph's")
    b.emit("// warm-up, which runs before any operand is in place, reads no index out of range).")
    b.emit(f"for (int i = 0; i < {k}; ++i) {{ const int j = v[i]; if (j < 0 || j >= {m}) continue; "
           f"const int t = o[i]; o[i] = o[j]; o[j] = t; }}")
    b.close()
    return b.finish("permutation", perm, _grid(-(-batch // THREADS)), THREADS)


def _pivot_search(b: KernelBuilder, rows: int, cols: int) -> None:
    """piv[j] = the first row at or below j of largest |s[i][j]| (warp 0), then a barrier."""
    b.open("if (threadIdx.x < 32)")
    b.emit("float best = -1.0f; int at = j;")
    b.open(f"for (int i = j + threadIdx.x; i < {rows}; i += 32)")
    b.emit(f"const float x = fabsf(s[i * {cols} + j]);")
    b.emit("if (x > best) { best = x; at = i; }")
    b.close()
    b.open("for (int o = 16; o > 0; o >>= 1)")
    b.emit("const float ob = __shfl_xor_sync(0xffffffffu, best, o);")
    b.emit("const int oa = __shfl_xor_sync(0xffffffffu, at, o);")
    b.emit("if (ob > best || (ob == best && oa < at)) { best = ob; at = oa; }")
    b.close()
    b.emit("if (threadIdx.x == 0) piv[j] = at;")
    b.close()
    b.emit("__syncthreads();")

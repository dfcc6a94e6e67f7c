"""The PTX helpers of the TF32 tensor-core GEMM kernel (gemm_tc.py): TF32 rounding, the
mma.sync product and cp.async copies, as `__device__` functions under `#ifndef
NIMBLE_TC_PTX` (a module may hold several such kernels; the CPU emulator defines
NIMBLE_TC_PTX and supplies its own)."""

PTX_HELPERS = r"""#ifndef NIMBLE_TC_PTX
#define NIMBLE_TC_PTX
// TF32 tensor-core helpers (compiler/lowering/gemm_tc.py); the CPU emulator's shim
// defines NIMBLE_TC_PTX and its own versions.
__device__ __forceinline__ unsigned nimble_tf32(float x) {  // round to nearest, ties away
  unsigned r;
  asm("cvt.rna.tf32.f32 %0, %1;" : "=r"(r) : "f"(x));
  return r;
}
// d (16x8, f32) += a (16x8 rows, tf32) * b (8x8 columns, tf32): one warp, PTX's layouts.
__device__ __forceinline__ void nimble_mma_tf32(float* d, const unsigned* a, const unsigned* b) {
  asm volatile("mma.sync.aligned.m16n8k8.row.col.f32.tf32.tf32.f32 "
               "{%0, %1, %2, %3}, {%4, %5, %6, %7}, {%8, %9}, {%0, %1, %2, %3};"
               : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
               : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b[0]), "r"(b[1]));
}
// 16 (4) bytes from global to shared memory, asynchronously; zeros where !valid.
__device__ __forceinline__ void nimble_cp_async16(float* dst, const float* src, bool valid) {
  const unsigned s = (unsigned)__cvta_generic_to_shared(dst);
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;"
               :: "r"(s), "l"(src), "r"(valid ? 16 : 0));
}
__device__ __forceinline__ void nimble_cp_async4(float* dst, const float* src, bool valid) {
  const unsigned s = (unsigned)__cvta_generic_to_shared(dst);
  asm volatile("cp.async.ca.shared.global [%0], [%1], 4, %2;"
               :: "r"(s), "l"(src), "r"(valid ? 4 : 0));
}
__device__ __forceinline__ void nimble_cp_async_commit() { asm volatile("cp.async.commit_group;"); }
template <int N> __device__ __forceinline__ void nimble_cp_async_wait() {
  asm volatile("cp.async.wait_group %0;" :: "n"(N));
}
#endif  // NIMBLE_TC_PTX
"""

"""Run a plan's generated kernels on the CPU, so that tests (the fuzzer, sort/scan,
indexing and integer kernels) check kernel semantics (index math, bounds, padding,
rounding, atomics) on machines without a GPU. The one CUDA-on-the-host harness.

The CPU interpreter (runtime/interpret.py) evaluates each task's equations with JAX: it
checks the planners, not the kernels. Here the CUDA C of the plan's kernels is compiled
as C++ with a small shim (thread indices, half types, intrinsics) and run on the CPU:
grid-stride loop kernels one emulated thread after another; kernels whose threads
cooperate (warp shuffles, shared memory, __syncthreads: reductions, argmax, tiled
transposes) with one fiber per CUDA thread of a block (RUNTIME: each runs to its next
barrier, then the next), blocks one after another, up to MAX_COOPERATIVE_THREADS.
Other tasks (GEMMs, library calls, larger cooperative launches) are evaluated with JAX
as the interpreter does. Tasks run in launch order over an arena laid out as the memory
plan says (NaN-filled, so a read past a buffer shows; afterwards the bytes between
buffers must still be the fill: no kernel wrote outside its buffers). A task's launches (`Kernel.launches`: a scatter's copy, then the scatter) run in
order. Atomics take one lock. __CUDA_ARCH__ is
undefined unless `build(..., arch=900)` defines it: a kernel's `#if __CUDA_ARCH__ >= 900`
branch (a scatter-add's vector atomics) runs then, its other branch otherwise. The TF32
tensor-core kernels' PTX helpers (compiler/lowering/gemm_tc.py, guarded by NIMBLE_TC_PTX)
are SHIM's own: mma.sync as a warp collective over a per-warp scratch, cvt.rna.tf32.f32
as rounding to 10 mantissa bits (ties away), cp.async as a plain copy; so is the float
division of compiler/lowering/xla_math.py (NIMBLE_XLA_DIV), rounded as IEEE's. `launch` runs one
kernel over given arrays; `compile_library` is the host compiler step, for other host code.

Host math (glibc) is not CUDA's libdevice: results agree within a few ulp, not bit for
bit: such tests compare with tolerances, as on the GPU. Kernels that only move, compare
or do integer math (sorts, indexing, integer ops) match JAX bit for bit.
"""
from __future__ import annotations

import ctypes
import hashlib
import math
import os
import re
import shutil
import subprocess
import tempfile

import numpy as np

from nimblejax.compiler import dtypes
from nimblejax.runtime import interpret

SHIM = r"""
#include <cmath>
#include <cstring>
#include <cstdint>
#include <cstdlib>
using std::isfinite;
// Threads, barriers and the atomics' lock: RUNTIME's, built once per process (its
// std::thread and std::barrier code compiled once, not in every kernel library).
extern "C" {
void* nimble_barrier_new(int n); void nimble_barrier_wait(void* b);
void nimble_barrier_drop(void* b); void nimble_barrier_free(void* b);
void nimble_lock(); void nimble_unlock();
void nimble_run_threads(unsigned int n, void (*body)(unsigned int)); }
struct Dim3 { unsigned int x, y, z; };
struct alignas(16) uint4 { unsigned int x, y, z, w; };
struct alignas(8) uint2 { unsigned int x, y; };
static Dim3 threadIdx, blockIdx;
static Dim3 blockDim, gridDim;
// One fiber per CUDA thread of a block; blocks run one after another, so a static
// array is the block's shared memory. Warp shuffles and __syncthreads are barriers;
// a thread that returns drops out of them (as an exited thread does on the GPU).
#define __shared__ static
struct Warp { void* bar; unsigned long long slot[32];  // bar: a barrier of 32 threads
              unsigned mma_a[32][4], mma_b[32][2]; };  // nimble_mma_tf32's fragments
static Warp* warps;
static void* block_bar;
static inline int flat_tid() { return threadIdx.x + threadIdx.y * blockDim.x; }
// A block's threads are fibers of one OS thread (RUNTIME): each keeps its own threadIdx
// across a wait, in which the others ran and set theirs.
static inline void nimble_wait(void* b) { Dim3 t = threadIdx; nimble_barrier_wait(b); threadIdx = t; }
static inline void __syncthreads() { nimble_wait(block_bar); }
static inline void __syncwarp(unsigned int = 0xffffffffu) { nimble_wait(warps[flat_tid() / 32].bar); }
static int votes;
static inline int __syncthreads_or(int p) {
  __syncthreads(); if (p) __atomic_fetch_add(&votes, 1, __ATOMIC_SEQ_CST);
  __syncthreads(); int r = __atomic_load_n(&votes, __ATOMIC_SEQ_CST) != 0;
  __syncthreads(); if (flat_tid() == 0) __atomic_store_n(&votes, 0, __ATOMIC_SEQ_CST);
  return r; }
template <class T> static inline T __shfl_down_sync(unsigned int, T v, int off) {
  int t = flat_tid(), lane = t % 32; Warp& w = warps[t / 32];
  memcpy(&w.slot[lane], &v, sizeof(T)); nimble_wait(w.bar);
  T r = v; if (lane + off < 32) memcpy(&r, &w.slot[lane + off], sizeof(T));
  nimble_wait(w.bar); return r; }
template <class T> static inline T __shfl_xor_sync(unsigned int, T v, int mask) {
  int t = flat_tid(), lane = t % 32; Warp& w = warps[t / 32];
  memcpy(&w.slot[lane], &v, sizeof(T)); nimble_wait(w.bar);
  T r; memcpy(&r, &w.slot[lane ^ mask], sizeof(T));
  nimble_wait(w.bar); return r; }
#define __global__
#define __launch_bounds__(...)
#define __device__
#define __forceinline__ inline
#define __restrict__ __restrict
struct __half { _Float16 v; };
struct __nv_bfloat16 { uint16_t x; };
static inline float __half2float(__half h) { return (float)h.v; }
static inline __half __float2half_rn(float f) { __half h; h.v = (_Float16)f; return h; }
static inline float __bfloat162float(__nv_bfloat16 b) {
  uint32_t u = (uint32_t)b.x << 16; float f; memcpy(&f, &u, 4); return f; }
static inline __nv_bfloat16 __float2bfloat16_rn(float f) {
  uint32_t u; memcpy(&u, &f, 4); __nv_bfloat16 b;
  if ((u & 0x7fffffffu) > 0x7f800000u) { b.x = 0x7fc0; return b; }
  u += 0x7fffu + ((u >> 16) & 1u); b.x = (uint16_t)(u >> 16); return b; }
static inline float __int_as_float(int i) { float f; memcpy(&f, &i, 4); return f; }
static inline int __float_as_int(float f) { int i; memcpy(&i, &f, 4); return i; }
static inline unsigned int __float_as_uint(float f) { unsigned int i; memcpy(&i, &f, 4); return i; }
static inline float __uint_as_float(unsigned int i) { float f; memcpy(&f, &i, 4); return f; }
static inline unsigned short __half_as_ushort(__half h) { unsigned short u; memcpy(&u, &h, 2); return u; }
static inline __half __ushort_as_half(unsigned short u) { __half h; memcpy(&h, &u, 2); return h; }
static inline unsigned short __bfloat16_as_ushort(__nv_bfloat16 b) { return b.x; }
static inline __nv_bfloat16 __ushort_as_bfloat16(unsigned short u) { __nv_bfloat16 b; b.x = u; return b; }
static inline int __mulhi(int a, int b) { return (int)(((long long)a * b) >> 32); }
static inline unsigned int __umulhi(unsigned int a, unsigned int b) {
  return (unsigned int)(((unsigned long long)a * b) >> 32); }
static inline int __popc(unsigned int x) { return __builtin_popcount(x); }
static inline int __clz(int x) { return x == 0 ? 32 : __builtin_clz((unsigned int)x); }
static inline int max(int a, int b) { return a > b ? a : b; }
static inline int min(int a, int b) { return a < b ? a : b; }
static inline unsigned int max(unsigned int a, unsigned int b) { return a > b ? a : b; }
static inline unsigned int min(unsigned int a, unsigned int b) { return a < b ? a : b; }
static inline long long max(long long a, long long b) { return a > b ? a : b; }
static inline long long min(long long a, long long b) { return a < b ? a : b; }
static inline float max(float a, float b) { return fmaxf(a, b); }
static inline float min(float a, float b) { return fminf(a, b); }
template <class T, class F> static inline T atomic_update(T* p, F f) {
  nimble_lock(); T old = *p; *p = f(old); nimble_unlock(); return old; }
template <class T> static inline T atomicAdd(T* p, T v) {
  return atomic_update(p, [&](T o) { return o + v; }); }
static inline __half atomicAdd(__half* p, __half v) { return atomic_update(p, [&](__half o) {
  return __float2half_rn(__half2float(o) + __half2float(v)); }); }
static inline __nv_bfloat16 atomicAdd(__nv_bfloat16* p, __nv_bfloat16 v) {
  return atomic_update(p, [&](__nv_bfloat16 o) {
    return __float2bfloat16_rn(__bfloat162float(o) + __bfloat162float(v)); }); }
// Hopper's vector atomics (scatter-add's `#if __CUDA_ARCH__ >= 900` branch): each lane
// rounds and adds as the one-element atomic does.
struct alignas(8) float2 { float x, y; };
struct alignas(16) float4 { float x, y, z, w; };
struct alignas(4) __half2 { __half x, y; };
struct alignas(4) __nv_bfloat162 { __nv_bfloat16 x, y; };
static inline float2 make_float2(float x, float y) { return {x, y}; }
static inline float4 make_float4(float x, float y, float z, float w) { return {x, y, z, w}; }
static inline __half2 __floats2half2_rn(float a, float b) {
  return {__float2half_rn(a), __float2half_rn(b)}; }
static inline __nv_bfloat162 __floats2bfloat162_rn(float a, float b) {
  return {__float2bfloat16_rn(a), __float2bfloat16_rn(b)}; }
static inline float2 atomicAdd(float2* p, float2 v) { return atomic_update(p, [&](float2 o) {
  return float2{o.x + v.x, o.y + v.y}; }); }
static inline float4 atomicAdd(float4* p, float4 v) { return atomic_update(p, [&](float4 o) {
  return float4{o.x + v.x, o.y + v.y, o.z + v.z, o.w + v.w}; }); }
static inline __half2 atomicAdd(__half2* p, __half2 v) { return atomic_update(p, [&](__half2 o) {
  return __floats2half2_rn(__half2float(o.x) + __half2float(v.x),
                           __half2float(o.y) + __half2float(v.y)); }); }
static inline __nv_bfloat162 atomicAdd(__nv_bfloat162* p, __nv_bfloat162 v) {
  return atomic_update(p, [&](__nv_bfloat162 o) {
    return __floats2bfloat162_rn(__bfloat162float(o.x) + __bfloat162float(v.x),
                                 __bfloat162float(o.y) + __bfloat162float(v.y)); }); }
template <class T> static inline T atomicMin(T* p, T v) {
  return atomic_update(p, [&](T o) { return min(o, v); }); }
template <class T> static inline T atomicMax(T* p, T v) {
  return atomic_update(p, [&](T o) { return max(o, v); }); }
template <class T> static inline T atomicCAS(T* p, T cmp, T v) {
  return atomic_update(p, [&](T o) { return o == cmp ? v : o; }); }
#define __align__(n) __attribute__((aligned(n)))
// compiler/lowering/xla_math.py's division (div.full.f32 there): IEEE, as XLA's CPU code.
#define NIMBLE_XLA_DIV
static inline float nimble_div(float a, float b) { return a / b; }
static inline float rsqrtf(float x) { return 1.0f / sqrtf(x); }  // rsqrt.approx there
static inline float __fmul_rn(float a, float b) { return a * b; }  // never fused (no -mfma)
// The TF32 tensor-core helpers of compiler/lowering/gemm_tc.py (its PTX block is skipped).
#define NIMBLE_TC_PTX
// cvt.rna.tf32.f32: round to 10 mantissa bits, to nearest, ties away from zero (a
// carry into the exponent gives the next power of two, or infinity); NaN and inf kept.
static inline unsigned nimble_tf32(float x) {
  unsigned u; memcpy(&u, &x, 4);
  return (u & 0x7f800000u) == 0x7f800000u ? u : (u + 0x1000u) & 0xffffe000u; }
// mma.sync.aligned.m16n8k8.row.col.f32.tf32.tf32.f32 as a warp collective: each lane
// leaves its fragments in the warp's scratch, then computes its four outputs from
// PTX's layouts (lane = 4 * group + t): a[r] is A(group + 8 * (r % 2), t + 4 * (r / 2)),
// b[r] is B(t + 4 * r, group), d[r] is D(group + 8 * (r / 2), 2 * t + r % 2).
static inline void nimble_mma_tf32(float* d, const unsigned* a, const unsigned* b) {
  int tid = flat_tid(), lane = tid % 32; Warp& w = warps[tid / 32];
  memcpy(w.mma_a[lane], a, 16); memcpy(w.mma_b[lane], b, 8);
  nimble_wait(w.bar);
  for (int r = 0; r < 4; ++r) {
    const int row = lane / 4 + 8 * (r / 2), col = 2 * (lane % 4) + r % 2;
    float sum = d[r];
    for (int k = 0; k < 8; ++k)
      sum = fmaf(__uint_as_float(w.mma_a[(row % 8) * 4 + k % 4][row / 8 + 2 * (k / 4)]),
                 __uint_as_float(w.mma_b[col * 4 + k % 4][k / 4]), sum);
    d[r] = sum; }
  nimble_wait(w.bar); }
// cp.async as a plain copy (done at once: wait_group has nothing to wait for).
static inline void nimble_cp_async16(float* dst, const float* src, bool valid) {
  if (valid) memcpy(dst, src, 16); else memset(dst, 0, 16); }
static inline void nimble_cp_async4(float* dst, const float* src, bool valid) {
  *dst = valid ? *src : 0.0f; }
static inline void nimble_cp_async_commit() {}
template <int N> static inline void nimble_cp_async_wait() {}
// One block of a cooperative launch: `body(t)` on a fiber for each of its n threads.
static Dim3 launch_block;
static void** launch_args;
static void nimble_block(unsigned int b, unsigned int y, unsigned int z, unsigned int n,
                         void (*body)(unsigned int)) {
  const unsigned int nw = (n + 31) / 32;
  Warp* ws = (Warp*)calloc(nw, sizeof(Warp));
  for (unsigned int i = 0; i < nw; ++i) ws[i].bar = nimble_barrier_new(32);
  warps = ws; block_bar = nimble_barrier_new((int)n); launch_block = {b, y, z};
  nimble_run_threads(n, body);
  for (unsigned int i = 0; i < nw; ++i) nimble_barrier_free(ws[i].bar);
  nimble_barrier_free(block_bar); free(ws); }
"""
RUNTIME = r"""
#include <cstdio>
#include <cstdlib>
#include <mutex>
#include <vector>
#include <sys/mman.h>
#include <ucontext.h>
// A block's CUDA threads are fibers of the calling OS thread (ucontext), run round by
// round: each runs until it waits at a barrier (or returns), then the next. OS threads
// (one per CUDA thread, a pool kept for the process) were as right but slow, and slower
// still on a busy machine: a barrier of 128 threads waited for all of them to be given
// a core (test_row_kernels' 256 x 1024 softmax: 42 s in a 2-core suite run, 4 s alone).
// Rounds alternate their order (0..n-1, then n-1..0), so a read of shared memory that
// misses a barrier sees both a later and an earlier thread's write not yet made.
// A barrier counts arrivals; a thread that returns drops out of its barriers, as
// std::barrier's arrive_and_drop (and an exited GPU thread) does.
static std::mutex atomic_lock;  // atomics: one lock (a fiber never waits holding it)
static std::mutex launch_lock;  // one cooperative launch at a time in the process
struct Barrier { int expected, arrived; unsigned long phase; };
struct Fiber { ucontext_t context; char* stack; bool done; };
static const size_t STACK = 256 << 10, GUARD = 64 << 10;  // pages cost once touched
static std::vector<Fiber>& fibers = *new std::vector<Fiber>;
static ucontext_t scheduler;
static unsigned int current;
static unsigned long events;  // arrivals, drops and returns: a round without any is a deadlock
static void (*fiber_body)(unsigned int);
extern "C" {
void* nimble_barrier_new(int n) { return new Barrier{n, 0, 0}; }
void nimble_barrier_free(void* b) { delete static_cast<Barrier*>(b); }
static void complete_if_all(Barrier* b) {
  if (b->arrived == b->expected) { b->arrived = 0; ++b->phase; } }
void nimble_barrier_wait(void* p) {
  Barrier* b = static_cast<Barrier*>(p);
  const unsigned long phase = b->phase;
  ++events; ++b->arrived; complete_if_all(b);
  while (b->phase == phase) swapcontext(&fibers[current].context, &scheduler); }
void nimble_barrier_drop(void* p) {
  Barrier* b = static_cast<Barrier*>(p);
  ++events; --b->expected; complete_if_all(b); }
void nimble_lock() { atomic_lock.lock(); }
void nimble_unlock() { atomic_lock.unlock(); }
static void fiber_main(unsigned int id) { fiber_body(id); fibers[id].done = true; ++events; }
// body(0..n-1) as n fibers, until every one has returned.
void nimble_run_threads(unsigned int n, void (*body)(unsigned int)) {
  std::lock_guard<std::mutex> guard(launch_lock);
  while (fibers.size() < n) {
    char* stack = static_cast<char*>(mmap(nullptr, STACK + GUARD, PROT_READ | PROT_WRITE,
                       MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE, -1, 0));
    if (stack == MAP_FAILED || mprotect(stack, GUARD, PROT_NONE)) {  // overflow: a fault
      perror("nimble emulator: fiber stack"); abort(); }
    fibers.push_back(Fiber{{}, stack + GUARD, true}); }
  fiber_body = body;
  for (unsigned int i = 0; i < n; ++i) {
    Fiber& f = fibers[i];
    getcontext(&f.context);
    f.context.uc_stack.ss_sp = f.stack; f.context.uc_stack.ss_size = STACK;
    f.context.uc_link = &scheduler; f.done = false;
    makecontext(&f.context, (void (*)())fiber_main, 1, i); }
  for (unsigned int left = n, round = 0; left; ++round) {
    const unsigned long before = events;
    for (unsigned int k = 0; k < n; ++k) {
      const unsigned int i = round % 2 ? n - 1 - k : k;
      if (fibers[i].done) continue;
      current = i;
      swapcontext(&scheduler, &fibers[i].context);
      left -= fibers[i].done; }
    if (left && events == before) {
      fprintf(stderr, "nimble emulator: %u of %u threads wait at barriers the others "
              "never reach\n", left, n);
      abort(); } } }
}
"""
# Kernels that use any of these run one fiber per CUDA thread (cooperative).
COOPERATIVE = ("__shfl", "__syncthreads", "__syncwarp", "__shared__")
MAX_COOPERATIVE_THREADS = 1 << 15  # larger launches go through JAX (emulation time)
UNSUPPORTED = ("__ldg", "asm(")


def compiler() -> str | None:
    return shutil.which("g++") or shutil.which("c++")


def cooperative(kernel) -> bool:  # (one launch)
    return any(k in kernel.source for k in COOPERATIVE)


def emulatable(kernel) -> bool:
    return all(_emulatable(k) for k in kernel.launches)


# Blocks of device code that SHIM replaces with its own (it defines the guard macro).
SHIM_GUARDS = ("NIMBLE_TC_PTX", "NIMBLE_XLA_DIV")


def _device_only(source: str) -> str:
    """`source` without the blocks that SHIM replaces."""
    for guard in SHIM_GUARDS:
        source = re.sub(rf"#ifndef {guard}\n.*?#endif  // {guard}\n", "", source, flags=re.S)
    return source


def _emulatable(kernel) -> bool:
    if any(k in _device_only(kernel.source) for k in UNSUPPORTED) or kernel.block[2] != 1:
        return False
    if cooperative(kernel):
        return math.prod(kernel.grid) * math.prod(kernel.block) <= MAX_COOPERATIVE_THREADS
    return kernel.block[1:] == (1, 1) and kernel.grid[1:] == (1, 1)


def _launcher(kernel) -> str:
    args = [f"({dtypes.storage_type(v.dtype)}*)a[{i}]" for i, v in enumerate(kernel.params)]
    args = ", ".join(args + [f"(long long)(intptr_t)a[{len(args) + i}]" for i in range(len(kernel.scalars))])
    (gx, gy, gz), (bx, by, _) = kernel.grid, kernel.block
    head = (f'extern "C" void launch_{kernel.name}(void** a) {{\n'
            f"  gridDim = {{{gx}u, {gy}u, {gz}u}}; blockDim = {{{bx}u, {by}u, 1u}};\n"
            f"  for (unsigned int z = 0; z < {gz}u; ++z) for (unsigned int y = 0; y < {gy}u; ++y)\n"
            f"  for (unsigned int b = 0; b < {gx}u; ++b) {{\n")
    call, n = f"{kernel.name}({args});", bx * by
    if not cooperative(kernel):
        return (head + f"    for (unsigned int t = 0; t < {n}u; ++t) {{\n"
                f"      blockIdx = {{b, y, z}}; threadIdx = {{t % {bx}u, t / {bx}u, 0u}}; {call}\n"
                "    }\n  }\n}\n")
    thread = (f"static void thread_{kernel.name}(unsigned int t) {{\n"
              f"  void** a = launch_args; blockIdx = launch_block;"
              f" threadIdx = {{t % {bx}u, t / {bx}u, 0u}}; {call}\n"
              f"  nimble_barrier_drop(warps[t / 32].bar); nimble_barrier_drop(block_bar);\n}}\n")
    return (thread + head.replace("{\n", "{\n  launch_args = a;\n", 1) +
            f"    nimble_block(b, y, z, {n}u, thread_{kernel.name});\n  }}\n}}\n")


def _strip(source: str) -> str:
    return "\n".join(line for line in source.splitlines() if not line.startswith("#include <cuda"))


_LIBS: dict[str, ctypes.CDLL] = {}
FLAGS = ("-O1",)
_COMMON = ("-std=c++20", "-pthread", "-fPIC", "-fwrapv", "-w")


def compile_library(text: str, flags: tuple[str, ...] = FLAGS,
                    include: str | None = None, shared_symbols: bool = False) -> ctypes.CDLL:
    """C++ `text` built by the host compiler as a shared library (cached by text), after
    the header `include` where given (as if it were the text's first line).
    `shared_symbols`: its symbols serve the libraries loaded after it (RUNTIME's)."""
    key = hashlib.sha1(" ".join((text, *flags, include or "")).encode()).hexdigest()
    if key not in _LIBS:
        # The folder goes once the library is loaded: a loaded library stays mapped
        # after its file is removed, and a test run must leave no files behind.
        with tempfile.TemporaryDirectory(prefix="nimble-emu-") as tmp:
            src, lib = os.path.join(tmp, "k.cpp"), os.path.join(tmp, "k.so")
            with open(src, "w") as f:
                f.write(text)
            pre = ("-include", include) if include else ()
            proc = subprocess.run([compiler(), *flags, *_COMMON, "-shared", *pre, src, "-o", lib],
                                  capture_output=True, text=True)
            if proc.returncode:
                raise RuntimeError(f"emulated kernels do not compile:\n{proc.stderr[-4000:]}")
            _LIBS[key] = ctypes.CDLL(lib, mode=ctypes.RTLD_GLOBAL if shared_symbols
                                     else ctypes.DEFAULT_MODE)
    return _LIBS[key]


# SHIM as a header precompiled once per process (its folder is removed when the process
# exits): the standard headers it includes are most of a build's compile time, and the
# fuzzer builds one library per program (measured: 0.36 s of g++ per build, 0.10 s with
# the header precompiled). SHIM leaves threads and barriers to RUNTIME, so that neither
# their headers nor their code are in every build: test_row_prologue.py's 24 emulated
# programs took 21.2 s of g++ CPU with them in SHIM, 6.7 s without (RUNTIME included). None where precompiling fails: builds then compile SHIM inline.
_SHIM_HEADER: dict[str, tempfile.TemporaryDirectory | None] = {}


def shim_header() -> str | None:
    if "dir" not in _SHIM_HEADER:
        folder = tempfile.TemporaryDirectory(prefix="nimble-emu-shim-")
        header = os.path.join(folder.name, "shim.h")
        with open(header, "w") as f:
            f.write(SHIM)
        proc = subprocess.run([compiler(), *FLAGS, *_COMMON, "-x", "c++-header", header,
                               "-o", header + ".gch"], capture_output=True, text=True)
        if proc.returncode:
            folder.cleanup()
            folder = None
        _SHIM_HEADER["dir"] = folder
    folder = _SHIM_HEADER["dir"]
    return os.path.join(folder.name, "shim.h") if folder is not None else None


def kernels(plan) -> list:
    """Every launch of `plan`'s tasks that `run` emulates."""
    return [k for t in plan.tasks if t.kernel is not None and emulatable(t.kernel)
            for k in t.kernel.launches]


def build(kernels, arch: int | None = None) -> ctypes.CDLL:
    """One shared library holding `kernels` and a launcher for each. `arch` defines
    __CUDA_ARCH__ (undefined by default), selecting kernels' branches for that GPU."""
    unique = {}
    for k in kernels:  # the same kernel may run twice, or in several plans
        assert unique.setdefault(k.name, k).source == k.source, f"two kernels named {k.name}"
    head = f"#define __CUDA_ARCH__ {arch}\n" if arch is not None else ""  # SHIM does not read it
    body = head + "\n".join(_strip(k.source) + "\n" + _launcher(k) for k in unique.values())
    compile_library(RUNTIME, shared_symbols=True)  # once per process (cached)
    header = shim_header()
    return compile_library(body, include=header) if header else compile_library(SHIM + body)


def _launch(lib, kernel, ptrs) -> None:
    """`ptrs`: one per param; the kernel's scalars follow them as its last arguments."""
    ptrs = list(ptrs) + list(kernel.scalars)
    args = (ctypes.c_void_p * len(ptrs))(*ptrs)
    for k in kernel.launches:  # a scatter's copy first, then the scatter
        getattr(lib, f"launch_{k.name}")(args)


def launch(kernel, buffers: list[np.ndarray], lib=None) -> None:
    """Run every launch of `kernel` over `buffers` (one per param, C-contiguous), in place."""
    assert all(b.flags.c_contiguous for b in buffers)
    _launch(lib or build(kernel.launches), kernel, [b.ctypes.data for b in buffers])


def run(plan, args, lib=None) -> tuple[list[np.ndarray], int]:
    """Outputs of `plan` on flat `args`, and how many tasks' kernels were emulated (from
    `lib`, a `build` of `kernels(plan)` and maybe more, if given)."""
    import jax

    arena = interpret.loaded(plan, args)
    if lib is None and kernels(plan):
        lib = build(kernels(plan))
    base = arena.bytes.ctypes.data
    emulated = 0
    with jax.default_device(jax.devices("cpu")[0]):
        for task in interpret.interleaving(plan.schedule, None):
            if task.kernel is not None and emulatable(task.kernel):
                _launch(lib, task.kernel, [base + plan.offset(v) for v in task.kernel.params])
                emulated += 1
            else:
                interpret.execute(task, arena)
    inside = np.zeros(arena.bytes.size, dtype=bool)
    for buf, off in plan.memory.offsets.items():
        inside[off: off + plan.sizes[buf]] = True
    assert (arena.bytes[~inside] == interpret.NAN_BYTE).all(), "a kernel wrote out of bounds"
    return interpret.outputs(plan, arena, args), emulated

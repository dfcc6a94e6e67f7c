// The copy kernel of the FFI handler (included by handler.cc): operands into the
// arena and results out of it, for the buffers that are not re-pointed in place.
#pragma once

#include <vector>

namespace {

constexpr int kMaxEntries = 160;  // copies per kernel launch (a 3,844-byte parameter: under 4 KB)
constexpr unsigned kThreads = 256;
constexpr unsigned long long kBytesPerBlock = kThreads * 16ull;  // uint4/thread
constexpr unsigned kMaxBlocksX = 1024;  // enough blocks to fill an H100 (132 SMs) on large copies

// Blocks in x of a copy launch whose largest entry has `max_bytes`.
inline unsigned GridX(unsigned long long max_bytes) {
  unsigned long long blocks = (max_bytes + kBytesPerBlock - 1) / kBytesPerBlock;
  return blocks < 1 ? 1 : (blocks > kMaxBlocksX ? kMaxBlocksX : unsigned(blocks));
}

// Must match nimble_ffi_copy's parameter in kCopyKernelSource byte for byte;
// it is passed by value through kernelParams.
struct CopyTable {
  unsigned long long dst[kMaxEntries];
  unsigned long long src[kMaxEntries];
  unsigned long long bytes[kMaxEntries];
  int count;
};

const char kCopyKernelSource[] = R"CUDA(
struct CopyTable {
  unsigned long long dst[160];
  unsigned long long src[160];
  unsigned long long bytes[160];
  int count;
};

// One entry per blockIdx.y; blocks in x and threads grid-stride over it.
extern "C" __global__ void nimble_ffi_copy(CopyTable t) {
  const int e = blockIdx.y;
  if (e >= t.count) return;
  unsigned char* dst = (unsigned char*)t.dst[e];
  const unsigned char* src = (const unsigned char*)t.src[e];
  const unsigned long long n = t.bytes[e];
  const unsigned long long start =
      (unsigned long long)blockIdx.x * blockDim.x + threadIdx.x;
  const unsigned long long stride = (unsigned long long)gridDim.x * blockDim.x;
  unsigned long long done = 0;
  if (((t.dst[e] | t.src[e]) & 15ull) == 0) {  // both 16-aligned: uint4 path
    const unsigned long long nv = n / 16;
    uint4* d4 = (uint4*)dst;
    const uint4* s4 = (const uint4*)src;
    for (unsigned long long i = start; i < nv; i += stride) d4[i] = s4[i];
    done = nv * 16;
  }
  for (unsigned long long i = done + start; i < n; i += stride) dst[i] = src[i];
}
)CUDA";

// The copies of one call, gathered before launching them.
struct CopyList {
  std::vector<unsigned long long> dst, src, bytes;
  void Add(unsigned long long d, unsigned long long s, unsigned long long n) {
    if (n == 0) return;
    dst.push_back(d);
    src.push_back(s);
    bytes.push_back(n);
  }
};

// Fills `table` with list[first:first + kMaxEntries] (CopyList holds no zero-byte
// copies) and returns the index of the first copy it could not take; `max_bytes` gets
// the largest copy's size (the launch's GridX).
size_t FillTable(const CopyList& list, size_t first, CopyTable* table,
                 unsigned long long* max_bytes) {
  table->count = 0;
  *max_bytes = 0;
  size_t i = first;
  for (; i < list.dst.size() && table->count < kMaxEntries; ++i) {
    table->dst[table->count] = list.dst[i];
    table->src[table->count] = list.src[i];
    table->bytes[table->count] = list.bytes[i];
    if (list.bytes[i] > *max_bytes) *max_bytes = list.bytes[i];
    ++table->count;
  }
  return i;
}

// Per thread, reused by every call: a steady-state call allocates nothing.
struct Scratch {
  std::vector<unsigned long long> in_src, out_dst;
  CopyList in, out;
  void Clear() {
    in_src.clear(), out_dst.clear();
    for (CopyList* l : {&in, &out}) l->dst.clear(), l->src.clear(), l->bytes.clear();
  }
};
thread_local Scratch t_scratch;

}  // namespace

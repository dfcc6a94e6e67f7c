// The copies of a call inside its graph (included by handler.cc, after copy_kernel.h).
//
// A plan's raw graph is captured between two launches of the copy kernel: the first
// node copies operands into the arena before any task, the last copies results out of
// it after every task. Each call writes its copy table into those nodes' parameters
// (cuGraphExecKernelNodeSetParams, only when it changed since the last call) instead
// of launching copy kernels of its own beside the graph: on an H100 one launch from the
// handler cost 7.6 µs of host time, setting a node about 0.4 µs. A node with nothing to
// copy is disabled (cuGraphNodeSetEnabled). A call with more copies than one table
// holds launches the rest as before. A launch already enqueued keeps the parameters it
// was launched with, so a call may set the nodes while the previous one still runs.
#pragma once

#include <cstring>

namespace {

// What the capture writes into a copy node's empty table (dst[0]) so that registration
// can tell the node before the tasks from the one after them.
constexpr unsigned long long kCopyNodeMark[2] = {0x6e696d626c65696eull,   // "nimblein"
                                                 0x6e696d626c656f75ull};  // "nimbleou"

struct CopyNode {
  CUgraphNode node = nullptr;
  nimble_patch::KernelNodeParams params{};
  CopyTable table{};  // what the node copies now (count 0: disabled)
  void* arg = &table;
  bool enabled = true;
};

// Launches the copy kernel with an empty, marked table on `stream` (under capture).
CUresult LaunchCopyMark(CUfunction fn, CUstream stream, int which) {
  CopyTable table{};
  table.dst[0] = kCopyNodeMark[which];
  void* params[] = {&table};
  return g_drv.LaunchKernel(fn, 1, 1, 1, kThreads, 1, 1, 0, stream, params, nullptr);
}

// Finds the two marked copy nodes of `graph` (kernel nodes of `copy_fn`); returns a
// bitmask of those found (1: before the tasks, 2: after them) or -1 on a driver error.
int FindCopyNodes(CUgraph graph, CUfunction copy_fn, CopyNode nodes[2], CUresult* rc) {
  long long n = nimble_patch::ListKernelNodes(graph, 0, nullptr, nullptr, rc);
  if (n < 0) return -1;
  std::vector<unsigned long long> handles(n), funcs(n);
  nimble_patch::ListKernelNodes(graph, n, handles.data(), funcs.data(), rc);
  if (*rc != 0) return -1;
  int found = 0;
  for (long long i = 0; i < n; ++i) {
    if (funcs[i] != reinterpret_cast<uintptr_t>(copy_fn)) continue;
    CUgraphNode node = reinterpret_cast<CUgraphNode>(handles[i]);
    nimble_patch::KernelNodeParams p{};
    *rc = nimble_patch::g_patch_drv.KernelNodeGetParams(node, &p);
    if (*rc != 0) return -1;
    if (p.kernelParams == nullptr) continue;
    CopyTable table;
    std::memcpy(&table, p.kernelParams[0], sizeof(table));
    for (int w = 0; w < 2; ++w) {
      if (table.count != 0 || table.dst[0] != kCopyNodeMark[w]) continue;
      nodes[w].node = node;
      nodes[w].params = p;
      nodes[w].table = CopyTable{};
      nodes[w].params.kernelParams = &nodes[w].arg;
      nodes[w].params.extra = nullptr;
      found |= 1 << w;
    }
  }
  return found;
}

// Gives `node` the first kMaxEntries copies of `list` and returns how many it took.
// Sets the node only where its table changed; disables it when it has nothing to copy.
size_t SetCopyNode(CopyNode& node, CUgraphExec exec, const CopyList& list,
                   unsigned long long* sets, CUresult* rc) {
  CopyTable want{};
  unsigned long long max_bytes = 0;
  size_t taken = FillTable(list, 0, &want, &max_bytes);
  *rc = 0;
  bool same = want.count == node.table.count;
  for (int e = 0; same && e < want.count; ++e)
    same = want.dst[e] == node.table.dst[e] && want.src[e] == node.table.src[e] &&
           want.bytes[e] == node.table.bytes[e];
  if (!same) {
    node.table = want;
    node.params.gridDimX = GridX(max_bytes);
    node.params.gridDimY = want.count > 0 ? want.count : 1;
    *rc = nimble_patch::g_patch_drv.ExecKernelNodeSetParams(exec, node.node, &node.params);
    ++*sets;
  }
  bool enable = want.count > 0;
  if (*rc == 0 && enable != node.enabled && nimble_patch::g_patch_drv.NodeSetEnabled) {
    *rc = nimble_patch::g_patch_drv.NodeSetEnabled(exec, node.node, enable ? 1 : 0);
    node.enabled = enable;
  }
  return taken;
}

}  // namespace

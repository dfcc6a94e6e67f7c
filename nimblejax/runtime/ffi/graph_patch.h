// Re-pointing a captured graph's kernel nodes (included by handler.cc).
//
// A buffer of a plan that only generated kernels touch is not copied into or out of
// the arena: each call rewrites the pointer parameters of the kernel nodes that name it
// (cuGraphExecKernelNodeSetParams), so the graph reads XLA's operand buffer or writes
// XLA's result buffer in place. Only nodes whose address changed since the last call
// are set; a launch already enqueued keeps the parameters it was launched with (CUDA
// guarantees this), so a call may re-point while the previous one still runs.
// Which buffers are re-pointed is decided in Python (nimblejax/runtime/inplace.py).
#pragma once

#include <cstring>
#include <vector>

typedef struct CUgraph_st* CUgraph;
typedef struct CUgraphNode_st* CUgraphNode;
typedef struct CUkern_st* CUkernel;
typedef struct CUctx_st* CUcontext;

namespace nimble_patch {

constexpr int kNodeTypeKernel = 0;  // CU_GRAPH_NODE_TYPE_KERNEL

// CUDA_KERNEL_NODE_PARAMS_v2, as declared in NVIDIA's cuda.h (CUDA 12.0 and later).
struct KernelNodeParams {
  CUfunction func;
  unsigned int gridDimX, gridDimY, gridDimZ;
  unsigned int blockDimX, blockDimY, blockDimZ;
  unsigned int sharedMemBytes;
  void** kernelParams;
  void** extra;
  CUkernel kern;
  CUcontext ctx;
};

struct Driver {
  CUresult (*GraphGetNodes)(CUgraph, CUgraphNode*, size_t*) = nullptr;
  CUresult (*NodeGetType)(CUgraphNode, int*) = nullptr;
  CUresult (*KernelNodeGetParams)(CUgraphNode, KernelNodeParams*) = nullptr;
  CUresult (*ExecKernelNodeSetParams)(CUgraphExec, CUgraphNode, const KernelNodeParams*) = nullptr;
  // CUDA 11.6+; without it a copy node with nothing to copy runs an empty table.
  CUresult (*NodeSetEnabled)(CUgraphExec, CUgraphNode, unsigned) = nullptr;
  bool ok() const {
    return GraphGetNodes && NodeGetType && KernelNodeGetParams && ExecKernelNodeSetParams;
  }
};

inline Driver g_patch_drv;

// Optional: without these entry points every buffer is copied, as before.
inline void ResolvePatchDriver(void* lib) {
  g_patch_drv.GraphGetNodes = reinterpret_cast<decltype(Driver::GraphGetNodes)>(
      dlsym(lib, "cuGraphGetNodes"));
  g_patch_drv.NodeGetType = reinterpret_cast<decltype(Driver::NodeGetType)>(
      dlsym(lib, "cuGraphNodeGetType"));
  g_patch_drv.KernelNodeGetParams = reinterpret_cast<decltype(Driver::KernelNodeGetParams)>(
      dlsym(lib, "cuGraphKernelNodeGetParams_v2"));
  g_patch_drv.ExecKernelNodeSetParams =
      reinterpret_cast<decltype(Driver::ExecKernelNodeSetParams)>(
          dlsym(lib, "cuGraphExecKernelNodeSetParams_v2"));
  g_patch_drv.NodeSetEnabled = reinterpret_cast<decltype(Driver::NodeSetEnabled)>(
      dlsym(lib, "cuGraphNodeSetEnabled"));
}

// One kernel node we may re-point: its launch parameters, with our own copy of its
// (8-byte pointer) arguments that kernelParams points into.
struct Node {
  CUgraphNode node = nullptr;
  KernelNodeParams params{};
  std::vector<unsigned long long> values;
  std::vector<void*> pointers;
  bool dirty = false;
};

struct Site {
  int node;   // index into Patches::nodes
  int param;  // pointer parameter position
};

// Per arena: the nodes, and for each plan input and output buffer the parameters that
// name it (empty: copied) and the address the graph holds there now.
struct Patches {
  std::vector<Node> nodes;
  std::vector<std::vector<Site>> in_sites, out_sites;
  std::vector<unsigned long long> in_addr, out_addr;
  std::vector<unsigned long long> in_home, out_home;  // the arena's, as captured
  std::vector<int> dirty;

  bool InPlaceIn(size_t i) const { return i < in_sites.size() && !in_sites[i].empty(); }
  bool InPlaceOut(size_t j) const { return j < out_sites.size() && !out_sites[j].empty(); }

  // Point every site of one buffer at `addr` (recorded; applied by Flush).
  void Retarget(const std::vector<Site>& sites, unsigned long long* current,
                unsigned long long addr) {
    if (*current == addr) return;
    for (const Site& s : sites) {
      Node& n = nodes[s.node];
      n.values[s.param] = addr;
      if (!n.dirty) {
        n.dirty = true;
        dirty.push_back(s.node);
      }
    }
    *current = addr;
  }

  // Point every site back at the arena (recorded; applied by Flush).
  void Home() {
    for (size_t i = 0; i < in_sites.size(); ++i) Retarget(in_sites[i], &in_addr[i], in_home[i]);
    for (size_t j = 0; j < out_sites.size(); ++j) Retarget(out_sites[j], &out_addr[j], out_home[j]);
  }

  // Forget what was re-pointed without setting it (a direct launch read the values).
  void ClearDirty() {
    for (int i : dirty) nodes[i].dirty = false;
    dirty.clear();
  }

  // Mark every node to be set by the next Flush (the graph exec may hold old values).
  void MarkAllDirty() {
    for (size_t i = 0; i < nodes.size(); ++i)
      if (!nodes[i].dirty) {
        nodes[i].dirty = true;
        dirty.push_back(static_cast<int>(i));
      }
  }

  // Set the parameters of every node re-pointed since the last flush; 0 or a CUresult.
  CUresult Flush(CUgraphExec exec, int* failed_node) {
    CUresult rc = 0;
    for (int i : dirty) {
      Node& n = nodes[i];
      n.dirty = false;
      if (rc == 0) {
        rc = g_patch_drv.ExecKernelNodeSetParams(exec, n.node, &n.params);
        if (rc != 0) *failed_node = i;
      }
    }
    dirty.clear();
    return rc;
  }
};

// Reads node `node`'s launch parameters and its first `n_params` 8-byte arguments.
inline CUresult LoadNode(CUgraphNode node, int n_params, Node* out) {
  out->node = node;
  CUresult rc = g_patch_drv.KernelNodeGetParams(node, &out->params);
  if (rc != 0) return rc;
  if (out->params.kernelParams == nullptr && n_params > 0) return 1;  // CUDA_ERROR_INVALID_VALUE
  out->values.assign(n_params, 0);
  out->pointers.resize(n_params);
  for (int p = 0; p < n_params; ++p) {
    std::memcpy(&out->values[p], out->params.kernelParams[p], sizeof(unsigned long long));
    out->pointers[p] = &out->values[p];
  }
  out->params.kernelParams = out->pointers.data();
  out->params.extra = nullptr;
  return 0;
}

// Lists up to `max` kernel nodes of `graph` (handles, CUfunctions); returns how many
// the graph has (with *rc set on a driver failure).
inline long long ListKernelNodes(CUgraph graph, long long max, unsigned long long* nodes,
                                 unsigned long long* funcs, CUresult* rc) {
  size_t n = 0;
  *rc = g_patch_drv.GraphGetNodes(graph, nullptr, &n);
  if (*rc != 0) return -1;
  std::vector<CUgraphNode> all(n);
  *rc = g_patch_drv.GraphGetNodes(graph, all.data(), &n);
  if (*rc != 0) return -1;
  long long count = 0;
  for (size_t i = 0; i < n; ++i) {
    int type = -1;
    KernelNodeParams p{};
    if (g_patch_drv.NodeGetType(all[i], &type) != 0 || type != kNodeTypeKernel) continue;
    if (g_patch_drv.KernelNodeGetParams(all[i], &p) != 0) continue;
    if (count < max) {
      nodes[count] = reinterpret_cast<uintptr_t>(all[i]);
      funcs[count] = reinterpret_cast<uintptr_t>(p.func);
    }
    ++count;
  }
  return count;
}

}  // namespace nimble_patch

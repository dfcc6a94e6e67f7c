// The handler's exported calls about its graph's nodes (included by handler.cc after
// its plan registry): the kernel nodes re-pointed in place (graph_patch.h) and the
// copy nodes (copy_node.h).
#pragma once

namespace {

// The plan `plan_id` on `device` for the export `what`, or null with the error set: the
// handler initialised, the plan registered, the driver with the graph node entry points.
std::shared_ptr<Plan> NodePlan(const char* what, long long plan_id, int device) {
  if (nimble_ffi_init() != 0) return nullptr;
  std::shared_ptr<Plan> plan = FindPlan(plan_id, device);
  if (!plan || !nimble_patch::g_patch_drv.ok()) {
    t_last_error = std::string(what) + ": no such plan, or no graph node entry points";
    return nullptr;
  }
  return plan;
}

}  // namespace

// Lists up to `max` kernel nodes of `graph` (node handles and their CUfunction);
// returns how many the graph has, or -1.
NIMBLE_EXPORT long long nimble_ffi_kernel_nodes(void* graph, long long max,
                                                unsigned long long* nodes,
                                                unsigned long long* funcs) {
  if (nimble_ffi_init() != 0) return -1;
  if (!nimble_patch::g_patch_drv.ok()) {
    t_last_error = "libcuda.so.1 lacks the graph node entry points (CUDA 12.0+)";
    return -1;
  }
  CUresult rc = 0;
  long long count = nimble_patch::ListKernelNodes(static_cast<CUgraph>(graph), max, nodes, funcs, &rc);
  if (rc != 0) t_last_error = DriverError("cuGraphGetNodes", rc);
  return rc != 0 ? -1 : count;
}

// The first n 8-byte arguments of kernel node `node` (the caller knows the kernel
// takes at least n such arguments); 0 or -1.
NIMBLE_EXPORT int nimble_ffi_kernel_node_params(void* node, int n, unsigned long long* values) {
  if (nimble_ffi_init() != 0 || !nimble_patch::g_patch_drv.ok()) return -1;
  nimble_patch::Node loaded;
  CUresult rc = nimble_patch::LoadNode(static_cast<CUgraphNode>(node), n, &loaded);
  if (rc != 0) { t_last_error = DriverError("cuGraphKernelNodeGetParams", rc); return -1; }
  for (int p = 0; p < n; ++p) values[p] = loaded.values[p];
  return 0;
}

// Makes plan `plan_id` on `device` read and write some buffers in place: site k is
// argument site_param[k] of node site_node[k] (an index into nodes, whose n_params
// are given), naming plan input site_index[k] (site_kind 0) or output buffer
// site_index[k] (1). The graph holds the arena's addresses until the first call.
NIMBLE_EXPORT int nimble_ffi_set_inplace(long long plan_id, int device, int n_nodes,
                                         const unsigned long long* nodes,
                                         const int* n_params, int n_sites,
                                         const int* site_node, const int* site_param,
                                         const int* site_kind, const int* site_index) {
  std::shared_ptr<Plan> plan = NodePlan("nimble_ffi_set_inplace", plan_id, device);
  if (!plan) return -1;
  nimble_patch::Patches patches;
  patches.nodes.resize(n_nodes);
  for (int i = 0; i < n_nodes; ++i) {
    CUresult rc = nimble_patch::LoadNode(reinterpret_cast<CUgraphNode>(nodes[i]), n_params[i],
                                         &patches.nodes[i]);
    if (rc != 0) { t_last_error = DriverError("cuGraphKernelNodeGetParams", rc); return -1; }
  }
  Arena& arena = *plan->arena;
  patches.in_sites.resize(plan->in_index.size());
  patches.out_sites.resize(arena.out_src.size());
  patches.in_addr.assign(patches.in_sites.size(), 0);
  patches.out_addr.assign(patches.out_sites.size(), 0);
  for (int k = 0; k < n_sites; ++k) {
    auto& lists = site_kind[k] == 0 ? patches.in_sites : patches.out_sites;
    auto& addr = site_kind[k] == 0 ? patches.in_addr : patches.out_addr;
    if (site_index[k] < 0 || size_t(site_index[k]) >= lists.size() || site_node[k] < 0 ||
        site_node[k] >= n_nodes || site_param[k] < 0 || site_param[k] >= n_params[site_node[k]]) {
      t_last_error = "nimble_ffi_set_inplace: site " + std::to_string(k) + " out of range";
      return -1;
    }
    lists[site_index[k]].push_back({site_node[k], site_param[k]});
    addr[site_index[k]] = patches.nodes[site_node[k]].values[site_param[k]];
  }
  patches.in_home = patches.in_addr;
  patches.out_home = patches.out_addr;
  std::lock_guard<std::mutex> lock(arena.mu);
  arena.patches = std::move(patches);
  return 0;
}

// Launches the copy kernel `copy_fn` on `stream`, which is capturing a plan's graph,
// with an empty table marked as the copies in (which 0, before the tasks) or out (1,
// after them); 0 or -1.
NIMBLE_EXPORT int nimble_ffi_capture_copy_node(void* copy_fn, void* stream, int which) {
  if (nimble_ffi_init() != 0) return -1;
  if (copy_fn == nullptr || which < 0 || which > 1) {
    t_last_error = "nimble_ffi_capture_copy_node: invalid arguments";
    return -1;
  }
  CUresult rc = LaunchCopyMark(static_cast<CUfunction>(copy_fn), static_cast<CUstream>(stream), which);
  if (rc != 0) { t_last_error = DriverError("cuLaunchKernel", rc); return -1; }
  return 0;
}

// Hands plan `plan_id` on `device` the marked copy nodes of its CUgraph `graph` (the
// one its graph exec was instantiated from): each call then copies through them.
// Returns the bitmask of the nodes found (1: in, 2: out) or -1.
NIMBLE_EXPORT int nimble_ffi_set_copy_nodes(long long plan_id, int device, void* graph) {
  std::shared_ptr<Plan> plan = NodePlan("nimble_ffi_set_copy_nodes", plan_id, device);
  if (!plan) return -1;
  Arena& arena = *plan->arena;
  std::lock_guard<std::mutex> lock(arena.mu);
  CUresult rc = 0;
  int found = FindCopyNodes(static_cast<CUgraph>(graph), arena.copy_fn, arena.copy_nodes, &rc);
  if (found < 0) { t_last_error = DriverError("listing the graph's copy nodes", rc); return -1; }
  arena.copy_nodes_found = found;
  return found;
}

// Points plan `plan_id`'s graph on `device` back at its arena alone: the copy nodes
// emptied and every re-pointed kernel argument at its arena buffer, as captured (to
// time the graph from Python without touching XLA's buffers). The next call sets what
// it needs again. 0 or -1.
NIMBLE_EXPORT int nimble_ffi_rest(long long plan_id, int device) {
  if (nimble_ffi_init() != 0) return -1;
  std::shared_ptr<Plan> plan = FindPlan(plan_id, device);
  if (!plan) {
    t_last_error = "nimble_ffi_rest: no such plan";
    return -1;
  }
  Arena& arena = *plan->arena;
  std::lock_guard<std::mutex> lock(arena.mu);
  CUresult rc = 0;
  unsigned long long sets = 0;
  static const CopyList kNothing;
  for (int w = 0; w < 2 && rc == 0; ++w)
    if (arena.copy_nodes_found & (1 << w))
      SetCopyNode(arena.copy_nodes[w], arena.graph, kNothing, &sets, &rc);
  int failed = -1;
  if (rc == 0) {
    if (arena.exec_stale) arena.patches.MarkAllDirty();
    arena.exec_stale = false;
    arena.patches.Home();
    rc = arena.patches.Flush(arena.graph, &failed);
  }
  if (rc != 0) { t_last_error = DriverError("resting the graph", rc); return -1; }
  return 0;
}

// Lets plan `plan_id` on `device` launch its one kernel directly on calls with nothing
// to copy, where its CUgraph `graph` holds that kernel node (re-pointed in place) and
// the copy nodes alone. Returns 1 (direct), 0 (not: the graph launches) or -1.
NIMBLE_EXPORT int nimble_ffi_set_direct(long long plan_id, int device, void* graph) {
  std::shared_ptr<Plan> plan = NodePlan("nimble_ffi_set_direct", plan_id, device);
  if (!plan) return -1;
  Arena& arena = *plan->arena;
  std::lock_guard<std::mutex> lock(arena.mu);
  arena.direct = -1;
  size_t n = 0;
  CUresult rc = nimble_patch::g_patch_drv.GraphGetNodes(static_cast<CUgraph>(graph), nullptr, &n);
  std::vector<CUgraphNode> all(n);
  if (rc == 0) rc = nimble_patch::g_patch_drv.GraphGetNodes(static_cast<CUgraph>(graph), all.data(), &n);
  if (rc != 0) { t_last_error = DriverError("cuGraphGetNodes", rc); return -1; }
  int kernel = -1, others = 0;
  for (CUgraphNode node : all) {
    bool copy = false;
    for (int w = 0; w < 2; ++w)
      copy = copy || ((arena.copy_nodes_found & (1 << w)) && arena.copy_nodes[w].node == node);
    if (copy) continue;
    ++others;
    for (size_t k = 0; k < arena.patches.nodes.size(); ++k)
      if (arena.patches.nodes[k].node == node) kernel = static_cast<int>(k);
  }
  if (others != 1 || kernel < 0 || arena.order || arena.patches.nodes[kernel].params.func == nullptr)
    return 0;
  arena.direct = kernel;
  return 1;
}

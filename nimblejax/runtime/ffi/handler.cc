// nimblejax FFI handler: replays a pre-captured CUDA graph ("a nimble plan")
// as an XLA custom call on XLA's own stream, with no Python on the call path.
// Built on the user's machine by nimblejax/runtime/ffi/__init__.py, without CUDA
// headers (driver.h says why).
#include <chrono>
#include <cstdint>
#include <memory>
#include <mutex>
#include <string>
#include <map>
#include <utility>
#include <vector>

#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;

#define NIMBLE_EXPORT extern "C" __attribute__((visibility("default")))

#include "driver.h"  // and graph_patch.h
#include "copy_kernel.h"
#include "copy_node.h"

namespace {

constexpr unsigned kEventDisableTiming = 2;  // CU_EVENT_DISABLE_TIMING

// One plan's arena and captured graph on one device. The arena addresses are
// baked into graph, which is why calls of one arena are serialized (mutex on the
// host, event on the GPU), whichever registration (operand set) they come from.
struct SegmentOrder {
  std::mutex mu;
  int next = 0, count = 1;
};

struct Arena {
  CUgraphExec graph = nullptr;
  CUfunction copy_fn = nullptr;
  std::vector<unsigned long long> out_src, out_bytes;
  CUevent event = nullptr;
  CUstream last_stream = nullptr;  // stream of the previous call, if any
  nimble_patch::Patches patches;   // buffers read and written in place, not copied
  CopyNode copy_nodes[2];          // the graph's copies in and out (copy_node.h)
  int copy_nodes_found = 0;        // bit w: copy_nodes[w] is in the graph
  // A graph of one kernel besides its copy nodes (nimble_ffi_set_direct): a call with
  // nothing to copy launches that kernel (patches.nodes[direct]) itself, no graph.
  // exec_stale: the graph exec's kernel arguments may lag the patches' values since.
  int direct = -1;
  bool exec_stale = false;
  // Counters for tests and profiles: calls, copy kernels launched, kernel nodes set,
  // host nanoseconds in the handler (from lookup to the last enqueue), and of those in
  // setting kernel nodes, launching copy kernels and launching the graph (or the direct
  // kernel); copies made by the graph's copy nodes, how often those nodes were set, and
  // the calls that launched the one kernel directly.
  unsigned long long stats[10] = {0, 0, 0, 0, 0, 0, 0, 0, 0, 0};
  // A segmented plan (compiler/segments.py): its segments' arenas share one order,
  // the segment due next; this arena's graph is segment `segment` of order->count.
  std::shared_ptr<SegmentOrder> order;
  int segment = 0;
  std::mutex mu;
  ~Arena() {
    // Safe with work pending: the driver releases the event once it is done.
    if (event != nullptr) g_drv.EventDestroy(event);
  }
};

// One registration: an arena and which arena slots its operands are copied to.
// A view of a plan (nimble_ffi_register_view) shares the arena and takes a
// subset of the operands: the others stay resident in their slots from earlier
// calls (the caller guarantees they hold the right data).
struct Plan {
  std::shared_ptr<Arena> arena;
  std::vector<unsigned long long> in_dst, in_bytes;
  std::vector<int> in_index;  // the plan input each operand is
  std::vector<int> fed_index;  // the plan input each fed-back copy fills
  std::vector<int> fed_out;    // and the output buffer it comes from
  // Copies inside the arena before the graph runs: a view's operands fed back
  // from the previous call's results, still in the arena's output buffers.
  std::vector<unsigned long long> fed_dst, fed_src, fed_bytes;
};

std::mutex g_plans_mu;
// (plan id, device ordinal) -> that device's copy of the plan. One id names a plan on
// every device it was registered for (the per-device body of a shard_map, or a jit
// placed on another GPU); XLA tells the handler which device it runs on.
std::map<std::pair<long long, int>, std::shared_ptr<Plan>> g_plans;
long long g_next_id = 1;

// The plan registered as `plan_id` for `device`, or null.
std::shared_ptr<Plan> FindPlan(long long plan_id, int device) {
  std::lock_guard<std::mutex> lock(g_plans_mu);
  auto it = g_plans.find({plan_id, device});
  return it == g_plans.end() ? nullptr : it->second;
}

// Copies the entries of `list` from `first` on with as few kernel launches as possible.
ffi::Error CopyBatched(Arena& arena, CUstream stream, const CopyList& list, size_t first) {
  CopyTable table;
  unsigned long long max_bytes = 0;
  for (size_t i = first; i < list.dst.size();) {
    i = FillTable(list, i, &table, &max_bytes);
    void* params[] = {&table};  // the driver copies the struct at launch
    CUresult rc = g_drv.LaunchKernel(arena.copy_fn, GridX(max_bytes), table.count, 1,
                                     kThreads, 1, 1, 0, stream, params, nullptr);
    if (rc != 0) return ffi::Error(ffi::ErrorCode::kInternal,
                                   DriverError("cuLaunchKernel", rc));
    ++arena.stats[1];
  }
  return ffi::Error::Success();
}

ffi::Error CheckSize(const char* what, size_t i, size_t got,
                     unsigned long long want) {
  if (want == 0 || got == want) return ffi::Error::Success();
  return ffi::Error(ffi::ErrorCode::kInvalidArgument,
                    std::string("nimblejax: ") + what + " " + std::to_string(i) +
                        " has " + std::to_string(got) + " bytes, plan expects " +
                        std::to_string(want));
}

// The end of every call: the event a call on another stream waits for, the counters.
ffi::Error Finish(Arena& arena, CUstream stream, std::chrono::steady_clock::time_point started) {
  CUresult rc = g_drv.EventRecord(arena.event, stream);
  if (rc != 0) return ffi::Error(ffi::ErrorCode::kInternal,
                                 DriverError("cuEventRecord", rc));
  arena.last_stream = stream;
  ++arena.stats[0];
  arena.stats[3] += std::chrono::duration_cast<std::chrono::nanoseconds>(
                        std::chrono::steady_clock::now() - started).count();
  return ffi::Error::Success();
}

ffi::Error PlanCall(CUstream stream, int32_t device, int64_t plan_id,
                    ffi::RemainingArgs args, ffi::RemainingRets rets) {
  auto started = std::chrono::steady_clock::now();
  // A plan exists only after a successful nimble_ffi_init (see register).
  std::shared_ptr<Plan> plan = FindPlan(plan_id, device);
  if (!plan) return ffi::Error(ffi::ErrorCode::kInvalidArgument,
                               "nimblejax: plan " + std::to_string(plan_id) +
                                   " is not registered for device " +
                                   std::to_string(device));
  Arena& arena = *plan->arena;
  if (args.size() != plan->in_dst.size() || rets.size() != arena.out_src.size())
    return ffi::Error(ffi::ErrorCode::kInvalidArgument,
                      "nimblejax: plan " + std::to_string(plan_id) +
                          " registered " + std::to_string(plan->in_dst.size()) +
                          " inputs / " + std::to_string(arena.out_src.size()) +
                          " outputs, called with " + std::to_string(args.size()) +
                          " / " + std::to_string(rets.size()));

  // Gather XLA's buffer addresses; a size mismatch would corrupt the arena
  // (0 registered bytes means "not copied", so any size is accepted).
  Scratch& scratch = t_scratch;
  scratch.Clear();
  std::vector<unsigned long long>& in_src = scratch.in_src;
  std::vector<unsigned long long>& out_dst = scratch.out_dst;
  in_src.resize(args.size());
  out_dst.resize(rets.size());
  for (size_t i = 0; i < args.size(); ++i) {
    auto buf = args.get<ffi::AnyBuffer>(i);
    if (buf.has_error()) return buf.error();
    ffi::Error err = CheckSize("input", i, buf->size_bytes(), plan->in_bytes[i]);
    if (err.failure()) return err;
    in_src[i] = reinterpret_cast<uintptr_t>(buf->untyped_data());
  }
  for (size_t i = 0; i < rets.size(); ++i) {
    auto buf = rets.get<ffi::AnyBuffer>(i);
    if (buf.has_error()) return buf.error();
    ffi::AnyBuffer out = **buf;
    ffi::Error err = CheckSize("output", i, out.size_bytes(), arena.out_bytes[i]);
    if (err.failure()) return err;
    out_dst[i] = reinterpret_cast<uintptr_t>(out.untyped_data());
  }

  std::lock_guard<std::mutex> lock(arena.mu);
  // The arena is shared by all calls of this plan: if the previous call ran
  // on another stream, its graph must finish before we overwrite the inputs.
  if (arena.last_stream != nullptr && arena.last_stream != stream) {
    CUresult rc = g_drv.StreamWaitEvent(stream, arena.event, 0);
    if (rc != 0) return ffi::Error(ffi::ErrorCode::kInternal,
                                   DriverError("cuStreamWaitEvent", rc));
  }
  // Operands and results re-pointed in place need no copy; the rest are copied.
  if (arena.order) {  // segments one call after another, never two calls interleaved
    std::lock_guard<std::mutex> turn(arena.order->mu);
    if (arena.order->next != arena.segment) {
      int due = arena.order->next;
      arena.order->next = 0;
      return ffi::Error(ffi::ErrorCode::kFailedPrecondition,
                        "nimblejax: segment " + std::to_string(arena.segment) + " of plan " +
                            std::to_string(plan_id) + " was called where segment " +
                            std::to_string(due) + " was due: two calls of one segmented "
                            "function interleave in this XLA program (their segments share "
                            "one arena); call it with segments=1 there, or make the second "
                            "call read a result of the first");
    }
    arena.order->next = (arena.segment + 1) % arena.order->count;
  }
  nimble_patch::Patches& patches = arena.patches;
  CopyList& in = scratch.in;
  CopyList& out = scratch.out;
  for (size_t k = 0; k < in_src.size(); ++k) {
    size_t i = plan->in_index[k];
    if (patches.InPlaceIn(i))
      patches.Retarget(patches.in_sites[i], &patches.in_addr[i], in_src[k]);
    else
      in.Add(plan->in_dst[k], in_src[k], plan->in_bytes[k]);
  }
  // Fed back: the previous call's result j, in the arena or, written in place, in the
  // XLA buffer the graph last wrote (the result array the caller passes back holds it).
  for (size_t e = 0; e < plan->fed_dst.size(); ++e) {
    size_t i = plan->fed_index[e], j = plan->fed_out[e];
    bool out_in_place = patches.InPlaceOut(j);
    unsigned long long src = out_in_place ? patches.out_addr[j] : plan->fed_src[e];
    if (!(out_in_place && patches.InPlaceIn(i))) in.Add(plan->fed_dst[e], src, plan->fed_bytes[e]);
    if (patches.InPlaceIn(i))
      patches.Retarget(patches.in_sites[i], &patches.in_addr[i],
                       out_in_place ? src : plan->fed_dst[e]);
  }
  for (size_t j = 0; j < out_dst.size(); ++j) {
    if (patches.InPlaceOut(j))
      patches.Retarget(patches.out_sites[j], &patches.out_addr[j], out_dst[j]);
    else
      out.Add(out_dst[j], arena.out_src[j], arena.out_bytes[j]);
  }
  int failed = -1;
  arena.stats[2] += patches.dirty.size();
  auto lap = std::chrono::steady_clock::now();
  auto split = [&](int k) {  // adds the time since the last split to counter k
    auto now = std::chrono::steady_clock::now();
    arena.stats[k] += std::chrono::duration_cast<std::chrono::nanoseconds>(now - lap).count();
    lap = now;
  };
  if (arena.direct >= 0 && in.dst.empty() && out.dst.empty()) {
    // One kernel and nothing to copy: launching it costs less than setting its node
    // and launching the graph (issue 30: a lookup's whole call is JAX's dispatch and this).
    patches.ClearDirty();
    arena.exec_stale = true;
    split(4);
    const nimble_patch::KernelNodeParams& k = patches.nodes[arena.direct].params;
    CUresult rc = g_drv.LaunchKernel(k.func, k.gridDimX, k.gridDimY, k.gridDimZ, k.blockDimX,
                                     k.blockDimY, k.blockDimZ, k.sharedMemBytes, stream,
                                     k.kernelParams, nullptr);
    if (rc != 0) return ffi::Error(ffi::ErrorCode::kInternal, DriverError("cuLaunchKernel", rc));
    split(6);
    ++arena.stats[9];
    return Finish(arena, stream, started);
  }
  if (arena.exec_stale) {  // direct calls left the graph exec's arguments behind
    patches.MarkAllDirty();
    arena.exec_stale = false;
  }
  CUresult rc = patches.Flush(arena.graph, &failed);
  if (rc != 0) return ffi::Error(ffi::ErrorCode::kInternal,
                                 DriverError("cuGraphExecKernelNodeSetParams", rc));
  // The graph's own copy nodes take what they can; the rest is launched beside it.
  size_t in_rest = 0, out_rest = 0;
  for (int w = 0; w < 2 && rc == 0; ++w) {
    if (!(arena.copy_nodes_found & (1 << w))) continue;
    size_t& rest = w == 0 ? in_rest : out_rest;
    rest = SetCopyNode(arena.copy_nodes[w], arena.graph, w == 0 ? in : out,
                       &arena.stats[8], &rc);
    arena.stats[7] += rest;
  }
  if (rc != 0) return ffi::Error(ffi::ErrorCode::kInternal,
                                 DriverError("setting a copy node", rc));
  split(4);
  ffi::Error err = CopyBatched(arena, stream, in, in_rest);
  if (err.failure()) return err;
  split(5);
  rc = g_drv.GraphLaunch(arena.graph, stream);
  if (rc != 0) return ffi::Error(ffi::ErrorCode::kInternal,
                                 DriverError("cuGraphLaunch", rc));
  split(6);
  err = CopyBatched(arena, stream, out, out_rest);
  if (err.failure()) return err;
  split(5);
  return Finish(arena, stream, started);
}

// Adds `plan` under `plan_id` (0: a new id) for `device`; returns the id or -1.
long long AddPlan(long long plan_id, int device, std::shared_ptr<Plan> plan) {
  std::lock_guard<std::mutex> lock(g_plans_mu);
  long long id = plan_id > 0 ? plan_id : g_next_id++;
  if (id >= g_next_id) g_next_id = id + 1;
  if (!g_plans.emplace(std::make_pair(id, device), std::move(plan)).second) {
    t_last_error = "nimble_ffi_register: plan " + std::to_string(id) +
                   " is already registered for device " + std::to_string(device);
    return -1;
  }
  return id;
}

}  // namespace

// ---- Exported C API (called from Python through ctypes) ----

NIMBLE_EXPORT int nimble_ffi_init(void) {
  std::call_once(g_init_once, InitOnce);
  if (g_init_status != 0) t_last_error = g_init_error;
  return g_init_status;
}

NIMBLE_EXPORT const char* nimble_ffi_last_error(void) {
  return t_last_error.c_str();
}

NIMBLE_EXPORT const char* nimble_ffi_copy_kernel_source(void) {
  return kCopyKernelSource;
}

// A new plan id, registered later (nimble_ffi_register or _register_view with it): a
// call's custom call can name its plan before the plan's graph is built.
NIMBLE_EXPORT long long nimble_ffi_reserve_id(void) {
  std::lock_guard<std::mutex> lock(g_plans_mu);
  return g_next_id++;
}

// Registers the copy of plan `plan_id` (0: a new id) for device ordinal `device`
// and returns the plan's id. Needs the device's CUDA context current (the one
// graph_exec and copy_fn belong to): the plan's event is created in it.
NIMBLE_EXPORT long long nimble_ffi_register(
    long long plan_id, int device, void* graph_exec, void* copy_fn, int n_in, const unsigned long long* in_dst,
    const unsigned long long* in_bytes, int n_out,
    const unsigned long long* out_src, const unsigned long long* out_bytes) {
  if (nimble_ffi_init() != 0) return -1;
  if (plan_id < 0 || device < 0 || graph_exec == nullptr || copy_fn == nullptr ||
      n_in < 0 || n_out < 0 ||
      (n_in > 0 && (in_dst == nullptr || in_bytes == nullptr)) ||
      (n_out > 0 && (out_src == nullptr || out_bytes == nullptr))) {
    t_last_error = "nimble_ffi_register: invalid arguments";
    return -1;
  }
  auto arena = std::make_shared<Arena>();
  arena->graph = static_cast<CUgraphExec>(graph_exec);
  arena->copy_fn = static_cast<CUfunction>(copy_fn);
  arena->out_src.assign(out_src, out_src + n_out);
  arena->out_bytes.assign(out_bytes, out_bytes + n_out);
  CUresult rc = g_drv.EventCreate(&arena->event, kEventDisableTiming);
  if (rc != 0) {
    arena->event = nullptr;
    t_last_error = DriverError("cuEventCreate", rc);
    return -1;
  }
  auto plan = std::make_shared<Plan>();
  plan->arena = std::move(arena);
  plan->in_dst.assign(in_dst, in_dst + n_in);
  plan->in_bytes.assign(in_bytes, in_bytes + n_in);
  for (int i = 0; i < n_in; ++i) plan->in_index.push_back(i);
  return AddPlan(plan_id, device, std::move(plan));
}

// Registers a view of plan `base_id` on `device` under `view_id` (0: a new id):
// the same arena and graph, called with the n_in operands (plan inputs in_index)
// copied to in_dst (the other inputs stay resident in the arena, or in the buffers
// the graph was last pointed at), and n_fed copies inside the arena into the slots
// of plan inputs fed_index from output buffers fed_out. Returns the view's id or -1.
NIMBLE_EXPORT long long nimble_ffi_register_view(
    long long view_id, long long base_id, int device, int n_in, const int* in_index,
    const unsigned long long* in_dst, const unsigned long long* in_bytes, int n_fed,
    const int* fed_index, const int* fed_out, const unsigned long long* fed_dst,
    const unsigned long long* fed_src, const unsigned long long* fed_bytes) {
  if (nimble_ffi_init() != 0) return -1;
  if (view_id < 0 || n_in < 0 ||
      (n_in > 0 && (in_dst == nullptr || in_bytes == nullptr || in_index == nullptr)) ||
      n_fed < 0 || (n_fed > 0 && (fed_dst == nullptr || fed_src == nullptr ||
                                  fed_bytes == nullptr || fed_index == nullptr ||
                                  fed_out == nullptr))) {
    t_last_error = "nimble_ffi_register_view: invalid arguments";
    return -1;
  }
  std::shared_ptr<Plan> base = FindPlan(base_id, device);
  if (!base) {
    t_last_error = "nimble_ffi_register_view: plan " + std::to_string(base_id) +
                   " is not registered for device " + std::to_string(device);
    return -1;
  }
  auto plan = std::make_shared<Plan>();
  plan->arena = base->arena;
  plan->in_dst.assign(in_dst, in_dst + n_in);
  plan->in_bytes.assign(in_bytes, in_bytes + n_in);
  plan->fed_dst.assign(fed_dst, fed_dst + n_fed);
  plan->fed_src.assign(fed_src, fed_src + n_fed);
  plan->fed_bytes.assign(fed_bytes, fed_bytes + n_fed);
  plan->in_index.assign(in_index, in_index + n_in);
  plan->fed_index.assign(fed_index, fed_index + n_fed);
  plan->fed_out.assign(fed_out, fed_out + n_fed);
  return AddPlan(view_id, device, std::move(plan));
}

// Makes plans ids[0..count) on `device` the segments of one plan, called in that order
// (each call's segments one after another): 0, or -1 if one is not registered.
NIMBLE_EXPORT int nimble_ffi_set_segments(int count, const long long* ids, int device) {
  if (count < 1 || ids == nullptr) return -1;
  auto order = std::make_shared<SegmentOrder>();
  order->count = count;
  for (int k = 0; k < count; ++k) {
    std::shared_ptr<Plan> plan = FindPlan(ids[k], device);
    if (!plan) {
      t_last_error = "nimble_ffi_set_segments: plan " + std::to_string(ids[k]) +
                     " is not registered for device " + std::to_string(device);
      return -1;
    }
    std::lock_guard<std::mutex> lock(plan->arena->mu);
    plan->arena->order = order;
    plan->arena->segment = k;
  }
  return 0;
}

#include "node_exports.h"  // the exported calls about the graph's nodes

// The 10 counters of plan `plan_id`'s arena on `device` (Arena::stats), shared by its
// views; 0 or -1.
NIMBLE_EXPORT int nimble_ffi_stats(long long plan_id, int device, unsigned long long* out) {
  std::shared_ptr<Plan> plan = FindPlan(plan_id, device);
  if (!plan) return -1;
  std::lock_guard<std::mutex> lock(plan->arena->mu);
  for (int i = 0; i < 10; ++i) out[i] = plan->arena->stats[i];
  return 0;
}

// A call already running keeps its shared_ptr, so the plan outlives it.
// Forgets the plan on every device it was registered for.
NIMBLE_EXPORT void nimble_ffi_unregister(long long id) {
  std::vector<std::shared_ptr<Plan>> doomed;  // destroyed outside the lock
  std::lock_guard<std::mutex> lock(g_plans_mu);
  auto it = g_plans.lower_bound({id, 0});
  while (it != g_plans.end() && it->first.first == id) {
    doomed.push_back(std::move(it->second));
    it = g_plans.erase(it);
  }
}

// ---- The XLA FFI handler ----

XLA_FFI_DEFINE_HANDLER(kNimblePlanCall, PlanCall,
                       ffi::Ffi::Bind()
                           .Ctx<ffi::PlatformStream<CUstream>>()
                           .Ctx<ffi::DeviceOrdinal>()
                           .Attr<int64_t>("plan")
                           .RemainingArgs()
                           .RemainingRets());

// Exported by hand (not XLA_FFI_DEFINE_HANDLER_SYMBOL) so that it stays
// visible although the library is built with -fvisibility=hidden.
NIMBLE_EXPORT XLA_FFI_Error* NimblePlanCall(XLA_FFI_CallFrame* call_frame) {
  return kNimblePlanCall(call_frame);
}

// The CUDA driver entry points the FFI handler calls (included by handler.cc).
//
// Why no CUDA headers: the library is built on the user's machine with only a C++
// compiler and jaxlib's FFI headers. The few driver entry points used are resolved
// from libcuda at run time, so the build works (and can be tested) without CUDA.
#pragma once

#include <dlfcn.h>

#include <mutex>
#include <string>

// Driver types (ABI as declared in NVIDIA's cuda.h).
typedef int CUresult;  // CUDA_SUCCESS == 0
typedef struct CUstream_st* CUstream;
typedef struct CUevent_st* CUevent;
typedef struct CUgraphExec_st* CUgraphExec;
typedef struct CUfunc_st* CUfunction;

#include "graph_patch.h"  // optional entry points, resolved in InitOnce

namespace {

struct Driver {
  CUresult (*GraphLaunch)(CUgraphExec, CUstream);
  CUresult (*LaunchKernel)(CUfunction, unsigned, unsigned, unsigned, unsigned,
                           unsigned, unsigned, unsigned, CUstream, void**,
                           void**);
  CUresult (*EventCreate)(CUevent*, unsigned);
  CUresult (*EventRecord)(CUevent, CUstream);
  CUresult (*StreamWaitEvent)(CUstream, CUevent, unsigned);
  CUresult (*GetErrorString)(CUresult, const char**);
  CUresult (*EventDestroy)(CUevent);
};

Driver g_drv;
int g_init_status = -1;      // written once under g_init_once
std::string g_init_error;    // idem; never modified afterwards
std::once_flag g_init_once;
thread_local std::string t_last_error;  // per thread: no races on c_str()

template <typename F>
bool Resolve(void* lib, const char* name, F* out) {
  *out = reinterpret_cast<F>(dlsym(lib, name));
  if (*out == nullptr) g_init_error = std::string("libcuda.so.1 lacks ") + name;
  return *out != nullptr;
}

void InitOnce() {
  // RTLD_LOCAL: share the process's libcuda without exporting its symbols.
  void* lib = dlopen("libcuda.so.1", RTLD_NOW | RTLD_LOCAL);
  if (lib == nullptr) {
    const char* why = dlerror();
    g_init_error = std::string("cannot dlopen libcuda.so.1: ") +
                   (why ? why : "unknown error");
    g_init_status = 1;
    return;
  }
  // cuEventDestroy is exported as cuEventDestroy_v2 since CUDA 4.0; the
  // others never got a versioned name (cuda.h only adds _ptsz/_ptds aliases).
  bool ok = Resolve(lib, "cuGraphLaunch", &g_drv.GraphLaunch) &&
            Resolve(lib, "cuLaunchKernel", &g_drv.LaunchKernel) &&
            Resolve(lib, "cuEventCreate", &g_drv.EventCreate) &&
            Resolve(lib, "cuEventRecord", &g_drv.EventRecord) &&
            Resolve(lib, "cuStreamWaitEvent", &g_drv.StreamWaitEvent) &&
            Resolve(lib, "cuGetErrorString", &g_drv.GetErrorString) &&
            Resolve(lib, "cuEventDestroy_v2", &g_drv.EventDestroy);
  if (ok) nimble_patch::ResolvePatchDriver(lib);
  g_init_status = ok ? 0 : 2;  // the handle stays open for the process
}

std::string DriverError(const char* call, CUresult rc) {
  const char* text = nullptr;
  if (g_drv.GetErrorString == nullptr || g_drv.GetErrorString(rc, &text) != 0)
    text = nullptr;
  return std::string("nimblejax: ") + call + " failed: " +
         (text ? text : "unknown error") + " (CUresult " + std::to_string(rc) +
         ")";
}

}  // namespace

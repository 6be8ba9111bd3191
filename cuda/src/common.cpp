// common.cpp: per-thread error messages and the library-level entry points.
#include "common.h"

#include <atomic>
#include <cstdio>

#if defined(KDT_WITH_CUDA)
#include <cuda_runtime.h>
#endif

namespace kdt {
namespace {
thread_local std::string g_last_error;
std::atomic<uint64_t> g_sync_count{0};
}

void count_sync() { g_sync_count.fetch_add(1, std::memory_order_relaxed); }

kdt_status set_error(kdt_status status, const char* fn, const char* fmt, ...) {
  char buf[1024];
  va_list ap;
  va_start(ap, fmt);
  std::vsnprintf(buf, sizeof buf, fmt, ap);
  va_end(ap);
  g_last_error = std::string(fn) + ": " + buf;
  return status;
}

void clear_error() { g_last_error.clear(); }

kdt_status cuda_unsupported(const char* fn) {
  return set_error(KDT_ERR_UNSUPPORTED, fn,
                   "this libkdtree was built without CUDA (cuda/build.sh --arch cpu); "
                   "rebuild with --arch sm_90, sm_120 or native");
}

}  // namespace kdt

extern "C" {

const char* kdt_last_error(void) { return kdt::g_last_error.c_str(); }

const char* kdt_version(void) { return "0.1.0"; }

uint64_t kdt_sync_count(void) { return kdt::g_sync_count.load(); }

int kdt_has_cuda(void) {
#if defined(KDT_WITH_CUDA)
  return 1;
#else
  return 0;
#endif
}

int kdt_cuda_device_count(void) {
#if defined(KDT_WITH_CUDA)
  int n = 0;
  if (cudaGetDeviceCount(&n) != cudaSuccess) {
    cudaGetLastError();  // clear the sticky-free error so later calls start clean
    return 0;
  }
  return n;
#else
  return 0;
#endif
}

}  // extern "C"

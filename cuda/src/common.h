// common.h: internal helpers shared by every translation unit of libkdtree (not part of the ABI).
// Error reporting: set_error() stores a per-thread message that kdt_last_error() returns.
#pragma once

#include <cstdarg>
#include <string>

#include "kdtree/kdtree.h"

namespace kdt {

// Records "fn: message" as the calling thread's last error and returns `status`.
kdt_status set_error(kdt_status status, const char* fn, const char* fmt, ...)
#if defined(__GNUC__)
    __attribute__((format(printf, 3, 4)))
#endif
    ;
void clear_error();

// Returns KDT_ERR_UNSUPPORTED with a clear message when the build has no CUDA backend.
kdt_status cuda_unsupported(const char* fn);

// Counts one host synchronisation (kdt_sync_count): every call that waits for the device
// (stream / device synchronise, a blocking cudaMemcpy) is preceded by this.
void count_sync();

}  // namespace kdt

// Argument checks for entry points: return an error status naming the argument.
#define KDT_CHECK_ARG(cond, fn, ...)                                          \
  do {                                                                        \
    if (!(cond)) return ::kdt::set_error(KDT_ERR_INVALID_ARGUMENT, fn, __VA_ARGS__); \
  } while (0)
#define KDT_CHECK_PTR(ptr, fn) KDT_CHECK_ARG((ptr) != nullptr, fn, "%s is NULL", #ptr)

#if defined(__CUDACC__)
#include <cuda_runtime.h>
// Checks a CUDA runtime call inside an entry point and returns KDT_ERR_CUDA on failure.
#define KDT_CUDA_CHECK(expr, fn)                                                        \
  do {                                                                                  \
    cudaError_t kdt_err_ = (expr);                                                      \
    if (kdt_err_ != cudaSuccess)                                                        \
      return ::kdt::set_error(KDT_ERR_CUDA, fn, "%s failed: %s", #expr,                 \
                              cudaGetErrorString(kdt_err_));                            \
  } while (0)
#endif

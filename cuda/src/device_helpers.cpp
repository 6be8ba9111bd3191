// device_helpers.cpp: small device-memory helpers so that test programs, benchmarks and Python
// (ctypes) can drive the CUDA backend without linking cudart or torch themselves.
// In a CPU-only build every helper returns KDT_ERR_UNSUPPORTED with the rebuild hint.
#include "common.h"

#if defined(KDT_WITH_CUDA)
#include <cuda_runtime.h>
#endif

namespace {

// A blocking copy's direction: a plain enum, since cudaMemcpyKind exists only in CUDA builds.
enum class Direction { kHostToDevice, kDeviceToHost };

// kdt_memcpy_htod / kdt_memcpy_dtoh: the argument checks, then one blocking cudaMemcpy. Every
// message names `fn`, the public function; a CUDA error also names the cudaMemcpyKind, as the
// literal in the failed call (KDT_CUDA_CHECK prints the expression).
kdt_status blocking_copy(void* dst, const void* src, size_t bytes, Direction dir, const char* fn) {
  kdt::clear_error();
  if (bytes == 0) return KDT_OK;
  KDT_CHECK_PTR(dst, fn);
  KDT_CHECK_PTR(src, fn);
#if defined(KDT_WITH_CUDA)
  kdt::count_sync();
  if (dir == Direction::kHostToDevice)
    KDT_CUDA_CHECK(cudaMemcpy(dst, src, bytes, cudaMemcpyHostToDevice), fn);
  else
    KDT_CUDA_CHECK(cudaMemcpy(dst, src, bytes, cudaMemcpyDeviceToHost), fn);
  return KDT_OK;
#else
  (void)dir;
  return kdt::cuda_unsupported(fn);
#endif
}

}  // namespace

extern "C" {

kdt_status kdt_device_alloc(void** ptr, size_t bytes) {
  static const char* fn = "kdt_device_alloc";
  kdt::clear_error();
  KDT_CHECK_PTR(ptr, fn);
  *ptr = nullptr;
#if defined(KDT_WITH_CUDA)
  if (bytes == 0) return KDT_OK;
  const cudaError_t e = cudaMalloc(ptr, bytes);
  if (e == cudaErrorMemoryAllocation) {
    cudaGetLastError();
    return kdt::set_error(KDT_ERR_OUT_OF_MEMORY, fn, "cudaMalloc(%zu bytes) failed: %s", bytes,
                          cudaGetErrorString(e));
  }
  KDT_CUDA_CHECK(e, fn);
  return KDT_OK;
#else
  (void)bytes;
  return kdt::cuda_unsupported(fn);
#endif
}

kdt_status kdt_device_free(void* ptr) {
  static const char* fn = "kdt_device_free";
  kdt::clear_error();
#if defined(KDT_WITH_CUDA)
  if (ptr == nullptr) return KDT_OK;
  KDT_CUDA_CHECK(cudaFree(ptr), fn);
  return KDT_OK;
#else
  if (ptr == nullptr) return KDT_OK;
  return kdt::cuda_unsupported(fn);
#endif
}

kdt_status kdt_memcpy_htod(void* dst, const void* src, size_t bytes) {
  static const char* fn = "kdt_memcpy_htod";
  return blocking_copy(dst, src, bytes, Direction::kHostToDevice, fn);
}

kdt_status kdt_memcpy_dtoh(void* dst, const void* src, size_t bytes) {
  static const char* fn = "kdt_memcpy_dtoh";
  return blocking_copy(dst, src, bytes, Direction::kDeviceToHost, fn);
}

kdt_status kdt_device_synchronize(void) {
  static const char* fn = "kdt_device_synchronize";
  kdt::clear_error();
#if defined(KDT_WITH_CUDA)
  kdt::count_sync();
  KDT_CUDA_CHECK(cudaDeviceSynchronize(), fn);
  return KDT_OK;
#else
  return kdt::cuda_unsupported(fn);
#endif
}

}  // extern "C"

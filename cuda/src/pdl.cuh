// pdl.cuh: programmatic dependent launch (PDL, sm_90 and later) for the round's small kernels.
//
// A kernel launched with launch_pdl may start (its CTAs scheduled, its prologue run) while the
// kernel before it on the stream is still finishing; it waits in pdl_wait() until that kernel
// has completed and its memory is visible, exactly what stream order guarantees. So every
// kernel launched this way calls pdl_wait() (pdl_enter) before its first global access, and the
// result is the same as a plain launch: what PDL removes is the gap between the two kernels
// (the dependent's launch, once the first has finished), and nothing of either's work.
// pdl_trigger() lets the next PDL kernel be scheduled now rather than when this one exits;
// it changes no ordering (the next kernel still waits in its pdl_wait()).
//
// Eager launches and launches under stream capture alike (there the attribute becomes a
// programmatic edge of the graph). H200, bench.tree_ab (two builds of the library in one process,
// alternating), budgets 15-255, bs 1-64: the kernel alone (a graph of 20 builds) 0.92-0.98x;
// one call from Python between events 0.955-0.973x. After a torch kernel, which never
// triggers, the edge gains nothing: kernel alone 1.00-1.02x. (Eager PDL was off for a while,
// on two bench runs on two machines whose one-call figures differed by 2-12 us; one-call
// figures are host-bound, and moved 1.6x within one process in the A/B above.) A kernel
// launched without the attribute, or on a device before sm_90, takes pdl_wait and pdl_trigger
// as no-ops. KDT_PDL=0 (read once, on the host) launches plainly (A/B measurements).
#pragma once

#include <cstdlib>
#include <cstring>

#include <cuda_runtime.h>

namespace kdt {

__device__ __forceinline__ void pdl_wait() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile("griddepcontrol.wait;" ::: "memory");
#endif
}

__device__ __forceinline__ void pdl_trigger() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile("griddepcontrol.launch_dependents;" ::: "memory");
#endif
}

// Before pdl_enter: prefetches the line at v into L2 (a hint: no data reaches the SM, so the
// kernel before this one may still be writing it), which makes ptxas compute v, from the
// kernel's parameters, before the wait: their constant-bank loads then overlap the kernel before
// this one. (An empty asm taking v orders nothing in SASS: ptxas moved those loads below the
// wait.)
template <class T>
__device__ __forceinline__ void pdl_ready(const T* v) {
  asm volatile("prefetch.global.L2 [%0];" ::"l"(v));
}

// Before the first global access of a kernel that launch_pdl launches (its first statement, or
// after pdl_ready): wait for the kernel before it, then let the next one be scheduled.
__device__ __forceinline__ void pdl_enter() {
  pdl_wait();
  pdl_trigger();
}

#ifndef KDT_PDL_DEFAULT
#define KDT_PDL_DEFAULT 1
#endif

// Whether launch_pdl may set the attribute: KDT_PDL=0 or 1, else KDT_PDL_DEFAULT (a define).
inline bool pdl_enabled() {
  static const bool on = [] {
    const char* v = std::getenv("KDT_PDL");
    if (v && std::strcmp(v, "0") == 0) return false;
    if (v && std::strcmp(v, "1") == 0) return true;
    return KDT_PDL_DEFAULT != 0;
  }();
  return on;
}

// kernel<<<grid, block, smem, st>>>(args...), with the programmatic-serialization attribute when
// pdl_enabled(); returns the launch's error.
template <class... P, class... A>
cudaError_t launch_pdl(void (*kernel)(P...), dim3 grid, dim3 block, size_t smem, cudaStream_t st,
                       A&&... args) {
  cudaLaunchConfig_t cfg{};
  cfg.gridDim = grid;
  cfg.blockDim = block;
  cfg.dynamicSmemBytes = smem;
  cfg.stream = st;
  cudaLaunchAttribute attr[1];
  attr[0].id = cudaLaunchAttributeProgrammaticStreamSerialization;
  attr[0].val.programmaticStreamSerializationAllowed = 1;
  cfg.attrs = attr;
  cfg.numAttrs = pdl_enabled() ? 1 : 0;
  return cudaLaunchKernelEx(&cfg, kernel, static_cast<P>(args)...);
}

}  // namespace kdt

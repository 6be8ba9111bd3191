// hd.h: KDT_HD marks the small functions that the CPU backends and the CUDA kernels share
// (the *_core.h headers, attention_state.cuh): __host__ __device__ under nvcc, inline otherwise.
#pragma once

#if defined(__CUDACC__)
#define KDT_HD __host__ __device__ __forceinline__
#else
#define KDT_HD inline
#endif

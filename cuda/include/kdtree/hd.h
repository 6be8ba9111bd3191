// hd.h: KDT_HD marks the small functions that the CPU backends and the CUDA kernels share
// (the *_core.h headers, attention_state.cuh): __host__ __device__ under nvcc, inline otherwise.
#pragma once

#if defined(__CUDACC__)
#define KDT_HD __host__ __device__ __forceinline__
#else
#define KDT_HD inline
#endif

// KDT_NO_UNROLL before a loop: device code keeps it rolled (`#pragma unroll 1`); elsewhere it is
// nothing. For a block-strided loop (i = t, t + T, ...) that runs once or twice a thread: nvcc
// unrolls such loops four times behind a trip count that costs a division by the run-time T
// (about 20 instructions on the thread's chain) and puts the copies it rarely runs between the
// code that does run.
#if defined(__CUDA_ARCH__)
#define KDT_NO_UNROLL _Pragma("unroll 1")
#else
#define KDT_NO_UNROLL
#endif

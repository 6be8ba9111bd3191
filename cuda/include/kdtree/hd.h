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
// code that does run. Kept rolled in the parallel build's loops of that kind, with its divisions
// by the block size replaced (GpuBlock::div_uniform, compares): SASS 166 -> 158 KB a kernel, PTX
// divisions 15 -> 7. H100 (no H200 came), bench.tree_ab against the unrolled loops, kernel
// alone, seed 15, 3 rounds, bit-exact: budget 63 0.954-0.964x at bs 1-256 (bs 1 8.89 -> 8.48
// us, bs 64 11.28 -> 10.81), 0.922x at bs 1024; budgets 33-127 0.946-0.963x, 255 0.97x, 1023
// 0.985-0.99x; the suites' budget-63 draws of run 20261205T164124Z 0.946-0.960x (bs 1 and 64).
#if defined(__CUDA_ARCH__)
#define KDT_NO_UNROLL _Pragma("unroll 1")
#else
#define KDT_NO_UNROLL
#endif

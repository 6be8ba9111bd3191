// model_route_core.h: what the router (DeepSeek-V3 noaux_tc) computes alike on the CPU backend
// (model_cpu.cpp, route) and in the CUDA kernel (model_cuda_kernels.cuh, route_kernel).
#pragma once

#include <math.h>

#include "kdtree/hd.h"

namespace kdt {
namespace model {

// A group's score from its `per` experts' choice values (score + bias): the sum of the two best,
// or the best alone when the group has one expert. The groups with the topk_group best scores
// keep their experts eligible.
KDT_HD float group_score(const float* choice, int per) {
  float b1 = -INFINITY, b2 = -INFINITY;
  for (int j = 0; j < per; ++j) {
    const float v = choice[j];
    if (v > b1) { b2 = b1; b1 = v; } else if (v > b2) { b2 = v; }
  }
  return per >= 2 ? b1 + b2 : b1;
}

}  // namespace model
}  // namespace kdt

// tree_build.cu: CUDA backend of kdt_tree_build: picks one of three builds per call. None
// synchronises with the host or allocates: all are safe under CUDA graph capture.
//
// KDT_TREE_BUILD (read per call on the host) picks the algorithm:
//   auto (the default, unset): warp for budgets <= tree::wrp::kAutoMaxBudget (31), parallel
//     above.
//   warp: tree_build_warp.cu (tree_build_warp.h's build on a warp per request), up to budget
//     tree::wrp::kMaxBudget (1023); budget 1024 runs the parallel build.
//   parallel: tree_build_parallel.cu (tree_build_parallel.h's build on a CTA per request); a
//     budget whose layout fits no shared memory runs the serial build.
//   serial: tree_build_serial.cu, the earlier kernel, the selection serial.
#include <cstdlib>
#include <cstring>

#include "tree_build_warp.h"
#include "tree_kernels.h"

namespace kdt {
namespace {

enum class Mode { kAuto, kWarp, kParallel, kSerial };

// KDT_TREE_BUILD, read per call: "serial", "parallel", "warp"; anything else (unset) is auto.
Mode mode_from_env() {
  const char* v = std::getenv("KDT_TREE_BUILD");
  if (!v) return Mode::kAuto;
  if (std::strcmp(v, "serial") == 0) return Mode::kSerial;
  if (std::strcmp(v, "parallel") == 0) return Mode::kParallel;
  if (std::strcmp(v, "warp") == 0) return Mode::kWarp;
  return Mode::kAuto;
}

}  // namespace

kdt_status tree_build_cuda(const TreeBuildArgs& a, void* stream) {
  const Mode mode = mode_from_env();
  if ((mode == Mode::kAuto && a.budget <= tree::wrp::kAutoMaxBudget) ||
      (mode == Mode::kWarp && a.budget <= tree::wrp::kMaxBudget))
    return tree_build_warp_cuda(a, stream);
  if (mode != Mode::kSerial) {
    bool launched = false;
    const kdt_status s = tree_build_parallel_cuda(a, stream, &launched);
    if (s != KDT_OK || launched) return s;
  }
  return tree_build_serial_cuda(a, stream);
}

}  // namespace kdt

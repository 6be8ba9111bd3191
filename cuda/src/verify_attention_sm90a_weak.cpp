// verify_attention_sm90a_weak.cpp: a weak placeholder of kdt::verify_attention_sm90a so that a
// build without the sm_90a wgmma kernel (cuda/src/verify_attention_sm90a.cu, a separate change)
// links. The real definition is strong and replaces this one at link time; this one only says
// the path is absent (KDT_ERR_UNSUPPORTED), so `auto` uses the mma path and a forced
// KDT_VERIFY_PATH=sm90a fails with that message. Delete this file once the kernel is merged.
#if defined(KDT_WITH_CUDA)
#include "common.h"
#include "verify_attention.h"

namespace kdt {

__attribute__((weak)) kdt_status verify_attention_sm90a(const VerifyAttentionArgs&, void*, void*,
                                                        size_t) {
  return set_error(KDT_ERR_UNSUPPORTED, "kdt_verify_attention",
                   "the sm90a path is not in this build (cuda/src/verify_attention_sm90a.cu is "
                   "absent)");
}

}  // namespace kdt
#endif

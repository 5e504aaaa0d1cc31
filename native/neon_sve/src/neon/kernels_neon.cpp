// Arm NEON variant: the armv8-a baseline every Neoverse core runs (N1 included). gemm_w8g_a8 adds
// SDOT / SMMLA functions (w8g_neon.inc, their own target), run only when the CPU reports
// dotprod / i8mm. The panel GEMMs (gemm_f32, gemm_bf16) are the NEON micro-kernels of gemm_neon.inc.
#include "kernel_common.h"

#if defined(__aarch64__)
#include <arm_neon.h>

namespace appliance_kernels {
namespace neon {

#include "neon_prims.inc"

static inline void pack_q(const float*, int, int, void*) {}

template <class KT>
static inline void qk_tile(const float* Q, const void*, int M, const KT* K, int n, int D, float* S,
                           int lds) {
  qk_tile_fma(Q, M, K, n, D, S, lds);
}

template <class KT>
static inline void pv_tile(float* A, int M, const float* P, int lds, const KT* V, int n, int D) {
  pv_tile_fma(A, M, P, lds, V, n, D);
}

#include "w8g_neon.inc"

#include "gemm_neon.inc"

#define AK_VARIANT_NAME "neon"
#include "kernels_impl.h"
#undef AK_VARIANT_NAME

}  // namespace neon
const KernelTable* kernels_neon() { return &neon::kTable; }
}  // namespace appliance_kernels
#else
namespace appliance_kernels {
const KernelTable* kernels_neon() { return nullptr; }
}
#endif

// Portable version of every kernel: plain C++, compiled for the baseline ISA of the build.
// It is the reference every ISA variant is compared against in the Arm harness.
#include "kernel_common.h"

namespace appliance_kernels {
namespace generic {

using common::bf16_to_f32;
using common::W8GBlock;

static inline float ld(const float* p, int i) { return p[i]; }
static inline float ld(const uint16_t* p, int i) { return bf16_to_f32(p[i]); }

// Quantized KV codes are read in place, by value without their scale (AK_KV_CODES).
#include "kv_codes.h"
#define AK_KV_CODES 1
static inline float ld(const KvI8* p, int i) { return (float)p[i].c; }
static inline float ld(const KvE4M3* p, int i) { return kv_decode(p[i]); }
static inline float ld(const KvE5M2* p, int i) { return kv_decode(p[i]); }

static inline void pack_q(const float*, int, int, void*) {}

template <class KT>
static void qk_tile(const float* Q, const void*, int M, const KT* K, int n, int D, float* S,
                    int lds) {
  for (int r = 0; r < M; ++r) {
    const float* q = Q + (int64_t)r * D;
    for (int j = 0; j < n; ++j) {
      const KT* k = K + (int64_t)j * D;
      float s = 0.f;
      for (int d = 0; d < D; ++d) s += q[d] * ld(k, d);
      S[(int64_t)r * lds + j] = s;
    }
  }
}

template <class KT>
static void pv_tile(float* A, int M, const float* P, int lds, const KT* V, int n, int D) {
  for (int r = 0; r < M; ++r) {
    float* acc = A + (int64_t)r * D;
    for (int j = 0; j < n; ++j) {
      const float p = P[(int64_t)r * lds + j];
      if (p == 0.f) continue;
      const KT* v = V + (int64_t)j * D;
      for (int d = 0; d < D; ++d) acc[d] += p * ld(v, d);
    }
  }
}

static inline void exp_vec(float* x, int64_t n) {
  for (int64_t i = 0; i < n; ++i) x[i] = common::exp_scalar(x[i]);
}

static inline int w8g_act_bias() { return 0; }
static inline bool w8g_block_fast(const W8GBlock&) { return false; }  // the portable loop

#define AK_VARIANT_NAME "generic"
#include "kernels_impl.h"
#undef AK_VARIANT_NAME

}  // namespace generic

const KernelTable* kernels_generic() { return &generic::kTable; }

}  // namespace appliance_kernels

// Arm NEON + BF16 variant (armv8.6-a BF16: Neoverse V1/V2/N2, Graviton3/4, Grace). Over a bf16
// KV cache, Q.K^T and P.V run on BFMMLA (2x4 by 4x2 bf16 matrix multiply-accumulate into fp32):
//   Q.K^T: A = two query rows x 4 dims (packed once per work item), B = two key rows x 4 dims;
//   P.V:   A = two rows of probabilities x 4 tokens (rounded to bf16 per block),
//          B = V^T for two dims x 4 tokens (a 4x8 bf16 tile transposed with 8 zips).
// The query and the probabilities are rounded to bf16 (about 3 significant digits), as every
// bf16 attention path does. An fp32 cache takes the NEON fp32 path.
// gemm_bf16 over bf16 activations multiplies with BFDOT by element (gemm_neon.inc, AK_BGEMM_BFDOT).
#include "kernel_common.h"

#if defined(__aarch64__)
#include <arm_neon.h>

#pragma GCC push_options
#pragma GCC target("arch=armv8.2-a+bf16")

namespace appliance_kernels {
namespace neon_bf16 {

#include "neon_prims.inc"

alignas(16) static const uint16_t kZeroRow[4096] = {0};  // stands in for rows past the end

// qpack: for each row pair rp, for each 4-dim step: [q(2rp)[d..d+3], q(2rp+1)[d..d+3]] in bf16.
static inline void pack_q(const float* Q, int M, int D, void* buf) {
  bfloat16x8_t* o = static_cast<bfloat16x8_t*>(buf);
  const float32x4_t z = vdupq_n_f32(0.f);
  for (int rp = 0; rp < (M + 1) / 2; ++rp) {
    const float* q0 = Q + (int64_t)(2 * rp) * D;
    const float* q1 = q0 + D;
    const bool has1 = 2 * rp + 1 < M;
    for (int d = 0; d < D; d += 4)
      *o++ = vcvtq_high_bf16_f32(vcvtq_low_bf16_f32(vld1q_f32(q0 + d)), has1 ? vld1q_f32(q1 + d) : z);
  }
}

static inline void store_pair(float* s0, float* s1, int j, int n, float32x4_t acc) {
  s0[j] = vgetq_lane_f32(acc, 0);
  if (j + 1 < n) s0[j + 1] = vgetq_lane_f32(acc, 1);
  if (s1) {
    s1[j] = vgetq_lane_f32(acc, 2);
    if (j + 1 < n) s1[j + 1] = vgetq_lane_f32(acc, 3);
  }
}

static void qk_tile_bfmmla(const void* qpack, int M, const uint16_t* K, int n, int D, float* S,
                           int lds) {
  const bfloat16x8_t* qp = static_cast<const bfloat16x8_t*>(qpack);
  const int steps = D / 4;
  for (int rp = 0; rp < (M + 1) / 2; ++rp) {
    const bfloat16x8_t* q = qp + (int64_t)rp * steps;
    float* s0 = S + (int64_t)(2 * rp) * lds;
    float* s1 = 2 * rp + 1 < M ? s0 + lds : nullptr;
    for (int j = 0; j < n; j += 4) {
      const bfloat16_t* k0 = reinterpret_cast<const bfloat16_t*>(K + (int64_t)j * D);
      const bfloat16_t* k1 = j + 1 < n ? k0 + D : reinterpret_cast<const bfloat16_t*>(kZeroRow);
      const bfloat16_t* k2 = j + 2 < n ? k0 + 2 * D : reinterpret_cast<const bfloat16_t*>(kZeroRow);
      const bfloat16_t* k3 = j + 3 < n ? k0 + 3 * D : reinterpret_cast<const bfloat16_t*>(kZeroRow);
      float32x4_t a01 = vdupq_n_f32(0.f), a23 = a01;
      for (int st = 0; st < steps; ++st) {
        const int d = st * 4;
        a01 = vbfmmlaq_f32(a01, q[st], vcombine_bf16(vld1_bf16(k0 + d), vld1_bf16(k1 + d)));
        a23 = vbfmmlaq_f32(a23, q[st], vcombine_bf16(vld1_bf16(k2 + d), vld1_bf16(k3 + d)));
      }
      store_pair(s0, s1, j, n, a01);
      if (j + 2 < n) store_pair(s0, s1, j + 2, n, a23);
    }
  }
}

static void pv_tile_bfmmla(float* A, int M, const float* P, int lds, const uint16_t* V, int n,
                           int D) {
  const int quads = (n + 3) / 4;
  // P as bf16 [rp][quad] = [p(2rp)[4q..4q+3], p(2rp+1)[4q..4q+3]], zero past n and past M.
  bfloat16x8_t pp[2 * 64 / 4 * 32];  // up to 32 row pairs x 16 quads (block_size <= 64)
  bfloat16x8_t* ppd = pp;
  const bool big = (int64_t)((M + 1) / 2) * quads > (int64_t)(sizeof(pp) / sizeof(pp[0]));
  if (big) ppd = static_cast<bfloat16x8_t*>(std::malloc(sizeof(bfloat16x8_t) * ((M + 1) / 2) * quads));
  for (int rp = 0; rp < (M + 1) / 2; ++rp) {
    const float* p0 = P + (int64_t)(2 * rp) * lds;
    const float* p1 = p0 + lds;
    const bool has1 = 2 * rp + 1 < M;
    for (int qd = 0; qd < quads; ++qd) {
      float t0[4] = {0, 0, 0, 0}, t1[4] = {0, 0, 0, 0};
      for (int i = 0; i < 4 && 4 * qd + i < n; ++i) {
        t0[i] = p0[4 * qd + i];
        if (has1) t1[i] = p1[4 * qd + i];
      }
      ppd[rp * quads + qd] = vcvtq_high_bf16_f32(vcvtq_low_bf16_f32(vld1q_f32(t0)), vld1q_f32(t1));
    }
  }
  for (int rp = 0; rp < (M + 1) / 2; ++rp) {
    float* o0 = A + (int64_t)(2 * rp) * D;
    float* o1 = 2 * rp + 1 < M ? o0 + D : nullptr;
    const bfloat16x8_t* prow = ppd + (int64_t)rp * quads;
    for (int d = 0; d < D; d += 8) {
      float32x4_t c0 = vdupq_n_f32(0.f), c1 = c0, c2 = c0, c3 = c0;
      for (int qd = 0; qd < quads; ++qd) {
        const int t = 4 * qd;
        const uint16_t* v0 = V + (int64_t)t * D + d;
        const uint16x8_t r0 = vld1q_u16(v0);
        const uint16x8_t r1 = vld1q_u16(t + 1 < n ? v0 + D : kZeroRow);
        const uint16x8_t r2 = vld1q_u16(t + 2 < n ? v0 + 2 * D : kZeroRow);
        const uint16x8_t r3 = vld1q_u16(t + 3 < n ? v0 + 3 * D : kZeroRow);
        const uint32x4_t z01l = vreinterpretq_u32_u16(vzip1q_u16(r0, r1));
        const uint32x4_t z23l = vreinterpretq_u32_u16(vzip1q_u16(r2, r3));
        const uint32x4_t z01h = vreinterpretq_u32_u16(vzip2q_u16(r0, r1));
        const uint32x4_t z23h = vreinterpretq_u32_u16(vzip2q_u16(r2, r3));
        const bfloat16x8_t pa = prow[qd];
        c0 = vbfmmlaq_f32(c0, pa, vreinterpretq_bf16_u32(vzip1q_u32(z01l, z23l)));  // dims d, d+1
        c1 = vbfmmlaq_f32(c1, pa, vreinterpretq_bf16_u32(vzip2q_u32(z01l, z23l)));  // d+2, d+3
        c2 = vbfmmlaq_f32(c2, pa, vreinterpretq_bf16_u32(vzip1q_u32(z01h, z23h)));  // d+4, d+5
        c3 = vbfmmlaq_f32(c3, pa, vreinterpretq_bf16_u32(vzip2q_u32(z01h, z23h)));  // d+6, d+7
      }
      // c = [o(r0, d), o(r0, d+1), o(r1, d), o(r1, d+1)]
      const float32x4_t lo0 = vcombine_f32(vget_low_f32(c0), vget_low_f32(c1));
      const float32x4_t lo1 = vcombine_f32(vget_low_f32(c2), vget_low_f32(c3));
      vst1q_f32(o0 + d, vaddq_f32(vld1q_f32(o0 + d), lo0));
      vst1q_f32(o0 + d + 4, vaddq_f32(vld1q_f32(o0 + d + 4), lo1));
      if (o1) {
        const float32x4_t hi0 = vcombine_f32(vget_high_f32(c0), vget_high_f32(c1));
        const float32x4_t hi1 = vcombine_f32(vget_high_f32(c2), vget_high_f32(c3));
        vst1q_f32(o1 + d, vaddq_f32(vld1q_f32(o1 + d), hi0));
        vst1q_f32(o1 + d + 4, vaddq_f32(vld1q_f32(o1 + d + 4), hi1));
      }
    }
  }
  if (big) std::free(ppd);
}

template <class KT>
static inline void qk_tile(const float* Q, const void* qpack, int M, const KT* K, int n, int D,
                           float* S, int lds) {
  if constexpr (sizeof(KT) == 2)
    qk_tile_bfmmla(qpack, M, K, n, D, S, lds);
  else
    qk_tile_fma(Q, M, K, n, D, S, lds);
}

template <class KT>
static inline void pv_tile(float* A, int M, const float* P, int lds, const KT* V, int n, int D) {
  if constexpr (sizeof(KT) == 2)
    pv_tile_bfmmla(A, M, P, lds, V, n, D);
  else
    pv_tile_fma(A, M, P, lds, V, n, D);
}

#include "w8g_neon.inc"

#define AK_BGEMM_BFDOT 1
#include "gemm_neon.inc"

#define AK_VARIANT_NAME "neon_bf16"
#include "kernels_impl.h"
#undef AK_VARIANT_NAME

}  // namespace neon_bf16
}  // namespace appliance_kernels

#pragma GCC pop_options

namespace appliance_kernels {
const KernelTable* kernels_neon_bf16() { return &neon_bf16::kTable; }
}
#else
namespace appliance_kernels {
const KernelTable* kernels_neon_bf16() { return nullptr; }
}
#endif

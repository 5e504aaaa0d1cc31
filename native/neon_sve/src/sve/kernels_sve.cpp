// Arm SVE variant, vector-length agnostic (svcntw() lanes; verified at 128 and 256 bit under
// qemu): Neoverse V1 (256 bit), V2/Grace (128 bit), A64FX (512 bit). Loops over head_size use
// whilelt predicates, so any head_size works; a bf16 cache is widened with LD1H + LSL.
// The panel GEMMs (gemm_f32, gemm_bf16) run the NEON micro-kernels of gemm_neon.inc (BFDOT for bf16
// activations where the CPU has BF16, as V1 does): NEON is as wide as SVE at 128 bit (V2); an SVE
// block for 256-bit vectors (V1) is not written.
#include "kernel_common.h"

#if defined(__aarch64__)

#include <arm_neon.h>

#pragma GCC push_options
#pragma GCC target("arch=armv8.2-a+sve")
#include <arm_sve.h>

namespace appliance_kernels {
namespace sve {

static inline svfloat32_t ldv(svbool_t pg, const float* p) { return svld1_f32(pg, p); }
static inline svfloat32_t ldv(svbool_t pg, const uint16_t* p) {
  return svreinterpret_f32_u32(svlsl_n_u32_x(pg, svld1uh_u32(pg, p), 16));
}

// Quantized KV codes read in place (kv_codes.h, AK_KV_CODES): one code per 32-bit lane (LD1SB /
// LD1B), then int8: scvtf; fp8: the half-precision bits in the lane's low half, then fcvt.
#include "kv_codes.h"
#define AK_KV_CODES 1
static inline svfloat32_t ldv(svbool_t pg, const KvI8* p) {
  return svcvt_f32_s32_x(pg, svld1sb_s32(pg, reinterpret_cast<const int8_t*>(p)));
}
static inline svfloat32_t ldv(svbool_t pg, const KvE5M2* p) {
  const svuint32_t h = svlsl_n_u32_x(pg, svld1ub_u32(pg, reinterpret_cast<const uint8_t*>(p)), 8);
  return svcvt_f32_f16_x(pg, svreinterpret_f16_u32(h));
}
static inline svfloat32_t ldv(svbool_t pg, const KvE4M3* p) {
  // the sign-extended byte << 7: sign at bit 15 (and 14-31, cleared), magnitude at bits 7-13
  svuint32_t h = svreinterpret_u32_s32(svld1sb_s32(pg, reinterpret_cast<const int8_t*>(p)));
  h = svand_n_u32_x(pg, svlsl_n_u32_x(pg, h, 7), 0xbfffu);
  const svbool_t nan = svcmpeq_n_u32(pg, svand_n_u32_x(pg, h, 0x7fffu), 0x3f80u);
  h = svorr_n_u32_m(nan, h, 0x7e00u);
  return svmul_n_f32_x(pg, svcvt_f32_f16_x(pg, svreinterpret_f16_u32(h)), kKvE4M3HalfUnit);
}

static inline void pack_q(const float*, int, int, void*) {}

// Two query rows share every K load (4 keys x 2 rows = 8 accumulators); sizeless SVE types
// cannot form arrays, so the row pair is spelled out.
template <class KT>
static void qk_pair(const float* q0, const float* q1, const KT* K, int n, int D, float* s0, float* s1) {
  const int vl = (int)svcntw();
  const svbool_t all = svptrue_b32();
  int j = 0;
  for (; j + 4 <= n; j += 4) {
    const KT* k = K + (int64_t)j * D;
    svfloat32_t a0 = svdup_n_f32(0.f), a1 = a0, a2 = a0, a3 = a0, b0 = a0, b1 = a0, b2 = a0, b3 = a0;
    for (int d = 0; d < D; d += vl) {
      const svbool_t pg = svwhilelt_b32(d, D);
      const svfloat32_t k0 = ldv(pg, k + d), k1 = ldv(pg, k + D + d);
      const svfloat32_t k2 = ldv(pg, k + 2 * D + d), k3 = ldv(pg, k + 3 * D + d);
      const svfloat32_t x = svld1_f32(pg, q0 + d), y = svld1_f32(pg, q1 + d);
      a0 = svmla_f32_m(pg, a0, x, k0);
      a1 = svmla_f32_m(pg, a1, x, k1);
      a2 = svmla_f32_m(pg, a2, x, k2);
      a3 = svmla_f32_m(pg, a3, x, k3);
      b0 = svmla_f32_m(pg, b0, y, k0);
      b1 = svmla_f32_m(pg, b1, y, k1);
      b2 = svmla_f32_m(pg, b2, y, k2);
      b3 = svmla_f32_m(pg, b3, y, k3);
    }
    s0[j] = svaddv_f32(all, a0);
    s0[j + 1] = svaddv_f32(all, a1);
    s0[j + 2] = svaddv_f32(all, a2);
    s0[j + 3] = svaddv_f32(all, a3);
    s1[j] = svaddv_f32(all, b0);
    s1[j + 1] = svaddv_f32(all, b1);
    s1[j + 2] = svaddv_f32(all, b2);
    s1[j + 3] = svaddv_f32(all, b3);
  }
  for (; j < n; ++j) {
    const KT* k = K + (int64_t)j * D;
    svfloat32_t a0 = svdup_n_f32(0.f), b0 = a0;
    for (int d = 0; d < D; d += vl) {
      const svbool_t pg = svwhilelt_b32(d, D);
      const svfloat32_t k0 = ldv(pg, k + d);
      a0 = svmla_f32_m(pg, a0, svld1_f32(pg, q0 + d), k0);
      b0 = svmla_f32_m(pg, b0, svld1_f32(pg, q1 + d), k0);
    }
    s0[j] = svaddv_f32(all, a0);
    s1[j] = svaddv_f32(all, b0);
  }
}

template <class KT>
static void qk_tile(const float* Q, const void*, int M, const KT* K, int n, int D, float* S,
                    int lds) {
  // An odd last row is paired with itself (computed twice, stored once).
  for (int r = 0; r < M; r += 2) {
    const int r1 = r + 1 < M ? r + 1 : r;
    qk_pair(Q + (int64_t)r * D, Q + (int64_t)r1 * D, K, n, D, S + (int64_t)r * lds, S + (int64_t)r1 * lds);
  }
}

// Two rows share every V load, two vectors of dims per pass.
template <class KT>
static void pv_pair(float* A0, float* A1, const float* p0, const float* p1, const KT* V, int n, int D) {
  const int vl = (int)svcntw();
  for (int d = 0; d < D; d += 2 * vl) {
    const svbool_t pg0 = svwhilelt_b32(d, D), pg1 = svwhilelt_b32(d + vl, D);
    svfloat32_t a0 = svld1_f32(pg0, A0 + d), a1 = svld1_f32(pg1, A0 + d + vl);
    svfloat32_t b0 = svld1_f32(pg0, A1 + d), b1 = svld1_f32(pg1, A1 + d + vl);
    for (int j = 0; j < n; ++j) {
      const KT* v = V + (int64_t)j * D + d;
      const svfloat32_t v0 = ldv(pg0, v), v1 = ldv(pg1, v + vl);
      a0 = svmla_n_f32_m(pg0, a0, v0, p0[j]);
      a1 = svmla_n_f32_m(pg1, a1, v1, p0[j]);
      b0 = svmla_n_f32_m(pg0, b0, v0, p1[j]);
      b1 = svmla_n_f32_m(pg1, b1, v1, p1[j]);
    }
    svst1_f32(pg0, A0 + d, a0);
    svst1_f32(pg1, A0 + d + vl, a1);
    svst1_f32(pg0, A1 + d, b0);
    svst1_f32(pg1, A1 + d + vl, b1);
  }
}

template <class KT>
static void pv_tile(float* A, int M, const float* P, int lds, const KT* V, int n, int D) {
  int r = 0;
  for (; r + 2 <= M; r += 2)
    pv_pair(A + (int64_t)r * D, A + (int64_t)(r + 1) * D, P + (int64_t)r * lds, P + (int64_t)(r + 1) * lds, V, n, D);
  if (r < M) {
    // Odd last row alone (a pair with itself would add its contribution twice).
    const int vl = (int)svcntw();
    float* acc = A + (int64_t)r * D;
    const float* p = P + (int64_t)r * lds;
    for (int d = 0; d < D; d += vl) {
      const svbool_t pg = svwhilelt_b32(d, D);
      svfloat32_t a0 = svld1_f32(pg, acc + d);
      for (int j = 0; j < n; ++j) a0 = svmla_n_f32_m(pg, a0, ldv(pg, V + (int64_t)j * D + d), p[j]);
      svst1_f32(pg, acc + d, a0);
    }
  }
}

static inline svfloat32_t expv(svbool_t pg, svfloat32_t x) {
  using namespace common;
  const svbool_t valid = svcmpge_n_f32(pg, x, kExpLo);
  x = svmin_n_f32_x(pg, x, kExpHi);
  const svfloat32_t n = svrintm_f32_x(pg, svmla_n_f32_x(pg, svdup_n_f32(0.5f), x, kLog2e));
  svfloat32_t r = svmls_n_f32_x(pg, x, n, kLn2Hi);
  r = svmls_n_f32_x(pg, r, n, kLn2Lo);
  svfloat32_t p = svdup_n_f32(kExpP0);
  p = svmad_n_f32_x(pg, p, r, kExpP1);
  p = svmad_n_f32_x(pg, p, r, kExpP2);
  p = svmad_n_f32_x(pg, p, r, kExpP3);
  p = svmad_n_f32_x(pg, p, r, kExpP4);
  p = svmad_n_f32_x(pg, p, r, kExpP5);
  p = svmla_f32_x(pg, svadd_n_f32_x(pg, r, 1.f), svmul_f32_x(pg, p, r), r);
  const svint32_t e = svlsl_n_s32_x(pg, svadd_n_s32_x(pg, svcvt_s32_f32_x(pg, n), 127), 23);
  const svfloat32_t y = svmul_f32_x(pg, p, svreinterpret_f32_s32(e));
  return svsel_f32(valid, y, svdup_n_f32(0.f));
}

static inline void exp_vec(float* x, int64_t n) {
  const int64_t vl = (int64_t)svcntw();
  for (int64_t i = 0; i < n; i += vl) {
    const svbool_t pg = svwhilelt_b32(i, n);
    svst1_f32(pg, x + i, expv(pg, svld1_f32(pg, x + i)));
  }
}

static int vector_bits() { return (int)svcntw() * 32; }

#include "w8g_neon.inc"

#define AK_BGEMM_BFDOT 1
#include "gemm_neon.inc"

#define AK_VARIANT_NAME "sve"
#include "kernels_impl.h"
#undef AK_VARIANT_NAME

}  // namespace sve
}  // namespace appliance_kernels

#pragma GCC pop_options

namespace appliance_kernels {
const KernelTable* kernels_sve() { return &sve::kTable; }
// Only called when HWCAP_SVE is set.
int sve_vector_bits() { return sve::vector_bits(); }
}
#else
namespace appliance_kernels {
const KernelTable* kernels_sve() { return nullptr; }
int sve_vector_bits() { return 0; }
}
#endif

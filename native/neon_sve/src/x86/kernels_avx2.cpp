// x86-64 AVX2 + FMA variant (Haswell and later). head_size must be a multiple of 8 (the Python
// facade only sends multiples of 16).
#include "kernel_common.h"

#if defined(__x86_64__)
#include <immintrin.h>

#pragma GCC push_options
#pragma GCC target("avx2,fma,f16c")

namespace appliance_kernels {
namespace avx2 {

static inline __m256 load8(const float* p) { return _mm256_loadu_ps(p); }
static inline __m256 load8(const uint16_t* p) {
  const __m256i w = _mm256_cvtepu16_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
  return _mm256_castsi256_ps(_mm256_slli_epi32(w, 16));
}

// Quantized KV codes read in place (kv_codes.h, AK_KV_CODES): 8 bytes -> the 8 codes' values,
// without their scale, converted in registers (int8: vpmovsxbd + vcvtdq2ps; fp8: to half
// precision in 16-bit lanes, then F16C vcvtph2ps, which every AVX2 host we dispatch to has).
// e4m3 loads give the value / kKvE4M3HalfUnit (AK_KV_E4M3_UNIT: run_item folds the 256 into the
// scales) and decode the NaN codes only as KvE4M3N (AK_KV_E4M3_NAN_SCAN): 4 instructions, not 9.
#include "kv_codes.h"
#define AK_KV_CODES 1
#define AK_KV_E4M3_UNIT kKvE4M3HalfUnit
#define AK_KV_E4M3_NAN_SCAN 1
static inline __m128i load8_bytes(const void* p) { return _mm_loadl_epi64(reinterpret_cast<const __m128i*>(p)); }
static inline __m256 load8(const KvI8* p) { return _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(load8_bytes(p))); }
static inline __m256 load8(const KvE5M2* p) {
  return _mm256_cvtph_ps(_mm_slli_epi16(_mm_cvtepu8_epi16(load8_bytes(p)), 8));
}
// the sign-extended byte << 7: sign at bit 15 (and bit 14, cleared), magnitude at bits 7-13
static inline __m128i e4m3_half_bits(const void* p) {
  return _mm_and_si128(_mm_slli_epi16(_mm_cvtepi8_epi16(load8_bytes(p)), 7), _mm_set1_epi16((short)0xbfff));
}
static inline __m256 load8(const KvE4M3* p) { return _mm256_cvtph_ps(e4m3_half_bits(p)); }
static inline __m256 load8(const KvE4M3N* p) {
  __m128i h = e4m3_half_bits(p);
  const __m128i nan = _mm_cmpeq_epi16(_mm_and_si128(h, _mm_set1_epi16(0x7fff)), _mm_set1_epi16(0x3f80));
  h = _mm_or_si128(h, _mm_and_si128(nan, _mm_set1_epi16(0x7e00)));
  return _mm256_cvtph_ps(h);
}

// 16 consecutive values as two vectors (dims d .. d + 7, d + 8 .. d + 15). e5m2: one 16-byte load and
// two byte interleaves with zero give the 16 halves (code << 8) directly, one shift fewer per 8.
template <class KT>
static inline void load16(const KT* p, __m256& lo, __m256& hi) {
  lo = load8(p);
  hi = load8(p + 8);
}
// e4m3: the 16 codes sign-extended to 16-bit lanes in one ymm (one widening instead of two), shifted
// and masked once, then the two halves converted
static inline __m256i e4m3_half_bits16(const void* p) {
  const __m256i w = _mm256_cvtepi8_epi16(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
  return _mm256_and_si256(_mm256_slli_epi16(w, 7), _mm256_set1_epi16((short)0xbfff));
}
static inline void load16(const KvE4M3* p, __m256& lo, __m256& hi) {
  const __m256i h = e4m3_half_bits16(p);
  lo = _mm256_cvtph_ps(_mm256_castsi256_si128(h));
  hi = _mm256_cvtph_ps(_mm256_extracti128_si256(h, 1));
}
static inline void load16(const KvE5M2* p, __m256& lo, __m256& hi) {
  const __m128i b = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p)), z = _mm_setzero_si128();
  lo = _mm256_cvtph_ps(_mm_unpacklo_epi8(z, b));
  hi = _mm256_cvtph_ps(_mm_unpackhi_epi8(z, b));
}

// [sum(a0), sum(a1), sum(a2), sum(a3)]
static inline __m128 hsum4(__m256 a0, __m256 a1, __m256 a2, __m256 a3) {
  const __m256 t = _mm256_hadd_ps(_mm256_hadd_ps(a0, a1), _mm256_hadd_ps(a2, a3));
  return _mm_add_ps(_mm256_castps256_ps128(t), _mm256_extractf128_ps(t, 1));
}

// One sum with hsum4's tree (what a key's lanes get in a group of 4): a key's score must not depend
// on whether the call holds 4 or fewer keys past it, or a verify chunk's rows, which see the keys of
// the whole chunk, would differ in the last bits from the decode step at their position (and a
// quantized model's next int8 activation code with them: bench/results/spec_native_quant.txt).
static inline float hsum_as4(__m256 a) { return _mm_cvtss_f32(hsum4(a, a, a, a)); }

static inline void pack_q(const float*, int, int, void*) {}

// R query rows of a GQA group share every K (or V) load from L1: fewer loads per FMA.
template <int R, class KT>
static inline void qk_rows(const float* q, const KT* K, int n, int D, float* s, int lds) {
  int j = 0;
  for (; j + 4 <= n; j += 4) {
    const KT* k = K + (int64_t)j * D;
    __m256 acc[R][4];
    for (int r = 0; r < R; ++r)
      for (int i = 0; i < 4; ++i) acc[r][i] = _mm256_setzero_ps();
    for (int d = 0; d < D; d += 8) {
      const __m256 k0 = load8(k + d), k1 = load8(k + D + d), k2 = load8(k + 2 * D + d), k3 = load8(k + 3 * D + d);
      for (int r = 0; r < R; ++r) {
        const __m256 qv = _mm256_loadu_ps(q + (int64_t)r * D + d);
        acc[r][0] = _mm256_fmadd_ps(qv, k0, acc[r][0]);
        acc[r][1] = _mm256_fmadd_ps(qv, k1, acc[r][1]);
        acc[r][2] = _mm256_fmadd_ps(qv, k2, acc[r][2]);
        acc[r][3] = _mm256_fmadd_ps(qv, k3, acc[r][3]);
      }
    }
    for (int r = 0; r < R; ++r)
      _mm_storeu_ps(s + (int64_t)r * lds + j, hsum4(acc[r][0], acc[r][1], acc[r][2], acc[r][3]));
  }
  for (; j < n; ++j) {
    const KT* k = K + (int64_t)j * D;
    for (int r = 0; r < R; ++r) {
      __m256 a0 = _mm256_setzero_ps();
      for (int d = 0; d < D; d += 8) a0 = _mm256_fmadd_ps(_mm256_loadu_ps(q + (int64_t)r * D + d), load8(k + d), a0);
      s[(int64_t)r * lds + j] = hsum_as4(a0);
    }
  }
}

// Three query rows over quantized codes: each converted key vector feeds the three rows at once.
// 12 accumulators + 3 query vectors + 1 key are the 16 ymm registers (qk_rows<3> keeps 4 keys live
// and spills an accumulator, a store-load chain through memory in the inner loop).
template <class KT>
static inline void qk_rows3(const float* q, const KT* K, int n, int D, float* s, int lds) {
  int j = 0;
  for (; j + 4 <= n; j += 4) {
    const KT* k = K + (int64_t)j * D;
    __m256 a0[4], a1[4], a2[4];
    for (int i = 0; i < 4; ++i) a0[i] = a1[i] = a2[i] = _mm256_setzero_ps();
    int d = 0;
    // e5m2 and e4m3: 16 dims per step (load16: one load and one widening per 16 codes); the others
    // 8 (3 query vectors stay in registers); the same order of products either way
    if constexpr (std::is_same<KT, KvE5M2>::value || std::is_same<KT, KvE4M3>::value)
      for (; d + 16 <= D; d += 16)
        for (int i = 0; i < 4; ++i) {
          __m256 lo, hi;
          load16(k + (int64_t)i * D + d, lo, hi);
          a0[i] = _mm256_fmadd_ps(_mm256_loadu_ps(q + d), lo, a0[i]);
          a1[i] = _mm256_fmadd_ps(_mm256_loadu_ps(q + D + d), lo, a1[i]);
          a2[i] = _mm256_fmadd_ps(_mm256_loadu_ps(q + 2 * D + d), lo, a2[i]);
          a0[i] = _mm256_fmadd_ps(_mm256_loadu_ps(q + d + 8), hi, a0[i]);
          a1[i] = _mm256_fmadd_ps(_mm256_loadu_ps(q + D + d + 8), hi, a1[i]);
          a2[i] = _mm256_fmadd_ps(_mm256_loadu_ps(q + 2 * D + d + 8), hi, a2[i]);
        }
    for (; d < D; d += 8) {
      const __m256 q0 = _mm256_loadu_ps(q + d), q1 = _mm256_loadu_ps(q + D + d), q2 = _mm256_loadu_ps(q + 2 * D + d);
      for (int i = 0; i < 4; ++i) {
        const __m256 kv = load8(k + (int64_t)i * D + d);
        a0[i] = _mm256_fmadd_ps(q0, kv, a0[i]);
        a1[i] = _mm256_fmadd_ps(q1, kv, a1[i]);
        a2[i] = _mm256_fmadd_ps(q2, kv, a2[i]);
      }
    }
    _mm_storeu_ps(s + j, hsum4(a0[0], a0[1], a0[2], a0[3]));
    _mm_storeu_ps(s + lds + j, hsum4(a1[0], a1[1], a1[2], a1[3]));
    _mm_storeu_ps(s + 2 * (int64_t)lds + j, hsum4(a2[0], a2[1], a2[2], a2[3]));
  }
  if (j < n) {  // the last n % 4 keys
    qk_rows<1>(q, K + (int64_t)j * D, n - j, D, s + j, lds);
    qk_rows<2>(q + D, K + (int64_t)j * D, n - j, D, s + lds + j, lds);
  }
}

template <class KT>
static void qk_tile(const float* Q, const void*, int M, const KT* K, int n, int D, float* S,
                    int lds) {
  int r = 0;
  // a code load is 2-9 instructions: three rows share each (the default model's GQA group is 3)
  if constexpr (KvQuant<KT>::value)
    for (; r + 3 <= M; r += 3) qk_rows3(Q + (int64_t)r * D, K, n, D, S + (int64_t)r * lds, lds);
  for (; r + 2 <= M; r += 2) qk_rows<2>(Q + (int64_t)r * D, K, n, D, S + (int64_t)r * lds, lds);
  for (; r < M; ++r) qk_rows<1>(Q + (int64_t)r * D, K, n, D, S + (int64_t)r * lds, lds);
}

// P.V of the dims from d0 on, 8 at a time (what is left past the wide kernels' blocks).
template <int R, class KT>
static inline void pv_tail8(float* A, const float* P, int lds, const KT* V, int n, int D, int d0) {
  for (int d = d0; d < D; d += 8) {
    for (int r = 0; r < R; ++r) {
      __m256 a0 = _mm256_loadu_ps(A + (int64_t)r * D + d);
      for (int j = 0; j < n; ++j)
        a0 = _mm256_fmadd_ps(_mm256_broadcast_ss(P + (int64_t)r * lds + j), load8(V + (int64_t)j * D + d), a0);
      _mm256_storeu_ps(A + (int64_t)r * D + d, a0);
    }
  }
}

// P.V over 16 dims at a time, up to 3 rows sharing each (converted) code load; even and odd
// tokens go to two sets of accumulators (4R of them), so that the FMA latency does not bound the
// loop (one set of 2R chains waits 4 cycles per token).
template <int R, class KT>
static inline void pv_rows16(float* A, const float* P, int lds, const KT* V, int n, int D, int d0 = 0) {
  int d = d0;
  for (; d + 16 <= D; d += 16) {
    __m256 acc[R][2], alt[R][2];
    for (int r = 0; r < R; ++r)
      for (int i = 0; i < 2; ++i) {
        acc[r][i] = _mm256_loadu_ps(A + (int64_t)r * D + d + 8 * i);
        alt[r][i] = _mm256_setzero_ps();
      }
    int j = 0;
    for (; j + 2 <= n; j += 2) {
      const KT* v = V + (int64_t)j * D + d;
      __m256 v0, v1, w0, w1;
      load16(v, v0, v1);
      for (int r = 0; r < R; ++r) {
        const __m256 pj = _mm256_broadcast_ss(P + (int64_t)r * lds + j);
        acc[r][0] = _mm256_fmadd_ps(pj, v0, acc[r][0]);
        acc[r][1] = _mm256_fmadd_ps(pj, v1, acc[r][1]);
      }
      load16(v + D, w0, w1);
      for (int r = 0; r < R; ++r) {
        const __m256 pj = _mm256_broadcast_ss(P + (int64_t)r * lds + j + 1);
        alt[r][0] = _mm256_fmadd_ps(pj, w0, alt[r][0]);
        alt[r][1] = _mm256_fmadd_ps(pj, w1, alt[r][1]);
      }
    }
    if (j < n) {
      const KT* v = V + (int64_t)j * D + d;
      __m256 v0, v1;
      load16(v, v0, v1);
      for (int r = 0; r < R; ++r) {
        const __m256 pj = _mm256_broadcast_ss(P + (int64_t)r * lds + j);
        acc[r][0] = _mm256_fmadd_ps(pj, v0, acc[r][0]);
        acc[r][1] = _mm256_fmadd_ps(pj, v1, acc[r][1]);
      }
    }
    for (int r = 0; r < R; ++r)
      for (int i = 0; i < 2; ++i)
        _mm256_storeu_ps(A + (int64_t)r * D + d + 8 * i, _mm256_add_ps(acc[r][i], alt[r][i]));
  }
  pv_tail8<R>(A, P, lds, V, n, D, d);
}

// P.V over 32 dims at a time for up to 3 rows: 4R accumulators stay in registers over the
// tile's tokens, the R weights are broadcast once per token and 32 dims (not once per 16), and each
// converted 8-code vector feeds the R rows before the next is loaded (12 + 3 + 1 of the 16 ymm
// registers at R = 3). Each accumulator takes one FMA per token, 4R independent chains: enough to
// cover the FMA latency without a second set. Dims past the last multiple of 32: quantized codes go
// to pv_rows16, float and bf16 values 8 at a time.
template <int R, class KT>
static inline void pv_rows32(float* A, const float* P, int lds, const KT* V, int n, int D) {
  int d = 0;
  for (; d + 32 <= D; d += 32) {
    __m256 acc[R][4];
    for (int r = 0; r < R; ++r)
      for (int i = 0; i < 4; ++i) acc[r][i] = _mm256_loadu_ps(A + (int64_t)r * D + d + 8 * i);
    for (int j = 0; j < n; ++j) {
      const KT* v = V + (int64_t)j * D + d;
      __m256 pj[R];
      for (int r = 0; r < R; ++r) pj[r] = _mm256_broadcast_ss(P + (int64_t)r * lds + j);
#pragma GCC unroll 4
      for (int i = 0; i < 4; ++i) {
        const __m256 vv = load8(v + 8 * i);
        for (int r = 0; r < R; ++r) acc[r][i] = _mm256_fmadd_ps(pj[r], vv, acc[r][i]);
      }
    }
    for (int r = 0; r < R; ++r)
      for (int i = 0; i < 4; ++i) _mm256_storeu_ps(A + (int64_t)r * D + d + 8 * i, acc[r][i]);
  }
  if constexpr (KvQuant<KT>::value) {
    if (d < D) pv_rows16<R>(A, P, lds, V, n, D, d);
  } else {
    pv_tail8<R>(A, P, lds, V, n, D, d);
  }
}

template <class KT>
static void pv_tile(float* A, int M, const float* P, int lds, const KT* V, int n, int D) {
  int r = 0;
  // int8 (and the e4m3 tiles holding a NaN code) over 32 dims at a time: 4-5% faster than 16 at the
  // default model's decode; e5m2 and e4m3 stay on pv_rows16, whose 16-code loads (load16) would need
  // a 17th register in pv_rows32 (measured slower with the weights broadcast per use instead)
  if constexpr (KvQuant<KT>::value && !std::is_same<KT, KvE5M2>::value && !std::is_same<KT, KvE4M3>::value) {
    for (; r + 3 <= M; r += 3) pv_rows32<3>(A + (int64_t)r * D, P + (int64_t)r * lds, lds, V, n, D);
    if (M - r == 2) pv_rows32<2>(A + (int64_t)r * D, P + (int64_t)r * lds, lds, V, n, D);
    if (M - r == 1) pv_rows32<1>(A + (int64_t)r * D, P + (int64_t)r * lds, lds, V, n, D);
    return;
  }
  if constexpr (KvQuant<KT>::value) {
    for (; r + 3 <= M; r += 3) pv_rows16<3>(A + (int64_t)r * D, P + (int64_t)r * lds, lds, V, n, D);
    if (M - r == 2) pv_rows16<2>(A + (int64_t)r * D, P + (int64_t)r * lds, lds, V, n, D);
    if (M - r == 1) pv_rows16<1>(A + (int64_t)r * D, P + (int64_t)r * lds, lds, V, n, D);
    return;
  }
  for (; r + 2 <= M; r += 2) pv_rows32<2>(A + (int64_t)r * D, P + (int64_t)r * lds, lds, V, n, D);
  for (; r < M; ++r) pv_rows32<1>(A + (int64_t)r * D, P + (int64_t)r * lds, lds, V, n, D);
}

static inline __m256 exp8(__m256 x) {
  using namespace common;
  const __m256 valid = _mm256_cmp_ps(x, _mm256_set1_ps(kExpLo), _CMP_GE_OQ);
  x = _mm256_min_ps(x, _mm256_set1_ps(kExpHi));
  const __m256 n = _mm256_floor_ps(_mm256_fmadd_ps(x, _mm256_set1_ps(kLog2e), _mm256_set1_ps(0.5f)));
  __m256 r = _mm256_fnmadd_ps(n, _mm256_set1_ps(kLn2Hi), x);
  r = _mm256_fnmadd_ps(n, _mm256_set1_ps(kLn2Lo), r);
  __m256 p = _mm256_set1_ps(kExpP0);
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(kExpP1));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(kExpP2));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(kExpP3));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(kExpP4));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(kExpP5));
  p = _mm256_fmadd_ps(_mm256_mul_ps(p, r), r, _mm256_add_ps(r, _mm256_set1_ps(1.f)));
  const __m256i e = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23);
  return _mm256_and_ps(_mm256_mul_ps(p, _mm256_castsi256_ps(e)), valid);
}

static inline void exp_vec(float* x, int64_t n) {
  int64_t i = 0;
  for (; i + 8 <= n; i += 8) _mm256_storeu_ps(x + i, exp8(_mm256_loadu_ps(x + i)));
  if (i < n) {
    float t[8] = {0, 0, 0, 0, 0, 0, 0, 0};
    std::memcpy(t, x + i, (n - i) * sizeof(float));
    _mm256_storeu_ps(t, exp8(_mm256_loadu_ps(t)));
    std::memcpy(x + i, t, (n - i) * sizeof(float));
  }
}

#define AK_W8G_VNNI 0
#include "w8g_x86.inc"
#undef AK_W8G_VNNI

// bf16-weight GEMM block (gemm_bf16 in kernels_impl.h): each 8-word load of a panel row gives 8
// columns' weights for k = 2kk (word << 16) and k = 2kk + 1 (word & 0xffff0000), FMA'd with the
// rows' broadcast activations. Rows go three at a time: 12 ymm accumulators of the 16.
template <int R>
static inline void bgemm_rows(const float* A, int64_t lda, const uint32_t* B, int64_t K2, float* C,
                              const char* pf, int pf_per4) {
  __m256 acc[R][4];
  for (int r = 0; r < R; ++r)
    for (int c = 0; c < 4; ++c) acc[r][c] = _mm256_setzero_ps();
  const __m256i hm = _mm256_set1_epi32((int)0xffff0000u);
  for (int64_t kk = 0; kk < K2; ++kk) {
    if (pf && (kk & 1) == 0) {
      for (int i = 0; i < pf_per4; ++i) _mm_prefetch(pf + 64 * i, _MM_HINT_T1);
      pf += 64 * pf_per4;
    }
    const uint32_t* b = B + kk * 32;
#pragma GCC unroll 4
    for (int c = 0; c < 4; ++c) {
      const __m256i w = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(b + 8 * c));
      const __m256 lo = _mm256_castsi256_ps(_mm256_slli_epi32(w, 16));
      const __m256 hi = _mm256_castsi256_ps(_mm256_and_si256(w, hm));
#pragma GCC unroll 3
      for (int r = 0; r < R; ++r) {
        acc[r][c] = _mm256_fmadd_ps(_mm256_broadcast_ss(A + (int64_t)r * lda + 2 * kk), lo, acc[r][c]);
        acc[r][c] = _mm256_fmadd_ps(_mm256_broadcast_ss(A + (int64_t)r * lda + 2 * kk + 1), hi, acc[r][c]);
      }
    }
  }
  for (int r = 0; r < R; ++r)
    for (int c = 0; c < 4; ++c) _mm256_store_ps(C + r * 32 + 8 * c, acc[r][c]);
}

// How the AVX2 blocks split MR rows into passes over a panel (12 ymm accumulators at most: 3 rows x
// 32 columns fp32): threes, then twos, then a last single row, except that a single row left after
// threes is taken as two groups of two (4 = 2 + 2, 7 = 3 + 2 + 2). A 1-row pass has 4 accumulator
// chains, too few to cover the FMA latency, so 3 + 1 cost more than 2 + 2 with the same loads.
template <int MR>
struct RowGroups {
  static constexpr int threes = MR % 3 == 1 && MR > 1 ? MR / 3 - 1 : MR / 3;
  static constexpr int twos = (MR - 3 * threes) / 2;
  static constexpr int passes = threes + twos + (MR - 3 * threes - 2 * twos);
};

#define AK_BGEMM_BLOCK 1
template <int MR>
static void bgemm_block(const float* A, int64_t lda, const uint32_t* B, int64_t K2, float* C,
                        const char* pf, int pf_per4) {
  constexpr int G3 = RowGroups<MR>::threes, G2 = RowGroups<MR>::twos, G = RowGroups<MR>::passes;
  int r = 0, g = 0, n = 0;
  for (int i = 0; i < G3; ++i, r += 3, ++g) {
    const char* p = common::prefetch_share(pf, pf_per4, K2 / 2, G, g, n);
    bgemm_rows<3>(A + r * lda, lda, B, K2, C + r * 32, p, n);
  }
  for (int i = 0; i < G2; ++i, r += 2, ++g) {
    const char* p = common::prefetch_share(pf, pf_per4, K2 / 2, G, g, n);
    bgemm_rows<2>(A + r * lda, lda, B, K2, C + r * 32, p, n);
  }
  if (r < MR) {
    const char* p = common::prefetch_share(pf, pf_per4, K2 / 2, G, g, n);
    bgemm_rows<1>(A + r * lda, lda, B, K2, C + r * 32, p, n);
  }
}

// fp32 GEMM block (sgemm_block in kernels_impl.h). The portable block keeps MR x 32 accumulators,
// 4 * MR ymm, which above 3 rows no longer fit the 16 registers: the compiler spills them and every
// FMA becomes a load, an FMA and a store (the default model's lm_head at 16 rows ran 1.4x slower
// than oneDNN). Here rows go in groups of three or two (RowGroups), 12 ymm accumulators at most, the
// panel re-read from L1/L2 for each group; each accumulator is one FMA chain over k in order, as in
// the portable block, so the results are the same bits.
template <int R>
static inline void sgemm_rows(const float* A, int64_t lda, const float* B, int K, float* C, int64_t ldc,
                              const float* bias, int nvalid, const char* pf, int pf_per4, bool stream) {
  __m256 acc[R][4];
  for (int r = 0; r < R; ++r)
    for (int c = 0; c < 4; ++c) acc[r][c] = _mm256_setzero_ps();
  int k = 0;
  for (; k + 4 <= K; k += 4) {
    if (pf) {
      for (int i = 0; i < pf_per4; ++i) _mm_prefetch(pf + 64 * i, _MM_HINT_T1);
      pf += 64 * pf_per4;
    }
#pragma GCC unroll 4
    for (int kk = 0; kk < 4; ++kk) {
      const float* b = B + (int64_t)(k + kk) * 32;
      __m256 a[R];
#pragma GCC unroll 3
      for (int r = 0; r < R; ++r) a[r] = _mm256_broadcast_ss(A + (int64_t)r * lda + k + kk);
#pragma GCC unroll 4
      for (int c = 0; c < 4; ++c) {
        const __m256 w = _mm256_loadu_ps(b + 8 * c);
#pragma GCC unroll 3
        for (int r = 0; r < R; ++r) acc[r][c] = _mm256_fmadd_ps(a[r], w, acc[r][c]);
      }
    }
  }
  for (; k < K; ++k) {
    const float* b = B + (int64_t)k * 32;
    for (int c = 0; c < 4; ++c) {
      const __m256 w = _mm256_loadu_ps(b + 8 * c);
      for (int r = 0; r < R; ++r) acc[r][c] = _mm256_fmadd_ps(_mm256_broadcast_ss(A + (int64_t)r * lda + k), w, acc[r][c]);
    }
  }
  if (nvalid == 32) {
    const bool nt = stream && ((reinterpret_cast<uintptr_t>(C) | (uintptr_t)ldc * 4) & 31) == 0;
    for (int c = 0; c < 4; ++c) {
      const __m256 bb = bias ? _mm256_loadu_ps(bias + 8 * c) : _mm256_setzero_ps();
      for (int r = 0; r < R; ++r) {
        float* o = C + (int64_t)r * ldc + 8 * c;
        if (nt)  // the caller fences after its streaming stores
          _mm256_stream_ps(o, _mm256_add_ps(acc[r][c], bb));
        else
          _mm256_storeu_ps(o, _mm256_add_ps(acc[r][c], bb));
      }
    }
    return;
  }
  for (int r = 0; r < R; ++r) {
    alignas(32) float t[32];
    for (int c = 0; c < 4; ++c) _mm256_store_ps(t + 8 * c, acc[r][c]);
    for (int j = 0; j < nvalid; ++j) C[(int64_t)r * ldc + j] = t[j] + (bias ? bias[j] : 0.f);
  }
}

#define AK_SGEMM_BLOCK 1
template <int MR>
static void sgemm_block(const float* A, int64_t lda, const float* B, int K, float* C, int64_t ldc,
                        const float* bias, int nvalid, const char* pf, int pf_per4, bool stream) {
  constexpr int G3 = RowGroups<MR>::threes, G2 = RowGroups<MR>::twos, G = RowGroups<MR>::passes;
  int r = 0, g = 0, n = 0;
  for (int i = 0; i < G3; ++i, r += 3, ++g) {
    const char* p = common::prefetch_share(pf, pf_per4, K / 4, G, g, n);
    sgemm_rows<3>(A + r * lda, lda, B, K, C + r * ldc, ldc, bias, nvalid, p, n, stream);
  }
  for (int i = 0; i < G2; ++i, r += 2, ++g) {
    const char* p = common::prefetch_share(pf, pf_per4, K / 4, G, g, n);
    sgemm_rows<2>(A + r * lda, lda, B, K, C + r * ldc, ldc, bias, nvalid, p, n, stream);
  }
  if (r < MR) {
    const char* p = common::prefetch_share(pf, pf_per4, K / 4, G, g, n);
    sgemm_rows<1>(A + r * lda, lda, B, K, C + r * ldc, ldc, bias, nvalid, p, n, stream);
  }
}

#define AK_VARIANT_NAME "avx2"
#include "kernels_impl.h"
#undef AK_VARIANT_NAME

}  // namespace avx2
}  // namespace appliance_kernels

#pragma GCC pop_options

namespace appliance_kernels {
const KernelTable* kernels_avx2() { return &avx2::kTable; }
}
#else
namespace appliance_kernels {
const KernelTable* kernels_avx2() { return nullptr; }
}
#endif

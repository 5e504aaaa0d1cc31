// x86-64 AVX512 + AVX512-BF16 variant (Cooper Lake, Sapphire Rapids, Zen 4): VDPBF16PS for Q.K^T
// over a bf16 KV cache and for gemm_bf16 over bf16 activations; everything else as the avx512
// variant (gemm_w8g_a8 included). head_size must be a multiple of 16.
#include "kernel_common.h"

#if defined(__x86_64__)
#include <immintrin.h>

#pragma GCC push_options
#pragma GCC target("avx512f,avx512dq,avx512vl,avx512bw,avx512bf16,avx2,fma,f16c")

namespace appliance_kernels {
namespace avx512bf16 {

#define AK_DPBF16 1
#include "avx512_prims.inc"
#undef AK_DPBF16

#define AK_W8G_VNNI 1
#include "w8g_x86.inc"
#undef AK_W8G_VNNI

// bf16-weight GEMM over bf16 activations (gemm_bf16 in kernels_impl.h): VDPBF16PS multiplies a row's
// broadcast (x[2kk], x[2kk + 1]) word with 16 columns' weight words and adds both products to the
// fp32 lanes; 2 zmm accumulators a row (as sgemm_block). fp32 activations take the portable block.
#define AK_BGEMM_DOT 1
static inline bool bgemm_dot_ok() { return true; }
template <int MR>
static void bgemm_block_dot(const uint32_t* A, int64_t lda, const uint32_t* B, int64_t K2, float* C,
                            const char* pf, int pf_per4) {
  __m512 c0[MR], c1[MR];
  for (int r = 0; r < MR; ++r) {
    c0[r] = _mm512_setzero_ps();
    c1[r] = _mm512_setzero_ps();
  }
  for (int64_t kk = 0; kk < K2; ++kk) {
    if (pf && (kk & 1) == 0) {
      for (int i = 0; i < pf_per4; ++i) _mm_prefetch(pf + 64 * i, _MM_HINT_T1);
      pf += 64 * pf_per4;
    }
    const __m512bh b0 = (__m512bh)_mm512_loadu_si512(B + kk * 32);
    const __m512bh b1 = (__m512bh)_mm512_loadu_si512(B + kk * 32 + 16);
#pragma GCC unroll 8
    for (int r = 0; r < MR; ++r) {
      uint32_t word;
      std::memcpy(&word, A + (int64_t)r * lda + kk, 4);
      const __m512bh a = (__m512bh)_mm512_set1_epi32((int)word);
      c0[r] = _mm512_dpbf16_ps(c0[r], a, b0);
      c1[r] = _mm512_dpbf16_ps(c1[r], a, b1);
    }
  }
  for (int r = 0; r < MR; ++r) {
    _mm512_store_ps(C + r * 32, c0[r]);
    _mm512_store_ps(C + r * 32 + 16, c1[r]);
  }
}

#define AK_VARIANT_NAME "avx512bf16"
#include "kernels_impl.h"
#undef AK_VARIANT_NAME

}  // namespace avx512bf16
}  // namespace appliance_kernels

#pragma GCC pop_options

namespace appliance_kernels {
const KernelTable* kernels_avx512bf16() { return &avx512bf16::kTable; }
}
#else
namespace appliance_kernels {
const KernelTable* kernels_avx512bf16() { return nullptr; }
}
#endif

// x86-64 AVX512 + AVX512-BF16 variant (Cooper Lake, Sapphire Rapids, Zen 4): VDPBF16PS for Q.K^T
// over a bf16 KV cache; everything else as the avx512 variant (gemm_w8g_a8 included). head_size
// must be a multiple of 16.
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

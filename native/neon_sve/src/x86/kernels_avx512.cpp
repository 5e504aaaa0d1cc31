// x86-64 AVX512F (+DQ/BW/VL) variant (Skylake-SP and later). head_size must be a multiple of 16.
// gemm_w8g_a8 runs VPDPBUSD (w8g_x86.inc, its own target) only when the CPU has AVX512-VNNI,
// else AVX2's VPMADDUBSW route. gemm_bf16 widens its bf16 weights in the portable block
// (kernels_impl.h, auto-vectorized for AVX512).
#include "kernel_common.h"

#if defined(__x86_64__)
#include <immintrin.h>

#pragma GCC push_options
#pragma GCC target("avx512f,avx512dq,avx512vl,avx512bw,avx2,fma,f16c")

namespace appliance_kernels {
namespace avx512 {

#define AK_DPBF16 0
#include "avx512_prims.inc"
#undef AK_DPBF16

#define AK_W8G_VNNI 1
#include "w8g_x86.inc"
#undef AK_W8G_VNNI

#define AK_VARIANT_NAME "avx512"
#include "kernels_impl.h"
#undef AK_VARIANT_NAME

}  // namespace avx512
}  // namespace appliance_kernels

#pragma GCC pop_options

namespace appliance_kernels {
const KernelTable* kernels_avx512() { return &avx512::kTable; }
}
#else
namespace appliance_kernels {
const KernelTable* kernels_avx512() { return nullptr; }
}
#endif

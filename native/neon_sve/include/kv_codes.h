// Quantized KV cache codes (kv_dtype kI8 / kFP8E4M3 / kFP8E5M2): one byte per element, a float32
// scale per cached token and KV head. Included inside a variant's namespace, either by the variant
// itself before its primitives (so that its qk_tile / pv_tile loads can take the code types, see
// AK_KV_CODES in kernels_impl.h) or by kernels_impl.h; once per TU (one variant per TU).
//
// The tag types pick paged_attention_kt's instantiation. A variant that defines AK_KV_CODES reads
// the codes straight from the cache in its qk_tile / pv_tile (loads that widen and convert in
// registers, value of the code without its scale), and kernels_impl.h folds the per-token scales
// into the products: one multiply per score column (q.k_j * k_scale_j) and per softmax weight
// (p_j * v_scale_j) instead of one per element. Otherwise kernels_impl.h dequantizes each tile
// into an L1 scratch tile (kv_dequant_tile) and runs the float qk_tile / pv_tile on it.
#pragma once

struct KvI8 { int8_t c; };
struct KvE4M3 { uint8_t c; };
struct KvE5M2 { uint8_t c; };
// The same e4m3 bytes, for a variant whose KvE4M3 load leaves the NaN codes out (AK_KV_E4M3_NAN_SCAN
// below): its load of this type decodes them as NaN. Only ever a tile of a KvE4M3 cache.
struct KvE4M3N { uint8_t c; };
template <class KT> struct KvQuant { static constexpr bool value = false; };
template <> struct KvQuant<KvI8> { static constexpr bool value = true; };
template <> struct KvQuant<KvE4M3> { static constexpr bool value = true; };
template <> struct KvQuant<KvE5M2> { static constexpr bool value = true; };
template <> struct KvQuant<KvE4M3N> { static constexpr bool value = true; };

static inline float kv_bits_f32(uint32_t u) {
  float f;
  std::memcpy(&f, &u, 4);
  return f;
}
static inline uint32_t kv_f32_bits(float f) {
  uint32_t u;
  std::memcpy(&u, &f, 4);
  return u;
}

// Exact code -> float32, the scalar definition every vector load is tested against (all 256 codes,
// tests/ops/test_kv_quant.py and the harness): a 256-entry table per format (1 KiB), built at
// compile time from the format's definition: value = (2^mb + f) * 2^(e - bias - mb), or
// f * 2^(1 - bias - mb) for subnormal codes (e == 0). Special codes decode as torch's float8 types
// do (the reference's dequantize_kv): e4m3fn 0x7f / 0xff NaN (it has no infinities), e5m2 exponent
// 31 +-inf (mantissa 0) or NaN. The writer clamps to kMax, so they never come from the cache
// writer; a cache holding one (written by something else) gives NaN, as the reference does.
struct KvFp8Table {
  float v[256];
};
constexpr float kv_pow2(int e) {
  float r = 1.f;
  for (; e > 0; --e) r *= 2.f;
  for (; e < 0; ++e) r *= 0.5f;
  return r;
}
constexpr KvFp8Table kv_fp8_table(int mb, int bias) {
  KvFp8Table t{};
  for (int b = 0; b < 256; ++b) {
    const int m = b & 0x7f, e = m >> mb, f = m & ((1 << mb) - 1);
    float v = e == 0 ? (float)f * kv_pow2(1 - bias - mb) : (float)((1 << mb) + f) * kv_pow2(e - bias - mb);
    if ((mb == 3 && m == 0x7f) || (mb == 2 && e == 31 && f != 0)) v = std::numeric_limits<float>::quiet_NaN();
    if (mb == 2 && e == 31 && f == 0) v = std::numeric_limits<float>::infinity();
    t.v[b] = (b & 0x80) ? -v : v;
  }
  return t;
}
static constexpr KvFp8Table kKvE4M3 = kv_fp8_table(3, 7);
static constexpr KvFp8Table kKvE5M2 = kv_fp8_table(2, 15);
static inline float kv_decode(KvI8 q) { return (float)q.c; }
static inline float kv_decode(KvE4M3 q) { return kKvE4M3.v[q.c]; }
static inline float kv_decode(KvE5M2 q) { return kKvE5M2.v[q.c]; }

// Vector loads of fp8 codes go through IEEE half precision, which every supported ISA converts to
// float32 in one instruction (F16C vcvtph2ps, Arm fcvtl / SVE fcvt): an e5m2 code is the top byte of
// the half with the same value (same exponent width and bias), so code << 8 is exact for all 256
// codes, inf and NaN included. An e4m3 code's magnitude m (7 bits) shifted to the half's exponent
// and mantissa, (m << 7) with the sign at bit 15, is the code's value times 2^-8 for every finite
// code (the exponent bias 15 instead of 7; e4m3's subnormals land on normal or subnormal halves of
// the same scaled value), so the load multiplies by kKvE4M3HalfUnit (exact: a power of two, no
// overflow: |value| <= 448); m == 0x7f (NaN) is mapped to the half NaN 0x7e00.
constexpr float kKvE4M3HalfUnit = 256.f;

// A variant may leave that power of two out of its e4m3 loads (code value / kKvE4M3HalfUnit, exact
// for every finite code) and say so with `#define AK_KV_E4M3_UNIT kKvE4M3HalfUnit`: kernels_impl.h
// then folds it into the per-token scales it already applies per score column and softmax weight
// (k_scale * 256, exact: a power of two), one multiply per element fewer in the loads.
//
// A variant may also define AK_KV_E4M3_NAN_SCAN: its KvE4M3 load then skips the NaN fix-up (the
// codes 0x7f / 0xff come out finite and wrong), which the cache writer never produces as it clamps
// to +-448; kernels_impl.h scans each tile's codes (kv_e4m3_has_nan, a max over the bytes, vectorized)
// and reads a tile that holds one with the KvE4M3N load, which decodes them as NaN (the same unit).
static inline bool kv_e4m3_has_nan(const uint8_t* p, int64_t n) {
  uint8_t m = 0;
#pragma omp simd reduction(max : m)
  for (int64_t i = 0; i < n; ++i) {
    const uint8_t b = (uint8_t)(p[i] & 0x7f);
    m = m > b ? m : b;
  }
  return m == 0x7f;
}

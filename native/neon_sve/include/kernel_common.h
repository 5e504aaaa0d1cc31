// Helpers shared by every variant. Included by each variant TU *before* its
// `#pragma GCC target`, so everything here (and every standard header) is compiled for the
// baseline ISA: no inline function that the linker may merge across TUs ever carries AVX512,
// BF16 or SVE instructions into code that runs on a CPU without them.
#pragma once

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <limits>
#include <type_traits>
#include <vector>
#ifdef _OPENMP
#include <omp.h>
#endif

#include "appliance_kernels.h"

namespace appliance_kernels {
namespace common {

inline float bf16_to_f32(uint16_t h) {
  uint32_t u = static_cast<uint32_t>(h) << 16;
  float f;
  std::memcpy(&f, &u, 4);
  return f;
}

// Round to nearest even, NaN kept quiet: the same bits as torch's float -> bfloat16.
inline uint16_t f32_to_bf16(float f) {
  uint32_t u;
  std::memcpy(&u, &f, 4);
  if ((u & 0x7fffffffu) > 0x7f800000u) return static_cast<uint16_t>((u >> 16) | 0x40);
  u += 0x7fffu + ((u >> 16) & 1u);
  return static_cast<uint16_t>(u >> 16);
}

inline float round_to(int dtype, float f) {
  return dtype == kBF16 ? bf16_to_f32(f32_to_bf16(f)) : f;
}

inline void load_row(const void* src, int dtype, int64_t offset, float* dst, int64_t n) {
  if (dtype == kF32) {
    std::memcpy(dst, static_cast<const float*>(src) + offset, n * sizeof(float));
  } else {
    const uint16_t* s = static_cast<const uint16_t*>(src) + offset;
    for (int64_t i = 0; i < n; ++i) dst[i] = bf16_to_f32(s[i]);
  }
}

inline void store_row(void* dst, int dtype, int64_t offset, const float* src, int64_t n) {
  if (dtype == kF32) {
    std::memcpy(static_cast<float*>(dst) + offset, src, n * sizeof(float));
  } else {
    uint16_t* d = static_cast<uint16_t*>(dst) + offset;
    for (int64_t i = 0; i < n; ++i) d[i] = f32_to_bf16(src[i]);
  }
}

// Zeroed float scratch. Used instead of std::vector<float> in kernels_impl.h: a vector<float>
// instantiated under a variant's target pragma would be a weak symbol the linker could share
// with baseline code; this class is defined (and compiled) here, for the baseline ISA.
class FloatBuf {
 public:
  explicit FloatBuf(size_t n) : p_(static_cast<float*>(std::calloc(n ? n : 1, sizeof(float)))) {}
  ~FloatBuf() { std::free(p_); }
  FloatBuf(const FloatBuf&) = delete;
  FloatBuf& operator=(const FloatBuf&) = delete;
  float* data() { return p_; }

 private:
  float* p_;
};

// One work item of gemm_w8g_a8 (kernels_impl.h): a tile of 16 weight rows (packed, see W8GArgs)
// against T <= 8 quantized tokens. x holds the tokens' K int8 values each, offset by `bias`
// (0: int8 xq; 128: uint8 xq + 128); corr[t] = zp[t] + bias, so that for every group
// sum_k (x - corr) q = sum_k (xq - zp) q. Result: out[t * ldo + r] for r < rows.
struct W8GBlock {
  const uint8_t* x;
  int64_t K;
  int T;
  const float* corr;
  const float* sx;
  const int8_t* w;      // the tile: [K/4][16][4]
  const float* scale;   // [K/G][16]
  const float* wsum;    // [K/G][16]
  int G;
  float* out;
  int64_t ldo;
  int rows;
  bool has_m128;        // some q == -128 in the weights
  // Optional software prefetch of the next work item's tile (same K and G: the same projection),
  // for the variants that issue it (x86 AVX2 sign kernel): its weights line k4 at 4-input step k4 and
  // its group g's scale and wsum lines at group g, into L2, so that while this tile computes the next
  // one streams from DRAM. Null: none. Results do not depend on it.
  const int8_t* pf_w = nullptr;
  const float* pf_scale = nullptr;
  const float* pf_wsum = nullptr;
};

// Low-bit weights (WLowArgs): the centre c of u = q + c, and a 16-row tile's bytes in the hi plane.
inline int wlow_centre(int bits) { return bits == 6 ? 32 : bits == 5 ? 16 : 8; }
inline int64_t wlow_hi_tile_bytes(int bits, int64_t K) { return bits == 6 ? 4 * K : bits == 5 ? 2 * K : 0; }

// One chunk [k0, k0 + kc) of a 16-row tile of low-bit weights (WLowArgs) against T tokens, added to
// acc[t * 16 + r] before the token's scale: acc += sum_g scale[g][r] * (sum_k xq q - zp wsum[g][r]).
struct WLowBlock {
  const uint8_t* lo;     // the tile's nibble plane, [K/8][16][4]
  const uint8_t* hi;     // the tile's 2-bit plane [K/16][16][4] (6 bits), 1-bit plane [K/32][16][4] (5 bits) or null
  int64_t k0, kc;        // k0 and kc multiples of G (and of 16; of 32 for 5 bits)
  int64_t ng;            // kc / G: the chunk's groups
  int G, bits;
  const int8_t* x;       // token 0's int8 xq from input k0; token t at x + t * ldx
  int64_t ldx;
  int T;
  const int32_t* xsum;   // token t, group g of the chunk: xsum[t * ldg + g] = sum of its xq
  int64_t ldg;
  const float* zp;       // [T] the tokens' zero points
  const float* scale;    // [kc/G][16] the chunk's group scales
  const int16_t* wsum;   // [kc/G][16] the chunk's integer group sums of q; null: all zero
  float* acc;            // [T][16]
};

// Per-thread float scratch that outlives the call: slot `slot` (< kScratchSlots) of the calling thread,
// at least n floats, NOT zeroed, grown on demand and freed when the thread ends. For kernels called
// every decode step whose workspace would otherwise be a fresh, zeroed (and past glibc's mmap
// threshold, page-faulting) allocation each time: paged attention's per-thread workspace and its
// partial softmax states. One caller per slot (no nesting); baseline-compiled like FloatBuf.
enum ScratchSlot : int { kScratchAttnWork = 0, kScratchAttnPartAcc = 1, kScratchAttnPartMl = 2, kScratchSlots = 3 };
inline float* thread_scratch(int slot, size_t n) {
  struct Slots {
    float* p[kScratchSlots] = {};
    size_t n[kScratchSlots] = {};
    ~Slots() {
      for (float* q : p) std::free(q);
    }
  };
  static thread_local Slots s;
  if (n > s.n[slot] || !s.p[slot]) {
    std::free(s.p[slot]);
    s.p[slot] = static_cast<float*>(std::malloc((n ? n : 1) * sizeof(float)));
    s.n[slot] = n;
  }
  return s.p[slot];
}

// Bytes of zeroed scratch (gemm_w8g_a8's quantized activations); baseline-compiled like FloatBuf.
class ByteBuf {
 public:
  explicit ByteBuf(size_t n) : p_(static_cast<uint8_t*>(std::calloc(n ? n : 1, 1))) {}
  ~ByteBuf() { std::free(p_); }
  ByteBuf(const ByteBuf&) = delete;
  ByteBuf& operator=(const ByteBuf&) = delete;
  uint8_t* data() { return p_; }

 private:
  uint8_t* p_;
};

// A software prefetch stream over up to kMaxRuns contiguous runs of run_bytes each (the next
// chunk's K or V tiles of paged attention), issued a block's worth of lines at a time between the
// compute calls, so that fetching the next chunk overlaps the arithmetic on this one.
struct PrefetchStream {
  static constexpr int kMaxRuns = 64;
  const char* run[kMaxRuns];
  int nruns = 0;
  int64_t run_bytes = 0;
  int r = 0;
  int64_t off = 0;
  void reset(int64_t bytes) {
    nruns = 0;
    r = 0;
    off = 0;
    run_bytes = bytes;
  }
  void add(const void* p) {
    if (nruns < kMaxRuns) run[nruns++] = static_cast<const char*>(p);
  }
  __attribute__((always_inline)) inline void issue(int lines) {
    while (lines > 0 && r < nruns) {
      const int64_t left = (run_bytes - off + 63) >> 6;
      const int k = lines < left ? lines : (int)left;
      const char* p = run[r] + off;
      for (int i = 0; i < k; ++i) __builtin_prefetch(p + 64 * i, 0, 3);
      lines -= k;
      off += 64 * (int64_t)k;
      if (off >= run_bytes) {
        off = 0;
        ++r;
      }
    }
  }
};

inline int max_threads() {
#ifdef _OPENMP
  return omp_get_max_threads();
#else
  return 1;
#endif
}

inline int team_size() {
#ifdef _OPENMP
  return omp_get_num_threads();
#else
  return 1;
#endif
}

inline int thread_id() {
#ifdef _OPENMP
  return omp_get_thread_num();
#else
  return 0;
#endif
}

// exp(x) polynomial, Cephes expf: x = n*ln2 + r, |r| <= ln2/2, exp(r) = 1 + r + r^2*P5(r),
// scaled by 2^n through the exponent bits. Max relative error ~1.2e-7 (about 2 ulp) over
// [-87.3, 88.3]; inputs below -87.3 (incl. -inf) give exactly 0, above 88.3 are clamped.
// Every variant's vector exp uses these constants, so all variants share this bound
// (tests/ops/test_exp.py holds each to 3e-7).
constexpr float kExpHi = 88.3f;  // keeps 2^n finite (n <= 127)
constexpr float kExpLo = -87.3f;
constexpr float kLog2e = 1.44269504088896341f;
constexpr float kLn2Hi = 0.693359375f;
constexpr float kLn2Lo = -2.12194440e-4f;
constexpr float kExpP0 = 1.9875691500e-4f;
constexpr float kExpP1 = 1.3981999507e-3f;
constexpr float kExpP2 = 8.3334519073e-3f;
constexpr float kExpP3 = 4.1665795894e-2f;
constexpr float kExpP4 = 1.6666665459e-1f;
constexpr float kExpP5 = 5.0000001201e-1f;

inline float exp_scalar(float x) {
  if (!(x >= kExpLo)) return 0.0f;  // also NaN -> 0 never happens for softmax inputs
  if (x > kExpHi) x = kExpHi;
  float n = std::floor(x * kLog2e + 0.5f);
  float r = x - n * kLn2Hi;
  r = r - n * kLn2Lo;
  float p = kExpP0;
  p = p * r + kExpP1;
  p = p * r + kExpP2;
  p = p * r + kExpP3;
  p = p * r + kExpP4;
  p = p * r + kExpP5;
  p = p * r * r + r + 1.0f;
  int32_t e = (static_cast<int32_t>(n) + 127) << 23;
  float s;
  std::memcpy(&s, &e, 4);
  return p * s;
}

// A variant whose micro-kernel cannot hold a whole row block's accumulators makes several passes over
// each panel, one per group of rows. The next panel's prefetch slice that the block is given (pf_per4
// lines every 4 k steps of one pass, `iters` such steps, from pf) is shared out over those `groups`
// passes, so that the DRAM keeps streaming while each of them runs: given all to the first pass, the
// slice was requested within that pass and the memory idled through the others (the cost of 4 and 8
// rows against 1: bench/results/gemm_cold.txt). Pass i takes q = ceil(pf_per4 / groups)
// lines every 4 k steps from line i * q * iters; its count goes to `lines` (0 with a null result).
inline const char* prefetch_share(const char* pf, int pf_per4, int64_t iters, int groups, int i, int& lines) {
  const int q = (pf_per4 + groups - 1) / groups;
  lines = pf ? std::max(0, std::min(q, pf_per4 - i * q)) : 0;
  return lines > 0 ? pf + (int64_t)i * q * iters * 64 : nullptr;
}

}  // namespace common
}  // namespace appliance_kernels

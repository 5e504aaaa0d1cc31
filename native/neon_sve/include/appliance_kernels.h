// appliance native kernels: the public, torch-free C++ interface.
//
// Every kernel exists as a portable generic version and as ISA variants with the same signature
// (x86: avx2, avx512, avx512bf16; Arm: neon, neon_bf16 (BFMMLA), sve). A variant is a
// KernelTable; the dispatcher (dispatch/dispatch.cpp) picks the best one the CPU supports, once.
// The same sources build into the torch extension (bindings/) and the standalone Arm harness.
//
// Tensor conventions follow appliance/ops/reference.py: KV cache per layer
// [num_blocks, num_kv_heads, block_size, head_size] (contiguous), varlen batches described by
// query_start_loc / seq_lens (context length including this step's tokens) / block_table.
#pragma once

#include <cstdint>

namespace appliance_kernels {

enum DType : int { kF32 = 0, kBF16 = 1 };
// KV cache storage types beyond kF32/kBF16 (--kv-cache-dtype): one byte per element, each token's
// head row with its own float32 scale (AttentionArgs::k_scale); an element's value is code * scale.
enum KvQuantDType : int { kI8 = 2, kFP8E4M3 = 3, kFP8E5M2 = 4 };
// Largest magnitude each quantized type stores: the absmax of a token's head row maps to it.
constexpr float kI8Max = 127.f, kFP8E4M3Max = 448.f, kFP8E5M2Max = 57344.f;

struct AttentionArgs {
  const void* query;        // [num_tokens, num_heads, head_size], rows strided below
  int64_t q_stride_token;   // in elements
  int64_t q_stride_head;
  int q_dtype;              // DType; out has the same dtype
  void* out;                // [num_tokens, num_heads, head_size]
  int64_t o_stride_token;
  int64_t o_stride_head;
  const void* key_cache;    // [num_blocks, num_kv_heads, block_size, head_size], contiguous
  const void* value_cache;
  int kv_dtype;             // DType
  const int32_t* block_table;  // [num_seqs, block_table_stride]
  int64_t block_table_stride;
  const int32_t* seq_lens;         // [num_seqs]
  const int32_t* query_start_loc;  // [num_seqs + 1]
  int num_seqs;
  int num_heads;
  int num_kv_heads;
  int head_size;   // multiple of 16
  int block_size;  // any >= 1
  float scale;
  // 0: off. W > 0: the query at position p attends keys at positions p-W+1 .. p only (W keys,
  // itself included; transformers' sliding-window mask). Blocks wholly before a tile's window
  // are never read, so their block_table entries may be placeholders.
  int sliding_window;
  // 0: off. c > 0: scores (after * scale) become c * tanh(scores / c) before the mask and
  // softmax (Gemma 2's attn_logit_softcapping).
  float logits_soft_cap;
  // kv_dtype kI8 / kFP8E4M3 / kFP8E5M2 only (null otherwise): float32 [num_blocks, num_kv_heads,
  // block_size], the scale of each cached token's head row (the caches' own paged layout minus
  // head_size); a cached element's value is its code's value times the scale.
  const float* k_scale;
  const float* v_scale;
};

// W8A8 GEMM with group-wise weight scales (gemm_w8g_a8). Weights are prepacked once
// (appliance/layers/quant.py, backend w8a8_native) into a layout shared by every variant:
//   w     int8  [ceil(N/16)][K/4][16][4]: tile t, k step s, row r, byte j = q[16t + r, 4s + j]
//         (rows past N are zero);
//   scale fp32  [ceil(N/16)][K/G][16]: the group's weight scale (0 past N);
//   wsum  fp32  [ceil(N/16)][K/G][16]: the group's integer sum of q (exact in fp32).
// Activations are quantized per token inside the kernel, exactly as quant._quant_act does
// (asymmetric int8: xq = clamp(round(x / s) + zp, -128, 127)). Then, per token m and row n,
//   out[m, n] = s[m] * sum_g scale[n, g] * (sum_{k in g} xq[m, k] q[n, k] - zp[m] wsum[n, g])
// where the bracket is exact integer arithmetic (int32, then exact in fp32: |.| < 2^24 for
// G <= 256) and the sum over groups is fp32.
// Every variant steps through a group 4 inputs at a time (NEON SDOT: 16 at a time, SMMLA: 8),
// so G = 16 is the smallest group each of them runs whole.
struct W8GArgs {
  const float* x;       // [M, K] fp32, contiguous
  int64_t M, K, N;      // K % G == 0
  const int8_t* w;
  const float* scale;
  const float* wsum;
  int group;            // G: a multiple of 16 (GGUF Q6_K's sub-blocks), at most 256; K % G == 0
  bool has_m128;        // some q == -128 (the AVX2 sign trick cannot take it: exact fallback)
  float* out;           // [M, N] fp32, contiguous
};

// Low-bit (4-, 5- or 6-bit) weights, group-wise scales and optional per-group offsets, int8 activations
// (gemm_wlow_a8: GGUF Q4_K / Q4_0 / Q4_1, Q5_0 and Q6_K kept at about their size in the file). Weights
// are held as u = q + c (c = 8 for 4 bits, q in [-8, 7]; c = 16 for 5 bits, q in [-16, 15]; c = 32 for
// 6 bits, q in [-32, 31]) in the 16-row tiles of W8GArgs (appliance/layers/methods/lowbit.py packs them):
//   lo     uint8 [ceil(N/16)][K/8][16][4]: tile t, step s, row r, byte j: low nibble = low 4 bits of
//          u[16t + r, 8s + j], high nibble = low 4 bits of u[16t + r, 8s + 4 + j];
//   hi     6 bits: uint8 [ceil(N/16)][K/16][16][4]: bits 2p..2p+1 of byte j = u[.., 16s + 4p + j] >> 4;
//          5 bits (K and G multiples of 32): uint8 [ceil(N/16)][K/32][16][4]: bit p (0..7) of byte j =
//          u[.., 32s + 4p + j] >> 4 (wlow_hi_tile_bytes: a tile's bytes); null for 4 bits;
//   scale  fp32 [ceil(N/16)][K/G][16]; offset fp32 [ceil(N/16)][K/G][16] or null.
// The weight is w[n, k] = scale[n, g] * q[n, k] + offset[n, g] (offset = -zero_point * scale). Per
// token m and row n:
//   out[m, n] = s[m] sum_g scale[n, g] (sum_{k in g} xq q - zp[m] sum_{k in g} q) + sum_g offset[n, g] xsum[m, g]
// i.e. gemm_w8g_a8's exact integer bracket over q, plus the offsets against the float activations'
// group sums xsum (fp32, in order). x86 (AVX2 and up) multiplies the unsigned u straight from the
// nibbles by int8 activations with VPMADDUBSW (sum xq q = sum xq u - c sum xq: exact; see
// w8g_x86.inc for the int16 bound); the other variants unpack each tile a 256-input chunk at a time
// into gemm_w8g_a8's layout in L1 and run their own W8A8 work item (SDOT, SMMLA, portable).
struct WLowArgs {
  const float* x;        // [M, K] fp32, contiguous
  int64_t M, K, N;       // K % 16 == 0, K % G == 0
  const uint8_t* lo;
  const uint8_t* hi;     // null for 4 bits
  const float* scale;
  const float* offset;   // null: no offsets
  int group;             // G: a multiple of 16 (of 32 for 5 bits), at most 256
  int bits;              // 4, 5 or 6
  float* out;            // [M, N] fp32, contiguous
  const int16_t* wsum;   // [ceil(N/16)][K/G][16]: the group's integer sum of q (|sum| <= 32 * 256)
  // K-quant scales (ksuper > 0; scale, offset and wsum are then unused): a GGUF K-quant's own
  // scales, kept at their size in the file instead of fp32 per group. Group g of row n (super-block
  // b = g G / S) has scale[n, g] = ksup[n, b] * ksub[n, g] and offset[n, g] = kshift[n] * scale[n, g]
  // - ksupmin[n, b] * ksubmin[n, g] (null kshift / ksubmin: those terms 0); tables in the tile layout
  // ([ceil(N/16)][groups][16]). The activations' zero point meets the whole row at once: per token,
  // out -= s zp krowsum[n], krowsum[n] = sum_g scale[n, g] sum_{k in g} q (q = u - c), which is
  // the group form's sum_g scale zp wsum regrouped (no int16 sums held).
  const int8_t* ksub;    // [ceil(N/16)][K/G][16]
  const int8_t* ksubmin; // [ceil(N/16)][K/G][16] or null
  const float* ksup;     // [ceil(N/16)][K/S][16]
  const float* ksupmin;  // [ceil(N/16)][K/S][16], with ksubmin
  const float* krowsum;  // [ceil(N/16) * 16]
  const int8_t* kshift;  // [ceil(N/16) * 16] or null
  int ksuper;            // S: 0 for fp32 group scales; else a multiple of G dividing K
};

// Every touched expert of one mixture-of-experts layer in fp32 (moe_f32): for expert e, its rows
// rows[start[e] .. start[e + 1]) of xg (the step's token rows gathered in expert order, [R, H]) go
// through gate_up (wgu[e]: gemm_f32 panels packed for kSgemmSiluMul, 2I columns) into act [R, I] as
// silu(gate) * up, then through down (wdn[e]: gemm_f32 panels, H columns) into y [R, H]. Work items
// are (touched expert, panel) pairs, split over the threads in expert order so each expert's weights
// stream from DRAM once per call; the gate_up pass ends with a barrier before down.
struct MoeF32Args {
  const float* xg;          // [R, H] contiguous
  int64_t H, I, E;          // hidden, expert width (a multiple of kSgemmPanel / 2), experts
  const int64_t* start;     // [E + 1] row offsets, start[E] = R
  const float* const* wgu;  // [E] [ceil(2I/32), H, 32] each (null for an expert with no rows)
  const float* const* wdn;  // [E] [ceil(H/32), I, 32]
  float* act;               // [R, I] scratch
  float* y;                 // [R, H]
};

// Every touched expert of one mixture-of-experts layer with quantized weights (moe_q): one
// projection's experts, all in one layout. kind 0: W8GArgs' (w: int8 tiles, wsum: fp32 group sums,
// m128: per expert, some q == -128); kind 1: WLowArgs' (w: the nibble plane lo, hi: the 2-bit plane
// for 6 bits or null, wsum: int16 group sums, offset: the per-group offsets against the float
// activations' group sums, as gemm_wlow_a8's), or with ksuper > 0 WLowArgs' K-quant scales instead
// of scale / wsum / offset (ksub .. kshift per expert, as gemm_wlow_a8 takes them; ksubmin, ksupmin
// and kshift entries may be null per expert). Pointers are per expert, null for an expert with no rows.
struct MoeQProj {
  int kind;                    // 0: W8G, 1: low-bit
  int group;                   // G: a multiple of 16, at most 256, dividing K
  int bits;                    // kind 1: 4 or 6
  const void* const* w;        // [E]
  const uint8_t* const* hi;    // [E] (kind 1, 6 bits)
  const float* const* scale;   // [E] [ceil(N/16)][K/G][16]
  const void* const* wsum;     // [E] [ceil(N/16)][K/G][16]: fp32 (kind 0) or int16 (kind 1)
  const uint8_t* m128;         // [E] (kind 0)
  const float* const* offset;  // [E] (kind 1) [ceil(N/16)][K/G][16] per-group offsets, or null entries
  int ksuper;                  // kind 1: S (K-quant scales, a multiple of G dividing K) or 0
  const int8_t* const* ksub;   // [E] (ksuper > 0) [ceil(N/16)][K/G][16]
  const int8_t* const* ksubmin;  // [E] [ceil(N/16)][K/G][16] or null entries
  const float* const* ksup;    // [E] [ceil(N/16)][K/S][16]
  const float* const* ksupmin; // [E] [ceil(N/16)][K/S][16], with ksubmin
  const float* const* krowsum; // [E] [ceil(N/16) * 16]
  const int8_t* const* kshift; // [E] [ceil(N/16) * 16] or null entries
};

// moe_q: as moe_f32 over quantized experts. Each token's row of x is quantized once (per token,
// asymmetric int8, as gemm_w8g_a8 does) and its bytes copied to the rows of the experts it chose;
// gate_up (gu: 2I rows) writes gu_out [R, 2I] fp32; silu(gate) * up of a row is quantized once into
// down's activations; down (dn: H rows) writes y [R, H]. Work items of a pass are (touched expert,
// 16-row tile) pairs over all threads, each running the expert's rows through the same work items as
// gemm_w8g_a8 / gemm_wlow_a8 (so a row's result equals the per-expert call's).
struct MoeQArgs {
  const float* x;              // [T, H] the step's tokens, contiguous
  int64_t T, H, I, E;
  const int64_t* start;        // [E + 1] grouped row offsets, start[E] = R
  const int64_t* token;        // [R] the token of grouped row r
  MoeQProj gu, dn;
  float* gu_out;               // [R, 2I] scratch
  float* y;                    // [R, H]
};

struct KernelTable {
  const char* name;
  // Causal paged attention (optionally windowed, soft-capped), semantics of
  // reference.paged_attention.
  void (*paged_attention)(const AttentionArgs& a);
  // x[i] = exp(x[i]) with the variant's vectorized polynomial (exposed to test its error bound).
  void (*exp_inplace)(float* x, int64_t n);
  // out[r] = x[r] * rsqrt(mean(x[r]^2) + eps) * w, rows of length hidden; dtypes per DType.
  void (*rms_norm)(const void* x, int x_dtype, const void* w, int w_dtype, void* out,
                   int64_t rows, int64_t hidden, float eps);
  // residual[r] += x[r] (rounded to residual's dtype); out[r] = rms_norm(residual[r]).
  void (*fused_add_rms_norm)(const void* x, int x_dtype, void* residual, int r_dtype,
                             const void* w, int w_dtype, void* out, int64_t rows,
                             int64_t hidden, float eps);
  // x [num_tokens, num_heads, head_size] (token stride x_stride_token elements, heads adjacent)
  // rotated into out [num_tokens, num_heads, head_size] (contiguous; may be x when x is
  // contiguous); dims past rot_dim copied. cos_sin is float32 [max_position, rot_dim] (cos half
  // then sin half); neox rotates halves, gptj pairs.
  void (*rotary_embedding)(const int64_t* positions, const void* x, int64_t x_stride_token, void* out,
                           int x_dtype, int64_t num_tokens, int num_heads, int head_size,
                           const float* cos_sin, int rot_dim, bool is_neox);
  // out[r, :d] = silu(x[r, :d]) * x[r, d:], x rows of 2d.
  void (*silu_and_mul)(const void* x, void* out, int dtype, int64_t rows, int64_t d);
  // key/value [num_tokens, num_kv_heads, head_size] (token/head strides in elements) into slots.
  void (*reshape_and_cache)(const void* key, const void* value, int in_dtype, int64_t k_stride_token,
                            int64_t k_stride_head, int64_t v_stride_token, int64_t v_stride_head,
                            void* key_cache, void* value_cache, int cache_dtype,
                            const int64_t* slot_mapping, int64_t num_tokens, int num_kv_heads,
                            int head_size, int block_size);
  // W8A8 GEMM with group-wise weight scales (see W8GArgs).
  void (*gemm_w8g_a8)(const W8GArgs& a);
  // fp32 GEMM out[M, N] = x[M, K] W^T (+ bias[N]) over W prepacked once into panels of
  // kSgemmPanel output columns: wp[p][k][j] = W[p * kSgemmPanel + j, k], zero past N.
  // x and out contiguous; bias may be null. act kSgemmSiluMul: each panel holds 16 gate then 16
  // up columns (N a multiple of kSgemmPanel) and out[M, N/2] gets silu(gate) * up, column
  // p * 16 + j from panel p (the MLP's gate/up GEMM and silu_and_mul in one pass).
  void (*gemm_f32)(const float* x, int64_t M, int64_t K, const float* wp, int64_t N,
                   const float* bias, float* out, int act);
  // out[r] = index of the first maximum of row r (x[r * ld .. r * ld + n)); a row holding NaN gives
  // its first NaN, as torch.argmax. Rows in parallel: the greedy sampler's logits.
  void (*argmax_rows)(const float* x, int64_t rows, int64_t n, int64_t ld, int64_t* out);
  // bf16-weight GEMM out[M, N] = x[M, K] W^T (+ bias[N]): the gemm_f32 work split over W prepacked
  // once in bf16 (half the bytes streamed per decode step), panels of kSgemmPanel output columns with
  // the k steps in pairs: as 32-bit words wp[p][kk][j] = W[32p + j, 2kk] (low half) | W[32p + j,
  // 2kk + 1] (high half), kk < ceil(K/2), zero past K and N. The layout is the same for every variant:
  // a word widens to its two fp32 weights with a shift and a mask (generic, avx2, avx512, neon, sve:
  // fp32 FMA), and it is the operand pair of the bf16 dot products, used when x is bf16 (avx512bf16:
  // VDPBF16PS, 16 columns per zmm; neon_bf16: BFDOT by element, 4 columns per register).
  // x: x_dtype (DType), contiguous [M, K]; bias: fp32 [N] or null; out: out_dtype, contiguous [M, N].
  // Accumulation in fp32 (products of bf16 x and bf16 W are exact in fp32), the bias added in fp32,
  // then one rounding to out_dtype.
  void (*gemm_bf16)(const void* x, int x_dtype, int64_t M, int64_t K, const uint16_t* wp, int64_t N,
                    const float* bias, void* out, int out_dtype);
  // reshape_and_cache into a quantized cache (cache_dtype kI8 / kFP8E4M3 / kFP8E5M2, one byte per
  // element): per token and KV head, scale = absmax(row) / kMax (1 for an all-zero row) goes to
  // k_scale / v_scale [num_blocks, num_kv_heads, block_size], the codes of clamp(x / scale, -kMax,
  // kMax) (int8: round half to even; fp8: round to nearest even, torch's float8 conversion) to the
  // cache. Bit for bit appliance/ops/reference.py's quantize_kv.
  void (*reshape_and_cache_quant)(const void* key, const void* value, int in_dtype, int64_t k_stride_token,
                                  int64_t k_stride_head, int64_t v_stride_token, int64_t v_stride_head,
                                  void* key_cache, void* value_cache, int cache_dtype, float* k_scale,
                                  float* v_scale, const int64_t* slot_mapping, int64_t num_tokens,
                                  int num_kv_heads, int head_size, int block_size);
  // Low-bit weights (4 or 6 bits) with int8 activations (see WLowArgs).
  void (*gemm_wlow_a8)(const WLowArgs& a);
  // One mixture-of-experts layer's experts in fp32 (see MoeF32Args).
  void (*moe_f32)(const MoeF32Args& a);
  // One mixture-of-experts layer's quantized experts (see MoeQArgs).
  void (*moe_q)(const MoeQArgs& a);
};

// Output columns per prepacked panel of gemm_f32 (the layout is the same for every variant).
constexpr int kSgemmPanel = 32;
constexpr int kSgemmNoAct = 0, kSgemmSiluMul = 1;

// The variant chosen for this process: the best the CPU supports, or APPLIANCE_KERNELS
// (a variant name) when set and supported. Chosen once; the choice is logged to stderr when
// APPLIANCE_KERNELS_LOG=1 (the Python side logs it through `logging`).
const KernelTable* selected_kernels();
// Override the process-wide choice (tests force each variant). Returns false if `name` is
// unknown or not supported by this CPU.
bool select_kernels(const char* name);
// Variants this CPU can run, best first; returns how many were written (at most max).
int available_kernels(const KernelTable** out, int max);
// A variant by name, or nullptr if unknown or not supported on this CPU.
const KernelTable* find_kernels(const char* name);
// Whether the CPU has an optional feature a variant uses inside one kernel: "avx512_vnni"
// (x86), "dotprod", "i8mm", "bf16" (Arm). Unknown names: false.
bool cpu_has(const char* feature);
// Short text describing the detected CPU features (for logs and `appliance doctor`).
const char* cpu_features_string();

}  // namespace appliance_kernels

// The ISA-independent body of every kernel, instantiated once per variant.
//
// A variant TU includes kernel_common.h (baseline ISA), switches the target with
// `#pragma GCC target`, opens its own namespace, defines the primitives below, then includes this
// file, which builds that variant's KernelTable from them. Plain loops in here are
// auto-vectorized for the variant's ISA; the hot products are the primitives:
//
//   void pack_q(const float* Q, int M, int D, void* buf);
//       once per work item: repack the (already scaled) query rows for qk_tile (buf holds
//       (M + 2) * D floats); variants that need no repacking do nothing.
//   template <class KT> void qk_tile(const float* Q, const void* qpack, int M, const KT* K,
//                                    int n, int D, float* S, int lds);
//       S[r * lds + j] = dot(Q[r], K[j]) for r < M, j < n (KT = float or uint16_t for bf16; with
//       AK_KV_CODES also KvI8 / KvE4M3 / KvE5M2, read as the codes' values: kv_codes.h).
//   template <class KT> void pv_tile(float* A, int M, const float* P, int lds, const KT* V,
//                                    int n, int D);
//       A[r] += sum_j P[r * lds + j] * V[j] for r < M.
//   void exp_vec(float* x, int64_t n);    x[i] = exp(x[i]) (polynomial, kernel_common.h bound)
//   int w8g_act_bias();                     how gemm_w8g_a8 stores quantized activations: 0 as
//       int8 xq, 128 as uint8 xq + 128 (VNNI's u8 x s8 product); see W8GBlock.
//   bool w8g_block_fast(const W8GBlock& b); one W8A8 work item with the variant's integer dot
//       products; false leaves it to the portable loop below (w8g_block_scalar).
//   #define AK_VARIANT_NAME "..."
//
// Work split of paged attention: items are (sequence, kv head, query tile, context partition).
// All query heads of a GQA group are rows of the same item, so every K/V block is streamed from
// memory once per group and then reused from L1 by the group's rows. The context of a short query
// tile (decode, a speculative verify) is cut on a fixed grid of partitions, [j * P, (j + 1) * P)
// with P = kPartitionTokens rounded to whole chunks, whose partial softmax states (max, sum,
// unnormalized accumulator) are merged afterwards; within an item the context is walked in chunks
// on the absolute grid of W tokens (~32 KiB of K, several blocks), one online-softmax step per
// chunk. Neither grid depends on the call (its batch, its spans, the thread count), so a query row
// gets the same bits whatever else the call holds: a verify chunk's rows equal the decode steps at
// their positions (the keys past a row are masked to exact zeros), and greedy tokens do not move
// with speculation, batching or the host's core count. A long query tile (prefill) is one item over
// its whole context, but keeps the same per-partition states: at each grid boundary a row's state is
// folded into a running one (fold_state) exactly as the merge folds the partials of a short tile, in
// the same order, so a prompt's row equals the decode step at its position too, and a prefix-cache
// hit (whose last prompt token is recomputed alone) or another prefill chunking does not change a
// later token. Both loops use static scheduling.
// Sliding window (AttentionArgs::sliding_window = W): an item's context starts at the block holding
// its first query's first visible key (position - W + 1), so blocks before every window of the
// item are never read (nor their block_table entries); within the item each row masks the keys
// before its own window. A row may see nothing in a chunk (its max stays -inf, sum 0): the online
// softmax and the partition merge skip such chunks/partials.

namespace impl {

using namespace ::appliance_kernels::common;

// Context partition of a short query tile (rounded up to whole chunks): a single decode spreads over
// the cores from ~512 tokens of context (its KV heads apart below that). Against 128, fewer partition
// states to fold and merge at long contexts and large batches (bench/results/attention_grid.txt).
constexpr int kPartitionTokens = 256;
constexpr int kMaxTileRows = 64;
// Blocks per softmax chunk: about 32 KiB of K per chunk (the chunk's K and V stay in L2; the
// prefetch runs one chunk ahead, and 32 KiB measured best for decode against 8, 16 and 64 KiB:
// 14.5 vs 15.4 ms per step at 64 x ~190 tokens of the default model, steps alternating in one run),
// at least one block. Context partitions are whole chunks long.
static inline int chunk_blocks_for(int BS, int D, size_t elem) {
  const int64_t tokens = 32768 / ((int64_t)D * (int64_t)elem);
  return (int)std::max<int64_t>(1, tokens / BS);
}

#include "kv_codes.h"

// A variant that reads quantized codes in place (AK_KV_CODES) gets scores and P.V products of the
// codes' values; run_item applies the per-token scales to whole rows of a softmax chunk (see there).
#ifdef AK_KV_CODES
constexpr bool kKvCodesInPlace = true;
#else
constexpr bool kKvCodesInPlace = false;
#endif

#ifndef AK_KV_DEQUANT_TILE
// out[j * D + d] = value(q[j * D + d]) * s[j] for j < n: one cached tile (n tokens of a KV head).
template <class KT>
static void kv_dequant_tile(const KT* q, const float* s, int n, int D, float* out) {
  for (int j = 0; j < n; ++j) {
    const float sj = s[j];
    const KT* qj = q + (int64_t)j * D;
    float* oj = out + (int64_t)j * D;
#pragma omp simd
    for (int d = 0; d < D; ++d) oj[d] = kv_decode(qj[d]) * sj;
  }
}
#endif

// float32 -> code, x already clamped to [-kMax, kMax]; round to nearest even with torch's float8
// conversion's bits (c10's fp8e4m3fn/fp8e5m2_from_fp32_value): below the smallest normal (2^-6,
// 2^-14) a code is a whole multiple of the subnormal step, else the mantissa is rounded in integer
// arithmetic (a carry moves into the exponent, as it should).
static inline uint8_t kv_encode_e4m3(float x) {
  uint32_t u = kv_f32_bits(x);
  const uint8_t sign = (uint8_t)((u >> 24) & 0x80u);
  u &= 0x7fffffffu;
  if (u < (121u << 23)) return (uint8_t)(sign | (uint8_t)std::nearbyint(kv_bits_f32(u) * 512.f));
  u += (uint32_t)(7 - 127) * (1u << 23) + 0x7ffffu + ((u >> 20) & 1u);
  return (uint8_t)(sign | (uint8_t)(u >> 20));
}
static inline uint8_t kv_encode_e5m2(float x) {
  uint32_t u = kv_f32_bits(x);
  const uint8_t sign = (uint8_t)((u >> 24) & 0x80u);
  u &= 0x7fffffffu;
  if (u < (113u << 23)) return (uint8_t)(sign | (uint8_t)std::nearbyint(kv_bits_f32(u) * 65536.f));
  u += (uint32_t)(15 - 127) * (1u << 23) + 0xfffffu + ((u >> 21) & 1u);
  return (uint8_t)(sign | (uint8_t)(u >> 21));
}

// One token's head row x[D] into codes q[D] and its scale (see reshape_and_cache_quant).
static void kv_quant_row(const float* x, int D, int cache_dtype, uint8_t* q, float* scale) {
  const float qmax = cache_dtype == kI8 ? kI8Max : (cache_dtype == kFP8E4M3 ? kFP8E4M3Max : kFP8E5M2Max);
  float amax = 0.f;
  for (int d = 0; d < D; ++d) amax = std::max(amax, std::fabs(x[d]));
  float s = amax / qmax;
  if (!(s > 0.f)) s = 1.f;  // an all-zero row (or one whose scale underflows): codes 0, any scale
  for (int d = 0; d < D; ++d) {
    float y = x[d] / s;  // a division, as the reference: bit-identical codes
    y = y < -qmax ? -qmax : (y > qmax ? qmax : y);
    if (cache_dtype == kI8)
      q[d] = (uint8_t)(int8_t)std::nearbyint(y);
    else
      q[d] = cache_dtype == kFP8E4M3 ? kv_encode_e4m3(y) : kv_encode_e5m2(y);
  }
  *scale = s;
}

#ifdef AK_KV_CODES
#ifdef AK_KV_E4M3_UNIT
constexpr float kKvE4M3LoadUnit = AK_KV_E4M3_UNIT;
#else
constexpr float kKvE4M3LoadUnit = 1.f;
#endif
// dst[j] = src[j] times the unit the variant's loads of KT leave out (kv_codes.h): the per-token
// scales of one tile, gathered into a chunk's row of scales.
template <class KT>
static inline void gather_scales(const float* src, int n, float* dst) {
  if constexpr (std::is_same<KT, KvE4M3>::value && kKvE4M3LoadUnit != 1.f) {
    for (int j = 0; j < n; ++j) dst[j] = src[j] * kKvE4M3LoadUnit;
  } else {
    for (int j = 0; j < n; ++j) dst[j] = src[j];
  }
}

// qk_tile / pv_tile over one tile of codes; an e4m3 tile holding a NaN code goes through the load
// that decodes it (AK_KV_E4M3_NAN_SCAN, kv_codes.h).
template <class KT>
static inline void qk_codes(const float* Q, const void* qpack, int M, const KT* K, int n, int D, float* S,
                            int lds) {
#ifdef AK_KV_E4M3_NAN_SCAN
  if constexpr (std::is_same<KT, KvE4M3>::value) {
    if (kv_e4m3_has_nan(reinterpret_cast<const uint8_t*>(K), (int64_t)n * D)) {
      qk_tile<KvE4M3N>(Q, qpack, M, reinterpret_cast<const KvE4M3N*>(K), n, D, S, lds);
      return;
    }
  }
#endif
  qk_tile<KT>(Q, qpack, M, K, n, D, S, lds);
}
template <class KT>
static inline void pv_codes(float* A, int M, const float* P, int lds, const KT* V, int n, int D) {
#ifdef AK_KV_E4M3_NAN_SCAN
  if constexpr (std::is_same<KT, KvE4M3>::value) {
    if (kv_e4m3_has_nan(reinterpret_cast<const uint8_t*>(V), (int64_t)n * D)) {
      pv_tile<KvE4M3N>(A, M, P, lds, reinterpret_cast<const KvE4M3N*>(V), n, D);
      return;
    }
  }
#endif
  pv_tile<KT>(A, M, P, lds, V, n, D);
}
#endif

// Folds a row's softmax state over one context partition (max m_p, sum l_p, unnormalized
// accumulator acc_p; l_p == 0: the row saw no key there) into its running state over the partitions
// before it. The one arithmetic for combining partitions, used by the merge of a short tile's
// partials and by a long tile's item at each partition boundary; noinline so that both run the same
// instructions (a row gets the same bits either way).
__attribute__((noinline)) static void fold_state(float* m_run, float* l_run, float* acc_run, float m_p,
                                                 float l_p, const float* acc_p, int D) {
  if (l_p == 0.f) return;
  if (*l_run == 0.f) {
    *m_run = m_p;
    *l_run = l_p;
    std::memcpy(acc_run, acc_p, sizeof(float) * (size_t)D);
    return;
  }
  // one exponential: the side holding the larger max keeps its scale (1)
  if (m_p <= *m_run) {
    const float b = exp_scalar(m_p - *m_run);
    *l_run += l_p * b;
    for (int d = 0; d < D; ++d) acc_run[d] += acc_p[d] * b;
  } else {
    const float a = exp_scalar(*m_run - m_p);
    *m_run = m_p;
    *l_run = *l_run * a + l_p;
    for (int d = 0; d < D; ++d) acc_run[d] = acc_run[d] * a + acc_p[d];
  }
}

struct Item {
  int seq;
  int h0, h1;       // KV heads [h0, h1): one, or all of them (see paged_attention_kt)
  int q0, q1;       // query tokens of the sequence, relative to its first new token
  int c0, c1;       // context positions [c0, c1), c0 a multiple of block_size
  int64_t partial;  // first row (of D floats) of its partial state, or -1: writes out directly
  int merge = -1;   // a partition's merge, and its index among the merge's partitions
  int pidx = 0;
};

struct Merge {
  int seq, h0, h1, q0, q1;
  int64_t first_partial;  // partial row index of the first partition
  int num_partials;       // partitions, each holding M = (h1 - h0) * (q1 - q0) * group rows
  // Partitions 0 .. prefix - 1 already folded, in order, by the thread that ran them one after the
  // other (its contiguous share of the items); their running state sits in partition 0's slot.
  int prefix = 0;
};

// A thread's fold over the consecutive partitions of one merge that it runs from partition 0 on: the
// same folds, in the same order, as the merge would make of their partials, done as they come (no
// partials written, fewer folded afterwards).
struct Chain {
  int merge = -1;
  int count = 0;  // partitions folded
};

// Rows of an item: KV head hh (relative to h0) major, then query token, then head of the group:
// r = (hh * nq + qi) * G + g, so each KV head's rows are contiguous (Mh = nq * G of them).
template <class KT>
static void run_item(const AttentionArgs& a, const Item& it, const Item* next, int cap, int part, float* ws,
                     float* part_acc, float* part_ml, std::vector<Merge>& merges, Chain& chain) {
  const int G = a.num_heads / a.num_kv_heads;
  const int D = a.head_size, BS = a.block_size;
  const int q_begin = a.query_start_loc[it.seq];
  const int q_len = a.query_start_loc[it.seq + 1] - q_begin;
  const int first_pos = a.seq_lens[it.seq] - q_len;
  const int nq = it.q1 - it.q0;
  const int nh = it.h1 - it.h0;
  const int Mh = nq * G;
  const int M = nh * Mh;
  const int W = chunk_blocks_for(BS, D, sizeof(KT)) * BS;
  // Workspace: Q [cap*D] | qpack [(cap + 2*nh)*D] | acc [cap*D] | S [cap*W] | m | l | lim | low [cap]
  // | deq [BS*D] (a dequantized tile) | ksc, vsc [num_kv_heads*W] each (the chunk's K and V scales per
  // KV head, contiguous; used by quantized KV only) | acc_run [cap*D] | m_run, l_run [cap] with cap >= M
  // rows (sized in paged_attention_kt as ws_floats).
  float* Q = ws;
  float* qpack = Q + (int64_t)cap * D;
  float* acc = qpack + (int64_t)(cap + 2 * a.num_kv_heads) * D;
  float* S = acc + (int64_t)cap * D;
  float* m = S + (int64_t)cap * W;
  float* l = m + cap;
  int* lim = reinterpret_cast<int*>(l + cap);
  int* low = lim + cap;
  float* deq = reinterpret_cast<float*>(low + cap);
  (void)deq;  // unused where the variant reads codes directly (AK_KV_CODES)
  float* ksc = deq + (int64_t)BS * D;
  float* vsc = ksc + (int64_t)a.num_kv_heads * W;
  // the running state over the partitions before the current one (an item over several: fold_state)
  float* acc_run = vsc + (int64_t)a.num_kv_heads * W;
  float* m_run = acc_run + (int64_t)cap * D;
  float* l_run = m_run + cap;
  bool folded = false;  // whether any partition has been folded into the running state
  // codes read in place: each row's scores of a chunk are taken times its K scales (q.(c_j * s_j) =
  // s_j * (q.c_j)), and once the chunk's softmax sums are taken, its weights times the V scales
  // (p_j * (c_j * s_j) = (p_j * s_j) * c_j): two multiplies per row and column of the chunk, over
  // contiguous rows, rather than per element or per 16-column block
  constexpr bool fold_scales = KvQuant<KT>::value && kKvCodesInPlace;
  const int win = a.sliding_window;
  const float cap_c = a.logits_soft_cap, inv_cap_c = cap_c > 0.f ? 1.f / cap_c : 0.f;
  auto qpack_of = [&](int hh) { return qpack + (int64_t)hh * (Mh + 2) * D; };

  for (int hh = 0; hh < nh; ++hh) {
    for (int qi = 0; qi < nq; ++qi) {
      const int64_t tok = q_begin + it.q0 + qi;
      for (int g = 0; g < G; ++g) {
        const int r = (hh * nq + qi) * G + g;
        const int head = (it.h0 + hh) * G + g;
        float* qr = Q + (int64_t)r * D;
        load_row(a.query, a.q_dtype, tok * a.q_stride_token + head * a.q_stride_head, qr, D);
        for (int d = 0; d < D; ++d) qr[d] *= a.scale;
        lim[r] = first_pos + it.q0 + qi + 1;  // causal: positions < lim attend
        low[r] = win > 0 ? lim[r] - win : 0;   // window: positions >= low attend
        m[r] = -std::numeric_limits<float>::infinity();
        l[r] = 0.f;
      }
    }
    pack_q(Q + (int64_t)hh * Mh * D, Mh, D, qpack_of(hh));
  }
  std::memset(acc, 0, sizeof(float) * (size_t)M * D);

  const KT* kc = static_cast<const KT*>(a.key_cache);
  const KT* vc = static_cast<const KT*>(a.value_cache);
  const int32_t* bt = a.block_table + (int64_t)it.seq * a.block_table_stride;
  // The context is walked in chunks of W tokens: Q.K^T of each block of a chunk fills the
  // columns of S, one online-softmax step covers the whole chunk (its per-row cost is amortized
  // over W columns rather than paid per block), then P.V block by block. An item over all KV
  // heads reads each block's K (and V) as one contiguous run of num_kv_heads tiles.
  const int64_t tile = (int64_t)BS * D;
  auto tile_of = [&](int pos, int h) { return ((int64_t)bt[pos / BS] * a.num_kv_heads + h) * tile; };
  // Software prefetch one chunk ahead: while Q.K^T runs over this chunk's K, the next chunk's K
  // (this item's, or the first chunk of the thread's next item) is fetched a block's worth per
  // block; the same for V during P.V. Blocks are scattered, so the hardware prefetcher (which stops
  // at page boundaries) cannot see them coming; spreading the fetches over the chunk, instead of
  // one burst per block, keeps the core computing while they are in flight.
  // A quantized cache's per-token scales are a third stream (a block's scales of the item's KV heads
  // are one contiguous run of (h1 - h0) * BS floats, K's and V's gathered with the K tiles): fetched
  // the same way, a block's worth with each block's K.
  PrefetchStream pfk, pfv, pfs;
  auto chunk_end = [&](int c, int c1) { return std::min(c1, (c / W + 1) * W); };  // the W grid
  auto plan = [&](int cn) {  // cn: where this item's next chunk starts
    const Item* src = &it;
    if (cn >= it.c1) {
      src = next;
      cn = next ? next->c0 : 0;
    }
    const int64_t run = src ? (int64_t)(src->h1 - src->h0) * tile * (int64_t)sizeof(KT) : 0;
    pfk.reset(run);
    pfv.reset(run);
    if constexpr (KvQuant<KT>::value) pfs.reset(src ? (int64_t)(src->h1 - src->h0) * BS * 4 : 0);
    if (!src) return;
    const int32_t* sbt = a.block_table + (int64_t)src->seq * a.block_table_stride;
    for (int pos = cn; pos < chunk_end(cn, src->c1); pos += BS) {
      const int64_t off = ((int64_t)sbt[pos / BS] * a.num_kv_heads + src->h0) * tile;
      pfk.add(kc + off);
      pfv.add(vc + off);
      if constexpr (KvQuant<KT>::value) {
        pfs.add(a.k_scale + off / D);
        pfs.add(a.v_scale + off / D);
      }
    }
  };
  const int scale_lines = (int)((2 * (int64_t)nh * BS * 4 + 63) / 64);
  const int block_lines = (int)(((int64_t)nh * tile * (int64_t)sizeof(KT) + 63) / 64);
  // folds every row's state over the partition just walked into the running state (an empty one
  // first when `fresh`)
  auto fold_into_run = [&](bool fresh) {
    for (int r = 0; r < M; ++r) {
      if (fresh) m_run[r] = -std::numeric_limits<float>::infinity(), l_run[r] = 0.f;
      fold_state(m_run + r, l_run + r, acc_run + (int64_t)r * D, m[r], l[r], acc + (int64_t)r * D, D);
    }
  };
  // ... and starts the next partition anew (a prefill item at a grid boundary)
  auto fold_rows = [&]() {
    fold_into_run(!folded);
    folded = true;
    for (int r = 0; r < M; ++r) m[r] = -std::numeric_limits<float>::infinity(), l[r] = 0.f;
    std::memset(acc, 0, sizeof(float) * (size_t)M * D);
  };
  for (int c = it.c0, cn; c < it.c1; c = cn) {
    cn = chunk_end(c, it.c1);
    const int cw = cn - c;
    if (c > it.c0 && c % part == 0) fold_rows();  // a partition boundary of the grid
    plan(cn);
    for (int b = 0; b * BS < cw; ++b) {
      const int cb = c + b * BS;
      pfk.issue(block_lines);
      if constexpr (KvQuant<KT>::value) pfs.issue(scale_lines);
      const int n = std::min(BS, cw - b * BS);
      for (int hh = 0; hh < nh; ++hh) {
        const int64_t off = tile_of(cb, it.h0 + hh);
        float* sb = S + (int64_t)hh * Mh * W + b * BS;
        if constexpr (KvQuant<KT>::value) {
#ifdef AK_KV_CODES
          // scores of the codes; the block's K and V scales gathered for the chunk's rows (times the
          // unit the variant's loads leave out: kv_codes.h, AK_KV_E4M3_UNIT)
          qk_codes<KT>(Q + (int64_t)hh * Mh * D, qpack_of(hh), Mh, kc + off, n, D, sb, W);
          gather_scales<KT>(a.k_scale + off / D, n, ksc + (int64_t)hh * W + b * BS);
          gather_scales<KT>(a.v_scale + off / D, n, vsc + (int64_t)hh * W + b * BS);
#else
          kv_dequant_tile<KT>(kc + off, a.k_scale + off / D, n, D, deq);
          qk_tile<float>(Q + (int64_t)hh * Mh * D, qpack_of(hh), Mh, deq, n, D, sb, W);
#endif
        } else {
          qk_tile<KT>(Q + (int64_t)hh * Mh * D, qpack_of(hh), Mh, kc + off, n, D, sb, W);
        }
      }
    }
    for (int r = 0; r < M; ++r) {
      float* s = S + (int64_t)r * W;
      // this row's visible columns of the chunk: [j0, nr)
      const int nr = std::min(cw, lim[r] - c);
      const int j0 = std::max(0, low[r] - c);
      if (nr <= j0) {
        for (int j = 0; j < cw; ++j) s[j] = 0.f;
        continue;
      }
      for (int j = 0; j < j0; ++j) s[j] = 0.f;
      float* sv = s + j0;
      const int nv = nr - j0;
      // `omp simd` reductions let the compiler vectorize (reorder) these for the variant's ISA.
      // Scores of codes: the K scales applied in the max's pass (no soft cap) or before the cap's.
      float bm = -std::numeric_limits<float>::infinity();
      if (fold_scales && !(cap_c > 0.f)) {
        const float* ks = ksc + (int64_t)(r / Mh) * W + j0;
#pragma omp simd reduction(max : bm)
        for (int j = 0; j < nv; ++j) {
          sv[j] *= ks[j];
          bm = bm > sv[j] ? bm : sv[j];
        }
      } else {
        if constexpr (fold_scales) {
          const float* ks = ksc + (int64_t)(r / Mh) * W + j0;
#pragma omp simd
          for (int j = 0; j < nv; ++j) sv[j] *= ks[j];
        }
        if (cap_c > 0.f)
          for (int j = 0; j < nv; ++j) sv[j] = cap_c * std::tanh(sv[j] * inv_cap_c);
#pragma omp simd reduction(max : bm)
        for (int j = 0; j < nv; ++j) bm = bm > sv[j] ? bm : sv[j];
      }
      const float m_new = std::max(m[r], bm);
      for (int j = 0; j < nv; ++j) sv[j] -= m_new;
      exp_vec(sv, nv);
      float sum = 0.f;
      if constexpr (fold_scales) {
        // the row's sum of weights, and the weights times the V scales, in one pass
        const float* vs = vsc + (int64_t)(r / Mh) * W + j0;
#pragma omp simd reduction(+ : sum)
        for (int j = 0; j < nv; ++j) {
          sum += sv[j];
          sv[j] *= vs[j];
        }
      } else {
#pragma omp simd reduction(+ : sum)
        for (int j = 0; j < nv; ++j) sum += sv[j];
      }
      for (int j = nr; j < cw; ++j) s[j] = 0.f;
      if (m_new > m[r]) {
        const float alpha = exp_scalar(m[r] - m_new);  // 0 on the first chunk of the row
        float* ar = acc + (int64_t)r * D;
        if (l[r] != 0.f)
          for (int d = 0; d < D; ++d) ar[d] *= alpha;
        l[r] *= alpha;
        m[r] = m_new;
      }
      l[r] += sum;
    }
    for (int b = 0; b * BS < cw; ++b) {
      pfv.issue(block_lines);
      const int n = std::min(BS, cw - b * BS);
      for (int hh = 0; hh < nh; ++hh) {
        const int64_t off = tile_of(c + b * BS, it.h0 + hh);
        const float* pb = S + (int64_t)hh * Mh * W + b * BS;
        if constexpr (KvQuant<KT>::value) {
#ifdef AK_KV_CODES
          // the weights carry V's scales already (the softmax loop above)
          pv_codes<KT>(acc + (int64_t)hh * Mh * D, Mh, pb, W, vc + off, n, D);
#else
          kv_dequant_tile<KT>(vc + off, a.v_scale + off / D, n, D, deq);
          pv_tile<float>(acc + (int64_t)hh * Mh * D, Mh, pb, W, deq, n, D);
#endif
        } else {
          pv_tile<KT>(acc + (int64_t)hh * Mh * D, Mh, pb, W, vc + off, n, D);
        }
      }
    }
  }

  if (it.partial < 0) {
    if (folded) fold_rows();  // the last partition too; the running state is the row's
    const float* lf = folded ? l_run : l;
    for (int r = 0; r < M; ++r) {
      const int hh = r / Mh, qi = (r % Mh) / G, g = r % G;
      const int64_t tok = q_begin + it.q0 + qi;
      float* ar = (folded ? acc_run : acc) + (int64_t)r * D;
      const float inv = lf[r] > 0.f ? 1.f / lf[r] : 0.f;
      for (int d = 0; d < D; ++d) ar[d] *= inv;
      store_row(a.out, a.q_dtype, tok * a.o_stride_token + ((it.h0 + hh) * G + g) * a.o_stride_head,
                ar, D);
    }
  } else if (it.pidx == 0 || (chain.merge == it.merge && chain.count == it.pidx)) {
    // partition 0 starts this thread's chain over the merge; the next partition continues it
    if (it.pidx == 0) chain.merge = it.merge, chain.count = 0;
    fold_into_run(it.pidx == 0);
    ++chain.count;
    if (!next || next->merge != it.merge || next->pidx != chain.count) {  // the chain ends: store it
      const int64_t slot = merges[it.merge].first_partial;
      std::memcpy(part_acc + slot * D, acc_run, sizeof(float) * (size_t)M * D);
      std::memcpy(part_ml + slot * 2, m_run, sizeof(float) * M);
      std::memcpy(part_ml + slot * 2 + M, l_run, sizeof(float) * M);
      merges[it.merge].prefix = chain.count;
      chain.merge = -1;
    }
  } else {
    std::memcpy(part_acc + it.partial * D, acc, sizeof(float) * (size_t)M * D);
    std::memcpy(part_ml + it.partial * 2, m, sizeof(float) * M);
    std::memcpy(part_ml + it.partial * 2 + M, l, sizeof(float) * M);
  }
}

// Row r of a merge (rows are merged in parallel: a single decode's merge has only its heads' rows).
static void merge_partials(const AttentionArgs& a, const Merge& mg, int r, const float* part_acc,
                           const float* part_ml, float* tmp) {
  const int G = a.num_heads / a.num_kv_heads;
  const int D = a.head_size;
  const int q_begin = a.query_start_loc[mg.seq];
  const int Mh = (mg.q1 - mg.q0) * G;
  const int M = (mg.h1 - mg.h0) * Mh;
  {
    {
      const int hh = r / Mh, qi = (r % Mh) / G, g = r % G;
      // partitions 0 .. prefix - 1 as the chain folded them (prefix >= 1: partition 0 always starts
      // one), then the rest in context order, as a long tile's item folds them
      const float* ml0 = part_ml + mg.first_partial * 2;
      float m_run = ml0[r], denom = ml0[M + r];
      std::memcpy(tmp, part_acc + (mg.first_partial + r) * D, sizeof(float) * (size_t)D);
      for (int p = mg.prefix; p < mg.num_partials; ++p) {
        const int64_t base = mg.first_partial + (int64_t)p * M;
        const float* ml = part_ml + base * 2;
        fold_state(&m_run, &denom, tmp, ml[r], ml[M + r], part_acc + (base + r) * D, D);
      }
      if (denom == 0.f)
        for (int d = 0; d < D; ++d) tmp[d] = 0.f;
      const float inv = denom > 0.f ? 1.f / denom : 0.f;
      for (int d = 0; d < D; ++d) tmp[d] *= inv;
      const int64_t tok = q_begin + mg.q0 + qi;
      store_row(a.out, a.q_dtype, tok * a.o_stride_token + ((mg.h0 + hh) * G + g) * a.o_stride_head,
                tmp, D);
    }
  }
}

template <class KT>
static void paged_attention_kt(const AttentionArgs& a) {
  const int G = a.num_heads / a.num_kv_heads;
  const int D = a.head_size, BS = a.block_size;
  const int qt = std::max(1, kMaxTileRows / G);  // query tokens per tile
  const int W = chunk_blocks_for(BS, D, sizeof(KT)) * BS;  // tokens per softmax chunk
  // A sequence whose new queries are one short tile (decode) can take all KV heads in one item
  // (groupable): each block's K and V are then read as one contiguous run of num_kv_heads tiles
  // instead of num_kv_heads scattered tiles. Used when there are still enough items to go
  // around; else items are per KV head as for prefill.
  auto groupable = [&](int q_len) { return q_len <= qt && (int64_t)q_len * a.num_heads <= kMaxTileRows; };
  // The partition grid (see the header): P tokens, whole chunks.
  const int part = std::max(1, (kPartitionTokens + W - 1) / W) * W;
  // First context position a query tile reads: 0, or with a window the start of the block that
  // holds its first query's first visible key (first query at position ctx - q_len + q0).
  auto ctx_start = [&](int ctx, int q_len, int q0) {
    if (a.sliding_window <= 0) return 0;
    const int lo = ctx - q_len + q0 - a.sliding_window + 1;
    return lo <= 0 ? 0 : lo / BS * BS;
  };
  // partitions of the grid that [start, end) touches
  auto parts_of = [&](int start, int end) { return (end - 1) / part - start / part + 1; };
  // Items per KV head grouping: one item per sequence over all KV heads (grouped) reads each
  // block as one contiguous run, but is used only while there are still two items per thread.
  auto count_items = [&](bool grouped) {
    int64_t n = 0;
    for (int s = 0; s < a.num_seqs; ++s) {
      const int q_len = a.query_start_loc[s + 1] - a.query_start_loc[s];
      if (q_len <= 0) continue;
      const int units = grouped && groupable(q_len) ? 1 : a.num_kv_heads;
      if (q_len <= qt)
        n += (int64_t)units * parts_of(ctx_start(a.seq_lens[s], q_len, 0), a.seq_lens[s]);
      else
        n += (int64_t)units * ((q_len + qt - 1) / qt);
    }
    return n;
  };
  const int64_t want = 2 * (int64_t)max_threads();
  const bool grouped = a.num_kv_heads > 1 && count_items(true) >= want;
  std::vector<Item> items;
  std::vector<Merge> merges;
  std::vector<std::pair<int, int>> merge_rows;  // (merge, row) of every row a merge writes
  int64_t num_partials = 0;  // partial rows
  for (int s = 0; s < a.num_seqs; ++s) {
    const int q_len = a.query_start_loc[s + 1] - a.query_start_loc[s];
    const int ctx = a.seq_lens[s];
    if (q_len <= 0) continue;
    const int hstep = grouped && groupable(q_len) ? a.num_kv_heads : 1;
    for (int h = 0; h < a.num_kv_heads; h += hstep) {
      const int h1 = h + hstep;
      for (int q0 = 0; q0 < q_len; q0 += qt) {
        const int q1 = std::min(q_len, q0 + qt);
        const int end = ctx - q_len + q1;  // the tile's last query sees positions < end
        const int start = ctx_start(ctx, q_len, q0);  // its first query sees positions >= start
        if (q_len <= qt && parts_of(start, end) > 1) {
          Merge mg{s, h, h1, q0, q1, num_partials, 0};
          for (int c0 = start, c1; c0 < end; c0 = c1) {
            c1 = std::min(end, (c0 / part + 1) * part);
            items.push_back(Item{s, h, h1, q0, q1, c0, c1, num_partials, (int)merges.size(), mg.num_partials});
            num_partials += (int64_t)hstep * (q1 - q0) * G;
            mg.num_partials++;
          }
          for (int r = 0; r < (h1 - h) * (q1 - q0) * G; ++r) merge_rows.emplace_back((int)merges.size(), r);
          merges.push_back(mg);
        } else {
          items.push_back(Item{s, h, h1, q0, q1, start, end, -1});
        }
      }
    }
  }
  // per-thread scratch kept across calls (a decode step's allocations would page-fault each time);
  // every partial row is written by its item before the merge reads it
  float* part_acc = thread_scratch(kScratchAttnPartAcc, (size_t)num_partials * D);
  float* part_ml = thread_scratch(kScratchAttnPartMl, (size_t)num_partials * 2);
  // Rows per item: qt tokens x G heads (G alone may exceed kMaxTileRows, e.g. MQA with 128
  // heads), or a grouped item's q_len x num_heads <= kMaxTileRows.
  const int cap = std::max(kMaxTileRows, qt * G);
  const int64_t ws_floats =
      (int64_t)cap * D * 3 + 2 * (int64_t)a.num_kv_heads * D + (int64_t)cap * W + 4 * cap + 64 +
      (int64_t)BS * D + 2 * (int64_t)a.num_kv_heads * W + (int64_t)cap * D + 2 * cap;
  const int64_t num_items = (int64_t)items.size();
  const int64_t num_merge_rows = (int64_t)merge_rows.size();
#pragma omp parallel if (num_items > 1)
  {
    float* ws = thread_scratch(kScratchAttnWork, (size_t)ws_floats);
    // The static schedule's contiguous range, spelled out so that each item knows the thread's next.
    const int nt = team_size(), t = thread_id();
    const int64_t lo = num_items * t / nt, hi = num_items * (t + 1) / nt;
    Chain chain;
    for (int64_t i = lo; i < hi; ++i)
      run_item<KT>(a, items[i], i + 1 < hi ? &items[i + 1] : nullptr, cap, part, ws, part_acc, part_ml, merges,
                   chain);
#pragma omp barrier
    // every merge's rows, round robin: a single decode's one merge spreads over the threads too
#pragma omp for schedule(static, 1)
    for (int64_t i = 0; i < num_merge_rows; ++i)
      merge_partials(a, merges[merge_rows[i].first], merge_rows[i].second, part_acc, part_ml, ws);
  }
}

static void paged_attention(const AttentionArgs& a) {
  if (a.kv_dtype == kBF16)
    paged_attention_kt<uint16_t>(a);
  else if (a.kv_dtype == kI8)
    paged_attention_kt<KvI8>(a);
  else if (a.kv_dtype == kFP8E4M3)
    paged_attention_kt<KvE4M3>(a);
  else if (a.kv_dtype == kFP8E5M2)
    paged_attention_kt<KvE5M2>(a);
  else
    paged_attention_kt<float>(a);
}

static void argmax_rows(const float* x, int64_t rows, int64_t n, int64_t ld, int64_t* out) {
#pragma omp parallel for schedule(static) if (rows > 1 && rows * n > (1 << 15))
  for (int64_t r = 0; r < rows; ++r) {
    const float* p = x + r * ld;
    // Two passes over a row (the second from L1/L2): the vectorized max, then its first position.
    float m = -std::numeric_limits<float>::infinity();
    int nan = 0;
#pragma omp simd reduction(max : m) reduction(| : nan)
    for (int64_t i = 0; i < n; ++i) {
      m = p[i] > m ? p[i] : m;
      nan |= p[i] != p[i];
    }
    int64_t idx = 0;
    for (int64_t i = 0; i < n; ++i)
      if (nan ? p[i] != p[i] : p[i] == m) {
        idx = i;
        break;
      }
    out[r] = idx;
  }
}

static void exp_inplace(float* x, int64_t n) {
#pragma omp parallel for schedule(static) if (n > (1 << 16))
  for (int64_t i = 0; i < n; i += 4096) exp_vec(x + i, std::min<int64_t>(4096, n - i));
}

static inline float sum_squares(const float* x, int64_t n) {
  float s = 0.f;
#pragma omp simd reduction(+ : s)
  for (int64_t i = 0; i < n; ++i) s += x[i] * x[i];
  return s;
}

static void rms_norm(const void* x, int x_dtype, const void* w, int w_dtype, void* out,
                     int64_t rows, int64_t hidden, float eps) {
  if (x_dtype == kF32 && w_dtype == kF32) {
    const float* xf = static_cast<const float*>(x);
    const float* wt = static_cast<const float*>(w);
    float* of = static_cast<float*>(out);
#pragma omp parallel for schedule(static) if (rows * hidden > (1 << 15))
    for (int64_t r = 0; r < rows; ++r) {
      const float* xi = xf + r * hidden;
      float ss = 0.f;
#pragma omp simd reduction(+ : ss)
      for (int64_t i = 0; i < hidden; ++i) ss += xi[i] * xi[i];
      const float inv = 1.f / std::sqrt(ss / (float)hidden + eps);
      float* o = of + r * hidden;
#pragma omp simd
      for (int64_t i = 0; i < hidden; ++i) o[i] = (xi[i] * inv) * wt[i];
    }
    return;
  }
  FloatBuf wf((size_t)hidden);
  load_row(w, w_dtype, 0, wf.data(), hidden);
#pragma omp parallel if (rows * hidden > (1 << 15))
  {
    FloatBuf buf((size_t)hidden);
#pragma omp for schedule(static)
    for (int64_t r = 0; r < rows; ++r) {
      float* b = buf.data();
      load_row(x, x_dtype, r * hidden, b, hidden);
      const float inv = 1.f / std::sqrt(sum_squares(b, hidden) / (float)hidden + eps);
      // Same rounding order as the reference: (x * rsqrt) first, then * weight.
      for (int64_t i = 0; i < hidden; ++i) b[i] = (b[i] * inv) * wf.data()[i];
      store_row(out, x_dtype, r * hidden, b, hidden);
    }
  }
}

static void fused_add_rms_norm(const void* x, int x_dtype, void* residual, int r_dtype,
                               const void* w, int w_dtype, void* out, int64_t rows, int64_t hidden,
                               float eps) {
  if (x_dtype == kF32 && r_dtype == kF32 && w_dtype == kF32) {
    // float32 (the common case): two passes over each row in place, no staging copies.
    const float* xf = static_cast<const float*>(x);
    float* rf = static_cast<float*>(residual);
    const float* wt = static_cast<const float*>(w);
    float* of = static_cast<float*>(out);
#pragma omp parallel for schedule(static) if (rows * hidden > (1 << 15))
    for (int64_t r = 0; r < rows; ++r) {
      float* res = rf + r * hidden;
      const float* xi = xf + r * hidden;
      float ss = 0.f;
#pragma omp simd reduction(+ : ss)
      for (int64_t i = 0; i < hidden; ++i) {
        const float v = res[i] + xi[i];
        res[i] = v;
        ss += v * v;
      }
      const float inv = 1.f / std::sqrt(ss / (float)hidden + eps);
      float* o = of + r * hidden;
#pragma omp simd
      for (int64_t i = 0; i < hidden; ++i) o[i] = (res[i] * inv) * wt[i];
    }
    return;
  }
  FloatBuf wf((size_t)hidden);
  load_row(w, w_dtype, 0, wf.data(), hidden);
#pragma omp parallel if (rows * hidden > (1 << 15))
  {
    FloatBuf buf((size_t)hidden * 2);
#pragma omp for schedule(static)
    for (int64_t r = 0; r < rows; ++r) {
      float* b = buf.data();
      float* xb = b + hidden;
      load_row(residual, r_dtype, r * hidden, b, hidden);
      load_row(x, x_dtype, r * hidden, xb, hidden);
      for (int64_t i = 0; i < hidden; ++i) b[i] += xb[i];
      store_row(residual, r_dtype, r * hidden, b, hidden);
      if (r_dtype == kBF16)  // the norm sees the residual as stored
        for (int64_t i = 0; i < hidden; ++i) b[i] = round_to(kBF16, b[i]);
      const float inv = 1.f / std::sqrt(sum_squares(b, hidden) / (float)hidden + eps);
      for (int64_t i = 0; i < hidden; ++i) b[i] = (b[i] * inv) * wf.data()[i];
      store_row(out, r_dtype, r * hidden, b, hidden);
    }
  }
}

static void rotary_embedding(const int64_t* positions, const void* x, int64_t x_stride_token, void* out,
                             int x_dtype, int64_t num_tokens, int num_heads, int head_size,
                             const float* cos_sin, int rot_dim, bool is_neox) {
  const int half = rot_dim / 2;
#pragma omp parallel if (num_tokens * num_heads * head_size > (1 << 15))
  {
    FloatBuf buf((size_t)head_size * 2);
#pragma omp for schedule(static)
    for (int64_t t = 0; t < num_tokens; ++t) {
      const float* cs = cos_sin + positions[t] * rot_dim;
      const float* cosv = cs;
      const float* sinv = cs + half;
      if (x_dtype == kF32 && is_neox) {  // float32 neox (the common case): straight from x to out
        const float* xt = static_cast<const float*>(x) + t * x_stride_token;
        float* ot = static_cast<float*>(out) + t * num_heads * (int64_t)head_size;
        for (int h = 0; h < num_heads; ++h) {
          const float* v = xt + (int64_t)h * head_size;
          float* o = ot + (int64_t)h * head_size;
#pragma omp simd
          for (int i = 0; i < half; ++i) {
            const float x1 = v[i], x2 = v[i + half];
            o[i] = x1 * cosv[i] - x2 * sinv[i];
            o[i + half] = x2 * cosv[i] + x1 * sinv[i];
          }
          for (int i = rot_dim; i < head_size; ++i) o[i] = v[i];
        }
        continue;
      }
      for (int h = 0; h < num_heads; ++h) {
        float* v = buf.data();
        float* o = v + head_size;
        load_row(x, x_dtype, t * x_stride_token + (int64_t)h * head_size, v, head_size);
        if (is_neox) {
          for (int i = 0; i < half; ++i) {
            const float x1 = v[i], x2 = v[i + half];
            o[i] = x1 * cosv[i] - x2 * sinv[i];
            o[i + half] = x2 * cosv[i] + x1 * sinv[i];
          }
        } else {
          for (int i = 0; i < half; ++i) {
            const float x1 = v[2 * i], x2 = v[2 * i + 1];
            o[2 * i] = x1 * cosv[i] - x2 * sinv[i];
            o[2 * i + 1] = x2 * cosv[i] + x1 * sinv[i];
          }
        }
        for (int i = rot_dim; i < head_size; ++i) o[i] = v[i];
        store_row(out, x_dtype, (t * num_heads + h) * (int64_t)head_size, o, head_size);
      }
    }
  }
}

static void silu_and_mul(const void* x, void* out, int dtype, int64_t rows, int64_t d) {
#pragma omp parallel if (rows * d > (1 << 15))
  {
    FloatBuf buf((size_t)d * 3);
#pragma omp for schedule(static)
    for (int64_t r = 0; r < rows; ++r) {
      float* a = buf.data();
      float* b = a + d;
      float* e = b + d;
      load_row(x, dtype, r * 2 * d, a, d);
      load_row(x, dtype, r * 2 * d + d, b, d);
      for (int64_t i = 0; i < d; ++i) e[i] = -a[i];
      exp_vec(e, d);
      // silu(a) = a / (1 + exp(-a)); rounded to the dtype before the product, as torch does.
      for (int64_t i = 0; i < d; ++i) e[i] = round_to(dtype, a[i] / (1.f + e[i])) * b[i];
      store_row(out, dtype, r * d, e, d);
    }
  }
}

static void reshape_and_cache(const void* key, const void* value, int in_dtype,
                              int64_t k_stride_token, int64_t k_stride_head,
                              int64_t v_stride_token, int64_t v_stride_head, void* key_cache,
                              void* value_cache, int cache_dtype, const int64_t* slot_mapping,
                              int64_t num_tokens, int num_kv_heads, int head_size,
                              int block_size) {
#pragma omp parallel if (num_tokens * num_kv_heads * head_size > (1 << 16))
  {
    FloatBuf buf((size_t)head_size);
#pragma omp for schedule(static)
    for (int64_t t = 0; t < num_tokens; ++t) {
      const int64_t slot = slot_mapping[t];
      if (slot < 0) continue;
      const int64_t blk = slot / block_size, off = slot % block_size;
      for (int h = 0; h < num_kv_heads; ++h) {
        const int64_t dst = ((blk * num_kv_heads + h) * block_size + off) * head_size;
        load_row(key, in_dtype, t * k_stride_token + h * k_stride_head, buf.data(), head_size);
        store_row(key_cache, cache_dtype, dst, buf.data(), head_size);
        load_row(value, in_dtype, t * v_stride_token + h * v_stride_head, buf.data(), head_size);
        store_row(value_cache, cache_dtype, dst, buf.data(), head_size);
      }
    }
  }
}

static void reshape_and_cache_quant(const void* key, const void* value, int in_dtype,
                                    int64_t k_stride_token, int64_t k_stride_head, int64_t v_stride_token,
                                    int64_t v_stride_head, void* key_cache, void* value_cache, int cache_dtype,
                                    float* k_scale, float* v_scale, const int64_t* slot_mapping,
                                    int64_t num_tokens, int num_kv_heads, int head_size, int block_size) {
  uint8_t* kc = static_cast<uint8_t*>(key_cache);
  uint8_t* vc = static_cast<uint8_t*>(value_cache);
#pragma omp parallel if (num_tokens * num_kv_heads * head_size > (1 << 16))
  {
    FloatBuf buf((size_t)head_size);
#pragma omp for schedule(static)
    for (int64_t t = 0; t < num_tokens; ++t) {
      const int64_t slot = slot_mapping[t];
      if (slot < 0) continue;
      const int64_t blk = slot / block_size, off = slot % block_size;
      for (int h = 0; h < num_kv_heads; ++h) {
        const int64_t row = (blk * num_kv_heads + h) * block_size + off;  // the scale's index
        load_row(key, in_dtype, t * k_stride_token + h * k_stride_head, buf.data(), head_size);
        kv_quant_row(buf.data(), head_size, cache_dtype, kc + row * head_size, k_scale + row);
        load_row(value, in_dtype, t * v_stride_token + h * v_stride_head, buf.data(), head_size);
        kv_quant_row(buf.data(), head_size, cache_dtype, vc + row * head_size, v_scale + row);
      }
    }
  }
}

// ------------------------------------------------------------------ W8A8, group-wise weight scales

// The portable W8A8 work item: every variant's fallback and the generic variant's kernel.
static void w8g_block_scalar(const W8GBlock& b, int bias) {
  const int64_t groups = b.K / b.G;
  for (int t = 0; t < b.T; ++t) {
    const uint8_t* x = b.x + (int64_t)t * b.K;
    float acc[16] = {0};
    for (int64_t g = 0; g < groups; ++g) {
      int32_t s[16] = {0};
      for (int64_t k4 = g * b.G / 4; k4 < (g + 1) * b.G / 4; ++k4) {
        const int8_t* w = b.w + k4 * 64;
        for (int j = 0; j < 4; ++j) {
          const int32_t xv = bias ? (int32_t)x[4 * k4 + j] : (int32_t)(int8_t)x[4 * k4 + j];
          for (int r = 0; r < 16; ++r) s[r] += xv * (int32_t)w[r * 4 + j];
        }
      }
      const float* sc = b.scale + g * 16;
      const float* ws = b.wsum + g * 16;
      for (int r = 0; r < 16; ++r) acc[r] += sc[r] * ((float)s[r] - b.corr[t] * ws[r]);  // exact bracket
    }
    for (int r = 0; r < b.rows; ++r) b.out[(int64_t)t * b.ldo + r] = b.sx[t] * acc[r];
  }
}

// Per-token asymmetric int8, bit for bit quant._quant_act (torch rounds half to even, as
// nearbyint does in the default rounding mode; the divisions are IEEE fp32 in both).
static void w8g_quant_row(const float* x, int64_t K, int bias, uint8_t* q, float* corr, float* sx) {
  float mn = 0.f, mx = 0.f;
#ifdef AK_W8G_MINMAX
  w8g_minmax(x, K, &mn, &mx);  // the same two values, in vectors
#else
  for (int64_t k = 0; k < K; ++k) {
    mn = std::min(mn, x[k]);
    mx = std::max(mx, x[k]);
  }
#endif
  const float s = std::max((mx - mn) / 255.f, 1e-12f);
  const float zp = std::min(127.f, std::max(-128.f, std::nearbyint(-128.f - mn / s)));
  const int32_t zpi = (int32_t)zp;
  // |x / s| <= 255: the conversion cannot overflow. The clamp is on integers: with a float clamp
  // feeding the byte store, GCC 12's SVE code gave wrong bytes at 256/512-bit vectors (qemu V1).
  for (int64_t k = 0; k < K; ++k) {
    const int32_t v = (int32_t)std::nearbyint(x[k] / s) + zpi;
    q[k] = (uint8_t)((v < -128 ? -128 : (v > 127 ? 127 : v)) + bias);
  }
  *corr = zp + (float)bias;
  *sx = s;
}

constexpr int kW8GTokens = 8;

static void gemm_w8g_a8(const W8GArgs& a) {
  const int bias = w8g_act_bias();
  const int64_t M = a.M, K = a.K, N = a.N;
  ByteBuf xq((size_t)(M * K));
  FloatBuf corr((size_t)M), sx((size_t)M);
#pragma omp parallel for schedule(static) if (M * K > (1 << 15))
  for (int64_t m = 0; m < M; ++m)
    w8g_quant_row(a.x + m * K, K, bias, xq.data() + m * K, corr.data() + m, sx.data() + m);
  const int64_t tiles = (N + 15) / 16, blocks = (M + kW8GTokens - 1) / kW8GTokens;
  const int64_t groups = K / a.group;
  // Items: (tile, token block), tiles outer: a thread's static share is a run of whole tiles,
  // whose weights stay in cache across its token blocks.
#pragma omp parallel for schedule(static) if (tiles * blocks > 1 && M * N * K > (1 << 16))
  for (int64_t i = 0; i < tiles * blocks; ++i) {
    const int64_t tile = i / blocks, m0 = (i % blocks) * kW8GTokens;
    W8GBlock b;
    b.x = xq.data() + m0 * K;
    b.K = K;
    b.T = (int)std::min<int64_t>(kW8GTokens, M - m0);
    b.corr = corr.data() + m0;
    b.sx = sx.data() + m0;
    b.w = a.w + tile * 16 * K;
    b.scale = a.scale + tile * groups * 16;
    b.wsum = a.wsum + tile * groups * 16;
    b.G = a.group;
    b.out = a.out + m0 * N + tile * 16;
    b.ldo = N;
    b.rows = (int)std::min<int64_t>(16, N - tile * 16);
    b.has_m128 = a.has_m128;
    if (!w8g_block_fast(b)) w8g_block_scalar(b, bias);
  }
}

// ------------------------------------------------------------------ low-bit weights (WLowArgs)

// Inputs per unpacked chunk: a 16-row tile's chunk is 4 KiB of int8 q (gemm_w8g_a8's layout), which
// stays in L1 while the variant's W8A8 work item reads it.
constexpr int64_t kWLowChunk = 256;
// Bytes of int8 activations per token block of the x86 work items (half a Zen 3 / Skylake L2).
constexpr int64_t kWLowBlockBytes = 1 << 18;

#ifndef AK_WLOW_FAST
// Unpack inputs [k0, k0 + kc) of one tile into q (gemm_w8g_a8's [kc/4][16][4] int8 layout).
static void wlow_unpack(const uint8_t* lo, const uint8_t* hi, int bits, int64_t k0, int64_t kc, int8_t* q) {
  const int c = wlow_centre(bits);
  const uint8_t* l = lo + (k0 / 8) * 64;
  for (int64_t s = 0; s < kc / 8; ++s) {
    const uint8_t* v = l + s * 64;
    int8_t* a = q + (2 * s) * 64;
    int8_t* b = a + 64;
    for (int i = 0; i < 64; ++i) {
      a[i] = (int8_t)((v[i] & 15) - c);
      b[i] = (int8_t)((v[i] >> 4) - c);
    }
  }
  if (bits == 6) {
    const uint8_t* h = hi + (k0 / 16) * 64;
    for (int64_t s = 0; s < kc / 16; ++s) {
      const uint8_t* v = h + s * 64;
      for (int p = 0; p < 4; ++p) {
        int8_t* a = q + (4 * s + p) * 64;
        for (int i = 0; i < 64; ++i) a[i] = (int8_t)(a[i] + (((v[i] >> (2 * p)) & 3) << 4));
      }
    }
  } else if (bits == 5) {  // bit p of the 32-input step's byte: u >> 4 of its 4-input step p (k0, kc multiples of 32)
    const uint8_t* h = hi + (k0 / 32) * 64;
    for (int64_t s = 0; s < kc / 32; ++s) {
      const uint8_t* v = h + s * 64;
      for (int p = 0; p < 8; ++p) {
        int8_t* a = q + (8 * s + p) * 64;
        for (int i = 0; i < 64; ++i) a[i] = (int8_t)(a[i] + (((v[i] >> p) & 1) << 4));
      }
    }
  }
}
#endif

// Per-row pieces of the low-bit epilogue, shared by gemm_wlow_a8 and moe_q (whose rows must equal
// the per-expert gemm calls bit for bit): the float group sums the offsets meet, the int8 group sums
// of the quantized row (x86 items), and the offsets' term y[r] += sum_g off[g][r] * xs[g].
static inline void wlow_float_group_sums(const float* x, int64_t K, int64_t G, float* xs) {
  for (int64_t g = 0; g < K / G; ++g) {
    float sum = 0.f;
    const float* xg = x + g * G;
#pragma omp simd reduction(+ : sum)
    for (int64_t k = 0; k < G; ++k) sum += xg[k];
    xs[g] = sum;
  }
}
static inline void wlow_int_group_sums(const int8_t* xr, int64_t K, int64_t G, int32_t* xsum) {
  for (int64_t g = 0; g < K / G; ++g) {
    int32_t sum = 0;
    for (int64_t k = g * G; k < (g + 1) * G; ++k) sum += xr[k];
    xsum[g] = sum;
  }
}
static inline void wlow_add_offsets(const float* off, const float* xs, int64_t groups, float* y) {
#ifdef AK_WLOW_OFFSET_DOT
  wlow_offset_dot(off, xs, groups, y);
#else
  for (int64_t g = 0; g < groups; ++g) {  // a 16-lane vector FMA per group
    const float xv = xs[g];
    const float* og = off + g * 16;
#pragma omp simd
    for (int r = 0; r < 16; ++r) y[r] += og[r] * xv;
  }
#endif
}

// A GGUF K-quant's scale tables of one weight (WLowArgs' ksub .. kshift, G and S), and what gemm_wlow_a8
// and moe_q both form from them: groups [g0, g0 + ng) of tile `tile`'s fp32 scales into sc and (off
// non-null) the per-group offsets into off, a 16-row group at a time (a plain vector loop each, or the
// variant's wlow_kscale_group): sc = d * sub, off = shift * sc - dmin * submin (the shift as a float
// per row, 0 without one); and the activations' zero point met by the row sums, y[r] -= cz * krowsum[r].
struct WLowKqTables {
  const int8_t* ksub;
  const int8_t* ksubmin;  // or null
  const float* ksup;
  const float* ksupmin;   // with ksubmin
  const int8_t* kshift;   // or null
  int64_t G, S;
};
static inline void wlow_kscales(const WLowKqTables& t, int64_t K, int64_t tile, int64_t g0, int64_t ng, float* sc,
                                float* off) {
  const int64_t G = t.G, S = t.S, groups = K / G, supers = K / S;
  const int8_t* sub = t.ksub + (tile * groups + g0) * 16;
  const int8_t* smin = t.ksubmin ? t.ksubmin + (tile * groups + g0) * 16 : nullptr;
  float shf[16];
  for (int r = 0; r < 16; ++r) shf[r] = t.kshift ? (float)t.kshift[tile * 16 + r] : 0.f;
  const int64_t gps = S / G;  // groups per super-block (S is a multiple of G)
  int64_t si = g0 / gps, gi = g0 % gps;
  for (int64_t g = 0; g < ng; ++g, gi = gi + 1 == gps ? (++si, 0) : gi + 1) {
    const int64_t b = (tile * supers + si) * 16;
    const float* sup = t.ksup + b;
    const int8_t* sg = sub + g * 16;
    float* scg = sc + g * 16;
    float* og = off ? off + g * 16 : nullptr;
    const float* supmin = smin ? t.ksupmin + b : nullptr;
    const int8_t* mg = smin ? smin + g * 16 : nullptr;
#ifdef AK_WLOW_KSCALE_GROUP
    wlow_kscale_group(sup, sg, shf, supmin, mg, scg, og);
#else
    if (!og) {
#pragma omp simd
      for (int r = 0; r < 16; ++r) scg[r] = sup[r] * (float)sg[r];
    } else if (!mg) {
#pragma omp simd
      for (int r = 0; r < 16; ++r) {
        const float v = sup[r] * (float)sg[r];
        scg[r] = v;
        og[r] = shf[r] * v;
      }
    } else {
#pragma omp simd
      for (int r = 0; r < 16; ++r) {
        const float v = sup[r] * (float)sg[r];
        scg[r] = v;
        og[r] = shf[r] * v - supmin[r] * (float)mg[r];
      }
    }
#endif
  }
}
static inline void wlow_krowsum_term(const float* rs, float cz, float* y) {
  for (int r = 0; r < 16; ++r) y[r] -= cz * rs[r];
}

static void gemm_wlow_a8(const WLowArgs& a) {
#ifdef AK_WLOW_FAST
  const int bias = 0;  // wlow_block_fast takes int8 xq
#else
  const int bias = w8g_act_bias();
#endif
  const int64_t M = a.M, K = a.K, N = a.N, G = a.group, groups = K / G;
  // K-quant scales: the chunk's fp32 group scales are formed from them in L1 (ksc), the group sums
  // of q are taken as zero (WLowBlock.wsum null) and the zero point's term is taken per row in finish (krowsum)
  const bool kq = a.ksuper > 0;
  const int64_t S = kq ? a.ksuper : K;
  const bool has_off = a.offset || (kq && (a.ksubmin || a.kshift));
  ByteBuf xq((size_t)(M * K));
  FloatBuf corr((size_t)M), sx((size_t)M), xs((size_t)(has_off ? M * groups : 1));
#ifdef AK_WLOW_FAST
  ByteBuf xsum_buf((size_t)(M * groups) * sizeof(int32_t));  // not a std::vector: see FloatBuf
  int32_t* xsum = reinterpret_cast<int32_t*>(xsum_buf.data());
#endif
#pragma omp parallel for schedule(static) if (M * K > (1 << 15))
  for (int64_t m = 0; m < M; ++m) {
    w8g_quant_row(a.x + m * K, K, bias, xq.data() + m * K, corr.data() + m, sx.data() + m);
    if (has_off) wlow_float_group_sums(a.x + m * K, K, G, xs.data() + m * groups);
#ifdef AK_WLOW_FAST
    wlow_int_group_sums(reinterpret_cast<const int8_t*>(xq.data() + m * K), K, G, xsum + m * groups);
#endif
  }
  // whole groups per chunk; AK_WLOW_FAST unpacks in registers (nothing in L1 to size), so its chunk
  // is the whole row unless K-quant scales are formed a chunk at a time: one pass per tile and token
  // pass, no per-chunk setup
#ifdef AK_WLOW_FAST
  const int64_t chunk = kq ? std::max<int64_t>(G, kWLowChunk / G * G) : K;
#else
  const int64_t chunk = std::max<int64_t>(G, kWLowChunk / G * G);
#endif
  const int64_t tiles = (N + 15) / 16;
  // K-quant: groups [g0, g0 + ng) of a tile's fp32 scales into sc, and (with offsets) into off
  const WLowKqTables kt{a.ksub, a.ksubmin, a.ksup, a.ksupmin, a.kshift, G, S};
  auto kscales = [&](int64_t tile, int64_t g0, int64_t ng, float* sc, float* off) {
    wlow_kscales(kt, K, tile, g0, ng, sc, off);
  };
  // the tile's rows: sx * acc plus the offsets' term against the float group sums; koff: the
  // tile's K-quant offsets (null otherwise); s: the token's scale if acc is not yet scaled, else 1
  auto finish = [&](int64_t tile, int64_t m, const float* ac, float s, const float* koff) {
    const int rows = (int)std::min<int64_t>(16, N - tile * 16);
    float* o = a.out + m * N + tile * 16;
    float y[16];
    for (int r = 0; r < 16; ++r) y[r] = s * ac[r];
    if (kq) wlow_krowsum_term(a.krowsum + tile * 16, sx.data()[m] * corr.data()[m], y);
    const float* off = kq ? koff : (a.offset ? a.offset + tile * groups * 16 : nullptr);
    if (off) wlow_add_offsets(off, xs.data() + m * groups, groups, y);
    if (rows == 16) {  // a fixed count: vector stores (the variable one is a memcpy call per token and tile)
      for (int r = 0; r < 16; ++r) o[r] = y[r];
    } else {
      for (int r = 0; r < rows; ++r) o[r] = y[r];
    }
  };
#ifdef AK_WLOW_FAST
  const int64_t chunk_groups = chunk / G;
  // Items: (token block, tile), tiles inner; a tile's row (its chunk: the whole row for float group
  // scales, 4.6 KiB at K = 576 in 4 bits; in L2 past ~16k inputs) meets the block's tokens 4 per pass. A block's int8 activations (about kWLowBlockBytes) stay in L2
  // while its tiles run over them, rather than all M tokens being read from further out per tile.
  // The blocks are of equal size (to a multiple of 4 tokens, the work item's step): the static
  // schedule gives each thread a run of items, which at a few blocks is whole blocks, and blocks of
  // the largest size and one remainder left a thread idle (512 tokens at K = 896: 292 + 220, the
  // second thread waiting a quarter of the time).
  const int64_t mb_max = std::min<int64_t>(M, std::max<int64_t>(16, kWLowBlockBytes / K / 4 * 4));
  const int64_t nb = (M + mb_max - 1) / mb_max;
  const int64_t mb = std::min<int64_t>(M, ((M + nb - 1) / nb + 3) / 4 * 4);
  const int64_t mblocks = (M + mb - 1) / mb;
#pragma omp parallel if (tiles * mblocks > 1 && M * N * K > (1 << 16))
  {
    FloatBuf acc((size_t)(mb * 16));
    FloatBuf ksc(kq ? (size_t)(chunk / G * 16) : 1), koff(kq && has_off ? (size_t)(groups * 16) : 1);
#pragma omp for schedule(static)
    for (int64_t item = 0; item < mblocks * tiles; ++item) {
      const int64_t tile = item % tiles, m0 = item / tiles * mb, T = std::min(mb, M - m0);
      for (int64_t j = 0; j < T * 16; ++j) acc.data()[j] = 0.f;
      for (int64_t k0 = 0; k0 < K; k0 += chunk) {
        WLowBlock b;
        b.lo = a.lo + tile * 8 * K;
        b.hi = a.hi ? a.hi + tile * wlow_hi_tile_bytes(a.bits, K) : nullptr;
        b.k0 = k0;
        b.kc = std::min(chunk, K - k0);
        b.ng = b.kc == chunk ? chunk_groups : b.kc / G;
        b.G = (int)G;
        b.bits = a.bits;
        b.x = reinterpret_cast<const int8_t*>(xq.data()) + m0 * K + k0;
        b.ldx = K;
        b.T = (int)T;
        b.xsum = xsum + m0 * groups + k0 / G;
        b.ldg = groups;
        b.zp = corr.data() + m0;
        if (kq) {
          kscales(tile, k0 / G, b.kc / G, ksc.data(), has_off ? koff.data() + k0 / G * 16 : nullptr);
          b.scale = ksc.data();
          b.wsum = nullptr;  // q's group sums are zero with K-quant scales
        } else {
          b.scale = a.scale + (tile * groups + k0 / G) * 16;
          b.wsum = a.wsum + (tile * groups + k0 / G) * 16;
        }
        b.acc = acc.data();
        wlow_block_fast(b);
      }
      for (int64_t t = 0; t < T; ++t)
        finish(tile, m0 + t, acc.data() + t * 16, sx.data()[m0 + t], kq && has_off ? koff.data() : nullptr);
    }
  }
#else
  const int64_t blocks = (M + kW8GTokens - 1) / kW8GTokens;
#pragma omp parallel if (tiles * blocks > 1 && M * N * K > (1 << 16))
  {
    ByteBuf qbuf((size_t)(chunk * 16)), xbuf((size_t)(chunk * kW8GTokens));
    FloatBuf wsum((size_t)chunk), tmp(16 * kW8GTokens), acc(16 * kW8GTokens);
    FloatBuf ksc(kq ? (size_t)(chunk / G * 16) : 1), koff(kq && has_off ? (size_t)(groups * 16) : 1);
    int8_t* q = reinterpret_cast<int8_t*>(qbuf.data());
#pragma omp for schedule(static)
    for (int64_t i = 0; i < tiles * blocks; ++i) {
      const int64_t tile = i / blocks, m0 = (i % blocks) * kW8GTokens;
      const int T = (int)std::min<int64_t>(kW8GTokens, M - m0);
      const uint8_t* lo = a.lo + tile * 8 * K;
      const uint8_t* hi = a.hi ? a.hi + tile * wlow_hi_tile_bytes(a.bits, K) : nullptr;
      for (int j = 0; j < 16 * T; ++j) acc.data()[j] = 0.f;
      for (int64_t k0 = 0; k0 < K; k0 += chunk) {
        const int64_t kc = std::min(chunk, K - k0);
        wlow_unpack(lo, hi, a.bits, k0, kc, q);
        if (kq) {
          kscales(tile, k0 / G, kc / G, ksc.data(), has_off ? koff.data() + k0 / G * 16 : nullptr);
          for (int64_t j = 0; j < kc / G * 16; ++j) wsum.data()[j] = 0.f;
        } else {
          const int16_t* ws = a.wsum + (tile * groups + k0 / G) * 16;
          for (int64_t j = 0; j < kc / G * 16; ++j) wsum.data()[j] = (float)ws[j];
        }
        W8GBlock b;
        if (T == 1) {
          b.x = xq.data() + m0 * K + k0;
        } else {  // the work item reads token t at x + t * K: the chunk's tokens side by side
          for (int t = 0; t < T; ++t) std::memcpy(xbuf.data() + t * kc, xq.data() + (m0 + t) * K + k0, (size_t)kc);
          b.x = xbuf.data();
        }
        b.K = kc;
        b.T = T;
        b.corr = corr.data() + m0;
        b.sx = sx.data() + m0;
        b.w = q;
        b.scale = kq ? ksc.data() : a.scale + (tile * groups + k0 / G) * 16;
        b.wsum = wsum.data();
        b.G = (int)G;
        b.out = tmp.data();
        b.ldo = 16;
        b.rows = 16;
        b.has_m128 = false;  // |q| <= 32
        if (!w8g_block_fast(b)) w8g_block_scalar(b, bias);
        for (int j = 0; j < 16 * T; ++j) acc.data()[j] += tmp.data()[j];
      }
      // tmp holds sx already
      for (int t = 0; t < T; ++t) finish(tile, m0 + t, acc.data() + t * 16, 1.f, kq && has_off ? koff.data() : nullptr);
    }
  }
#endif
}

// ------------------------------------------------------------------ fp32 GEMM, prepacked weights
//
// Decode-sized GEMMs (tens of rows) are where a general library loses most: each weight is used
// once per step and streams from DRAM, and a kernel that does not fetch ahead stalls on it. Work
// split: each thread owns a contiguous run of panels (kSgemmPanel output columns, K deep, one
// contiguous stretch of memory) and, for each, runs every row block of kSgemmMR rows through the
// variant's micro-kernel while prefetching its next panel into L2, a slice per row block, so that
// the DRAM reads overlap the FMAs. With more than kSgemmMB rows (prefill) panels go in groups of
// about kSgemmGroupBytes, which stay in L2 while every row block of x runs over them (x's rows then
// come from L1), and the next group is prefetched meanwhile.
//
//   template <int MR> void sgemm_block(const float* A, int64_t lda, const float* B, int K,
//       float* C, int64_t ldc, const float* bias, int nvalid, const char* pf, int pf_per4,
//       bool stream);
//     C[r, j] = sum_k A[r, k] * B[k, j] (+ bias[j]) for r < MR, j < nvalid (B: one panel,
//     [K][kSgemmPanel]); prefetches pf_per4 lines from pf every 4 k steps (pf may be null).
//     stream: C may be written with non-temporal stores (variants that have them; the caller
//     fences). A variant defines AK_SGEMM_BLOCK when it has its own; else the portable one below.
//
// An output of kSgemmStreamBytes or more (the logits of a decode batch: 64 x 49152 floats) cannot
// stay in cache until it is read; written with ordinary stores, each of its lines is first read
// from DRAM (write-allocate) and later written back. Streaming stores skip the read: the default
// model's lm_head at 64 rows goes from ~420 to ~490 GFLOP/s on AVX512.

constexpr int kSgemmMR = 8;
constexpr int kSgemmMB = 128;               // rows up to which every panel is its own group
constexpr int64_t kSgemmGroupBytes = 512 << 10;  // panels per group beyond that: what fits in L2
constexpr int64_t kSgemmStreamBytes = 8 << 20;   // outputs this large are written with streaming stores

#ifndef AK_SGEMM_BLOCK
template <int MR>
static void sgemm_block(const float* A, int64_t lda, const float* B, int K, float* C, int64_t ldc,
                        const float* bias, int nvalid, const char* pf, int pf_per4, bool /*stream*/) {
  constexpr int NR = kSgemmPanel;
  float acc[MR][NR];
  for (int r = 0; r < MR; ++r)
    for (int j = 0; j < NR; ++j) acc[r][j] = 0.f;
  for (int k = 0; k < K; ++k) {
    if (pf && (k & 3) == 0) {
      for (int i = 0; i < pf_per4; ++i) __builtin_prefetch(pf + 64 * i, 0, 2);
      pf += 64 * pf_per4;
    }
    const float* b = B + (int64_t)k * NR;
    for (int r = 0; r < MR; ++r) {
      const float a = A[(int64_t)r * lda + k];
#pragma omp simd
      for (int j = 0; j < NR; ++j) acc[r][j] += a * b[j];
    }
  }
  for (int r = 0; r < MR; ++r)
    for (int j = 0; j < nvalid; ++j) C[(int64_t)r * ldc + j] = acc[r][j] + (bias ? bias[j] : 0.f);
}
#endif

static void gemm_f32(const float* x, int64_t M, int64_t K, const float* wp, int64_t N,
                     const float* bias, float* out, int act) {
  constexpr int NR = kSgemmPanel, MR = kSgemmMR;
  using Block = void (*)(const float*, int64_t, const float*, int, float*, int64_t, const float*,
                         int, const char*, int, bool);
  static const Block kBlocks[MR + 1] = {nullptr,         sgemm_block<1>, sgemm_block<2>,
                                        sgemm_block<3>, sgemm_block<4>, sgemm_block<5>,
                                        sgemm_block<6>, sgemm_block<7>, sgemm_block<8>};
  const int64_t P = (N + NR - 1) / NR;
  const int64_t panel = K * NR;  // floats
  const int64_t lines = panel * (int64_t)sizeof(float) / 64;
  const int iters = (int)(K / 4);
  const bool silu_mul = act == kSgemmSiluMul;
  const int64_t ldo = silu_mul ? N / 2 : N;
  const bool stream = !silu_mul && M * N * (int64_t)sizeof(float) >= kSgemmStreamBytes;
#pragma omp parallel if (M * N * K > (1 << 17) && P > 1)
  {
    const int T = omp_get_num_threads(), t = omp_get_thread_num();
    alignas(64) float tile[MR * NR];  // a row block's gate|up panel before silu(gate) * up
    const int64_t p0 = P * t / T, p1 = P * (t + 1) / T;
    // Panels are taken in groups that stay in L2 (one panel when all rows fit one pass); for each
    // group every row block of x runs over the group's panels, then the next group. While a group
    // computes, the next one (contiguous: panels are adjacent) is prefetched a slice per call.
    const int64_t gp = M <= kSgemmMB ? 1 : std::max<int64_t>(1, kSgemmGroupBytes / (panel * (int64_t)sizeof(float)));
    const int64_t nrb = (M + MR - 1) / MR;
    for (int64_t g0 = p0; g0 < p1; g0 += gp) {
      const int64_t g1 = std::min(p1, g0 + gp);
      const int64_t next_lines = (std::min(p1, g1 + gp) - g1) * lines;
      const int64_t calls = nrb * (g1 - g0);
      const int per4 = iters && next_lines ? (int)((next_lines + calls * iters - 1) / (calls * iters)) : 0;
      const char* next = reinterpret_cast<const char*>(wp + g1 * panel);
      int64_t c = 0;
      for (int64_t rb = 0; rb < nrb; ++rb) {
        const int64_t r0 = rb * MR;
        const int mr = (int)std::min<int64_t>(MR, M - r0);
        for (int64_t p = g0; p < g1; ++p, ++c) {
          const float* B = wp + p * panel;
          const int nvalid = (int)std::min<int64_t>(NR, N - p * NR);
          const int64_t first = c * iters * per4;  // first line of this call's prefetch slice
          const char* pf = per4 > 0 && first < next_lines ? next + first * 64 : nullptr;
          if (!silu_mul) {
            kBlocks[mr](x + r0 * K, K, B, (int)K, out + r0 * N + p * NR, N, bias ? bias + p * NR : nullptr,
                        nvalid, pf, per4, stream);
            continue;
          }
          kBlocks[mr](x + r0 * K, K, B, (int)K, tile, NR, bias ? bias + p * NR : nullptr, NR, pf, per4, false);
          constexpr int H = NR / 2;
          for (int r = 0; r < mr; ++r) {
            const float* g = tile + r * NR;
            float e[H];
            for (int j = 0; j < H; ++j) e[j] = -g[j];
            exp_vec(e, H);
            // as silu_and_mul: silu(a) = a / (1 + exp(-a)), then times up
            float* o = out + (r0 + r) * ldo + p * H;
            for (int j = 0; j < H; ++j) o[j] = (g[j] / (1.f + e[j])) * g[H + j];
          }
        }
      }
    }
#if defined(__x86_64__)
    if (stream) __builtin_ia32_sfence();  // streaming stores are weakly ordered: drain before the barrier
#endif
  }
}

// ------------------------------------------------------------------ mixture-of-experts layer, fp32
//
// moe_f32 (MoeF32Args in appliance_kernels.h): gemm_f32's panel micro-kernel and silu epilogue over
// every touched expert in one parallel region. The work items of a pass are (expert, panel) pairs of
// the experts with rows, in expert order; thread t takes a contiguous run of them (weights adjacent in
// memory within an expert), runs each expert's row blocks over the panel and prefetches its next
// item's panel meanwhile, so each touched expert's weights are read once per pass. A decode step has
// one or two rows per expert: per-expert calls would each pay a parallel region and split a small
// GEMM over the threads; here the threads split the layer's whole weight stream instead.
static void moe_f32(const MoeF32Args& a) {
  constexpr int NR = kSgemmPanel, MR = kSgemmMR, HP = NR / 2;
  using Block = void (*)(const float*, int64_t, const float*, int, float*, int64_t, const float*,
                         int, const char*, int, bool);
  static const Block kBlocks[MR + 1] = {nullptr,         sgemm_block<1>, sgemm_block<2>,
                                        sgemm_block<3>, sgemm_block<4>, sgemm_block<5>,
                                        sgemm_block<6>, sgemm_block<7>, sgemm_block<8>};
  const int64_t H = a.H, I = a.I;
  const int64_t Pgu = (2 * I + NR - 1) / NR, Pdn = (H + NR - 1) / NR;
  std::vector<int64_t> touched;
  for (int64_t e = 0; e < a.E; ++e)
    if (a.start[e + 1] > a.start[e]) touched.push_back(e);
  const int64_t nt = (int64_t)touched.size();
  if (!nt) return;
  const int64_t R = a.start[a.E];
#pragma omp parallel if (R * (H * I) > (1 << 15))
  {
    const int T = omp_get_num_threads(), t = omp_get_thread_num();
    alignas(64) float tile[MR * NR];
    for (int pass = 0; pass < 2; ++pass) {
      const bool gu = pass == 0;
      const int64_t P = gu ? Pgu : Pdn, K = gu ? H : I, N = gu ? 2 * I : H;
      const int64_t panel = K * NR, lines = panel * (int64_t)sizeof(float) / 64;
      const int iters = (int)(K / 4);
      const float* src = gu ? a.xg : a.act;
      const int64_t W = nt * P, w0 = W * t / T, w1 = W * (t + 1) / T;
      for (int64_t w = w0; w < w1; ++w) {
        const int64_t e = touched[w / P], p = w % P;
        const float* wp = gu ? a.wgu[e] : a.wdn[e];
        const float* B = wp + p * panel;
        const int64_t r_begin = a.start[e], rows = a.start[e + 1] - r_begin;
        const int64_t nrb = (rows + MR - 1) / MR;
        // the next item's panel, a slice per row block
        const char* next = nullptr;
        int per4 = 0;
        if (w + 1 < w1 && iters) {
          const int64_t en = touched[(w + 1) / P], pn = (w + 1) % P;
          next = reinterpret_cast<const char*>((gu ? a.wgu[en] : a.wdn[en]) + pn * panel);
          per4 = (int)((lines + nrb * iters - 1) / (nrb * iters));
        }
        const int nvalid = (int)std::min<int64_t>(NR, N - p * NR);
        for (int64_t rb = 0; rb < nrb; ++rb) {
          const int64_t r0 = r_begin + rb * MR;
          const int mr = (int)std::min<int64_t>(MR, r_begin + rows - r0);
          const int64_t first = rb * iters * per4;
          const char* pf = per4 > 0 && first < lines ? next + first * 64 : nullptr;
          if (!gu) {
            kBlocks[mr](src + r0 * K, K, B, (int)K, a.y + r0 * H + p * NR, H, nullptr, nvalid, pf, per4, false);
            continue;
          }
          kBlocks[mr](src + r0 * K, K, B, (int)K, tile, NR, nullptr, NR, pf, per4, false);
          for (int r = 0; r < mr; ++r) {  // as gemm_f32's kSgemmSiluMul epilogue
            const float* g = tile + r * NR;
            float ex[HP];
            for (int j = 0; j < HP; ++j) ex[j] = -g[j];
            exp_vec(ex, HP);
            float* o = a.act + (r0 + r) * I + p * HP;
            for (int j = 0; j < HP; ++j) o[j] = (g[j] / (1.f + ex[j])) * g[HP + j];
          }
        }
      }
      if (gu) {
#pragma omp barrier
      }
    }
  }
}

// ------------------------------------------------------------------ mixture-of-experts layer, quantized
//
// moe_q (MoeQArgs in appliance_kernels.h): the W8A8 / low-bit work items of gemm_w8g_a8 and
// gemm_wlow_a8 over every touched expert in one parallel region, in three phases split by barriers:
// (1) each token quantized once and copied to its grouped rows, then gate_up's (expert, tile) items;
// (2) per row silu(gate) * up (silu_and_mul's arithmetic) quantized once for down; (3) down's items.
// An expert's rows run in the blocks its own gemm call would use (8 rows for W8G and the portable
// low-bit item, the x86 low-bit item's token blocks), so each row's result is the per-expert call's.

// The activation byte bias a projection's work items take (see W8GBlock / WLowBlock).
static int moe_q_bias(const MoeQProj& p) {
#ifdef AK_WLOW_FAST
  if (p.kind == 1) return 0;
#endif
  return w8g_act_bias();
}

// Row r of src (K values) quantized: q (K bytes), corr, sx; and, for the low-bit items, the float
// group sums of src (xs) and (x86) the int8 group sums of q (xsum), K / G values each.
static void moe_q_quant(const float* src, int64_t K, const MoeQProj& p, uint8_t* q, float* corr, float* sx,
                        int32_t* xsum, float* xs) {
  w8g_quant_row(src, K, moe_q_bias(p), q, corr, sx);
  if (p.kind == 1) wlow_float_group_sums(src, K, p.group, xs);  // the float group sums the offsets meet
#ifdef AK_WLOW_FAST
  if (p.kind == 1) wlow_int_group_sums(reinterpret_cast<const int8_t*>(q), K, p.group, xsum);
#else
  (void)xsum;
#endif
}

// Scratch of one thread for the low-bit items.
struct MoeQScratch {
  FloatBuf acc, tmp, wsum, ksc, koff;
  ByteBuf q, xb;
  // koff: a tile's K-quant offsets, [K/G][16] for the largest K (at most K values)
  MoeQScratch(int64_t rows, int64_t max_k)
      : acc((size_t)(std::max<int64_t>(rows, kW8GTokens) * 16)), tmp(16 * kW8GTokens), wsum((size_t)kWLowChunk),
        ksc((size_t)kWLowChunk), koff((size_t)max_k), q((size_t)(kWLowChunk * 16)),
        xb((size_t)(kWLowChunk * kW8GTokens)) {}
};

// Tile `tile` of expert e's projection p (K inputs, N outputs) over grouped rows [r0, r0 + n) of
// the quantized activations xq [R, K] (corr, sx, xsum per row): out [R, N] (row stride N).
// (ne, ntile): the thread's next item of this projection (ne < 0: none), whose W8G tile the first row
// block prefetches while it computes (W8GBlock::pf_w): at 1-2 rows an expert a tile's arithmetic is
// shorter than its read from DRAM, and the next expert's weights are not adjacent to this one's.
static void moe_q_tile(const MoeQProj& p, int64_t e, int64_t tile, int64_t K, int64_t N, const uint8_t* xq,
                       const float* corr, const float* sx, const int32_t* xsum, const float* xs, int64_t r0,
                       int64_t n, float* out, MoeQScratch& s, int64_t ne = -1, int64_t ntile = 0) {
  const int64_t G = p.group, groups = K / G;
  const int rows = (int)std::min<int64_t>(16, N - tile * 16);
  if (p.kind == 0) {
    const int bias = moe_q_bias(p);
    for (int64_t m0 = r0; m0 < r0 + n; m0 += kW8GTokens) {
      W8GBlock b;
      b.x = xq + m0 * K;
      b.K = K;
      b.T = (int)std::min<int64_t>(kW8GTokens, r0 + n - m0);
      b.corr = corr + m0;
      b.sx = sx + m0;
      b.w = static_cast<const int8_t*>(p.w[e]) + tile * 16 * K;
      b.scale = p.scale[e] + tile * groups * 16;
      b.wsum = static_cast<const float*>(p.wsum[e]) + tile * groups * 16;
      b.G = (int)G;
      b.out = out + m0 * N + tile * 16;
      b.ldo = N;
      b.rows = rows;
      b.has_m128 = p.m128[e] != 0;
      if (ne >= 0 && m0 == r0) {
        b.pf_w = static_cast<const int8_t*>(p.w[ne]) + ntile * 16 * K;
        b.pf_scale = p.scale[ne] + ntile * groups * 16;
        b.pf_wsum = static_cast<const float*>(p.wsum[ne]) + ntile * groups * 16;
      }
      if (!w8g_block_fast(b)) w8g_block_scalar(b, bias);
    }
    return;
  }
  const uint8_t* lo = static_cast<const uint8_t*>(p.w[e]) + tile * 8 * K;
  const uint8_t* hi = p.hi[e] ? p.hi[e] + tile * wlow_hi_tile_bytes(p.bits, K) : nullptr;
  // K-quant scales: the chunk's fp32 group scales formed in L1 (s.ksc) and the tile's offsets (s.koff)
  // as gemm_wlow_a8 forms them; q's group sums taken as zero, the zero point met by krowsum in finish
  const bool kq = p.ksuper > 0;
  const WLowKqTables kt{kq ? p.ksub[e] : nullptr, kq ? p.ksubmin[e] : nullptr, kq ? p.ksup[e] : nullptr,
                        kq ? p.ksupmin[e] : nullptr, kq ? p.kshift[e] : nullptr, G, kq ? p.ksuper : K};
  const bool kq_off = kq && (kt.ksubmin || kt.kshift);
  const float* scale = kq ? nullptr : p.scale[e] + tile * groups * 16;
  const int16_t* ws = kq ? nullptr : static_cast<const int16_t*>(p.wsum[e]) + tile * groups * 16;
  const float* off = kq ? (kq_off ? s.koff.data() : nullptr) : p.offset[e] ? p.offset[e] + tile * groups * 16 : nullptr;
  const float* krs = kq ? p.krowsum[e] + tile * 16 : nullptr;
  // as gemm_wlow_a8's finish: s * acc, the K-quant zero point's row term, plus the offsets' term
  auto finish = [&](int64_t m, const float* ac, float sc) {
    float y[16];
    for (int r = 0; r < 16; ++r) y[r] = sc * ac[r];
    if (kq) wlow_krowsum_term(krs, sx[m] * corr[m], y);
    if (off) wlow_add_offsets(off, xs + m * groups, groups, y);
    float* o = out + m * N + tile * 16;
    for (int r = 0; r < rows; ++r) o[r] = y[r];
  };
  // chunk k0's scales (and, K-quant with offsets, its groups' offsets into s.koff)
  auto chunk_scales = [&](int64_t k0, int64_t kc) -> const float* {
    if (!kq) return scale + k0 / G * 16;
    wlow_kscales(kt, K, tile, k0 / G, kc / G, s.ksc.data(), kq_off ? s.koff.data() + k0 / G * 16 : nullptr);
    return s.ksc.data();
  };
  const int64_t chunk = std::max<int64_t>(G, kWLowChunk / G * G);
#ifdef AK_WLOW_FAST
  // gemm_wlow_a8's token blocks for these rows
  const int64_t chunk_groups = chunk / G;
  const int64_t mb = std::min<int64_t>(n, std::max<int64_t>(16, kWLowBlockBytes / K / 4 * 4));
  for (int64_t m0 = r0; m0 < r0 + n; m0 += mb) {
    const int64_t T = std::min(mb, r0 + n - m0);
    float* acc = s.acc.data();
    for (int64_t j = 0; j < T * 16; ++j) acc[j] = 0.f;
    for (int64_t k0 = 0; k0 < K; k0 += chunk) {
      WLowBlock b;
      b.lo = lo;
      b.hi = hi;
      b.k0 = k0;
      b.kc = std::min(chunk, K - k0);
      b.ng = b.kc == chunk ? chunk_groups : b.kc / G;
      b.G = (int)G;
      b.bits = p.bits;
      b.x = reinterpret_cast<const int8_t*>(xq) + m0 * K + k0;
      b.ldx = K;
      b.T = (int)T;
      b.xsum = xsum + m0 * groups + k0 / G;
      b.ldg = groups;
      b.zp = corr + m0;
      b.scale = chunk_scales(k0, b.kc);
      b.wsum = kq ? nullptr : ws + k0 / G * 16;  // q's group sums are zero with K-quant scales
      b.acc = acc;
      wlow_block_fast(b);
    }
    for (int64_t t = 0; t < T; ++t) finish(m0 + t, acc + t * 16, sx[m0 + t]);
  }
#else
  (void)xsum;
  const int bias = moe_q_bias(p);
  int8_t* q = reinterpret_cast<int8_t*>(s.q.data());
  for (int64_t m0 = r0; m0 < r0 + n; m0 += kW8GTokens) {
    const int T = (int)std::min<int64_t>(kW8GTokens, r0 + n - m0);
    float* acc = s.acc.data();
    for (int j = 0; j < 16 * T; ++j) acc[j] = 0.f;
    for (int64_t k0 = 0; k0 < K; k0 += chunk) {
      const int64_t kc = std::min(chunk, K - k0);
      wlow_unpack(lo, hi, p.bits, k0, kc, q);
      const float* sc = chunk_scales(k0, kc);
      for (int64_t j = 0; j < kc / G * 16; ++j) s.wsum.data()[j] = kq ? 0.f : (float)ws[k0 / G * 16 + j];
      W8GBlock b;
      if (T == 1) {
        b.x = xq + m0 * K + k0;
      } else {
        for (int t = 0; t < T; ++t) std::memcpy(s.xb.data() + t * kc, xq + (m0 + t) * K + k0, (size_t)kc);
        b.x = s.xb.data();
      }
      b.K = kc;
      b.T = T;
      b.corr = corr + m0;
      b.sx = sx + m0;
      b.w = q;
      b.scale = sc;
      b.wsum = s.wsum.data();
      b.G = (int)G;
      b.out = s.tmp.data();
      b.ldo = 16;
      b.rows = 16;
      b.has_m128 = false;  // |q| <= 32
      if (!w8g_block_fast(b)) w8g_block_scalar(b, bias);
      for (int j = 0; j < 16 * T; ++j) acc[j] += s.tmp.data()[j];
    }
    for (int t = 0; t < T; ++t) finish(m0 + t, acc + t * 16, 1.f);  // tmp held sx already
  }
#endif
}

static void moe_q(const MoeQArgs& a) {
  const int64_t H = a.H, I = a.I, E = a.E, T = a.T, R = a.start[E];
  if (!R) return;
  std::vector<int64_t> touched;
  int64_t max_rows = 0;
  for (int64_t e = 0; e < E; ++e)
    if (a.start[e + 1] > a.start[e]) {
      touched.push_back(e);
      max_rows = std::max(max_rows, a.start[e + 1] - a.start[e]);
    }
  const int64_t nt = (int64_t)touched.size();
  const int64_t ggu = H / a.gu.group, gdn = I / a.dn.group;
  // per token (x's rows), then per grouped row: quantized bytes, corr, sx, int8 group sums
  ByteBuf xt((size_t)(T * H)), xr((size_t)(R * H)), ar((size_t)(R * I));
  FloatBuf ct((size_t)T), st((size_t)T), cr((size_t)R), sr((size_t)R), ca((size_t)R), sa((size_t)R);
  ByteBuf gt((size_t)(T * ggu) * 4), gr((size_t)(R * ggu) * 4), ga((size_t)(R * gdn) * 4);
  FloatBuf ft((size_t)(T * ggu)), fr((size_t)(R * ggu)), fa((size_t)(R * gdn));
  int32_t* xsum_t = reinterpret_cast<int32_t*>(gt.data());
  int32_t* xsum_r = reinterpret_cast<int32_t*>(gr.data());
  int32_t* xsum_a = reinterpret_cast<int32_t*>(ga.data());
  const int64_t tgu = (2 * I + 15) / 16, tdn = (H + 15) / 16;
#pragma omp parallel if (R * H * I > (1 << 15))
  {
    MoeQScratch scratch(max_rows, std::max(H, I));
    FloatBuf row((size_t)(3 * I));
#pragma omp for schedule(static)
    for (int64_t t = 0; t < T; ++t)
      moe_q_quant(a.x + t * H, H, a.gu, xt.data() + t * H, ct.data() + t, st.data() + t, xsum_t + t * ggu,
                  ft.data() + t * ggu);
#pragma omp for schedule(static)
    for (int64_t r = 0; r < R; ++r) {
      const int64_t t = a.token[r];
      std::memcpy(xr.data() + r * H, xt.data() + t * H, (size_t)H);
      std::memcpy(xsum_r + r * ggu, xsum_t + t * ggu, (size_t)ggu * 4);
      std::memcpy(fr.data() + r * ggu, ft.data() + t * ggu, (size_t)ggu * 4);
      cr.data()[r] = ct.data()[t];
      sr.data()[r] = st.data()[t];
    }
    // gate_up: (touched expert, tile) items; a thread's static share is a run of one expert's tiles
#pragma omp for schedule(static)
    for (int64_t w = 0; w < nt * tgu; ++w) {
      const int64_t e = touched[w / tgu];
      const int64_t ne = w + 1 < nt * tgu ? touched[(w + 1) / tgu] : -1;
      moe_q_tile(a.gu, e, w % tgu, H, 2 * I, xr.data(), cr.data(), sr.data(), xsum_r, fr.data(), a.start[e],
                 a.start[e + 1] - a.start[e], a.gu_out, scratch, ne, (w + 1) % tgu);
    }
    // silu(gate) * up (as silu_and_mul in fp32), quantized once for down
#pragma omp for schedule(static)
    for (int64_t r = 0; r < R; ++r) {
      const float* g = a.gu_out + r * 2 * I;
      float* ex = row.data();
      float* act = ex + I;
      for (int64_t i = 0; i < I; ++i) ex[i] = -g[i];
      exp_vec(ex, I);
      for (int64_t i = 0; i < I; ++i) act[i] = (g[i] / (1.f + ex[i])) * g[I + i];
      moe_q_quant(act, I, a.dn, ar.data() + r * I, ca.data() + r, sa.data() + r, xsum_a + r * gdn,
                  fa.data() + r * gdn);
    }
#pragma omp for schedule(static)
    for (int64_t w = 0; w < nt * tdn; ++w) {
      const int64_t e = touched[w / tdn];
      const int64_t ne = w + 1 < nt * tdn ? touched[(w + 1) / tdn] : -1;
      moe_q_tile(a.dn, e, w % tdn, I, H, ar.data(), ca.data(), sa.data(), xsum_a, fa.data(), a.start[e],
                 a.start[e + 1] - a.start[e], a.y, scratch, ne, (w + 1) % tdn);
    }
  }
}

// ------------------------------------------------------------------ bf16-weight GEMM, prepacked panels
//
// gemm_bf16 (layout in appliance_kernels.h): gemm_f32's work split and prefetch over bf16 panels
// (K2 = ceil(K/2) words of 32 columns, 128 bytes a word row). A row block computes into an fp32
// tile; the bias and the rounding to the output dtype are applied here, once per element.
//
//   template <int MR> void bgemm_block(const float* A, int64_t lda, const uint32_t* B, int64_t K2,
//       float* C, const char* pf, int pf_per4);
//     C[r * 32 + j] = sum_kk A[r, 2kk] lo(B[kk, j]) + A[r, 2kk + 1] hi(B[kk, j]) for r < MR, j < 32
//     (A fp32 with rows of at least 2 * K2: zero-padded when K is odd); prefetches pf_per4 lines from
//     pf every 2 word rows (4 k steps, as sgemm_block). A variant defines AK_BGEMM_BLOCK for its own.
//   template <int MR> void bgemm_block_dot(const uint32_t* A, int64_t lda, ...same...);
//     the same over bf16 activations given as words of (x[2kk], x[2kk + 1]) pairs: defined by the
//     variants with a bf16 dot product (AK_BGEMM_DOT), used when x is bf16 and bgemm_dot_ok() (the
//     CPU has it: always for avx512bf16 and neon_bf16, a run-time check for sve).

static inline float bgemm_bits(uint32_t u) {
  float f;
  std::memcpy(&f, &u, 4);
  return f;
}

#ifndef AK_BGEMM_BLOCK
template <int MR>
static void bgemm_block(const float* A, int64_t lda, const uint32_t* B, int64_t K2, float* C,
                        const char* pf, int pf_per4) {
  constexpr int NR = kSgemmPanel;
  float acc[MR][NR];
  for (int r = 0; r < MR; ++r)
    for (int j = 0; j < NR; ++j) acc[r][j] = 0.f;
  for (int64_t kk = 0; kk < K2; ++kk) {
    if (pf && (kk & 1) == 0) {
      for (int i = 0; i < pf_per4; ++i) __builtin_prefetch(pf + 64 * i, 0, 2);
      pf += 64 * pf_per4;
    }
    const uint32_t* b = B + kk * NR;
    float lo[NR], hi[NR];
#pragma omp simd
    for (int j = 0; j < NR; ++j) {
      lo[j] = bgemm_bits(b[j] << 16);
      hi[j] = bgemm_bits(b[j] & 0xffff0000u);
    }
    for (int r = 0; r < MR; ++r) {
      const float a0 = A[(int64_t)r * lda + 2 * kk], a1 = A[(int64_t)r * lda + 2 * kk + 1];
#pragma omp simd
      for (int j = 0; j < NR; ++j) acc[r][j] += a0 * lo[j] + a1 * hi[j];
    }
  }
  for (int r = 0; r < MR; ++r)
    for (int j = 0; j < NR; ++j) C[r * NR + j] = acc[r][j];
}
#endif

static void gemm_bf16(const void* x, int x_dtype, int64_t M, int64_t K, const uint16_t* wp, int64_t N,
                      const float* bias, void* out, int out_dtype) {
  constexpr int NR = kSgemmPanel, MR = kSgemmMR;
  using Block = void (*)(const float*, int64_t, const uint32_t*, int64_t, float*, const char*, int);
  static const Block kBlocks[MR + 1] = {nullptr,         bgemm_block<1>, bgemm_block<2>,
                                        bgemm_block<3>, bgemm_block<4>, bgemm_block<5>,
                                        bgemm_block<6>, bgemm_block<7>, bgemm_block<8>};
  const int64_t K2 = (K + 1) / 2;
  const int64_t P = (N + NR - 1) / NR;
  const int64_t panel = K2 * NR;  // words
  const int64_t lines = panel * 4 / 64;
  const int iters = (int)(K2 / 2);
  const uint32_t* W = reinterpret_cast<const uint32_t*>(wp);
#ifdef AK_BGEMM_DOT
  using DotBlock = void (*)(const uint32_t*, int64_t, const uint32_t*, int64_t, float*, const char*, int);
  static const DotBlock kDot[MR + 1] = {nullptr,             bgemm_block_dot<1>, bgemm_block_dot<2>,
                                        bgemm_block_dot<3>, bgemm_block_dot<4>, bgemm_block_dot<5>,
                                        bgemm_block_dot<6>, bgemm_block_dot<7>, bgemm_block_dot<8>};
  const bool dot = x_dtype == kBF16 && bgemm_dot_ok();
#else
  const bool dot = false;
#endif
  // Activations as the blocks read them: x itself when it already is (fp32, or bf16 pairs for the
  // dot product, with K even and word-aligned rows), else a staged copy (K padded with a zero).
  const bool direct = K % 2 == 0 && (dot ? (x_dtype == kBF16 && (reinterpret_cast<uintptr_t>(x) & 3) == 0)
                                         : x_dtype == kF32);
  FloatBuf stage(direct ? 0 : (size_t)(M * (dot ? K2 : 2 * K2)));
  if (!direct) {
#pragma omp parallel for schedule(static) if (M * K > (1 << 16))
    for (int64_t m = 0; m < M; ++m) {
      if (dot) {
        uint16_t* d = reinterpret_cast<uint16_t*>(stage.data() + m * K2);
        std::memcpy(d, static_cast<const uint16_t*>(x) + m * K, K * sizeof(uint16_t));
        if (K % 2) d[K] = 0;
      } else {
        float* d = stage.data() + m * 2 * K2;
        load_row(x, x_dtype, m * K, d, K);
        if (K % 2) d[K] = 0.f;
      }
    }
  }
  const float* xf = direct ? static_cast<const float*>(x) : stage.data();
  const int64_t lda = dot ? K2 : 2 * K2;  // in floats or words
#pragma omp parallel if (M * N * K > (1 << 17) && P > 1)
  {
    const int T = omp_get_num_threads(), t = omp_get_thread_num();
    alignas(64) float tile[MR * NR];
    const int64_t p0 = P * t / T, p1 = P * (t + 1) / T;
    const int64_t gp = M <= kSgemmMB ? 1 : std::max<int64_t>(1, kSgemmGroupBytes / (panel * 4));
    const int64_t nrb = (M + MR - 1) / MR;
    for (int64_t g0 = p0; g0 < p1; g0 += gp) {
      const int64_t g1 = std::min(p1, g0 + gp);
      const int64_t next_lines = (std::min(p1, g1 + gp) - g1) * lines;
      const int64_t calls = nrb * (g1 - g0);
      const int per4 = iters && next_lines ? (int)((next_lines + calls * iters - 1) / (calls * iters)) : 0;
      const char* next = reinterpret_cast<const char*>(W + g1 * panel);
      int64_t c = 0;
      for (int64_t rb = 0; rb < nrb; ++rb) {
        const int64_t r0 = rb * MR;
        const int mr = (int)std::min<int64_t>(MR, M - r0);
        for (int64_t p = g0; p < g1; ++p, ++c) {
          const uint32_t* B = W + p * panel;
          const int nvalid = (int)std::min<int64_t>(NR, N - p * NR);
          const int64_t first = c * iters * per4;
          const char* pf = per4 > 0 && first < next_lines ? next + first * 64 : nullptr;
#ifdef AK_BGEMM_DOT
          if (dot)
            kDot[mr](reinterpret_cast<const uint32_t*>(xf) + r0 * lda, lda, B, K2, tile, pf, per4);
          else
#endif
            kBlocks[mr](xf + r0 * lda, lda, B, K2, tile, pf, per4);
          for (int r = 0; r < mr; ++r) {
            float* tr = tile + r * NR;
            if (bias)
              for (int j = 0; j < nvalid; ++j) tr[j] += bias[p * NR + j];
            store_row(out, out_dtype, (r0 + r) * N + p * NR, tr, nvalid);
          }
        }
      }
    }
  }
}

}  // namespace impl

static const KernelTable kTable = {
    AK_VARIANT_NAME,        impl::paged_attention,  impl::exp_inplace,
    impl::rms_norm,         impl::fused_add_rms_norm, impl::rotary_embedding,
    impl::silu_and_mul,     impl::reshape_and_cache, impl::gemm_w8g_a8,
    impl::gemm_f32,         impl::argmax_rows,
    impl::gemm_bf16,
    impl::reshape_and_cache_quant,
    impl::gemm_wlow_a8,
    impl::moe_f32,
    impl::moe_q,
};

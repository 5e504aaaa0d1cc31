// Thin torch binding over the torch-free kernels: checks what the kernels assume (dtypes,
// contiguity, shapes) and passes raw pointers. Choosing whether a call goes native at all (head
// size, dtypes) is appliance/ops/native.py's job; these checks only guard memory safety.
#include <atomic>
#include <torch/extension.h>

#include <algorithm>
#include <cstring>
#include <string>
#include <vector>

#include "appliance_kernels.h"

namespace ak = appliance_kernels;

namespace {

int dtype_of(const torch::Tensor& t, const char* what) {
  if (t.scalar_type() == torch::kFloat32) return ak::kF32;
  if (t.scalar_type() == torch::kBFloat16) return ak::kBF16;
  TORCH_CHECK(false, what, " must be float32 or bfloat16, got ", t.scalar_type());
  return -1;
}

const ak::KernelTable* K() { return ak::selected_kernels(); }

// A KV cache's storage type: float32 / bfloat16, or a quantized one (--kv-cache-dtype) whose
// per-row scales come as a separate tensor.
int kv_dtype_of(const torch::Tensor& t) {
  switch (t.scalar_type()) {
    case torch::kChar: return ak::kI8;
    case torch::kFloat8_e4m3fn: return ak::kFP8E4M3;
    case torch::kFloat8_e5m2: return ak::kFP8E5M2;
    default: return dtype_of(t, "key_cache");
  }
}

// The scales of a quantized cache: float32 [num_blocks, num_kv_heads, block_size], contiguous.
const float* kv_scale_ptr(const torch::Tensor& cache, const c10::optional<torch::Tensor>& scale, const char* what) {
  TORCH_CHECK(scale.has_value() && scale->defined(), what, " is required for a ", cache.scalar_type(), " KV cache");
  TORCH_CHECK(scale->scalar_type() == torch::kFloat32 && scale->is_contiguous() && scale->dim() == 3 &&
                  scale->size(0) == cache.size(0) && scale->size(1) == cache.size(1) &&
                  scale->size(2) == cache.size(2),
              what, ": contiguous float32 [num_blocks, num_kv_heads, block_size] of the cache, got ", scale->sizes());
  return scale->data_ptr<float>();
}

void paged_attention(const torch::Tensor& query, const torch::Tensor& key_cache,
                     const torch::Tensor& value_cache, const torch::Tensor& block_table,
                     const torch::Tensor& seq_lens, const torch::Tensor& query_start_loc,
                     double scale, torch::Tensor& out, int64_t sliding_window = 0,
                     double logits_soft_cap = 0.0, const c10::optional<torch::Tensor>& k_scale = c10::nullopt,
                     const c10::optional<torch::Tensor>& v_scale = c10::nullopt) {
  TORCH_CHECK(query.dim() == 3 && out.sizes() == query.sizes(), "query/out: [num_tokens, num_heads, head_size]");
  TORCH_CHECK(sliding_window >= 0 && sliding_window <= INT32_MAX, "sliding_window must be in [0, 2^31), got ",
              sliding_window);
  TORCH_CHECK(logits_soft_cap >= 0.0, "logits_soft_cap must be >= 0, got ", logits_soft_cap);
  TORCH_CHECK(query.stride(2) == 1 && out.stride(2) == 1, "query/out: head_size dim must be contiguous");
  TORCH_CHECK(out.scalar_type() == query.scalar_type(), "out must have query's dtype");
  TORCH_CHECK(key_cache.dim() == 4 && key_cache.is_contiguous() && value_cache.is_contiguous() &&
                  key_cache.sizes() == value_cache.sizes(),
              "key_cache/value_cache: contiguous [num_blocks, num_kv_heads, block_size, head_size]");
  TORCH_CHECK(key_cache.scalar_type() == value_cache.scalar_type(), "key/value cache dtypes differ");
  TORCH_CHECK(block_table.scalar_type() == torch::kInt32 && block_table.dim() == 2 &&
                  block_table.stride(1) == 1, "block_table: int32 [num_seqs, max_blocks], rows contiguous");
  TORCH_CHECK(seq_lens.scalar_type() == torch::kInt32 && seq_lens.is_contiguous(), "seq_lens: contiguous int32");
  TORCH_CHECK(query_start_loc.scalar_type() == torch::kInt32 && query_start_loc.is_contiguous(),
              "query_start_loc: contiguous int32");
  const int num_seqs = (int)seq_lens.size(0);
  TORCH_CHECK(query_start_loc.size(0) == num_seqs + 1 && block_table.size(0) >= num_seqs,
              "query_start_loc must have num_seqs + 1 entries and block_table num_seqs rows");
  const int num_heads = (int)query.size(1), head_size = (int)query.size(2);
  const int num_kv_heads = (int)key_cache.size(1);
  TORCH_CHECK(key_cache.size(3) == head_size, "cache head_size ", key_cache.size(3), " != query's ", head_size);
  TORCH_CHECK(num_heads % num_kv_heads == 0, "num_heads must be a multiple of num_kv_heads");
  TORCH_CHECK(head_size % 16 == 0, "native paged_attention needs head_size % 16 == 0, got ", head_size);
  ak::AttentionArgs a{};
  a.query = query.data_ptr();
  a.q_stride_token = query.stride(0);
  a.q_stride_head = query.stride(1);
  a.q_dtype = dtype_of(query, "query");
  a.out = out.data_ptr();
  a.o_stride_token = out.stride(0);
  a.o_stride_head = out.stride(1);
  a.key_cache = key_cache.data_ptr();
  a.value_cache = value_cache.data_ptr();
  a.kv_dtype = kv_dtype_of(key_cache);
  if (a.kv_dtype != ak::kF32 && a.kv_dtype != ak::kBF16) {
    a.k_scale = kv_scale_ptr(key_cache, k_scale, "k_scale");
    a.v_scale = kv_scale_ptr(value_cache, v_scale, "v_scale");
  }
  a.block_table = block_table.data_ptr<int32_t>();
  a.block_table_stride = block_table.stride(0);
  a.seq_lens = seq_lens.data_ptr<int32_t>();
  a.query_start_loc = query_start_loc.data_ptr<int32_t>();
  a.num_seqs = num_seqs;
  a.num_heads = num_heads;
  a.num_kv_heads = num_kv_heads;
  a.head_size = head_size;
  a.block_size = (int)key_cache.size(2);
  a.scale = (float)scale;
  a.sliding_window = (int)sliding_window;
  a.logits_soft_cap = (float)logits_soft_cap;
  K()->paged_attention(a);
}

void exp_(torch::Tensor& x) {
  TORCH_CHECK(x.scalar_type() == torch::kFloat32 && x.is_contiguous(), "exp_: contiguous float32");
  K()->exp_inplace(x.data_ptr<float>(), x.numel());
}

void rms_norm(const torch::Tensor& x, const torch::Tensor& weight, double eps, torch::Tensor& out) {
  TORCH_CHECK(x.is_contiguous() && out.is_contiguous() && weight.is_contiguous(), "rms_norm: contiguous tensors");
  const int64_t hidden = x.size(-1);
  TORCH_CHECK(weight.numel() == hidden && out.sizes() == x.sizes() && out.scalar_type() == x.scalar_type(),
              "rms_norm: weight [hidden], out like x");
  K()->rms_norm(x.data_ptr(), dtype_of(x, "x"), weight.data_ptr(), dtype_of(weight, "weight"),
                out.data_ptr(), x.numel() / hidden, hidden, (float)eps);
}

void fused_add_rms_norm(const torch::Tensor& x, torch::Tensor& residual, const torch::Tensor& weight,
                        double eps, torch::Tensor& out) {
  TORCH_CHECK(x.is_contiguous() && residual.is_contiguous() && out.is_contiguous() && weight.is_contiguous(),
              "fused_add_rms_norm: contiguous tensors");
  const int64_t hidden = residual.size(-1);
  TORCH_CHECK(x.sizes() == residual.sizes() && out.sizes() == residual.sizes() && weight.numel() == hidden &&
                  out.scalar_type() == residual.scalar_type(),
              "fused_add_rms_norm: x, residual, out of one shape; weight [hidden]");
  K()->fused_add_rms_norm(x.data_ptr(), dtype_of(x, "x"), residual.data_ptr(), dtype_of(residual, "residual"),
                          weight.data_ptr(), dtype_of(weight, "weight"), out.data_ptr(),
                          residual.numel() / hidden, hidden, (float)eps);
}

// x [num_tokens, num_heads, head_size] with heads adjacent (a view into a fused q/k/v output is
// fine) rotated into out (contiguous, same shape and dtype; may be x itself when x is contiguous).
void rotary_embedding(const torch::Tensor& positions, const torch::Tensor& x, const torch::Tensor& cos_sin,
                      bool is_neox, torch::Tensor& out) {
  TORCH_CHECK(x.dim() == 3 && x.stride(2) == 1 && x.stride(1) == x.size(2),
              "rotary: x [num_tokens, num_heads, head_size], heads adjacent");
  TORCH_CHECK(out.sizes() == x.sizes() && out.is_contiguous() && out.scalar_type() == x.scalar_type(),
              "rotary: out contiguous, x's shape and dtype");
  TORCH_CHECK(out.data_ptr() != x.data_ptr() || x.is_contiguous(), "rotary: in place needs a contiguous x");
  TORCH_CHECK(positions.scalar_type() == torch::kInt64 && positions.is_contiguous() &&
                  positions.numel() == x.size(0), "rotary: positions int64 [num_tokens]");
  TORCH_CHECK(cos_sin.scalar_type() == torch::kFloat32 && cos_sin.is_contiguous() && cos_sin.dim() == 2,
              "rotary: cos_sin_cache float32 [max_position, rotary_dim]");
  const int rot_dim = (int)cos_sin.size(1);
  TORCH_CHECK(rot_dim % 2 == 0 && rot_dim <= x.size(2), "rotary: rotary_dim even and <= head_size");
  K()->rotary_embedding(positions.data_ptr<int64_t>(), x.data_ptr(), x.size(0) > 1 ? x.stride(0) : x.size(1) * x.size(2),
                        out.data_ptr(), dtype_of(x, "x"), x.size(0), (int)x.size(1), (int)x.size(2),
                        cos_sin.data_ptr<float>(), rot_dim, is_neox);
}

void silu_and_mul(const torch::Tensor& x, torch::Tensor& out) {
  TORCH_CHECK(x.is_contiguous() && out.is_contiguous() && x.scalar_type() == out.scalar_type(),
              "silu_and_mul: contiguous x/out of one dtype");
  const int64_t d = x.size(-1) / 2;
  TORCH_CHECK(x.size(-1) == 2 * d && out.size(-1) == d && out.numel() * 2 == x.numel(),
              "silu_and_mul: x [..., 2d] -> out [..., d]");
  K()->silu_and_mul(x.data_ptr(), out.data_ptr(), dtype_of(x, "x"), out.numel() / std::max<int64_t>(d, 1), d);
}

void reshape_and_cache(const torch::Tensor& key, const torch::Tensor& value, torch::Tensor& key_cache,
                       torch::Tensor& value_cache, const torch::Tensor& slot_mapping,
                       const c10::optional<torch::Tensor>& k_scale = c10::nullopt,
                       const c10::optional<torch::Tensor>& v_scale = c10::nullopt) {
  TORCH_CHECK(key.dim() == 3 && value.sizes() == key.sizes() && key.stride(2) == 1 && value.stride(2) == 1,
              "reshape_and_cache: key/value [num_tokens, num_kv_heads, head_size], last dim contiguous");
  TORCH_CHECK(key.scalar_type() == value.scalar_type(), "reshape_and_cache: key/value dtypes differ");
  TORCH_CHECK(key_cache.is_contiguous() && value_cache.is_contiguous() && key_cache.sizes() == value_cache.sizes() &&
                  key_cache.scalar_type() == value_cache.scalar_type(), "reshape_and_cache: contiguous caches");
  TORCH_CHECK(key_cache.size(1) == key.size(1) && key_cache.size(3) == key.size(2), "reshape_and_cache: shapes");
  TORCH_CHECK(slot_mapping.scalar_type() == torch::kInt64 && slot_mapping.is_contiguous() &&
                  slot_mapping.numel() == key.size(0), "reshape_and_cache: slot_mapping int64 [num_tokens]");
  const int64_t slots = key_cache.size(0) * key_cache.size(2);
  {  // a plain loop: a torch max() + item() per layer and step cost more than the copy itself
    const int64_t* sm = slot_mapping.data_ptr<int64_t>();
    for (int64_t i = 0; i < slot_mapping.numel(); ++i)
      TORCH_CHECK(sm[i] < slots, "reshape_and_cache: slot ", sm[i], " out of range (", slots, " slots)");
  }
  const int cache_dtype = kv_dtype_of(key_cache);
  if (cache_dtype != ak::kF32 && cache_dtype != ak::kBF16) {
    float* ks = const_cast<float*>(kv_scale_ptr(key_cache, k_scale, "k_scale"));
    float* vs = const_cast<float*>(kv_scale_ptr(value_cache, v_scale, "v_scale"));
    K()->reshape_and_cache_quant(key.data_ptr(), value.data_ptr(), dtype_of(key, "key"), key.stride(0),
                                 key.stride(1), value.stride(0), value.stride(1), key_cache.data_ptr(),
                                 value_cache.data_ptr(), cache_dtype, ks, vs, slot_mapping.data_ptr<int64_t>(),
                                 key.size(0), (int)key.size(1), (int)key.size(2), (int)key_cache.size(2));
    return;
  }
  K()->reshape_and_cache(key.data_ptr(), value.data_ptr(), dtype_of(key, "key"), key.stride(0), key.stride(1),
                         value.stride(0), value.stride(1), key_cache.data_ptr(), value_cache.data_ptr(),
                         dtype_of(key_cache, "key_cache"), slot_mapping.data_ptr<int64_t>(), key.size(0),
                         (int)key.size(1), (int)key.size(2), (int)key_cache.size(2));
}

// W8A8 with group-wise weight scales over weights packed by appliance/layers/quant.py (w8a8_native).
torch::Tensor gemm_w8g_a8(const torch::Tensor& x, const torch::Tensor& w, const torch::Tensor& scale,
                          const torch::Tensor& wsum, int64_t n, int64_t group, bool has_m128) {
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == torch::kFloat32 && x.is_contiguous(), "gemm_w8g_a8: x contiguous float32 [M, K]");
  const int64_t m = x.size(0), k = x.size(1), tiles = (n + 15) / 16;
  TORCH_CHECK(group % 16 == 0 && group <= 256 && k % group == 0, "gemm_w8g_a8: group must be a multiple of 16, <= 256, dividing K; got group ",
              group, " for K ", k);
  TORCH_CHECK(w.scalar_type() == torch::kInt8 && w.is_contiguous() && w.numel() == tiles * 16 * k,
              "gemm_w8g_a8: w int8 [ceil(N/16), K/4, 16, 4]");
  for (const auto* t : {&scale, &wsum})
    TORCH_CHECK(t->scalar_type() == torch::kFloat32 && t->is_contiguous() && t->numel() == tiles * (k / group) * 16,
                "gemm_w8g_a8: scale/wsum float32 [ceil(N/16), K/G, 16]");
  auto out = torch::empty({m, n}, x.options());
  ak::W8GArgs a{};
  a.x = x.data_ptr<float>();
  a.M = m;
  a.K = k;
  a.N = n;
  a.w = w.data_ptr<int8_t>();
  a.scale = scale.data_ptr<float>();
  a.wsum = wsum.data_ptr<float>();
  a.group = (int)group;
  a.has_m128 = has_m128;
  a.out = out.data_ptr<float>();
  if (m > 0 && n > 0) K()->gemm_w8g_a8(a);
  return out;
}

// Low-bit weights (4 or 6 bits) packed by appliance/layers/methods/lowbit.py (see WLowArgs). hiw: the
// 2-bit plane (6 bits only) followed by the int16 group sums of q, in one uint8 tensor; offset may be
// empty (no offsets).
torch::Tensor gemm_wlow_a8(const torch::Tensor& x, const torch::Tensor& lo, const torch::Tensor& hiw,
                           const torch::Tensor& scale, const torch::Tensor& offset, int64_t n, int64_t group,
                           int64_t bits) {
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == torch::kFloat32 && x.is_contiguous(), "gemm_wlow_a8: x contiguous float32 [M, K]");
  const int64_t m = x.size(0), k = x.size(1), tiles = (n + 15) / 16;
  TORCH_CHECK(bits == 4 || bits == 5 || bits == 6, "gemm_wlow_a8: bits must be 4, 5 or 6; got ", bits);
  TORCH_CHECK(k % 16 == 0 && group % 16 == 0 && group <= 256 && k % group == 0,
              "gemm_wlow_a8: group must be a multiple of 16, <= 256, dividing K (a multiple of 16); got group ", group, " for K ", k);
  TORCH_CHECK(bits != 5 || group % 32 == 0, "gemm_wlow_a8: 5 bits need group a multiple of 32; got group ", group);
  TORCH_CHECK(lo.scalar_type() == torch::kUInt8 && lo.is_contiguous() && lo.numel() == tiles * 8 * k,
              "gemm_wlow_a8: lo uint8 [ceil(N/16), K/8, 16, 4]");
  const int64_t hi_bytes = tiles * (bits == 6 ? 4 * k : bits == 5 ? 2 * k : 0), groups = k / group;
  TORCH_CHECK(hiw.scalar_type() == torch::kUInt8 && hiw.is_contiguous() && hiw.numel() == hi_bytes + tiles * groups * 16 * 2,
              "gemm_wlow_a8: hiw uint8: the 2-bit plane [ceil(N/16), K/16, 16, 4] (6 bits) or the 1-bit plane "
              "[ceil(N/16), K/32, 16, 4] (5 bits), then int16 [ceil(N/16), K/G, 16]");
  TORCH_CHECK(scale.scalar_type() == torch::kFloat32 && scale.is_contiguous() && scale.numel() == tiles * groups * 16,
              "gemm_wlow_a8: scale float32 [ceil(N/16), K/G, 16]");
  TORCH_CHECK(!offset.numel() || (offset.scalar_type() == torch::kFloat32 && offset.is_contiguous() &&
                                  offset.numel() == tiles * groups * 16),
              "gemm_wlow_a8: offset float32 [ceil(N/16), K/G, 16] or empty");
  auto out = torch::empty({m, n}, x.options());
  ak::WLowArgs a{};
  a.x = x.data_ptr<float>();
  a.M = m;
  a.K = k;
  a.N = n;
  a.lo = lo.data_ptr<uint8_t>();
  a.hi = bits != 4 ? hiw.data_ptr<uint8_t>() : nullptr;
  a.wsum = reinterpret_cast<const int16_t*>(hiw.data_ptr<uint8_t>() + hi_bytes);
  a.scale = scale.data_ptr<float>();
  a.offset = offset.numel() ? offset.data_ptr<float>() : nullptr;
  a.group = (int)group;
  a.bits = (int)bits;
  a.out = out.data_ptr<float>();
  if (m > 0 && n > 0) K()->gemm_wlow_a8(a);
  return out;
}

// The WLowArgs planes of a canonical low-bit weight (appliance/layers/methods/lowbit.py, pack_lowbit
// and pack_kquant): q int8 [N, K] with values in [-c, c) (c = 8 for 4 bits, 16 for 5, 32 for 6; the
// caller checks), stored as u = q + c in 16-row tiles, rows past N holding q = 0. Returns lo uint8
// [T, K/8, 16, 4] (byte j of 16-input step s, row r: u[16t + r, 8s + j] low nibble, u[.., 8s + 4 + j]
// high nibble), hi uint8 [T, K/16, 16, 4] (6 bits: bits 2p..2p+1 of byte j hold u[16t + r, 16s + 4p + j]
// >> 4), [T, K/32, 16, 4] (5 bits, K a multiple of 32: bit p of byte j holds u[16t + r, 32s + 4p + j] >> 4)
// or empty (4 bits), and qsum int32 [16 T, K/group], the sum of q per group (0 on padding rows).
// A layout transform at load, one pass in parallel over tiles: numpy's strided uint8 operations
// took most of a GGUF's warm start.
std::vector<torch::Tensor> pack_wlow_planes(const torch::Tensor& q, int64_t bits, int64_t group) {
  TORCH_CHECK(q.dim() == 2 && q.scalar_type() == torch::kChar && q.is_contiguous(), "pack_wlow_planes: q contiguous int8 [N, K]");
  TORCH_CHECK(bits == 4 || bits == 5 || bits == 6, "pack_wlow_planes: bits must be 4, 5 or 6; got ", bits);
  const int64_t n = q.size(0), k = q.size(1), tiles = (n + 15) / 16;
  TORCH_CHECK(k % (bits == 5 ? 32 : 16) == 0 && group > 0 && k % group == 0,
              "pack_wlow_planes: K must be a multiple of ", bits == 5 ? 32 : 16, " and of the group; got K ", k,
              ", group ", group);
  auto u8 = torch::TensorOptions().dtype(torch::kUInt8);
  auto lo = torch::empty({tiles, k / 8, 16, 4}, u8);
  auto hi = bits == 5 ? torch::empty({tiles, k / 32, 16, 4}, u8) : torch::empty({bits == 6 ? tiles : 0, k / 16, 16, 4}, u8);
  auto qsum = torch::zeros({tiles * 16, k / group}, torch::TensorOptions().dtype(torch::kInt32));
  const int8_t* qp = q.data_ptr<int8_t>();
  uint8_t* lop = lo.data_ptr<uint8_t>();
  uint8_t* hip = bits != 4 ? hi.data_ptr<uint8_t>() : nullptr;
  int32_t* sp = qsum.data_ptr<int32_t>();
  const int c = bits == 4 ? 8 : bits == 5 ? 16 : 32;
  const int64_t groups = k / group;
  at::parallel_for(0, tiles, 1, [&](int64_t t0, int64_t t1) {
    std::vector<uint8_t> u(16 * k);
    for (int64_t t = t0; t < t1; ++t) {
      for (int r = 0; r < 16; ++r) {
        const int64_t row = 16 * t + r;
        uint8_t* ur = u.data() + r * k;
        if (row >= n) {
          std::fill(ur, ur + k, (uint8_t)c);
          continue;
        }
        const int8_t* qr = qp + row * k;
        int32_t* sr = sp + row * groups;
        for (int64_t i = 0; i < k; ++i) ur[i] = (uint8_t)(qr[i] + c);
        for (int64_t g = 0; g < groups; ++g) {
          int32_t acc = 0;
          for (int64_t i = g * group; i < (g + 1) * group; ++i) acc += qr[i];
          sr[g] = acc;
        }
      }
      uint8_t* lt = lop + t * 8 * k;  // [K/8, 16, 4]
      for (int64_t s = 0; s < k / 8; ++s)
        for (int r = 0; r < 16; ++r) {
          const uint8_t* ur = u.data() + r * k + 8 * s;
          uint8_t* o = lt + (s * 16 + r) * 4;
          for (int j = 0; j < 4; ++j) o[j] = (uint8_t)((ur[j] & 15) | ((ur[4 + j] & 15) << 4));
        }
      if (!hip) continue;
      if (bits == 5) {
        uint8_t* ht = hip + t * 2 * k;  // [K/32, 16, 4]
        for (int64_t s = 0; s < k / 32; ++s)
          for (int r = 0; r < 16; ++r) {
            const uint8_t* ur = u.data() + r * k + 32 * s;
            uint8_t* o = ht + (s * 16 + r) * 4;
            for (int j = 0; j < 4; ++j) {
              uint8_t v = 0;
              for (int p = 0; p < 8; ++p) v = (uint8_t)(v | (((ur[4 * p + j] >> 4) & 1) << p));
              o[j] = v;
            }
          }
        continue;
      }
      uint8_t* ht = hip + t * 4 * k;  // [K/16, 16, 4]
      for (int64_t s = 0; s < k / 16; ++s)
        for (int r = 0; r < 16; ++r) {
          const uint8_t* ur = u.data() + r * k + 16 * s;
          uint8_t* o = ht + (s * 16 + r) * 4;
          for (int j = 0; j < 4; ++j)
            o[j] = (uint8_t)(((ur[j] >> 4) & 3) | (((ur[4 + j] >> 4) & 3) << 2) | (((ur[8 + j] >> 4) & 3) << 4) |
                             (((ur[12 + j] >> 4) & 3) << 6));
        }
    }
  });
  return {lo, hi, qsum};
}

// GGUF blocks -> the canonical integers q = u - centre (appliance/models/gguf_quants.py, whose numpy
// decoders are the reference and hold the layouts' description). kind: 0 Q4_0, 1 Q4_1, 2 Q5_0,
// 3 Q5_1, 4 Q4_K, 5 Q5_K, 6 Q6_K. blocks uint8 [B, type size] -> int8 [B, block size]; the scales
// and zero points stay in Python (one per group, cheap there). One loop per type, each with
// uniform shifts so that the compiler vectorizes it.
namespace gguf_unpack {

// byte v -> 8 bytes, byte i = 16 * bit i of v (the 5th bits of Q5_0/Q5_1, 8 weights at a time)
struct FifthBits {
  uint64_t t[256];
  FifthBits() {
    for (int v = 0; v < 256; ++v) {
      uint64_t x = 0;
      for (int i = 0; i < 8; ++i) x |= (uint64_t)(((v >> i) & 1) << 4) << (8 * i);
      t[v] = x;
    }
  }
};

void q4_0(const uint8_t* x, int8_t* o, int off) {  // fp16 d (, fp16 m), 16 bytes of nibbles
  const uint8_t* qs = x + off;
  for (int j = 0; j < 16; ++j) {
    o[j] = (int8_t)((qs[j] & 15) - 8);
    o[j + 16] = (int8_t)((qs[j] >> 4) - 8);
  }
}

void q5_0(const uint8_t* x, int8_t* o, int off, const FifthBits& fb) {  // 4 bytes of 5th bits, nibbles
  const uint8_t* qh = x + off;
  const uint8_t* qs = qh + 4;
  uint8_t h[32];
  for (int i = 0; i < 4; ++i) std::memcpy(h + 8 * i, &fb.t[qh[i]], 8);
  for (int j = 0; j < 16; ++j) {
    o[j] = (int8_t)(((qs[j] & 15) | h[j]) - 16);
    o[j + 16] = (int8_t)(((qs[j] >> 4) | h[j + 16]) - 16);
  }
}

void qk(const uint8_t* x, int8_t* o, bool five) {  // Q4_K / Q5_K: 128 bytes of nibbles (Q5_K: + 5th bits)
  const uint8_t* qh = x + 16;
  const uint8_t* qs = x + (five ? 48 : 16);
  const int c = five ? 16 : 8;
  for (int i = 0; i < 4; ++i) {
    const uint8_t* s = qs + 32 * i;
    int8_t* lo = o + 64 * i;
    int8_t* hi = lo + 32;
    if (five) {
      for (int l = 0; l < 32; ++l) {
        lo[l] = (int8_t)(((s[l] & 15) | (((qh[l] >> (2 * i)) & 1) << 4)) - c);
        hi[l] = (int8_t)(((s[l] >> 4) | (((qh[l] >> (2 * i + 1)) & 1) << 4)) - c);
      }
    } else {
      for (int l = 0; l < 32; ++l) {
        lo[l] = (int8_t)((s[l] & 15) - c);
        hi[l] = (int8_t)((s[l] >> 4) - c);
      }
    }
  }
}

void q6_k(const uint8_t* x, int8_t* o) {  // 128 bytes of low nibbles, 64 bytes of high 2 bits
  for (int h = 0; h < 2; ++h) {
    const uint8_t* ql = x + 64 * h;
    const uint8_t* qh = x + 128 + 32 * h;
    int8_t* oh = o + 128 * h;
    for (int l = 0; l < 32; ++l) {
      oh[l] = (int8_t)(((ql[l] & 15) | ((qh[l] & 3) << 4)) - 32);
      oh[32 + l] = (int8_t)(((ql[32 + l] & 15) | (((qh[l] >> 2) & 3) << 4)) - 32);
      oh[64 + l] = (int8_t)(((ql[l] >> 4) | (((qh[l] >> 4) & 3) << 4)) - 32);
      oh[96 + l] = (int8_t)(((ql[32 + l] >> 4) | (((qh[l] >> 6) & 3) << 4)) - 32);
    }
  }
}

}  // namespace gguf_unpack

torch::Tensor gguf_unpack_q(const torch::Tensor& blocks, int64_t kind) {
  static const int64_t kTypeSize[] = {18, 20, 22, 24, 144, 176, 210};
  static const int64_t kBlock[] = {32, 32, 32, 32, 256, 256, 256};
  static const gguf_unpack::FifthBits fifth;
  TORCH_CHECK(kind >= 0 && kind <= 6, "gguf_unpack_q: kind must be 0..6; got ", kind);
  TORCH_CHECK(blocks.dim() == 2 && blocks.scalar_type() == torch::kUInt8 && blocks.is_contiguous() &&
                  blocks.size(1) == kTypeSize[kind],
              "gguf_unpack_q: blocks contiguous uint8 [B, ", kTypeSize[kind], "]");
  const int64_t nb = blocks.size(0), bs = kBlock[kind], ts = kTypeSize[kind];
  auto q = torch::empty({nb, bs}, torch::TensorOptions().dtype(torch::kChar));
  const uint8_t* bp = blocks.data_ptr<uint8_t>();
  int8_t* qp = q.data_ptr<int8_t>();
  at::parallel_for(0, nb, 2048, [&](int64_t b0, int64_t b1) {
    const uint8_t* x = bp + b0 * ts;
    int8_t* o = qp + b0 * bs;
    const int64_t m = b1 - b0;
    switch (kind) {
      case 0: for (int64_t b = 0; b < m; ++b) gguf_unpack::q4_0(x + b * ts, o + b * bs, 2); break;
      case 1: for (int64_t b = 0; b < m; ++b) gguf_unpack::q4_0(x + b * ts, o + b * bs, 4); break;
      case 2: for (int64_t b = 0; b < m; ++b) gguf_unpack::q5_0(x + b * ts, o + b * bs, 2, fifth); break;
      case 3: for (int64_t b = 0; b < m; ++b) gguf_unpack::q5_0(x + b * ts, o + b * bs, 4, fifth); break;
      case 4: for (int64_t b = 0; b < m; ++b) gguf_unpack::qk(x + b * ts, o + b * bs, false); break;
      case 5: for (int64_t b = 0; b < m; ++b) gguf_unpack::qk(x + b * ts, o + b * bs, true); break;
      default: for (int64_t b = 0; b < m; ++b) gguf_unpack::q6_k(x + b * ts, o + b * bs); break;
    }
  });
  return q;
}

// Low-bit weights with a GGUF K-quant's own scales (WLowArgs' ksuper > 0), packed by
// appliance/layers/methods/lowbit.py (pack_kquant). flags: 1 the rows have shifts, 2 the groups have
// mins. hi: the 2-bit plane (6 bits) or empty; kf float32: krowsum [T*16], ksup [T, K/S, 16], then
// ksupmin of that shape (mins); k8 int8: kshift [T*16] (shifts), ksub [T, K/G, 16], then ksubmin
// of that shape (mins) (T = ceil(N/16)).
torch::Tensor gemm_wlow_kq_a8(const torch::Tensor& x, const torch::Tensor& lo, const torch::Tensor& hi,
                              const torch::Tensor& kf, const torch::Tensor& k8, int64_t n, int64_t group, int64_t bits,
                              int64_t super, int64_t flags) {
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == torch::kFloat32 && x.is_contiguous(), "gemm_wlow_kq_a8: x contiguous float32 [M, K]");
  const int64_t m = x.size(0), k = x.size(1), tiles = (n + 15) / 16;
  TORCH_CHECK(bits == 4 || bits == 6, "gemm_wlow_kq_a8: bits must be 4 or 6; got ", bits);
  TORCH_CHECK(k % 16 == 0 && group % 16 == 0 && group <= 256 && k % group == 0,
              "gemm_wlow_kq_a8: group must be a multiple of 16, <= 256, dividing K (a multiple of 16); got group ", group, " for K ", k);
  TORCH_CHECK(super > 0 && super % group == 0 && k % super == 0,
              "gemm_wlow_kq_a8: super must be a multiple of group dividing K; got super ", super, " for group ", group, ", K ", k);
  TORCH_CHECK(flags >= 0 && flags < 4, "gemm_wlow_kq_a8: flags must be in [0, 3]; got ", flags);
  TORCH_CHECK(lo.scalar_type() == torch::kUInt8 && lo.is_contiguous() && lo.numel() == tiles * 8 * k,
              "gemm_wlow_kq_a8: lo uint8 [ceil(N/16), K/8, 16, 4]");
  TORCH_CHECK(hi.scalar_type() == torch::kUInt8 && hi.is_contiguous() && hi.numel() == (bits == 6 ? tiles * 4 * k : 0),
              "gemm_wlow_kq_a8: hi uint8 [ceil(N/16), K/16, 16, 4] (6 bits) or empty (4 bits)");
  const int64_t groups = k / group, supers = k / super;
  const bool shifts = flags & 1, mins = flags & 2;
  TORCH_CHECK(k8.scalar_type() == torch::kInt8 && k8.is_contiguous() &&
              k8.numel() == (shifts ? tiles * 16 : 0) + (mins ? 2 : 1) * tiles * groups * 16,
              "gemm_wlow_kq_a8: k8 int8: kshift [ceil(N/16) * 16] (flags & 1), ksub [ceil(N/16), K/G, 16], then "
              "ksubmin of that shape (flags & 2); got ", k8.numel(), " values");
  TORCH_CHECK(kf.scalar_type() == torch::kFloat32 && kf.is_contiguous() &&
              kf.numel() == tiles * 16 + (mins ? 2 : 1) * tiles * supers * 16,
              "gemm_wlow_kq_a8: kf float32: krowsum [ceil(N/16) * 16], ksup [ceil(N/16), K/S, 16], then ksupmin "
              "of that shape (flags & 2); got ", kf.numel(), " values");
  auto out = torch::empty({m, n}, x.options());
  ak::WLowArgs a{};
  a.x = x.data_ptr<float>();
  a.M = m;
  a.K = k;
  a.N = n;
  a.lo = lo.data_ptr<uint8_t>();
  a.hi = bits == 6 ? hi.data_ptr<uint8_t>() : nullptr;
  a.group = (int)group;
  a.bits = (int)bits;
  a.out = out.data_ptr<float>();
  const float* f = kf.data_ptr<float>();
  a.krowsum = f;
  a.ksup = f + tiles * 16;
  a.ksupmin = mins ? a.ksup + tiles * supers * 16 : nullptr;
  const int8_t* b = k8.data_ptr<int8_t>();
  a.kshift = shifts ? b : nullptr;
  a.ksub = shifts ? b + tiles * 16 : b;
  a.ksubmin = mins ? a.ksub + tiles * groups * 16 : nullptr;
  a.ksuper = (int)super;
  if (m > 0 && n > 0) K()->gemm_wlow_a8(a);
  return out;
}

// fp32 GEMM over weights prepacked by appliance/layers/linear.py (backend "native").
torch::Tensor gemm_f32(const torch::Tensor& x, const torch::Tensor& wp, const c10::optional<torch::Tensor>& bias,
                       int64_t n, bool silu_mul) {
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == torch::kFloat32 && x.is_contiguous(), "gemm_f32: x contiguous float32 [M, K]");
  const int64_t m = x.size(0), k = x.size(1), panels = (n + ak::kSgemmPanel - 1) / ak::kSgemmPanel;
  TORCH_CHECK(n > 0 && wp.scalar_type() == torch::kFloat32 && wp.is_contiguous() && wp.numel() == panels * ak::kSgemmPanel * k,
              "gemm_f32: wp float32 [ceil(N/", ak::kSgemmPanel, "), K, ", ak::kSgemmPanel, "] for N=", n, ", K=", k);
  const float* b = nullptr;
  if (bias.has_value() && bias->defined()) {
    TORCH_CHECK(bias->scalar_type() == torch::kFloat32 && bias->is_contiguous() && bias->numel() == n, "gemm_f32: bias float32 [N]");
    b = bias->data_ptr<float>();
  }
  TORCH_CHECK(!silu_mul || n % ak::kSgemmPanel == 0, "gemm_f32: silu_mul needs N a multiple of ", ak::kSgemmPanel);
  auto out = torch::empty({m, silu_mul ? n / 2 : n}, x.options());
  if (m > 0)
    K()->gemm_f32(x.data_ptr<float>(), m, k, wp.data_ptr<float>(), n, b, out.data_ptr<float>(),
                  silu_mul ? ak::kSgemmSiluMul : ak::kSgemmNoAct);
  return out;
}

// Index of each row's first maximum (greedy sampling over float32 logits [rows, n]).
torch::Tensor argmax_rows(const torch::Tensor& x) {
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == torch::kFloat32 && x.stride(1) == 1 && x.size(1) > 0,
              "argmax_rows: x float32 [rows, n > 0] with unit stride along n");
  auto out = torch::empty({x.size(0)}, x.options().dtype(torch::kInt64));
  if (x.size(0) > 0)
    K()->argmax_rows(x.data_ptr<float>(), x.size(0), x.size(1), x.stride(0), out.data_ptr<int64_t>());
  return out;
}

// bf16-weight GEMM over weights prepacked by appliance/ops/native.py pack_bf16 (backend "native_bf16"):
// wp bfloat16 [ceil(N/32), ceil(K/2), 32, 2]; x float32 or bfloat16 [M, K]; the output has x's dtype.
torch::Tensor gemm_bf16(const torch::Tensor& x_in, const torch::Tensor& wp, const c10::optional<torch::Tensor>& bias,
                        int64_t n) {
  TORCH_CHECK(x_in.dim() == 2, "gemm_bf16: x [M, K], got ", x_in.dim(), " dims");
  const auto x = x_in.contiguous();
  const int x_dtype = dtype_of(x, "x");
  const int64_t m = x.size(0), k = x.size(1), panels = (n + ak::kSgemmPanel - 1) / ak::kSgemmPanel;
  TORCH_CHECK(n > 0 && k > 0 && wp.scalar_type() == torch::kBFloat16 && wp.is_contiguous() &&
                  wp.numel() == panels * ak::kSgemmPanel * ((k + 1) / 2) * 2,
              "gemm_bf16: wp bfloat16 [ceil(N/", ak::kSgemmPanel, "), ceil(K/2), ", ak::kSgemmPanel, ", 2] for N=", n,
              ", K=", k);
  torch::Tensor bf;  // the bias in fp32 (a bf16 model's bias is bf16)
  if (bias.has_value() && bias->defined()) {
    TORCH_CHECK(bias->numel() == n, "gemm_bf16: bias [N] with N=", n, ", got ", bias->numel(), " elements");
    bf = bias->to(torch::kFloat32).contiguous();
  }
  auto out = torch::empty({m, n}, x.options());
  if (m > 0)
    K()->gemm_bf16(x.data_ptr(), x_dtype, m, k, reinterpret_cast<const uint16_t*>(wp.data_ptr()), n,
                   bf.defined() ? bf.data_ptr<float>() : nullptr, out.data_ptr(), x_dtype);
  return out;
}

// A linear layer of llama_layers: how its linear method (appliance/layers/methods) packed it. Each
// is applied exactly as that method's ``apply`` (and QuantLinear.forward, for the quantized kinds:
// the float32 result plus the bias, cast to the activations' dtype) does it, op for op.
//   kLinNative  gemm_f32 over pack_f32's panels;       kLinOneDNN  mkldnn::_linear_pointwise;
//   kLinTorch   torch::linear;
//   kLinW8G     gemm_w8g_a8 (w8a8_native): aux {scale, wsum, offset_t}, ints {group, has_m128};
//   kLinInt4Pack _weight_int4pack_mm_for_cpu on bf16 activations (w4a16_int4pack): aux {scales and zeros},
//               ints {group};
//   kLinDynQuant4 _dyn_quant_matmul_4bit (w4a8_dynquant, KleidiAI on Arm): aux {-, -, offset_t},
//               ints {group};
//   kLinInt8Pack _weight_int8pack_mm on bf16 activations (w8a16_int8pack): aux {bf16 scales}.
//   kLinBF16    gemm_bf16 over pack_bf16's panels (native_bf16).
//   kLinWLow    gemm_wlow_a8 (w4a8_native, w6a8_native): aux {hiw, scale, offset}, ints {group, bits};
//               with K-quant scales (ints[3] = super | flags << 16) gemm_wlow_kq_a8: aux {hi, kf, k8}.
// offset_t [G, N] (empty: none) is the group zero points' term: x's G group sums times it, added.
enum LinearKind : int64_t {
  kLinNative = 0, kLinOneDNN = 1, kLinTorch = 2, kLinW8G = 3, kLinInt4Pack = 4, kLinDynQuant4 = 5, kLinInt8Pack = 6,
  kLinBF16 = 7, kLinWLow = 8
};

// oneDNN's prepacked linear, as Linear.forward calls it (mkldnn::_linear_pointwise, attr "none").
torch::Tensor onednn_linear(const torch::Tensor& x, const torch::Tensor& w, const c10::optional<torch::Tensor>& b) {
  static const c10::OperatorHandle op =
      c10::Dispatcher::singleton().findSchemaOrThrow("mkldnn::_linear_pointwise", "");
  torch::jit::Stack st;
  st.emplace_back(x);
  st.emplace_back(w);
  st.emplace_back(b.has_value() ? c10::IValue(*b) : c10::IValue());
  st.emplace_back(std::string("none"));
  st.emplace_back(c10::impl::GenericList(c10::OptionalType::create(c10::NumberType::get())));
  st.emplace_back(std::string(""));
  op.callBoxed(&st);
  return st[0].toTensor();
}

c10::optional<torch::Tensor> opt_tensor(const torch::Tensor& t) {
  return t.numel() ? c10::optional<torch::Tensor>(t) : c10::nullopt;
}

// A group zero point's term, as the methods' qmath.add_offset: y + x's group sums @ offset_t [G, N].
torch::Tensor add_offset(const torch::Tensor& y, const torch::Tensor& xf, const torch::Tensor& off_t) {
  if (!off_t.numel()) return y;
  return torch::addmm(y, xf.reshape({xf.size(0), off_t.size(0), -1}).sum(-1), off_t);
}

// One linear layer as its method packed it (a LinearKind, see above): lin kLinearEntries tensors
// (weight, bias, aux0..2), ki kLinearInts ints (kind, then three kind-specific), n output features.
torch::Tensor apply_linear(const int64_t* ki, const torch::Tensor& x, const torch::Tensor* lin, int64_t n,
                           const char* who) {
  const int64_t kind = ki[0];
  const torch::Tensor& w = lin[0];
  const auto b = opt_tensor(lin[1]);
  if (kind == kLinNative) return gemm_f32(x, w, b, n, false);
  if (kind == kLinOneDNN) return onednn_linear(x, w, b);
  if (kind == kLinTorch) return torch::linear(x, w, b);
  if (kind == kLinBF16) return gemm_bf16(x, w, b, n);
  torch::Tensor y;
  if (kind == kLinW8G) {
    const auto xf = x.to(torch::kFloat32).contiguous();
    y = add_offset(gemm_w8g_a8(xf, w, lin[2], lin[3], n, ki[1], ki[2] != 0), xf, lin[4]);
  } else if (kind == kLinInt4Pack) {
    y = at::_weight_int4pack_mm_for_cpu(x.to(torch::kBFloat16), w, ki[1], lin[2]).to(torch::kFloat32);
  } else if (kind == kLinDynQuant4) {
    const auto xf = x.to(torch::kFloat32);
    y = add_offset(at::_dyn_quant_matmul_4bit(xf, w, ki[1], x.size(1), n), xf, lin[4]);
  } else if (kind == kLinInt8Pack) {
    y = at::_weight_int8pack_mm(x.to(torch::kBFloat16), w, lin[2]).to(torch::kFloat32);
  } else if (kind == kLinWLow && ki[3]) {  // K-quant scales: ki[3] = super | flags << 16
    y = gemm_wlow_kq_a8(x.to(torch::kFloat32).contiguous(), w, lin[2], lin[3], lin[4], n, ki[1], ki[2],
                        ki[3] & 0xFFFF, ki[3] >> 16);
  } else if (kind == kLinWLow) {
    y = gemm_wlow_a8(x.to(torch::kFloat32).contiguous(), w, lin[2], lin[3], lin[4], n, ki[1], ki[2]);
  } else {
    TORCH_CHECK(false, who, ": unknown linear kind ", kind);
  }
  if (b.has_value()) y = y + b->to(torch::kFloat32);
  return y.to(x.scalar_type());
}

// Every decoder layer of a Llama-family model (Llama, Mistral, Qwen2, Qwen3: pre-norm, fused
// q/k/v with optional bias, optional per-head q/k RMSNorm, neox rotary, paged attention, o_proj,
// gate/up then silu(gate) * up, down) in one call, through the same functions as the per-op path
// (appliance/models/llama.py) and in its order, so the results are the same. What it saves is the
// Python between ops: ~10-25 us per op, ~4 ms of a 64-sequence decode step of the default model.
// layers: kLayerEntries tensors per layer, an empty tensor where the layer has none:
//   input_norm_w, q_norm_w, k_norm_w, post_norm_w, key_cache, value_cache, then for each of the
//   q/k/v, o, gate/up and down projections kLinearEntries tensors: weight, bias, aux0, aux1, aux2
// kinds: kLinearInts int64 per projection (kind, then three kind-specific ints), four per layer.
// windows: one int64 per layer, its attention's sliding window (0: full attention).
// A native gate/up weight is packed for the silu epilogue (its bias in the packed order); the others
// are followed by silu_and_mul.
// Gemma 2/3 (appliance/models/gemma.py) add, all optional so a Llama call is unchanged:
// extras: empty, or kExtraEntries tensors per layer: pre_ff_norm_w, post_ff_norm_w, cos_sin (empty: the
//   shared table). With them a layer is "sandwich"-normed: post_norm_w normalizes o_proj's output alone,
//   pre_ff_norm_w is the residual add's norm, post_ff_norm_w normalizes down's output; the norm weights
//   are the float32 factors (1 + w) of Gemma's offset norm.
// act: the gate's activation, kActSilu (silu_and_mul; a native gate/up packed for the silu epilogue), or
//   gelu(gate) * up with torch's tanh (kActGeluTanh) or exact (kActGelu) GELU, as ops gelu_and_mul does.
// logits_soft_cap: the attention scores' soft cap (Gemma 2), 0: none.
// kv_scales: empty (float32 / bfloat16 caches), or 2 per layer, its k_scale then v_scale: a quantized
//   cache's (--kv-cache-dtype int8 / fp8) per-row float32 scales [num_blocks, num_kv_heads, block_size],
//   written and read by reshape_and_cache and paged_attention as on the per-op path (appliance/layers/
//   attention.py), so the stack reads and writes the same codes and scales.
// Returns the final norm of the last hidden states, [num_tokens, hidden].
constexpr size_t kLinearEntries = 5;
constexpr size_t kLinearInts = 4;
constexpr size_t kLayerEntries = 6 + 4 * kLinearEntries;
constexpr size_t kExtraEntries = 3;
enum Activation : int64_t { kActSilu = 0, kActGeluTanh = 1, kActGelu = 2 };

torch::Tensor llama_layers(const torch::Tensor& embeds, const torch::Tensor& positions,
                           const std::vector<torch::Tensor>& layers, const std::vector<int64_t>& kinds,
                           const std::vector<int64_t>& windows, const torch::Tensor& final_norm_w, double eps, int64_t num_heads, int64_t num_kv_heads,
                           int64_t head_dim, int64_t intermediate, double scale, const torch::Tensor& cos_sin,
                           const torch::Tensor& slot_mapping, const torch::Tensor& block_table,
                           const torch::Tensor& seq_lens, const torch::Tensor& query_start_loc,
                           int64_t allreduce_fn, int64_t allreduce_handle,
                           const std::vector<torch::Tensor>& extras, int64_t act, double logits_soft_cap,
                           const std::vector<torch::Tensor>& kv_scales) {
  TORCH_CHECK(!layers.empty() && layers.size() % kLayerEntries == 0, "llama_layers: ", kLayerEntries,
              " tensors per layer, got ", layers.size());
  const size_t L = layers.size() / kLayerEntries;
  TORCH_CHECK(extras.empty() || extras.size() == kExtraEntries * L, "llama_layers: extras empty or ",
              kExtraEntries, " tensors per layer (", kExtraEntries * L, "), got ", extras.size());
  TORCH_CHECK(act == kActSilu || act == kActGeluTanh || act == kActGelu, "llama_layers: act 0 (silu), "
              "1 (gelu tanh) or 2 (gelu), got ", act);
  TORCH_CHECK(logits_soft_cap >= 0, "llama_layers: logits_soft_cap >= 0, got ", logits_soft_cap);
  TORCH_CHECK(kinds.size() == 4 * kLinearInts * L, "llama_layers: ", 4 * kLinearInts, " ints per layer");
  TORCH_CHECK(windows.size() == L, "llama_layers: one window per layer (", L, "), got ", windows.size());
  TORCH_CHECK(kv_scales.empty() || kv_scales.size() == 2 * L, "llama_layers: kv_scales empty or 2 tensors per "
              "layer (", 2 * L, "), got ", kv_scales.size());
  TORCH_CHECK(embeds.dim() == 2, "llama_layers: embeds [T, hidden]");
  dtype_of(embeds, "embeds");
  const int64_t T = embeds.size(0), hidden = embeds.size(1);
  const int64_t q_size = num_heads * head_dim, kv_size = num_kv_heads * head_dim, qkv_n = q_size + 2 * kv_size;
  const auto pos = positions.to(torch::kInt64).contiguous();
  const auto slots = slot_mapping.to(torch::kInt64).contiguous();
  const auto bt = block_table.to(torch::kInt32).contiguous();
  const auto sl = seq_lens.to(torch::kInt32).contiguous();
  const auto qsl = query_start_loc.to(torch::kInt32).contiguous();
  const auto cs = cos_sin.to(torch::kFloat32).contiguous();
  auto linear = [](const int64_t* ki, const torch::Tensor& x, const torch::Tensor* lin, int64_t n) {
    return apply_linear(ki, x, lin, n, "llama_layers");
  };
  auto head_norm = [&](const torch::Tensor& x, const torch::Tensor& w) {  // Qwen3's q/k RMSNorm
    const auto xc = x.contiguous();
    auto out = torch::empty_like(xc);
    rms_norm(xc, w, eps, out);
    return out;
  };
  // Tensor parallel: the row-parallel o_proj and down_proj give each rank a partial sum, which
  // allreduce_fn (an ``int fn(void* handle, void* data, size_t n, int dtype, char* err, size_t errlen)``,
  // the shared-memory all-reduce's C entry, appliance/distributed/shm_allreduce.py ShmSegment.c_entry)
  // sums in place before the residual add, as appliance.layers.parallel.finish does on the per-op path.
  // Passed as an address, so this extension has no link dependency on that library; 0: one rank.
  using AllReduceFn = int (*)(void*, void*, size_t, int, char*, size_t);
  const auto all_reduce = reinterpret_cast<AllReduceFn>(allreduce_fn);
  auto reduce_ = [&](const torch::Tensor& y) {
    if (!all_reduce) return;
    TORCH_CHECK(y.is_contiguous(), "llama_layers: all-reduce of a non-contiguous tensor");
    const int code = y.scalar_type() == torch::kFloat32 ? 0 : y.scalar_type() == torch::kBFloat16 ? 1 : -1;
    TORCH_CHECK(code >= 0, "llama_layers: all-reduce takes float32 or bfloat16, got ", y.scalar_type());
    char err[512] = {0};
    if (all_reduce(reinterpret_cast<void*>(allreduce_handle), y.data_ptr(), size_t(y.numel()), code, err,
                   sizeof err) != 0)
      TORCH_CHECK(false, "llama_layers: ", err);
  };
  torch::Tensor residual = embeds.contiguous().clone();
  torch::Tensor h = torch::empty_like(residual);
  rms_norm(residual, layers[0], eps, h);
  for (size_t l = 0; l < L; ++l) {
    const torch::Tensor* p = &layers[l * kLayerEntries];
    const torch::Tensor* lin = p + 6;  // q/k/v, o, gate/up, down: kLinearEntries each
    const int64_t* ki = &kinds[kLinearInts * 4 * l];
    const torch::Tensor* ex = extras.empty() ? nullptr : &extras[l * kExtraEntries];
    torch::Tensor lcs = cs;
    if (ex && ex[2].numel()) {
      TORCH_CHECK(ex[2].scalar_type() == torch::kFloat32 && ex[2].is_contiguous() && ex[2].sizes() == cs.sizes(),
                  "llama_layers: layer ", l, "'s cos_sin float32, contiguous, shaped like cos_sin");
      lcs = ex[2];
    }
    torch::Tensor kc = p[4], vc = p[5];
    if (l > 0) {
      auto hn = torch::empty_like(residual);
      fused_add_rms_norm(h, residual, p[0], eps, hn);
      h = hn;
    }
    const auto qkv = linear(ki, h, lin, qkv_n);
    torch::Tensor q = qkv.narrow(1, 0, q_size).view({T, num_heads, head_dim});
    torch::Tensor k = qkv.narrow(1, q_size, kv_size).view({T, num_kv_heads, head_dim});
    const auto v = qkv.narrow(1, q_size + kv_size, kv_size).view({T, num_kv_heads, head_dim});
    if (p[1].numel()) q = head_norm(q, p[1]);
    if (p[2].numel()) k = head_norm(k, p[2]);
    auto qr = torch::empty({T, num_heads, head_dim}, qkv.options());
    auto kr = torch::empty({T, num_kv_heads, head_dim}, qkv.options());
    rotary_embedding(pos, q, lcs, true, qr);
    rotary_embedding(pos, k, lcs, true, kr);
    // a quantized cache's scales (the bindings refuse such a cache without them, naming k_scale / v_scale)
    c10::optional<torch::Tensor> ks, vs;
    if (!kv_scales.empty()) ks = kv_scales[2 * l], vs = kv_scales[2 * l + 1];
    reshape_and_cache(kr, v, kc, vc, slots, ks, vs);
    auto attn = torch::empty({T, num_heads, head_dim}, qkv.options());
    paged_attention(qr, kc, vc, bt, sl, qsl, scale, attn, windows[l], logits_soft_cap, ks, vs);
    const auto o = linear(ki + kLinearInts, attn.view({T, q_size}), lin + kLinearEntries, hidden);
    reduce_(o);
    auto hn = torch::empty_like(residual);
    if (ex) {  // Gemma: o normed alone, then added to the residual under the pre-feed-forward norm
      auto on = torch::empty_like(o);
      rms_norm(o, p[3], eps, on);
      fused_add_rms_norm(on, residual, ex[0], eps, hn);
    } else {
      fused_add_rms_norm(o, residual, p[3], eps, hn);
    }
    torch::Tensor a;
    const torch::Tensor* gu_lin = lin + 2 * kLinearEntries;
    if (act == kActSilu && ki[2 * kLinearInts] == kLinNative) {
      a = gemm_f32(hn, gu_lin[0], opt_tensor(gu_lin[1]), 2 * intermediate, true);
    } else {
      const auto gu = linear(ki + 2 * kLinearInts, hn, gu_lin, 2 * intermediate);
      if (act == kActSilu) {
        a = torch::empty({T, intermediate}, gu.options());
        silu_and_mul(gu, a);
      } else {  // ops gelu_and_mul (reference.gelu_and_mul): torch's GELU of the gate times up
        a = at::gelu(gu.narrow(1, 0, intermediate), act == kActGeluTanh ? "tanh" : "none") *
            gu.narrow(1, intermediate, intermediate);
      }
    }
    h = linear(ki + 3 * kLinearInts, a, lin + 3 * kLinearEntries, hidden);
    reduce_(h);
    if (ex) {  // Gemma's post-feed-forward norm; the next layer's input norm adds it to the residual
      auto hn2 = torch::empty_like(h);
      rms_norm(h, ex[1], eps, hn2);
      h = hn2;
    }
  }
  auto out = torch::empty_like(residual);
  fused_add_rms_norm(h, residual, final_norm_w, eps, out);
  return out;
}

// One mixture-of-experts layer's experts in one call: sum over k of weights[t, k] *
// expert[ids[t, k]](x[t]), as appliance/layers/fused_moe.py grouped_experts computes it. experts:
// per expert 2 * kLinearEntries tensors (its gate/up then its down projection, as llama_layers takes a
// projection), kinds: 2 * kLinearInts ints per expert (its LinearKinds, from the methods'
// fused_descriptor). The step's (token, slot) pairs are sorted by expert (stably, counting sort); when
// every touched expert is native fp32 (gate/up packed for the silu epilogue, no biases) and x is
// float32, the kernel table's moe_f32 runs them all in one parallel region; when every touched
// expert's gate/up (and down) is one quantized kind (W8G, or low-bit with fp32 group scales or with
// a GGUF K-quant's own scales at one super-block size) of one group size, without bias (nor, for
// W8G, offsets), moe_q does (each token quantized once, (expert, tile) items
// over the threads); otherwise each touched expert's projections run once on its rows, through the
// kinds as llama_layers applies them. Each
// row's output is weighted in the weights' dtype, rounded to x's, and a token's k rows are added in
// increasing expert order in x's dtype (transformers' loop over experts).
// Calls that ran moe_q (tests and benchmarks read which path ran: moe_q_calls).
static std::atomic<int64_t> g_moe_q_calls{0};

int64_t moe_q_calls() { return g_moe_q_calls.load(); }

// per_expert: always the per-expert loop (the reference the one-region paths are tested against).
torch::Tensor moe_experts(const torch::Tensor& x_in, const torch::Tensor& ids_in, const torch::Tensor& weights,
                          const std::vector<torch::Tensor>& experts, const std::vector<int64_t>& kinds,
                          int64_t intermediate, bool per_expert) {
  TORCH_CHECK(x_in.dim() == 2, "moe_experts: x [T, hidden], got ", x_in.dim(), " dims");
  TORCH_CHECK(ids_in.dim() == 2 && ids_in.size(0) == x_in.size(0), "moe_experts: ids [T, top_k] with T=",
              x_in.size(0), ", got ", ids_in.sizes());
  TORCH_CHECK(weights.sizes() == ids_in.sizes(), "moe_experts: weights of ids' shape ", ids_in.sizes(), ", got ",
              weights.sizes());
  TORCH_CHECK(!experts.empty() && experts.size() % (2 * kLinearEntries) == 0, "moe_experts: ",
              2 * kLinearEntries, " tensors per expert, got ", experts.size());
  const int64_t E = (int64_t)(experts.size() / (2 * kLinearEntries));
  TORCH_CHECK(kinds.size() == (size_t)E * 2 * kLinearInts, "moe_experts: ", 2 * kLinearInts,
              " ints per expert (", E, " experts), got ", kinds.size());
  TORCH_CHECK(intermediate > 0, "moe_experts: intermediate must be > 0, got ", intermediate);
  const auto x = x_in.contiguous();
  const auto ids = ids_in.to(torch::kInt64).contiguous();
  const int64_t T = x.size(0), H = x.size(1), k = ids.size(1), R = T * k;
  const int64_t* id = ids.data_ptr<int64_t>();
  std::vector<int64_t> start(E + 1, 0);
  for (int64_t f = 0; f < R; ++f) {
    TORCH_CHECK(id[f] >= 0 && id[f] < E, "moe_experts: expert ids must be in [0, ", E, "), got ", id[f]);
    ++start[id[f] + 1];
  }
  for (int64_t e = 0; e < E; ++e) start[e + 1] += start[e];
  // order[r]: the (token, slot) index f of grouped row r (stable within an expert)
  auto order = torch::empty({R}, torch::kInt64);
  {
    int64_t* o = order.data_ptr<int64_t>();
    std::vector<int64_t> pos(start.begin(), start.end() - 1);
    for (int64_t f = 0; f < R; ++f) o[pos[id[f]]++] = f;
  }
  const auto token_of = torch::div(order, k, "floor");
  // [R, H], each expert's rows contiguous: the float paths' input (moe_q gathers quantized bytes itself)
  auto gathered_rows = [&] { return x.index_select(0, token_of); };
  auto lin_of = [&](int64_t e, int which) { return &experts[(size_t)(2 * e + which) * kLinearEntries]; };
  auto ki_of = [&](int64_t e, int which) { return &kinds[(size_t)(2 * e + which) * kLinearInts]; };
  bool all_f32 = !per_expert && x.scalar_type() == torch::kFloat32 && intermediate % (ak::kSgemmPanel / 2) == 0;
  for (int64_t e = 0; e < E && all_f32; ++e) {
    if (start[e + 1] == start[e]) continue;
    for (int which = 0; which < 2; ++which) {
      const torch::Tensor* lin = lin_of(e, which);
      all_f32 = all_f32 && ki_of(e, which)[0] == kLinNative && !lin[1].numel();
    }
  }
  // Quantized experts in one call (moe_q): per projection every touched expert on one kind (W8G, or
  // low-bit with fp32 group scales or with a GGUF K-quant's own scales) with one group size (and bit
  // width, and K-quant super-block), no bias, no W8G offsets.
  ak::MoeQProj qp[2] = {};
  std::vector<const void*> qw[2], qws[2];
  std::vector<const uint8_t*> qhi[2];
  std::vector<const float*> qsc[2], qoff[2], qksup[2], qksupmin[2], qkrow[2];
  std::vector<const int8_t*> qksub[2], qksubmin[2], qkshift[2];
  std::vector<uint8_t> qm128[2];
  bool all_q = !per_expert && !all_f32 && x.scalar_type() == torch::kFloat32 && R > 0;
  for (int which = 0; which < 2 && all_q; ++which) {
    const int64_t K = which ? intermediate : H, N = which ? H : 2 * intermediate, tiles = (N + 15) / 16;
    const char* proj = which ? " down" : " gate/up";
    int64_t kind = -1, group = 0, bits = 0, super = 0;
    for (auto* v : {&qw[which], &qws[which]}) v->assign(E, nullptr);
    for (auto* v : {&qsc[which], &qoff[which], &qksup[which], &qksupmin[which], &qkrow[which]}) v->assign(E, nullptr);
    for (auto* v : {&qksub[which], &qksubmin[which], &qkshift[which]}) v->assign(E, nullptr);
    qhi[which].assign(E, nullptr);
    qm128[which].assign(E, 0);
    for (int64_t e = 0; e < E && all_q; ++e) {
      if (start[e + 1] == start[e]) continue;
      const int64_t* ki = ki_of(e, which);
      const torch::Tensor* lin = lin_of(e, which);
      const bool w8 = ki[0] == kLinW8G, wl = ki[0] == kLinWLow;
      const int64_t esuper = wl ? (ki[3] & 0xFFFF) : 0;  // K-quant scales: ki[3] = super | flags << 16
      if (!(w8 || wl) || lin[1].numel() || (w8 && lin[4].numel()) ||
          (kind >= 0 && (ki[0] != kind || ki[1] != group || (wl && (ki[2] != bits || esuper != super))))) {
        all_q = false;
        break;
      }
      kind = ki[0], group = ki[1], bits = wl ? ki[2] : 0, super = esuper;
      TORCH_CHECK(group % 16 == 0 && group > 0 && group <= 256 && K % group == 0 && K % 16 == 0, "moe_experts: expert ",
                  e, proj, ": group must be a multiple of 16, <= 256, dividing K=", K, "; got ", group);
      const int64_t groups = K / group;
      if (super) {  // as gemm_wlow_kq_a8 takes them: lo, hi (6 bits), kf, k8
        const int64_t flags = ki[3] >> 16, supers = K / super;
        TORCH_CHECK(super % group == 0 && K % super == 0, "moe_experts: expert ", e, proj,
                    ": super must be a multiple of group dividing K=", K, "; got super ", super, " for group ", group);
        TORCH_CHECK(flags >= 0 && flags < 4, "moe_experts: expert ", e, proj, ": flags must be in [0, 3]; got ", flags);
        TORCH_CHECK(bits == 4 || bits == 6, "moe_experts: expert ", e, proj, ": bits must be 4 or 6; got ", bits);
        const bool shifts = flags & 1, mins = flags & 2;
        TORCH_CHECK(lin[0].scalar_type() == torch::kUInt8 && lin[0].is_contiguous() && lin[0].numel() == tiles * 8 * K,
                    "moe_experts: expert ", e, proj, ": lo uint8 [", tiles, ", ", K / 8, ", 16, 4]");
        TORCH_CHECK(lin[2].scalar_type() == torch::kUInt8 && lin[2].is_contiguous() &&
                        lin[2].numel() == (bits == 6 ? tiles * 4 * K : 0),
                    "moe_experts: expert ", e, proj, ": hi uint8 [", tiles, ", ", K / 16, ", 16, 4] (6 bits) or empty");
        TORCH_CHECK(lin[3].scalar_type() == torch::kFloat32 && lin[3].is_contiguous() &&
                        lin[3].numel() == tiles * 16 + (mins ? 2 : 1) * tiles * supers * 16,
                    "moe_experts: expert ", e, proj, ": kf float32: krowsum [", tiles * 16, "], ksup [", tiles, ", ",
                    supers, ", 16], then ksupmin of that shape (flags & 2); got ", lin[3].numel(), " values");
        TORCH_CHECK(lin[4].scalar_type() == torch::kInt8 && lin[4].is_contiguous() &&
                        lin[4].numel() == (shifts ? tiles * 16 : 0) + (mins ? 2 : 1) * tiles * groups * 16,
                    "moe_experts: expert ", e, proj, ": k8 int8: kshift [", tiles * 16, "] (flags & 1), ksub [", tiles,
                    ", ", groups, ", 16], then ksubmin of that shape (flags & 2); got ", lin[4].numel(), " values");
        qw[which][e] = lin[0].data_ptr<uint8_t>();
        qhi[which][e] = bits == 6 ? lin[2].data_ptr<uint8_t>() : nullptr;
        const float* f = lin[3].data_ptr<float>();
        qkrow[which][e] = f;
        qksup[which][e] = f + tiles * 16;
        qksupmin[which][e] = mins ? f + tiles * 16 + tiles * supers * 16 : nullptr;
        const int8_t* b8 = lin[4].data_ptr<int8_t>();
        qkshift[which][e] = shifts ? b8 : nullptr;
        qksub[which][e] = shifts ? b8 + tiles * 16 : b8;
        qksubmin[which][e] = mins ? qksub[which][e] + tiles * groups * 16 : nullptr;
        continue;
      }
      const torch::Tensor& sc = wl ? lin[3] : lin[2];
      TORCH_CHECK(sc.scalar_type() == torch::kFloat32 && sc.is_contiguous() && sc.numel() == tiles * groups * 16,
                  "moe_experts: expert ", e, " scale float32 [", tiles, ", ", groups, ", 16]");
      qsc[which][e] = sc.data_ptr<float>();
      if (w8) {
        TORCH_CHECK(lin[0].scalar_type() == torch::kInt8 && lin[0].is_contiguous() && lin[0].numel() == tiles * 16 * K,
                    "moe_experts: expert ", e, " w int8 [", tiles, ", ", K / 4, ", 16, 4]");
        TORCH_CHECK(lin[3].scalar_type() == torch::kFloat32 && lin[3].is_contiguous() &&
                        lin[3].numel() == tiles * groups * 16,
                    "moe_experts: expert ", e, " wsum float32 [", tiles, ", ", groups, ", 16]");
        qw[which][e] = lin[0].data_ptr<int8_t>();
        qws[which][e] = lin[3].data_ptr<float>();
        qm128[which][e] = ki[2] != 0;
      } else {
        TORCH_CHECK(bits == 4 || bits == 5 || bits == 6, "moe_experts: expert ", e, " bits must be 4, 5 or 6; got ", bits);
        TORCH_CHECK(bits != 5 || group % 32 == 0, "moe_experts: expert ", e, " 5 bits need group a multiple of 32; got ", group);
        TORCH_CHECK(lin[0].scalar_type() == torch::kUInt8 && lin[0].is_contiguous() && lin[0].numel() == tiles * 8 * K,
                    "moe_experts: expert ", e, " lo uint8 [", tiles, ", ", K / 8, ", 16, 4]");
        const int64_t hi_bytes = tiles * (bits == 6 ? 4 * K : bits == 5 ? 2 * K : 0);
        TORCH_CHECK(lin[2].scalar_type() == torch::kUInt8 && lin[2].is_contiguous() &&
                        lin[2].numel() == hi_bytes + tiles * groups * 16 * 2,
                    "moe_experts: expert ", e, " hiw uint8: the 2-bit (6 bits) or 1-bit (5 bits) plane then int16 group sums");
        qw[which][e] = lin[0].data_ptr<uint8_t>();
        qhi[which][e] = bits != 4 ? lin[2].data_ptr<uint8_t>() : nullptr;
        qws[which][e] = lin[2].data_ptr<uint8_t>() + hi_bytes;
        if (lin[4].numel()) {
          TORCH_CHECK(lin[4].scalar_type() == torch::kFloat32 && lin[4].is_contiguous() &&
                          lin[4].numel() == tiles * groups * 16,
                      "moe_experts: expert ", e, " offset float32 [", tiles, ", ", groups, ", 16] or empty");
          qoff[which][e] = lin[4].data_ptr<float>();
        }
      }
    }
    qp[which].kind = kind == kLinW8G ? 0 : 1;
    qp[which].group = (int)group;
    qp[which].bits = (int)bits;
    qp[which].w = qw[which].data();
    qp[which].hi = qhi[which].data();
    qp[which].scale = qsc[which].data();
    qp[which].wsum = qws[which].data();
    qp[which].m128 = qm128[which].data();
    qp[which].offset = qoff[which].data();
    qp[which].ksuper = (int)super;
    qp[which].ksub = qksub[which].data();
    qp[which].ksubmin = qksubmin[which].data();
    qp[which].ksup = qksup[which].data();
    qp[which].ksupmin = qksupmin[which].data();
    qp[which].krowsum = qkrow[which].data();
    qp[which].kshift = qkshift[which].data();
  }
  torch::Tensor y;
  if (all_q) {
    auto gu_out = torch::empty({R, 2 * intermediate}, x.options());
    y = torch::empty({R, H}, x.options());
    ak::MoeQArgs a{};
    a.x = x.data_ptr<float>();
    a.T = T;
    a.H = H;
    a.I = intermediate;
    a.E = E;
    a.start = start.data();
    a.token = token_of.data_ptr<int64_t>();
    a.gu = qp[0];
    a.dn = qp[1];
    a.gu_out = gu_out.data_ptr<float>();
    a.y = y.data_ptr<float>();
    K()->moe_q(a);
    ++g_moe_q_calls;
  } else if (all_f32) {
    const int64_t pgu = (2 * intermediate + ak::kSgemmPanel - 1) / ak::kSgemmPanel;
    const int64_t pdn = (H + ak::kSgemmPanel - 1) / ak::kSgemmPanel;
    std::vector<const float*> wgu(E, nullptr), wdn(E, nullptr);
    for (int64_t e = 0; e < E; ++e) {
      if (start[e + 1] == start[e]) continue;
      const torch::Tensor& g = lin_of(e, 0)[0];
      const torch::Tensor& d = lin_of(e, 1)[0];
      TORCH_CHECK(g.scalar_type() == torch::kFloat32 && g.is_contiguous() && g.numel() == pgu * ak::kSgemmPanel * H,
                  "moe_experts: expert ", e, " gate/up: float32 panels [", pgu, ", ", H, ", ", ak::kSgemmPanel,
                  "], got ", g.numel(), " values");
      TORCH_CHECK(d.scalar_type() == torch::kFloat32 && d.is_contiguous() &&
                      d.numel() == pdn * ak::kSgemmPanel * intermediate,
                  "moe_experts: expert ", e, " down: float32 panels [", pdn, ", ", intermediate, ", ",
                  ak::kSgemmPanel, "], got ", d.numel(), " values");
      wgu[e] = g.data_ptr<float>();
      wdn[e] = d.data_ptr<float>();
    }
    auto act = torch::empty({R, intermediate}, x.options());
    y = torch::empty({R, H}, x.options());
    ak::MoeF32Args a{};
    const auto rows = gathered_rows();
    a.xg = rows.data_ptr<float>();
    a.H = H;
    a.I = intermediate;
    a.E = E;
    a.start = start.data();
    a.wgu = wgu.data();
    a.wdn = wdn.data();
    a.act = act.data_ptr<float>();
    a.y = y.data_ptr<float>();
    K()->moe_f32(a);
  } else {
    y = torch::empty({R, H}, x.options());
    const auto rows = gathered_rows();
    for (int64_t e = 0; e < E; ++e) {
      const int64_t n = start[e + 1] - start[e];
      if (!n) continue;
      const auto xs = rows.narrow(0, start[e], n);
      const torch::Tensor* gu = lin_of(e, 0);
      torch::Tensor act;
      if (ki_of(e, 0)[0] == kLinNative) {  // packed for the silu epilogue (NativeLinear.fused_descriptor)
        act = gemm_f32(xs, gu[0], opt_tensor(gu[1]), 2 * intermediate, true);
      } else {
        const auto g = apply_linear(ki_of(e, 0), xs, gu, 2 * intermediate, "moe_experts");
        act = torch::empty({n, intermediate}, g.options());
        silu_and_mul(g, act);
      }
      y.narrow(0, start[e], n).copy_(apply_linear(ki_of(e, 1), act, lin_of(e, 1), H, "moe_experts"));
    }
  }
  const auto w = weights.reshape({-1}).index_select(0, order);
  const auto contrib = (y * w.unsqueeze(1)).to(x.scalar_type());
  // by_token: each token's k rows in increasing expert order (grouped rows are in expert order)
  const auto by_token = std::get<1>(torch::sort(token_of, /*stable=*/true, /*dim=*/0, /*descending=*/false));
  const auto per_slot = contrib.index_select(0, by_token).view({T, k, H});
  auto out = per_slot.select(1, 0).clone();
  for (int64_t j = 1; j < k; ++j) out.add_(per_slot.select(1, j));
  return out;
}

bool cpu_has(const std::string& name) { return ak::cpu_has(name.c_str()); }

std::string kernel_variant() { return K()->name; }

std::vector<std::string> available_variants() {
  const ak::KernelTable* list[8];
  const int n = ak::available_kernels(list, 8);
  std::vector<std::string> names;
  for (int i = 0; i < n; ++i) names.push_back(list[i]->name);
  return names;
}

bool set_variant(const std::string& name) { return ak::select_kernels(name.c_str()); }

std::string cpu_features() { return ak::cpu_features_string(); }

}  // namespace

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.doc() = "appliance native kernels (native/neon_sve)";
  m.def("paged_attention", &paged_attention, pybind11::arg("query"), pybind11::arg("key_cache"),
        pybind11::arg("value_cache"), pybind11::arg("block_table"), pybind11::arg("seq_lens"),
        pybind11::arg("query_start_loc"), pybind11::arg("scale"), pybind11::arg("out"),
        pybind11::arg("sliding_window") = 0, pybind11::arg("logits_soft_cap") = 0.0,
        pybind11::arg("k_scale") = pybind11::none(), pybind11::arg("v_scale") = pybind11::none());
  m.def("exp_", &exp_);
  m.def("rms_norm", &rms_norm);
  m.def("fused_add_rms_norm", &fused_add_rms_norm);
  m.def("rotary_embedding", &rotary_embedding);
  m.def("silu_and_mul", &silu_and_mul);
  m.def("reshape_and_cache", &reshape_and_cache, pybind11::arg("key"), pybind11::arg("value"),
        pybind11::arg("key_cache"), pybind11::arg("value_cache"), pybind11::arg("slot_mapping"),
        pybind11::arg("k_scale") = pybind11::none(), pybind11::arg("v_scale") = pybind11::none());
  m.def("gemm_w8g_a8", &gemm_w8g_a8);
  m.def("gemm_wlow_a8", &gemm_wlow_a8);
  m.def("gemm_wlow_kq_a8", &gemm_wlow_kq_a8);
  m.def("pack_wlow_planes", &pack_wlow_planes);
  m.def("gguf_unpack_q", &gguf_unpack_q);
  m.def("gemm_f32", &gemm_f32, pybind11::arg("x"), pybind11::arg("wp"), pybind11::arg("bias") = pybind11::none(),
        pybind11::arg("n"), pybind11::arg("silu_mul") = false);
  m.def("argmax_rows", &argmax_rows);
  m.def("gemm_bf16", &gemm_bf16, pybind11::arg("x"), pybind11::arg("wp"), pybind11::arg("bias") = pybind11::none(),
        pybind11::arg("n"));
  m.def("llama_layers", &llama_layers);
  m.def("moe_experts", &moe_experts);
  m.def("moe_q_calls", &moe_q_calls);
  m.def("cpu_has", &cpu_has);
  m.def("kernel_variant", &kernel_variant);
  m.def("available_variants", &available_variants);
  m.def("set_variant", &set_variant);
  m.def("cpu_features", &cpu_features);
}

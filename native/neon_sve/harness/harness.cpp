// Standalone test harness (no torch): builds with the kernels for any target, notably
// aarch64 under qemu (tests/arm64). Holds every variant the CPU supports against the generic
// version (and the generic attention against a naive double-precision one) on attention
// (decode, prefill, chunked prefill, mixed batches; GQA 1/4/8; fp32 and bf16 caches; several
// head and block sizes), reshape_and_cache, RMSNorm, fused add+RMSNorm, rotary, SiLU-and-mul,
// the polynomial exp's error bound, and the W8A8 group-scale GEMM (every variant, generic included,
// against a double-precision reference of its quantized math), the float32 and bf16-weight panel
// GEMMs against double-precision products (gemm_f32, gemm_bf16 with fp32 and bf16 activations), and
// the quantized KV cache (int8 / fp8 writes bit for bit against an oracle, attention over such caches).
//
//   harness [--expect-variants a,b,c] [--expect-selected name]
// Prints one line per check and "RESULT: OK" (exit 0) or "RESULT: FAIL" (exit 1).
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <limits>
#include <string>
#include <utility>
#include <vector>

#include "appliance_kernels.h"
#include "kernel_common.h"

using namespace appliance_kernels;
using common::bf16_to_f32;
using common::f32_to_bf16;

namespace {

int g_failures = 0;
int g_checks = 0;

struct Rng {
  uint64_t s;
  explicit Rng(uint64_t seed) : s(seed * 0x9E3779B97F4A7C15ull + 1) {}
  uint32_t next() {
    s ^= s << 13;
    s ^= s >> 7;
    s ^= s << 17;
    return (uint32_t)(s >> 11);
  }
  float uniform() { return (next() & 0xFFFFFF) / float(0x1000000); }
  float normal() {
    float u1 = uniform() + 1e-7f, u2 = uniform();
    return std::sqrt(-2.f * std::log(u1)) * std::cos(6.2831853f * u2);
  }
};

// A tensor of float32 or bf16 values held as bytes; vals() is its float view.
struct Buf {
  int dtype = kF32;
  std::vector<float> f;
  std::vector<uint16_t> h;
  Buf(size_t n, int dt, float fill = 0.f) : dtype(dt) {
    if (dt == kF32)
      f.assign(n, fill);
    else
      h.assign(n, f32_to_bf16(fill));
  }
  void set(size_t i, float v) {
    if (dtype == kF32)
      f[i] = v;
    else
      h[i] = f32_to_bf16(v);
  }
  float get(size_t i) const { return dtype == kF32 ? f[i] : bf16_to_f32(h[i]); }
  void* data() { return dtype == kF32 ? (void*)f.data() : (void*)h.data(); }
  size_t size() const { return dtype == kF32 ? f.size() : h.size(); }
};

bool close_enough(const std::vector<float>& got, const std::vector<float>& want, double atol,
                  double rtol, double* max_err) {
  bool ok = got.size() == want.size();
  double m = 0;
  for (size_t i = 0; ok && i < got.size(); ++i) {
    const double e = std::fabs((double)got[i] - (double)want[i]);
    if (!(e <= atol + rtol * std::fabs((double)want[i]))) ok = false;
    if (!(e <= m)) m = e;
  }
  *max_err = m;
  return ok;
}

void report(bool ok, const char* variant, const std::string& what, double err) {
  ++g_checks;
  if (!ok) ++g_failures;
  std::printf("%s %-10s %-58s max_abs_err=%.3g\n", ok ? "PASS" : "FAIL", variant, what.c_str(), err);
}

// A GEMM's rows the same bits computed one at a time as in the call's M rows (what --batch-invariant
// takes from every GEMM variant: a row's output must not depend on the other rows or how many there
// are). ``alone(m, out)`` computes row m by itself into out (n values).
template <class T, class Alone>
void check_rows_alone(const char* variant, const std::string& what, const std::vector<T>& batch, int M, int N,
                      Alone alone) {
  bool ok = true;
  std::vector<T> one((size_t)N);
  for (int m = 0; m < M && ok; ++m) {
    alone(m, one.data());
    ok = std::memcmp(one.data(), batch.data() + (size_t)m * N, (size_t)N * sizeof(T)) == 0;
  }
  report(ok, variant, "rows == alone " + what, 0);
}

// ------------------------------------------------------------------------------------------
// attention

struct AttnCase {
  std::vector<std::pair<int, int>> seqs;  // (q_len, ctx)
  int heads, kv_heads, head_size, block_size, kv_dtype, q_dtype;
  int window = 0;      // AttentionArgs::sliding_window
  float soft_cap = 0;  // AttentionArgs::logits_soft_cap
};

struct AttnData {
  Buf q, kc, vc;
  std::vector<int32_t> bt, seq_lens, qsl;
  int bt_stride = 0, num_tokens = 0;
  AttnData(const AttnCase& c, uint64_t seed) : q(0, c.q_dtype), kc(0, c.kv_dtype), vc(0, c.kv_dtype) {
    Rng rng(seed);
    std::vector<int> nbs;
    int total = 0;
    for (auto& s : c.seqs) {
      nbs.push_back((s.second + c.block_size - 1) / c.block_size);
      total += nbs.back();
      bt_stride = std::max(bt_stride, nbs.back() + 1);
    }
    const int num_blocks = total + 5;
    std::vector<int> perm(num_blocks);
    for (int i = 0; i < num_blocks; ++i) perm[i] = i;
    for (int i = num_blocks - 1; i > 0; --i) std::swap(perm[i], perm[rng.next() % (i + 1)]);
    const size_t tile = (size_t)c.block_size * c.head_size;
    kc = Buf((size_t)num_blocks * c.kv_heads * tile, c.kv_dtype, 37.f);  // garbage off-context
    vc = Buf((size_t)num_blocks * c.kv_heads * tile, c.kv_dtype, -53.f);
    bt.assign((size_t)c.seqs.size() * bt_stride, -1);
    int used = 0;
    qsl.push_back(0);
    for (size_t s = 0; s < c.seqs.size(); ++s) {
      const int ctx = c.seqs[s].second;
      for (int b = 0; b < nbs[s]; ++b) {
        const int blk = perm[used++];
        bt[s * bt_stride + b] = blk;
        const int n = std::min(c.block_size, ctx - b * c.block_size);
        for (int h = 0; h < c.kv_heads; ++h)
          for (int t = 0; t < n; ++t)
            for (int d = 0; d < c.head_size; ++d) {
              const size_t i = (((size_t)blk * c.kv_heads + h) * c.block_size + t) * c.head_size + d;
              kc.set(i, rng.normal());
              vc.set(i, rng.normal());
            }
      }
      seq_lens.push_back(ctx);
      qsl.push_back(qsl.back() + c.seqs[s].first);
    }
    num_tokens = qsl.back();
    q = Buf((size_t)num_tokens * c.heads * c.head_size, c.q_dtype);
    for (size_t i = 0; i < q.size(); ++i) q.set(i, 1.5f * rng.normal());
  }
};

std::vector<float> run_attention(const KernelTable* kt, const AttnCase& c, AttnData& d) {
  Buf out((size_t)d.num_tokens * c.heads * c.head_size, c.q_dtype);
  AttentionArgs a{};
  a.query = d.q.data();
  a.q_stride_token = (int64_t)c.heads * c.head_size;
  a.q_stride_head = c.head_size;
  a.q_dtype = c.q_dtype;
  a.out = out.data();
  a.o_stride_token = a.q_stride_token;
  a.o_stride_head = a.q_stride_head;
  a.key_cache = d.kc.data();
  a.value_cache = d.vc.data();
  a.kv_dtype = c.kv_dtype;
  a.block_table = d.bt.data();
  a.block_table_stride = d.bt_stride;
  a.seq_lens = d.seq_lens.data();
  a.query_start_loc = d.qsl.data();
  a.num_seqs = (int)c.seqs.size();
  a.num_heads = c.heads;
  a.num_kv_heads = c.kv_heads;
  a.head_size = c.head_size;
  a.block_size = c.block_size;
  a.scale = 1.f / std::sqrt((float)c.head_size);
  a.sliding_window = c.window;
  a.logits_soft_cap = c.soft_cap;
  kt->paged_attention(a);
  std::vector<float> r(out.size());
  for (size_t i = 0; i < r.size(); ++i) r[i] = out.get(i);
  return r;
}

// Naive causal attention in double: the oracle for the generic kernel.
std::vector<float> naive_attention(const AttnCase& c, const AttnData& d) {
  const int D = c.head_size, G = c.heads / c.kv_heads;
  std::vector<float> out((size_t)d.num_tokens * c.heads * D);
  const double scale = 1.0 / std::sqrt((double)D);
  for (size_t s = 0; s < c.seqs.size(); ++s) {
    const int q_len = c.seqs[s].first, ctx = c.seqs[s].second;
    for (int i = 0; i < q_len; ++i) {
      const int tok = d.qsl[s] + i, pos = ctx - q_len + i;
      const int lo = c.window > 0 ? std::max(0, pos - c.window + 1) : 0;  // first visible key
      for (int h = 0; h < c.heads; ++h) {
        const int kvh = h / G;
        std::vector<double> sc(pos + 1, 0.0);
        double mx = -1e300;
        for (int t = lo; t <= pos; ++t) {
          const int blk = d.bt[s * d.bt_stride + t / c.block_size];
          const size_t base = (((size_t)blk * c.kv_heads + kvh) * c.block_size + t % c.block_size) * D;
          double acc = 0;
          for (int e = 0; e < D; ++e)
            acc += (double)d.q.get(((size_t)tok * c.heads + h) * D + e) * d.kc.get(base + e);
          sc[t] = acc * scale;
          if (c.soft_cap > 0) sc[t] = c.soft_cap * std::tanh(sc[t] / c.soft_cap);
          mx = std::max(mx, sc[t]);
        }
        double den = 0;
        for (int t = lo; t <= pos; ++t) den += (sc[t] = std::exp(sc[t] - mx));
        for (int e = 0; e < D; ++e) {
          double acc = 0;
          for (int t = lo; t <= pos; ++t) {
            const int blk = d.bt[s * d.bt_stride + t / c.block_size];
            acc += sc[t] * d.vc.get((((size_t)blk * c.kv_heads + kvh) * c.block_size + t % c.block_size) * D + e);
          }
          out[((size_t)tok * c.heads + h) * D + e] = (float)(acc / den);
        }
      }
    }
  }
  return out;
}

std::string describe(const AttnCase& c) {
  std::string s = "attn H" + std::to_string(c.heads) + "/" + std::to_string(c.kv_heads) + " D" +
                  std::to_string(c.head_size) + " BS" + std::to_string(c.block_size) +
                  (c.kv_dtype == kBF16 ? " kv:bf16" : " kv:f32") + (c.q_dtype == kBF16 ? " q:bf16" : " q:f32") +
                  (c.window ? " win" + std::to_string(c.window) : "") +
                  (c.soft_cap > 0 ? " cap" + std::to_string((int)c.soft_cap) : "") + " [";
  for (size_t i = 0; i < c.seqs.size() && i < 4; ++i)
    s += std::to_string(c.seqs[i].first) + "/" + std::to_string(c.seqs[i].second) + " ";
  return s + "]";
}

void check_attention(const std::vector<const KernelTable*>& variants) {
  const KernelTable* gen = variants.back();
  std::vector<AttnCase> cases;
  const std::vector<std::pair<int, int>> decode = {{1, 1}, {1, 17}, {1, 100}, {1, 600}};
  const std::vector<std::pair<int, int>> mixed = {{1, 45}, {20, 20}, {7, 90}, {1, 530}, {33, 70}};
  for (int ratio : {1, 4, 8})
    for (int kvdt : {kF32, kBF16}) {
      cases.push_back({decode, 2 * ratio, 2, 64, 16, kvdt, kF32});
      cases.push_back({mixed, 2 * ratio, 2, 64, 16, kvdt, kF32});
    }
  cases.push_back({decode, 8, 1, 128, 16, kF32, kF32});
  for (int kvdt : {kF32, kBF16}) {  // odd groups (3, 5 rows) and 128-head MQA
    cases.push_back({mixed, 6, 2, 64, 16, kvdt, kF32});
    cases.push_back({{{1, 40}, {9, 60}}, 5, 1, 64, 16, kvdt, kF32});
    cases.push_back({{{1, 70}, {3, 20}}, 128, 1, 64, 16, kvdt, kF32});
  }
  cases.push_back({mixed, 8, 2, 128, 5, kBF16, kBF16});
  cases.push_back({mixed, 4, 2, 80, 7, kF32, kF32});
  cases.push_back({{{1, 9}, {3, 40}}, 4, 4, 16, 1, kBF16, kF32});
  cases.push_back({{{5, 5}, {1, 33}}, 4, 2, 48, 32, kF32, kBF16});
  // sliding window (blocks before it skipped) and soft-capped scores, decode and chunked prefill
  for (int kvdt : {kF32, kBF16}) {
    cases.push_back({decode, 8, 2, 64, 16, kvdt, kF32, 40, 0.f});
    cases.push_back({mixed, 8, 2, 64, 7, kvdt, kF32, 13, 5.f});
  }
  uint64_t seed = 1;
  for (const AttnCase& c : cases) {
    AttnData d(c, seed++);
    const std::vector<float> ref = run_attention(gen, c, d);
    double err;
    if (c.head_size <= 80 && c.q_dtype == kF32) {
      const bool ok = close_enough(ref, naive_attention(c, d), 2e-5, 2e-5, &err);
      report(ok, "generic", describe(c) + " vs naive", err);
    }
    for (const KernelTable* kt : variants) {
      if (kt == gen) continue;
      // Variants that multiply in bf16 (BFMMLA, VDPBF16PS) round the query and P to bf16.
      const bool bf16_math = c.kv_dtype == kBF16 && (std::strcmp(kt->name, "neon_bf16") == 0 ||
                                                     std::strcmp(kt->name, "avx512bf16") == 0);
      const double tol = (c.q_dtype == kBF16 || bf16_math) ? 2e-2 : 2e-5;
      const bool ok = close_enough(run_attention(kt, c, d), ref, tol, tol, &err);
      report(ok, kt->name, describe(c), err);
    }
  }
}

// A query row's attention is the same bits whatever else the call holds (kernels_impl.h, the work
// split): each row of a verify chunk (2..7 queries) or a prefill tile (40 queries) equals the one-query
// call at its position, also where a row crosses the partition grid (256 keys here) or the softmax
// chunks' (128), within a sliding window,
// and on both thread counts the harness runs with. In every variant, its own rows against its own
// decode steps (the variants differ from each other in the last bits; each must agree with itself).
void check_row_invariance(const std::vector<const KernelTable*>& variants) {
  struct Shape { int ctx0, q_len, window; };
  const std::vector<Shape> shapes = {{13, 4, 0},   {125, 5, 0}, {252, 7, 0}, {509, 2, 0}, {0, 40, 0},
                                     {230, 40, 0}, {250, 5, 40}, {240, 40, 147}};
  for (int kvdt : {kF32, kBF16})
    for (const Shape& sh : shapes) {
      const int ctx = sh.ctx0 + sh.q_len;
      AttnCase c{{{sh.q_len, ctx}}, 9, 3, 64, 16, kvdt, kF32, sh.window, 0.f};
      AttnData d(c, 500 + sh.ctx0 + sh.q_len);
      const size_t row = (size_t)c.heads * c.head_size;
      for (const KernelTable* kt : variants) {
        const std::vector<float> chunk = run_attention(kt, c, d);
        bool ok = true;
        double err = 0;
        for (int j = 0; j < sh.q_len; ++j) {
          // the same cache and block table, one query: row j at its own position
          AttnCase c1 = c;
          c1.seqs = {{1, sh.ctx0 + j + 1}};
          AttnData d1 = d;
          d1.seq_lens = {sh.ctx0 + j + 1};
          d1.qsl = {0, 1};
          d1.num_tokens = 1;
          d1.q = Buf(row, c.q_dtype);
          for (size_t e = 0; e < row; ++e) d1.q.set(e, d.q.get(j * row + e));
          const std::vector<float> one = run_attention(kt, c1, d1);
          for (size_t e = 0; e < row; ++e)
            if (one[e] != chunk[j * row + e]) {
              ok = false;
              err = std::max(err, (double)std::fabs(one[e] - chunk[j * row + e]));
            }
        }
        report(ok, kt->name,
               "attn rows == decode steps " + std::string(kvdt == kBF16 ? "kv:bf16" : "kv:f32") + " ctx0 " +
                   std::to_string(sh.ctx0) + " q " + std::to_string(sh.q_len) +
                   (sh.window ? " win" + std::to_string(sh.window) : ""),
               err);
      }
    }
}

// ------------------------------------------------------------------------------------------
// the other ops

void check_exp(const std::vector<const KernelTable*>& variants) {
  std::vector<float> x;
  for (int i = 0; i <= 200000; ++i) x.push_back(-87.3f + (88.3f + 87.3f) * i / 200000.f);
  for (int i = 0; i < 37; ++i) x.push_back(-1e30f);
  for (const KernelTable* kt : variants) {
    std::vector<float> y = x;
    kt->exp_inplace(y.data(), (int64_t)y.size());
    double worst = 0;
    bool ok = true;
    for (size_t i = 0; i < x.size(); ++i) {
      if (x[i] < -87.3f) {
        ok = ok && y[i] == 0.f;
        continue;
      }
      const double e = std::exp((double)x[i]);
      worst = std::max(worst, std::fabs(y[i] - e) / e);
    }
    ok = ok && worst < 2e-7;
    ++g_checks;
    if (!ok) ++g_failures;
    std::printf("%s %-10s %-58s max_rel_err=%.3g\n", ok ? "PASS" : "FAIL", kt->name,
                "exp polynomial, [-87.3, 88.3], bound 2e-7", worst);
  }
}

void check_rows(const std::vector<const KernelTable*>& variants) {
  const KernelTable* gen = variants.back();
  Rng rng(99);
  for (int dt : {kF32, kBF16}) {
    const double tol = dt == kF32 ? 2e-6 : 1e-2;
    const char* dn = dt == kF32 ? "f32" : "bf16";
    const int rows = 5, hidden = 896;
    Buf x(rows * hidden, dt), w(hidden, dt), res(rows * hidden, dt);
    for (size_t i = 0; i < x.size(); ++i) x.set(i, 3 * rng.normal()), res.set(i, rng.normal());
    for (int i = 0; i < hidden; ++i) w.set(i, 0.5f + rng.uniform());
    auto as_vec = [](const Buf& b) {
      std::vector<float> v(b.size());
      for (size_t i = 0; i < v.size(); ++i) v[i] = b.get(i);
      return v;
    };
    // RMSNorm
    Buf ref(rows * hidden, dt);
    gen->rms_norm(x.data(), dt, w.data(), dt, ref.data(), rows, hidden, 1e-6f);
    // fused add + RMSNorm
    Buf rref = res, fref(rows * hidden, dt);
    gen->fused_add_rms_norm(x.data(), dt, rref.data(), dt, w.data(), dt, fref.data(), rows, hidden, 1e-6f);
    // SiLU and mul: x viewed as [rows, 2 * 448]
    Buf sref(rows * hidden / 2, dt);
    gen->silu_and_mul(x.data(), sref.data(), dt, rows, hidden / 2);
    // rotary, neox and gptj, rotary_dim 64 of head_size 128
    const int T = 6, H = 3, HD = 128, RD = 64, P = 100;
    std::vector<float> cs((size_t)P * RD);
    for (int p = 0; p < P; ++p)
      for (int i = 0; i < RD / 2; ++i) {
        const double f = p * std::pow(10000.0, -2.0 * i / RD);
        cs[p * RD + i] = (float)std::cos(f);
        cs[p * RD + RD / 2 + i] = (float)std::sin(f);
      }
    std::vector<int64_t> pos = {0, 3, 99, 42, 7, 7};
    Buf qx(T * H * HD, dt);
    for (size_t i = 0; i < qx.size(); ++i) qx.set(i, rng.normal());
    Buf rope_ref[2] = {qx, qx};
    for (int neox = 0; neox < 2; ++neox)
      gen->rotary_embedding(pos.data(), rope_ref[neox].data(), H * HD, rope_ref[neox].data(), dt, T, H, HD, cs.data(), RD, neox == 1);
    // reshape_and_cache: 9 tokens, 2 kv heads, head 64, block 5, one padding slot
    const int NT = 9, KH = 2, KD = 64, BS = 5, NB = 4;
    Buf kin(NT * KH * KD, dt), vin(NT * KH * KD, dt);
    for (size_t i = 0; i < kin.size(); ++i) kin.set(i, rng.normal()), vin.set(i, rng.normal());
    std::vector<int64_t> slots = {3, 19, 0, -1, 7, 12, 5, 18, 1};
    Buf kc_ref(NB * KH * BS * KD, dt, 9.f), vc_ref(NB * KH * BS * KD, dt, 9.f);
    gen->reshape_and_cache(kin.data(), vin.data(), dt, KH * KD, KD, KH * KD, KD, kc_ref.data(), vc_ref.data(),
                           dt, slots.data(), NT, KH, KD, BS);
    // every slot written holds the token's values exactly
    bool rc_ok = true;
    for (int t = 0; t < NT; ++t) {
      if (slots[t] < 0) continue;
      for (int h = 0; h < KH; ++h)
        for (int e = 0; e < KD; ++e) {
          const size_t dst = (((size_t)(slots[t] / BS) * KH + h) * BS + slots[t] % BS) * KD + e;
          rc_ok = rc_ok && kc_ref.get(dst) == kin.get(((size_t)t * KH + h) * KD + e) &&
                  vc_ref.get(dst) == vin.get(((size_t)t * KH + h) * KD + e);
        }
    }
    report(rc_ok, "generic", std::string("reshape_and_cache slots ") + dn, 0);

    for (const KernelTable* kt : variants) {
      if (kt == gen) continue;
      double err;
      Buf out(rows * hidden, dt);
      kt->rms_norm(x.data(), dt, w.data(), dt, out.data(), rows, hidden, 1e-6f);
      report(close_enough(as_vec(out), as_vec(ref), tol, tol, &err), kt->name, std::string("rms_norm ") + dn, err);
      Buf r2 = res, f2(rows * hidden, dt);
      kt->fused_add_rms_norm(x.data(), dt, r2.data(), dt, w.data(), dt, f2.data(), rows, hidden, 1e-6f);
      report(close_enough(as_vec(r2), as_vec(rref), 0, 0, &err), kt->name,
             std::string("fused_add_rms_norm residual ") + dn, err);
      report(close_enough(as_vec(f2), as_vec(fref), tol, tol, &err), kt->name,
             std::string("fused_add_rms_norm out ") + dn, err);
      Buf s2(rows * hidden / 2, dt);
      kt->silu_and_mul(x.data(), s2.data(), dt, rows, hidden / 2);
      report(close_enough(as_vec(s2), as_vec(sref), tol, tol, &err), kt->name, std::string("silu_and_mul ") + dn, err);
      for (int neox = 0; neox < 2; ++neox) {
        Buf q2 = qx;
        kt->rotary_embedding(pos.data(), q2.data(), H * HD, q2.data(), dt, T, H, HD, cs.data(), RD, neox == 1);
        report(close_enough(as_vec(q2), as_vec(rope_ref[neox]), tol, tol, &err), kt->name,
               std::string("rotary ") + (neox ? "neox " : "gptj ") + dn, err);
      }
      Buf kc2(NB * KH * BS * KD, dt, 9.f), vc2(NB * KH * BS * KD, dt, 9.f);
      kt->reshape_and_cache(kin.data(), vin.data(), dt, KH * KD, KD, KH * KD, KD, kc2.data(), vc2.data(), dt,
                            slots.data(), NT, KH, KD, BS);
      report(close_enough(as_vec(kc2), as_vec(kc_ref), 0, 0, &err) &&
                 close_enough(as_vec(vc2), as_vec(vc_ref), 0, 0, &err),
             kt->name, std::string("reshape_and_cache ") + dn, err);
    }
  }
}

// The activations' per-token asymmetric int8 code every W8/Wlow kernel uses: scale s and zero point zp
// of a row, and a value's code clamp(round(x / s) + zp).
struct ActQuant {
  float s, zp;
  explicit ActQuant(const float* xr, int K) {
    float lo = 0.f, hi = 0.f;
    for (int k = 0; k < K; ++k) lo = std::min(lo, xr[k]), hi = std::max(hi, xr[k]);
    s = std::max((hi - lo) / 255.f, 1e-12f);
    zp = std::min(127.f, std::max(-128.f, std::nearbyint(-128.f - lo / s)));
  }
  float code(float x) const { return std::min(127.f, std::max(-128.f, std::nearbyint(x / s) + zp)); }
};

// Row n of low-bit weights q (u = q + ctr) into gemm_wlow_a8's nibble plane lo and 2-bit plane hi.
// ctr 32: 6 bits (a 2-bit plane, 16 inputs per 4 bytes of a row); 16: 5 bits (a 1-bit plane, 32
// inputs per 4 bytes); 8: 4 bits (hi untouched).
void pack_wlow_row(const int* q, int n, int K, int ctr, uint8_t* lo, uint8_t* hi) {
  const int t = n / 16, r = n % 16;
  for (int k = 0; k < K; ++k) {
    const int u = q[k] + ctr;
    const int s8 = k / 8, j = k % 4, half = (k % 8) / 4;
    lo[(((size_t)t * (K / 8) + s8) * 16 + r) * 4 + j] |= (uint8_t)((u & 15) << (4 * half));
    if (ctr == 32) {
      const int s16 = k / 16, p = (k % 16) / 4;
      hi[(((size_t)t * (K / 16) + s16) * 16 + r) * 4 + j] |= (uint8_t)((u >> 4) << (2 * p));
    } else if (ctr == 16) {
      const int s32 = k / 32, p = (k % 32) / 4;
      hi[(((size_t)t * (K / 32) + s32) * 16 + r) * 4 + j] |= (uint8_t)((u >> 4) << p);
    }
  }
}

// ------------------------------------------------------------------------------------------
// W8A8 GEMM with group-wise weight scales (gemm_w8g_a8) against a double-precision reference of
// the same quantized math (activations quantized per token as the kernel's contract says).

void check_w8g(const std::vector<const KernelTable*>& variants) {
  struct Case { int M, N, K, G; bool m128; int extreme; };
  // decode and prefill rows (Arm I8MM: token pairs by SMMLA, a lone token by SDOT); odd N; K not a
  // multiple of 64; q == -128 (the portable loop on x86 AVX2). Then the worst cases for integer
  // overflow, in the largest group (256): (1) every activation coded 127 against weights all 127
  // (rows of -127 below), (2) activations coded 127 / -128 against weights 127 / -128, every product
  // at its largest (127 * 127, -128 * -128), with no cancellation to hide a clipped sum.
  const Case cases[] = {{1, 37, 96, 32, false, 0}, {5, 40, 160, 32, true, 0}, {9, 64, 576, 64, false, 0},
                        {2, 17, 256, 256, false, 0}, {3, 32, 512, 256, false, 1}, {4, 33, 512, 256, true, 2},
                        // group 16 (GGUF Q6_K): one SDOT pass / two SMMLA steps per group, pairs and a lone token
                        {3, 40, 96, 16, false, 0}, {5, 33, 256, 16, true, 2}};
  Rng rng(7);
  for (const Case& c : cases) {
    const int tiles = (c.N + 15) / 16, groups = c.K / c.G;
    std::vector<int8_t> q((size_t)c.N * c.K);
    std::vector<float> sc((size_t)c.N * groups), x((size_t)c.M * c.K);
    for (auto& v : q) v = (int8_t)((int)(rng.next() % 255) - 127);
    if (c.m128) q[3] = q[c.K + 5] = -128;
    for (auto& v : sc) v = 1e-3f + 0.01f * rng.uniform();
    for (int m = 0; m < c.M; ++m)
      for (int k = 0; k < c.K; ++k) x[(size_t)m * c.K + k] = 2 * rng.normal() + (k == 0 ? 3.f : 0.f);
    if (c.extreme)
      for (int n = 0; n < c.N; ++n)
        for (int k = 0; k < c.K; ++k)
          q[(size_t)n * c.K + k] = c.extreme == 1 ? (n < c.N / 2 ? 127 : -127) : (k % 2 ? -128 : 127);
    if (c.extreme)
      for (int m = 0; m < c.M; ++m)
        for (int k = 0; k < c.K; ++k) x[(size_t)m * c.K + k] = c.extreme == 1 || k % 2 == 0 ? 1.f : -0.99f;
    // pack (appliance_kernels.h, W8GArgs)
    std::vector<int8_t> w((size_t)tiles * 16 * c.K, 0);
    std::vector<float> ps((size_t)tiles * groups * 16, 0.f), pw((size_t)tiles * groups * 16, 0.f);
    for (int n = 0; n < c.N; ++n) {
      const int t = n / 16, r = n % 16;
      for (int k = 0; k < c.K; ++k) w[(((size_t)t * (c.K / 4) + k / 4) * 16 + r) * 4 + k % 4] = q[(size_t)n * c.K + k];
      for (int g = 0; g < groups; ++g) {
        int sum = 0;
        for (int k = g * c.G; k < (g + 1) * c.G; ++k) sum += q[(size_t)n * c.K + k];
        ps[((size_t)t * groups + g) * 16 + r] = sc[(size_t)n * groups + g];
        pw[((size_t)t * groups + g) * 16 + r] = (float)sum;
      }
    }
    // reference: xq = clamp(round(x / s) + zp), then sum_g scale * sum (xq - zp) q in double
    std::vector<float> ref((size_t)c.M * c.N);
    double mx = 0;
    for (int m = 0; m < c.M; ++m) {
      const float* xr = x.data() + (size_t)m * c.K;
      const ActQuant aq(xr, c.K);
      const float s = aq.s, zp = aq.zp;
      for (int n = 0; n < c.N; ++n) {
        double acc = 0;
        for (int k = 0; k < c.K; ++k) {
          const float xq = aq.code(xr[k]);
          acc += (double)(xq - zp) * q[(size_t)n * c.K + k] * sc[(size_t)n * groups + k / c.G];
        }
        ref[(size_t)m * c.N + n] = (float)(acc * s);
        mx = std::max(mx, std::fabs(acc * s));
      }
    }
    const double tol = 2e-5 * mx * std::sqrt(c.K / 576.0) + 1e-6;
    for (const KernelTable* kt : variants) {
      std::vector<float> out((size_t)c.M * c.N, -1.f);
      W8GArgs a{x.data(), c.M, c.K, c.N, w.data(), ps.data(), pw.data(), c.G, c.m128, out.data()};
      kt->gemm_w8g_a8(a);
      double err;
      char what[96];
      std::snprintf(what, sizeof what, "w8g M=%d N=%d K=%d G=%d%s%s", c.M, c.N, c.K, c.G, c.m128 ? " q=-128" : "",
                    c.extreme ? " extremes" : "");
      const bool ok = close_enough(out, ref, tol, 0, &err);  // before reading err
      report(ok, kt->name, what, err);
      if (c.M > 1)
        check_rows_alone(kt->name, what, out, c.M, c.N, [&](int m, float* o) {
          W8GArgs one{x.data() + (size_t)m * c.K, 1, c.K, c.N, w.data(), ps.data(), pw.data(), c.G, c.m128, o};
          kt->gemm_w8g_a8(one);
        });
    }
  }
}

// Row m of a gemm_wlow_a8 call computed by itself into o.
void wlow_row_alone(const KernelTable* kt, WLowArgs a, int m, float* o) {
  a.x += (size_t)m * a.K;
  a.M = 1;
  a.out = o;
  kt->gemm_wlow_a8(a);
}

// ------------------------------------------------------------------------------------------
// Low-bit weights (gemm_wlow_a8, 4, 5 and 6 bits, with and without offsets) against a double-precision
// reference of the same quantized math. Extremes: every weight at the top or bottom of its range and
// activations coded 127 / -128, so that no clipped integer sum could hide.

void check_wlow(const std::vector<const KernelTable*>& variants) {
  struct Case { int M, N, K, G, bits; bool off; int extreme; };
  const Case cases[] = {{1, 37, 256, 32, 4, true, 0}, {3, 40, 896, 32, 4, true, 0}, {9, 33, 512, 32, 4, false, 0},
                        {1, 17, 256, 16, 6, false, 0}, {5, 48, 768, 16, 6, false, 0}, {2, 20, 512, 32, 4, true, 1},
                        {3, 16, 512, 16, 6, false, 1}, {1, 64, 4864, 32, 4, true, 0},
                        // 5 bits (GGUF Q5_0 / Q5_1: groups of 32, or more): decode and prefill rows,
                        // offsets, a group of 64, the extremes
                        {1, 37, 256, 32, 5, false, 0}, {6, 40, 896, 32, 5, true, 0}, {3, 33, 512, 64, 5, false, 0},
                        {2, 20, 512, 32, 5, true, 1}, {5, 16, 4864, 32, 5, false, 1}};
  Rng rng(13);
  for (const Case& c : cases) {
    const int tiles = (c.N + 15) / 16, groups = c.K / c.G, ctr = c.bits == 6 ? 32 : c.bits == 5 ? 16 : 8;
    std::vector<int> q((size_t)c.N * c.K);
    std::vector<float> sc((size_t)c.N * groups), off((size_t)c.N * groups), x((size_t)c.M * c.K);
    for (auto& v : q) v = (int)(rng.next() % (2 * ctr)) - ctr;
    for (auto& v : sc) v = 1e-3f + 0.01f * rng.uniform();
    for (auto& v : off) v = c.off ? 0.02f * rng.normal() : 0.f;
    for (int m = 0; m < c.M; ++m)
      for (int k = 0; k < c.K; ++k) x[(size_t)m * c.K + k] = 2 * rng.normal() + (k == 0 ? 3.f : 0.f);
    if (c.extreme) {
      for (int n = 0; n < c.N; ++n)
        for (int k = 0; k < c.K; ++k) q[(size_t)n * c.K + k] = (n + k) % 2 ? ctr - 1 : -ctr;
      for (int m = 0; m < c.M; ++m)
        for (int k = 0; k < c.K; ++k) x[(size_t)m * c.K + k] = k % 2 ? -1.f : 0.99f;
      for (auto& v : sc) v = 65504.f * 63.f;  // an fp16 d at its largest times the largest 6-bit sub-scale
    }
    // pack (appliance_kernels.h, WLowArgs)
    std::vector<uint8_t> lo((size_t)tiles * 8 * c.K, 0), hi((size_t)tiles * 4 * c.K, 0);
    std::vector<float> ps((size_t)tiles * groups * 16, 0.f), po((size_t)tiles * groups * 16, 0.f);
    std::vector<int16_t> pws((size_t)tiles * groups * 16, 0);
    // rows past N: u = 0 (q = -ctr), their group sums to match
    for (int n = c.N; n < tiles * 16; ++n)
      for (int g = 0; g < groups; ++g) pws[((size_t)(n / 16) * groups + g) * 16 + n % 16] = (int16_t)(-ctr * c.G);
    for (int n = 0; n < c.N; ++n) {
      const int t = n / 16, r = n % 16;
      for (int g = 0; g < groups; ++g) {
        int sum = 0;
        for (int k = g * c.G; k < (g + 1) * c.G; ++k) sum += q[(size_t)n * c.K + k];
        pws[((size_t)t * groups + g) * 16 + r] = (int16_t)sum;
      }
      pack_wlow_row(q.data() + (size_t)n * c.K, n, c.K, ctr, lo.data(), hi.data());
      for (int g = 0; g < groups; ++g) {
        ps[((size_t)t * groups + g) * 16 + r] = sc[(size_t)n * groups + g];
        po[((size_t)t * groups + g) * 16 + r] = off[(size_t)n * groups + g];
      }
    }
    std::vector<float> ref((size_t)c.M * c.N);
    double mx = 0;
    for (int m = 0; m < c.M; ++m) {
      const float* xr = x.data() + (size_t)m * c.K;
      const ActQuant aq(xr, c.K);
      const float s = aq.s, zp = aq.zp;
      for (int n = 0; n < c.N; ++n) {
        double acc = 0, ao = 0;
        for (int k = 0; k < c.K; ++k) {
          const float xq = aq.code(xr[k]);
          acc += (double)(xq - zp) * q[(size_t)n * c.K + k] * sc[(size_t)n * groups + k / c.G];
          ao += (double)xr[k] * off[(size_t)n * groups + k / c.G];
        }
        const double y = acc * s + ao;
        ref[(size_t)m * c.N + n] = (float)y;
        mx = std::max(mx, std::fabs(acc * s) + std::fabs(ao));
      }
    }
    const double tol = 2e-5 * mx * std::sqrt(c.K / 576.0) + 1e-6;
    for (const KernelTable* kt : variants) {
      std::vector<float> out((size_t)c.M * c.N, -1.f);
      WLowArgs a{x.data(), c.M, c.K, c.N, lo.data(), c.bits != 4 ? hi.data() : nullptr, ps.data(),
                 c.off ? po.data() : nullptr, c.G, c.bits, out.data(), pws.data()};
      kt->gemm_wlow_a8(a);
      double err;
      char what[96];
      std::snprintf(what, sizeof what, "wlow M=%d N=%d K=%d G=%d bits=%d%s%s", c.M, c.N, c.K, c.G, c.bits,
                    c.off ? " offsets" : "", c.extreme ? " extremes" : "");
      const bool ok = close_enough(out, ref, tol, 0, &err);
      report(ok, kt->name, what, err);
      if (c.M > 1)
        check_rows_alone(kt->name, what, out, c.M, c.N, [&](int m, float* o) { wlow_row_alone(kt, a, m, o); });
    }
  }
}

// ------------------------------------------------------------------------------------------
// Low-bit weights with a GGUF K-quant's own scales (WLowArgs.ksuper > 0) against a double-precision
// reference of the same math: w[n, k] = scale[n, g] q[n, k] + offset[n, g], scale = ksup[n, b] ksub[n, g],
// offset = kshift[n] scale - ksupmin[n, b] ksubmin[n, g] (Q4_K: u in [0, 16) with c = 8, so kshift 8 and
// a sub-min; Q6_K: signed int8 sub-scales, no offset). Extremes: fp16's largest d times the largest
// sub-scale, every weight at the top or bottom of its range, activations alternating at the edges.

void check_wlow_kquant(const std::vector<const KernelTable*>& variants) {
  struct Case { int M, N, K, G, S, bits; bool mins; int extreme; };
  const Case cases[] = {{1, 37, 256, 32, 256, 4, true, 0},  {3, 40, 512, 32, 256, 4, true, 0},
                        {9, 33, 768, 16, 256, 6, false, 0}, {2, 20, 512, 32, 256, 4, true, 1},
                        {3, 16, 512, 16, 256, 6, false, 1}, {1, 64, 4864, 32, 256, 4, true, 0},
                        // super-blocks finer than 256: a tensor-parallel rank whose inputs cut one
                        // (appliance.layers.parallel._row_kquant)
                        {3, 40, 384, 32, 128, 4, true, 0},  {5, 33, 384, 16, 64, 6, true, 0}};
  Rng rng(17);
  for (const Case& c : cases) {
    const int tiles = (c.N + 15) / 16, groups = c.K / c.G, supers = c.K / c.S, ctr = c.bits == 6 ? 32 : 8;
    std::vector<int> q((size_t)c.N * c.K), sub((size_t)c.N * groups), smin((size_t)c.N * groups);
    std::vector<float> sup((size_t)c.N * supers), supmin((size_t)c.N * supers), x((size_t)c.M * c.K);
    for (auto& v : q) v = (int)(rng.next() % (2 * ctr)) - ctr;
    // Q4_K: 6-bit unsigned sub-scales and sub-mins; Q6_K: signed 8-bit sub-scales
    for (auto& v : sub) v = c.bits == 4 ? (int)(rng.next() % 64) : (int)(rng.next() % 256) - 128;
    for (auto& v : smin) v = c.mins ? (int)(rng.next() % 64) : 0;
    for (auto& v : sup) v = 1e-4f + 1e-3f * rng.uniform();
    for (auto& v : supmin) v = c.mins ? 1e-4f + 1e-3f * rng.uniform() : 0.f;
    for (int m = 0; m < c.M; ++m)
      for (int k = 0; k < c.K; ++k) x[(size_t)m * c.K + k] = 2 * rng.normal() + (k == 0 ? 3.f : 0.f);
    if (c.extreme) {
      for (int n = 0; n < c.N; ++n)
        for (int k = 0; k < c.K; ++k) q[(size_t)n * c.K + k] = (n + k) % 2 ? ctr - 1 : -ctr;
      for (int m = 0; m < c.M; ++m)
        for (int k = 0; k < c.K; ++k) x[(size_t)m * c.K + k] = k % 2 ? -1.f : 0.99f;
      for (auto& v : sup) v = 65504.f;
      for (auto& v : sub) v = c.bits == 4 ? 63 : -128;
      if (c.mins) {
        for (auto& v : supmin) v = 65504.f;
        for (auto& v : smin) v = 63;
      }
    }
    // pack (appliance_kernels.h, WLowArgs): the nibble and 2-bit planes as check_wlow packs them
    std::vector<uint8_t> lo((size_t)tiles * 8 * c.K, 0), hi((size_t)tiles * 4 * c.K, 0);
    std::vector<int8_t> psub((size_t)tiles * groups * 16, 0), psmin((size_t)tiles * groups * 16, 0);
    std::vector<int8_t> pshift((size_t)tiles * 16, 0);
    std::vector<float> psup((size_t)tiles * supers * 16, 0.f), psupmin((size_t)tiles * supers * 16, 0.f);
    std::vector<float> rowsum((size_t)tiles * 16, 0.f);
    std::vector<double> scale((size_t)c.N * groups), offset((size_t)c.N * groups);
    for (int n = 0; n < c.N; ++n) {
      const int t = n / 16, r = n % 16;
      pshift[(size_t)t * 16 + r] = (int8_t)(c.mins ? ctr : 0);
      for (int b = 0; b < supers; ++b) {
        psup[((size_t)t * supers + b) * 16 + r] = sup[(size_t)n * supers + b];
        psupmin[((size_t)t * supers + b) * 16 + r] = supmin[(size_t)n * supers + b];
      }
      double rs = 0;
      for (int g = 0; g < groups; ++g) {
        const int b = g * c.G / c.S;
        psub[((size_t)t * groups + g) * 16 + r] = (int8_t)sub[(size_t)n * groups + g];
        psmin[((size_t)t * groups + g) * 16 + r] = (int8_t)smin[(size_t)n * groups + g];
        const float s = sup[(size_t)n * supers + b] * (float)sub[(size_t)n * groups + g];  // as the kernel forms it
        scale[(size_t)n * groups + g] = s;
        offset[(size_t)n * groups + g] = (c.mins ? (double)ctr * s : 0.0) -
                                         (double)supmin[(size_t)n * supers + b] * smin[(size_t)n * groups + g];
        long qs = 0;
        for (int k = g * c.G; k < (g + 1) * c.G; ++k) qs += q[(size_t)n * c.K + k];
        rs += (double)s * qs;
      }
      rowsum[(size_t)t * 16 + r] = (float)rs;
      pack_wlow_row(q.data() + (size_t)n * c.K, n, c.K, ctr, lo.data(), hi.data());
    }
    std::vector<float> ref((size_t)c.M * c.N);
    double mx = 0;
    for (int m = 0; m < c.M; ++m) {
      const float* xr = x.data() + (size_t)m * c.K;
      const ActQuant aq(xr, c.K);
      const float s = aq.s, zp = aq.zp;
      for (int n = 0; n < c.N; ++n) {
        double acc = 0, ao = 0, mag = 0;
        for (int k = 0; k < c.K; ++k) {
          const float xq = aq.code(xr[k]);
          const double sk = scale[(size_t)n * groups + k / c.G];
          acc += (double)(xq - zp) * q[(size_t)n * c.K + k] * sk;
          mag += std::fabs((double)xq * q[(size_t)n * c.K + k] * sk);
          ao += (double)xr[k] * offset[(size_t)n * groups + k / c.G];
        }
        ref[(size_t)m * c.N + n] = (float)(acc * s + ao);
        // the kernel sums xq q (zero point included) and takes s zp rowsum off: its rounding is of
        // those terms' size, not of the result's
        mx = std::max(mx, (mag + std::fabs(zp * rowsum[(size_t)(n / 16) * 16 + n % 16])) * s + std::fabs(ao));
      }
    }
    const double tol = 2e-5 * mx * std::sqrt(c.K / 576.0) + 1e-6;
    for (const KernelTable* kt : variants) {
      std::vector<float> out((size_t)c.M * c.N, -1.f);
      WLowArgs a{x.data(), c.M, c.K, c.N, lo.data(), c.bits == 6 ? hi.data() : nullptr, nullptr, nullptr, c.G,
                 c.bits, out.data(), nullptr};
      a.ksub = psub.data();
      a.ksubmin = c.mins ? psmin.data() : nullptr;
      a.ksup = psup.data();
      a.ksupmin = c.mins ? psupmin.data() : nullptr;
      a.krowsum = rowsum.data();
      a.kshift = c.mins ? pshift.data() : nullptr;
      a.ksuper = c.S;
      kt->gemm_wlow_a8(a);
      double err;
      char what[112];
      std::snprintf(what, sizeof what, "wlow-kquant M=%d N=%d K=%d G=%d S=%d bits=%d%s%s", c.M, c.N, c.K, c.G, c.S,
                    c.bits, c.mins ? " mins" : "", c.extreme ? " extremes" : "");
      const bool ok = close_enough(out, ref, tol, 0, &err);
      report(ok, kt->name, what, err);
      if (c.M > 1)
        check_rows_alone(kt->name, what, out, c.M, c.N, [&](int m, float* o) { wlow_row_alone(kt, a, m, o); });
    }
  }
}

// ------------------------------------------------------------------------------------------
// fp32 GEMM over panel-packed weights (gemm_f32) against a double-precision product.

void check_sgemm(const std::vector<const KernelTable*>& variants) {
  struct Case { int M, N, K; bool bias; };
  // single decode row; partial and several row blocks; N and K tails; more than one 128-row pass
  const Case cases[] = {{1, 64, 96, false}, {3, 33, 17, true}, {9, 96, 130, true}, {20, 40, 64, false},
                        {130, 35, 24, true}};
  constexpr int NR = kSgemmPanel;
  Rng rng(11);
  for (const Case& c : cases) {
    const int P = (c.N + NR - 1) / NR;
    std::vector<float> w((size_t)c.N * c.K), x((size_t)c.M * c.K), b(c.N), wp((size_t)P * c.K * NR, 0.f);
    for (auto& v : w) v = 0.1f * rng.normal();
    for (auto& v : x) v = rng.normal();
    for (auto& v : b) v = rng.normal();
    for (int n = 0; n < c.N; ++n)
      for (int k = 0; k < c.K; ++k) wp[((size_t)(n / NR) * c.K + k) * NR + n % NR] = w[(size_t)n * c.K + k];
    std::vector<float> ref((size_t)c.M * c.N);
    double mx = 0;
    for (int m = 0; m < c.M; ++m)
      for (int n = 0; n < c.N; ++n) {
        double acc = c.bias ? b[n] : 0.0;
        for (int k = 0; k < c.K; ++k) acc += (double)x[(size_t)m * c.K + k] * w[(size_t)n * c.K + k];
        ref[(size_t)m * c.N + n] = (float)acc;
        mx = std::max(mx, std::fabs(acc));
      }
    const double tol = 4e-6 * mx * std::sqrt(c.K / 64.0) + 1e-6;
    for (const KernelTable* kt : variants) {
      std::vector<float> out((size_t)c.M * c.N, -1.f);
      kt->gemm_f32(x.data(), c.M, c.K, wp.data(), c.N, c.bias ? b.data() : nullptr, out.data(), kSgemmNoAct);
      double err;
      char what[96];
      std::snprintf(what, sizeof what, "gemm_f32 M=%d N=%d K=%d%s", c.M, c.N, c.K, c.bias ? " bias" : "");
      const bool ok = close_enough(out, ref, tol, 0, &err);
      report(ok, kt->name, what, err);
      if (c.N % NR) continue;
      // the same panels read as gate|up halves: silu(gate) * up
      std::vector<float> act((size_t)c.M * c.N / 2, -1.f), act_ref(act.size());
      for (int m = 0; m < c.M; ++m)
        for (int p = 0; p < P; ++p)
          for (int j = 0; j < NR / 2; ++j) {
            const double g = ref[(size_t)m * c.N + p * NR + j], u = ref[(size_t)m * c.N + p * NR + NR / 2 + j];
            act_ref[(size_t)m * c.N / 2 + p * NR / 2 + j] = (float)(g / (1 + std::exp(-g)) * u);
          }
      kt->gemm_f32(x.data(), c.M, c.K, wp.data(), c.N, c.bias ? b.data() : nullptr, act.data(), kSgemmSiluMul);
      std::snprintf(what, sizeof what, "gemm_f32 silu_mul M=%d N=%d K=%d%s", c.M, c.N, c.K, c.bias ? " bias" : "");
      const bool ok2 = close_enough(act, act_ref, tol * (2 * mx + 1) + 1e-6, 1e-5, &err);  // |d act| <= (|u| + |silu g|) tol
      report(ok2, kt->name, what, err);
    }
  }
}

// ------------------------------------------------------------------------------------------
// One mixture-of-experts layer's experts (moe_f32) against double-precision products: E experts,
// rows grouped by expert with experts of 0 rows, 1 row, several row blocks (17) and a partial one;
// hidden with a partial down panel. Bound: gemm_f32's per projection, the gate/up error carried
// through silu(gate) * up (|d act| <= (|u| + |silu g|) tol) and the down projection's sum over I.

void check_moe(const std::vector<const KernelTable*>& variants) {
  constexpr int NR = kSgemmPanel, H = 72, I = 48, E = 6;
  const int64_t counts[E] = {2, 0, 1, 17, 0, 5};
  int64_t start[E + 1] = {0};
  for (int e = 0; e < E; ++e) start[e + 1] = start[e] + counts[e];
  const int64_t R = start[E];
  const int Pgu = 2 * I / NR, Pdn = (H + NR - 1) / NR;
  Rng rng(23);
  std::vector<float> xg((size_t)R * H);
  for (auto& v : xg) v = rng.normal();
  std::vector<std::vector<float>> gu(E), dn(E), gup(E), dnp(E);
  std::vector<const float*> pg(E), pd(E);
  for (int e = 0; e < E; ++e) {
    gu[e].resize((size_t)2 * I * H);  // canonical [2I, H]: gate rows then up rows
    dn[e].resize((size_t)H * I);
    for (auto& v : gu[e]) v = 0.1f * rng.normal();
    for (auto& v : dn[e]) v = 0.1f * rng.normal();
    // gate/up panels for the silu epilogue: 16 gate then 16 up columns per panel
    gup[e].assign((size_t)Pgu * H * NR, 0.f);
    for (int p = 0; p < Pgu; ++p)
      for (int j = 0; j < NR; ++j) {
        const int row = j < NR / 2 ? p * NR / 2 + j : I + p * NR / 2 + j - NR / 2;
        for (int k = 0; k < H; ++k) gup[e][((size_t)p * H + k) * NR + j] = gu[e][(size_t)row * H + k];
      }
    dnp[e].assign((size_t)Pdn * I * NR, 0.f);
    for (int n = 0; n < H; ++n)
      for (int k = 0; k < I; ++k) dnp[e][((size_t)(n / NR) * I + k) * NR + n % NR] = dn[e][(size_t)n * I + k];
    pg[e] = gup[e].data();
    pd[e] = dnp[e].data();
  }
  std::vector<float> ref((size_t)R * H);
  double mx = 0, mg = 0;
  for (int e = 0; e < E; ++e)
    for (int64_t r = start[e]; r < start[e + 1]; ++r) {
      std::vector<double> act(I);
      for (int i = 0; i < I; ++i) {
        double g = 0, u = 0;
        for (int k = 0; k < H; ++k) {
          g += (double)xg[r * H + k] * gu[e][(size_t)i * H + k];
          u += (double)xg[r * H + k] * gu[e][(size_t)(I + i) * H + k];
        }
        mg = std::max(mg, std::max(std::fabs(g), std::fabs(u)));
        act[i] = g / (1 + std::exp(-g)) * u;
      }
      for (int n = 0; n < H; ++n) {
        double acc = 0;
        for (int i = 0; i < I; ++i) acc += act[i] * dn[e][(size_t)n * I + i];
        ref[r * H + n] = (float)acc;
        mx = std::max(mx, std::fabs(acc));
      }
    }
  // act's error (2 mg + 1) tol_gu summed over I weights of 0.1 sigma, plus down's own rounding
  const double tol_gu = 4e-6 * mg * std::sqrt(H / 64.0) + 1e-6;
  const double tol = (2 * mg + 1) * tol_gu * 0.1 * std::sqrt((double)I) * 4 + 4e-6 * mx * std::sqrt(I / 64.0) + 1e-6;
  for (const KernelTable* kt : variants) {
    std::vector<float> act((size_t)R * I, -1.f), y((size_t)R * H, -1.f);
    MoeF32Args a{};
    a.xg = xg.data();
    a.H = H;
    a.I = I;
    a.E = E;
    a.start = start;
    a.wgu = pg.data();
    a.wdn = pd.data();
    a.act = act.data();
    a.y = y.data();
    kt->moe_f32(a);
    double err;
    const bool ok = close_enough(y, ref, tol, 0, &err);
    report(ok, kt->name, "moe_f32 E=6 rows 2,0,1,17,0,5 H=72 I=48", err);
  }
}

// ------------------------------------------------------------------------------------------
// One mixture-of-experts layer's quantized experts (moe_q) against the same variant's per-expert
// calls (gemm_w8g_a8 / gemm_wlow_a8 on the expert's rows, silu_and_mul between): bit for bit, as
// moe_q runs the same work items over the same row blocks. Experts of 0, 1, 9 (a whole block of 8
// and one more) and 3 rows; tokens repeated across experts (each quantized once in moe_q); gate/up
// W8G with some q = -128 (the AVX2 exact fallback) and down W8G, then both low-bit (4 bits with
// offsets; 6 bits; 5 bits), then GGUF K-quant scales (WLowArgs' ksuper: gate/up 4 bits with row shifts and
// mins as Q4_K, one expert without shifts; down 6 bits with int8 sub-scales to -128 and no mins, as
// Q6_K; groups of 16 in super-blocks of 32), activations with a 1e3 outlier.

void check_moe_q(const std::vector<const KernelTable*>& variants) {
  constexpr int H = 96, I = 64, E = 5, T = 11, S = 32;
  const int64_t counts[E] = {3, 0, 1, 9, 4};
  int64_t start[E + 1] = {0};
  for (int e = 0; e < E; ++e) start[e + 1] = start[e] + counts[e];
  const int64_t R = start[E];
  std::vector<int64_t> token(R);
  for (int64_t r = 0; r < R; ++r) token[r] = (r * 7 + 3) % T;
  Rng rng(31);
  std::vector<float> x((size_t)T * H);
  for (auto& v : x) v = rng.normal();
  x[5 * H + 7] = 1e3f;
  for (int mode = 0; mode < 5; ++mode) {  // 0: W8G, 1: 4-bit with offsets, 2: 6-bit, 3: K-quant scales, 4: 5-bit
    const bool kq = mode == 3;
    const int G = kq ? 16 : 32;
    auto bits_of = [&](int p) { return mode == 1 || (kq && !p) ? 4 : mode == 4 ? 5 : 6; };
    // K-quant flags per expert and projection: gate/up shifts (not expert 3's) and mins; down none
    auto flags_of = [&](int e, int p) { return !kq || p ? 0 : (e == 3 ? 0 : 1) | 2; };
    // per expert and projection (0 gate/up [2I, H], 1 down [H, I]) the packed tensors
    std::vector<std::vector<int8_t>> w8(2 * E), ksub(2 * E), ksubmin(2 * E), kshift(2 * E);
    std::vector<std::vector<uint8_t>> lo(2 * E), hi(2 * E);
    std::vector<std::vector<float>> sc(2 * E), ws(2 * E), off(2 * E), ksup(2 * E), ksupmin(2 * E), krow(2 * E);
    std::vector<std::vector<int16_t>> ws16(2 * E);
    std::vector<uint8_t> m128(2 * E, 0);
    for (int e = 0; e < E; ++e)
      for (int p = 0; p < 2; ++p) {
        const int N = p ? H : 2 * I, K = p ? I : H, tiles = (N + 15) / 16, groups = K / G, supers = K / S;
        const int i = 2 * e + p, ctr = bits_of(p) == 6 ? 32 : bits_of(p) == 5 ? 16 : 8, fl = flags_of(e, p);
        sc[i].assign((size_t)tiles * groups * 16, 0.f);
        off[i].assign((size_t)tiles * groups * 16, 0.f);
        ws[i].assign((size_t)tiles * groups * 16, 0.f);
        ws16[i].assign((size_t)tiles * groups * 16, 0);
        w8[i].assign((size_t)tiles * 16 * K, 0);
        lo[i].assign((size_t)tiles * 8 * K, 0);
        hi[i].assign((size_t)tiles * 4 * K, 0);
        ksub[i].assign((size_t)tiles * groups * 16, 0);
        ksubmin[i].assign((size_t)tiles * groups * 16, 0);
        kshift[i].assign((size_t)tiles * 16, 0);
        ksup[i].assign((size_t)tiles * supers * 16, 0.f);
        ksupmin[i].assign((size_t)tiles * supers * 16, 0.f);
        krow[i].assign((size_t)tiles * 16, 0.f);
        std::vector<int> q((size_t)K);
        for (int n = 0; n < tiles * 16; ++n) {
          const int t = n / 16, r = n % 16;
          for (int k = 0; k < K; ++k) {
            if (n >= N) q[k] = mode ? -ctr : 0;  // padding rows (u = 0 for low bits)
            else if (mode == 0) q[k] = (int)(rng.next() % 256) - 128;
            else q[k] = (int)(rng.next() % (2 * ctr)) - ctr;
          }
          if (mode == 0)
            for (int k = 0; k < K; ++k) {
              w8[i][(((size_t)t * (K / 4) + k / 4) * 16 + r) * 4 + k % 4] = (int8_t)q[k];
              if (q[k] == -128) m128[i] = 1;
            }
          else
            pack_wlow_row(q.data(), n, K, ctr, lo[i].data(), hi[i].data());
          if (kq && n < N) {
            if (fl & 1) kshift[i][n] = (int8_t)((int)(rng.next() % 17) - 8);
            for (int b = 0; b < supers; ++b) {
              ksup[i][((size_t)t * supers + b) * 16 + r] = 1e-4f + 1e-3f * rng.uniform();
              if (fl & 2) ksupmin[i][((size_t)t * supers + b) * 16 + r] = 1e-3f * rng.uniform();
            }
          }
          double rowsum = 0;
          for (int g = 0; g < groups; ++g) {
            int sum = 0;
            for (int k = g * G; k < (g + 1) * G; ++k) sum += q[k];
            const size_t at = ((size_t)t * groups + g) * 16 + r;
            ws[i][at] = (float)sum;
            ws16[i][at] = (int16_t)sum;
            if (n < N && kq) {
              // 4 bits: sub-scales and mins 6-bit (0..63, ends included); 6 bits: int8 to its ends
              const int v = (int)(rng.next() % 64);
              ksub[i][at] = (int8_t)(p ? (g % 3 == 0 ? -128 : g % 3 == 1 ? 127 : v - 32) : (g == 1 ? 63 : v));
              if (fl & 2) ksubmin[i][at] = (int8_t)(rng.next() % 64);
              rowsum += (double)ksup[i][((size_t)t * supers + g * G / S) * 16 + r] * ksub[i][at] * sum;
            } else if (n < N) {
              sc[i][at] = 1e-3f + 0.01f * rng.uniform();
              off[i][at] = mode == 1 ? 0.02f * rng.normal() : 0.f;
            }
          }
          krow[i][n] = (float)rowsum;
        }
      }
    // the per-expert calls (expert 1 has no rows: its pointers stay null in moe_q)
    for (const KernelTable* kt : variants) {
      std::vector<float> want((size_t)R * H, 0.f);
      for (int e = 0; e < E; ++e) {
        const int64_t n = counts[e];
        if (!n) continue;
        std::vector<float> xs((size_t)n * H), gu((size_t)n * 2 * I), act((size_t)n * I);
        for (int64_t r = 0; r < n; ++r)
          std::memcpy(xs.data() + r * H, x.data() + token[start[e] + r] * H, sizeof(float) * H);
        for (int p = 0; p < 2; ++p) {
          const int N = p ? H : 2 * I, K = p ? I : H, i = 2 * e + p, bits = bits_of(p), fl = flags_of(e, p);
          const float* src = p ? act.data() : xs.data();
          float* out = p ? want.data() + start[e] * H : gu.data();
          if (mode == 0) {
            W8GArgs a{src, n, K, N, w8[i].data(), sc[i].data(), ws[i].data(), G, m128[i] != 0, out};
            kt->gemm_w8g_a8(a);
          } else {
            WLowArgs a{src, n, K, N, lo[i].data(), bits != 4 ? hi[i].data() : nullptr, sc[i].data(),
                       mode == 1 ? off[i].data() : nullptr, G, bits, out, ws16[i].data()};
            if (kq) {
              a.scale = nullptr, a.wsum = nullptr;
              a.ksub = ksub[i].data();
              a.ksubmin = fl & 2 ? ksubmin[i].data() : nullptr;
              a.ksup = ksup[i].data();
              a.ksupmin = fl & 2 ? ksupmin[i].data() : nullptr;
              a.krowsum = krow[i].data();
              a.kshift = fl & 1 ? kshift[i].data() : nullptr;
              a.ksuper = S;
            }
            kt->gemm_wlow_a8(a);
          }
          if (!p) kt->silu_and_mul(gu.data(), act.data(), kF32, n, I);
        }
      }
      std::vector<const void*> pw[2], pws[2];
      std::vector<const uint8_t*> phi[2];
      std::vector<const float*> psc[2], poff[2], psup[2], psupmin[2], prow[2];
      std::vector<const int8_t*> psub[2], psubmin[2], pshift[2];
      std::vector<uint8_t> pm[2];
      MoeQProj proj[2];
      for (int p = 0; p < 2; ++p) {
        pw[p].assign(E, nullptr), pws[p].assign(E, nullptr), phi[p].assign(E, nullptr);
        psc[p].assign(E, nullptr), poff[p].assign(E, nullptr), pm[p].assign(E, 0);
        psup[p].assign(E, nullptr), psupmin[p].assign(E, nullptr), prow[p].assign(E, nullptr);
        psub[p].assign(E, nullptr), psubmin[p].assign(E, nullptr), pshift[p].assign(E, nullptr);
        for (int e = 0; e < E; ++e) {
          if (!counts[e]) continue;
          const int i = 2 * e + p, fl = flags_of(e, p);
          pw[p][e] = mode ? (const void*)lo[i].data() : (const void*)w8[i].data();
          pws[p][e] = kq ? nullptr : mode ? (const void*)ws16[i].data() : (const void*)ws[i].data();
          phi[p][e] = bits_of(p) != 4 && mode ? hi[i].data() : nullptr;
          psc[p][e] = kq ? nullptr : sc[i].data();
          poff[p][e] = mode == 1 ? off[i].data() : nullptr;
          pm[p][e] = m128[i];
          if (kq) {
            psub[p][e] = ksub[i].data();
            psubmin[p][e] = fl & 2 ? ksubmin[i].data() : nullptr;
            psup[p][e] = ksup[i].data();
            psupmin[p][e] = fl & 2 ? ksupmin[i].data() : nullptr;
            prow[p][e] = krow[i].data();
            pshift[p][e] = fl & 1 ? kshift[i].data() : nullptr;
          }
        }
        proj[p] = MoeQProj{mode ? 1 : 0, G, mode ? bits_of(p) : 0, pw[p].data(), phi[p].data(), psc[p].data(),
                           pws[p].data(), pm[p].data(), poff[p].data()};
        if (kq) {
          proj[p].ksuper = S;
          proj[p].ksub = psub[p].data();
          proj[p].ksubmin = psubmin[p].data();
          proj[p].ksup = psup[p].data();
          proj[p].ksupmin = psupmin[p].data();
          proj[p].krowsum = prow[p].data();
          proj[p].kshift = pshift[p].data();
        }
      }
      std::vector<float> gu_out((size_t)R * 2 * I, -1.f), y((size_t)R * H, -1.f);
      MoeQArgs a{x.data(), T, H, I, E, start, token.data(), proj[0], proj[1], gu_out.data(), y.data()};
      kt->moe_q(a);
      double err = 0;
      bool ok = true;
      for (size_t j = 0; j < y.size(); ++j) {
        ok = ok && y[j] == want[j] && std::isfinite(y[j]);
        err = std::max(err, (double)std::fabs(y[j] - want[j]));
      }
      static const char* names[] = {"G=32 W8G (q = -128 included)", "G=32 4-bit with offsets", "G=32 6-bit",
                                    "G=16 S=32 K-quant (gate/up Q4_K-like with shifts and mins, down Q6_K-like)",
                                    "G=32 5-bit"};
      report(ok, kt->name, std::string("moe_q E=5 rows 3,0,1,9,4 H=96 I=64 ") + names[mode] +
                               " == the per-expert calls", err);
    }
  }
}

// The panel GEMMs over the shapes of issue 19: decode rows (1), partial, whole and several row blocks
// (3, 8, 17, 64), K of a small layer, the default model's hidden size, and not a multiple of the
// unrolls (1000, 1001: odd, a padded last pair), N with a partial last panel (100). Against a double
// product with a rigorous bound: each of the ~K fp32 operations of an output rounds by at most one
// ulp (2^-23, relative: round-to-odd of BFDOT included), so |err| <= 2^-23 (K + 2) sum_k |x_k w_k|
// (+ the bias' rounding); a bf16 output adds its own rounding, 2^-8 |y|. A wrong panel, column, pair
// or tail is off by O(sum |x w| / sqrt(K)), hundreds of times the bound. "large": x ~ 1e6 and
// w ~ 1e3 of mixed signs, every even k's weight cancelled by the next (y ~ 0, sum |x w| ~ 1e9 K).
struct GemmCase {
  int M, N, K;
  bool bias, large;
};

std::vector<GemmCase> gemm_grid() {
  std::vector<GemmCase> cases;
  // rows: decode; the blocks' passes (NEON pairs and a single row; AVX2 4 = 2 + 2, 7 = 3 + 2 + 2); whole
  // and several 8-row blocks
  for (int m : {1, 3, 4, 7, 8, 17, 64})
    for (int k : {64, 576, 1000, 1001}) cases.push_back({m, 100, k, m % 2 == 1, false});
  cases.push_back({3, 70, 1001, true, true});
  cases.push_back({17, 40, 576, false, true});
  return cases;
}

void fill_gemm(const GemmCase& c, Rng& rng, std::vector<float>& w, std::vector<float>& x, std::vector<float>& b) {
  w.resize((size_t)c.N * c.K);
  x.resize((size_t)c.M * c.K);
  b.resize(c.N);
  for (int n = 0; n < c.N; ++n)
    for (int k = 0; k < c.K; ++k) {
      float v = (c.large ? 1e3f : 0.1f) * rng.normal();
      if (c.large && k % 2 == 1) v = -w[(size_t)n * c.K + k - 1] * (1.f + 1e-3f * rng.normal());
      w[(size_t)n * c.K + k] = v;
    }
  for (auto& v : x) v = (c.large ? 1e6f : 1.f) * rng.normal();
  for (auto& v : b) v = rng.normal();
}

// y = x w^T + b in double, and the rigorous fp32 bound of each output (see above).
void gemm_ref(const GemmCase& c, const std::vector<float>& x, const std::vector<float>& w, const std::vector<float>& b,
              std::vector<double>& ref, std::vector<double>& bound) {
  ref.assign((size_t)c.M * c.N, 0);
  bound.assign(ref.size(), 0);
  const double u = std::ldexp(1.0, -23) * (c.K + 2);
  for (int m = 0; m < c.M; ++m)
    for (int n = 0; n < c.N; ++n) {
      double acc = c.bias ? b[n] : 0.0, mag = c.bias ? std::fabs(b[n]) : 0.0;
      for (int k = 0; k < c.K; ++k) {
        const double p = (double)x[(size_t)m * c.K + k] * w[(size_t)n * c.K + k];
        acc += p;
        mag += std::fabs(p);
      }
      ref[(size_t)m * c.N + n] = acc;
      bound[(size_t)m * c.N + n] = u * mag + 1e-30;
    }
}

template <class Get>
void report_gemm(const char* variant, const std::string& what, const std::vector<double>& ref,
                 const std::vector<double>& bound, double rel_out, Get got) {
  bool ok = true;
  double worst = 0;
  for (size_t i = 0; i < ref.size(); ++i) {
    const double e = std::fabs(got(i) - ref[i]);
    if (!(e <= bound[i] + rel_out * std::fabs(ref[i]))) ok = false;
    if (!(e <= worst)) worst = e;
  }
  report(ok, variant, what, worst);
}

void check_gemm_grid(const std::vector<const KernelTable*>& variants) {
  constexpr int NR = kSgemmPanel;
  Rng rng(23);
  for (const GemmCase& c : gemm_grid()) {
    std::vector<float> w, x, b;
    fill_gemm(c, rng, w, x, b);
    const int P = (c.N + NR - 1) / NR, K2 = (c.K + 1) / 2;
    // gemm_f32 panels
    std::vector<float> wp((size_t)P * c.K * NR, 0.f);
    for (int n = 0; n < c.N; ++n)
      for (int k = 0; k < c.K; ++k) wp[((size_t)(n / NR) * c.K + k) * NR + n % NR] = w[(size_t)n * c.K + k];
    std::vector<double> ref, bound;
    gemm_ref(c, x, w, b, ref, bound);
    char what[96];
    for (const KernelTable* kt : variants) {
      std::vector<float> out((size_t)c.M * c.N, -1.f);
      kt->gemm_f32(x.data(), c.M, c.K, wp.data(), c.N, c.bias ? b.data() : nullptr, out.data(), kSgemmNoAct);
      std::snprintf(what, sizeof what, "gemm_f32 grid M=%d N=%d K=%d%s%s", c.M, c.N, c.K, c.bias ? " bias" : "",
                    c.large ? " large" : "");
      report_gemm(kt->name, what, ref, bound, 0, [&](size_t i) { return (double)out[i]; });
      if (c.M > 1)
        check_rows_alone(kt->name, what, out, c.M, c.N, [&](int m, float* o) {
          kt->gemm_f32(x.data() + (size_t)m * c.K, 1, c.K, wp.data(), c.N, c.bias ? b.data() : nullptr, o, kSgemmNoAct);
        });
    }
    // gemm_bf16: the weights rounded to bf16, packed in k pairs; x fp32, then x rounded to bf16 (bf16 out)
    std::vector<float> wr(w.size());
    std::vector<uint16_t> bp((size_t)P * K2 * NR * 2, 0);
    for (int n = 0; n < c.N; ++n)
      for (int k = 0; k < c.K; ++k) {
        const uint16_t h = f32_to_bf16(w[(size_t)n * c.K + k]);
        wr[(size_t)n * c.K + k] = bf16_to_f32(h);
        bp[(((size_t)(n / NR) * K2 + k / 2) * NR + n % NR) * 2 + k % 2] = h;
      }
    gemm_ref(c, x, wr, b, ref, bound);
    for (const KernelTable* kt : variants) {
      std::vector<float> out((size_t)c.M * c.N, -1.f);
      kt->gemm_bf16(x.data(), kF32, c.M, c.K, bp.data(), c.N, c.bias ? b.data() : nullptr, out.data(), kF32);
      std::snprintf(what, sizeof what, "gemm_bf16 x:f32 M=%d N=%d K=%d%s%s", c.M, c.N, c.K, c.bias ? " bias" : "",
                    c.large ? " large" : "");
      report_gemm(kt->name, what, ref, bound, 0, [&](size_t i) { return (double)out[i]; });
      if (c.M > 1)
        check_rows_alone(kt->name, what, out, c.M, c.N, [&](int m, float* o) {
          kt->gemm_bf16(x.data() + (size_t)m * c.K, kF32, 1, c.K, bp.data(), c.N, c.bias ? b.data() : nullptr, o, kF32);
        });
    }
    std::vector<uint16_t> xh(x.size());
    std::vector<float> xr(x.size());
    for (size_t i = 0; i < x.size(); ++i) {
      xh[i] = f32_to_bf16(x[i]);
      xr[i] = bf16_to_f32(xh[i]);
    }
    gemm_ref(c, xr, wr, b, ref, bound);
    for (const KernelTable* kt : variants) {
      std::vector<uint16_t> out((size_t)c.M * c.N, 0xffff);
      kt->gemm_bf16(xh.data(), kBF16, c.M, c.K, bp.data(), c.N, c.bias ? b.data() : nullptr, out.data(), kBF16);
      std::snprintf(what, sizeof what, "gemm_bf16 x:bf16 M=%d N=%d K=%d%s%s", c.M, c.N, c.K, c.bias ? " bias" : "",
                    c.large ? " large" : "");
      report_gemm(kt->name, what, ref, bound, std::ldexp(1.0, -8), [&](size_t i) { return (double)bf16_to_f32(out[i]); });
      if (c.M > 1)
        check_rows_alone(kt->name, what, out, c.M, c.N, [&](int m, uint16_t* o) {
          kt->gemm_bf16(xh.data() + (size_t)m * c.K, kBF16, 1, c.K, bp.data(), c.N, c.bias ? b.data() : nullptr, o,
                        kBF16);
        });
    }
  }
}

// Row argmax (greedy sampling): the first maximum; ties, -inf rows, NaN (counts as the maximum) and a
// row stride wider than the row.
void check_argmax(const std::vector<const KernelTable*>& variants) {
  const int rows = 6, n = 301, ld = 320;
  Rng rng(5);
  std::vector<float> x((size_t)rows * ld);
  for (auto& v : x) v = rng.normal();
  x[7] = x[250] = 100.f;                                                   // row 0: tie -> 7
  for (int i = 0; i < n; ++i) x[(size_t)ld + i] = -std::numeric_limits<float>::infinity();  // row 1 -> 0
  x[2 * ld + 300] = std::numeric_limits<float>::infinity();                // row 2 -> 300 (tail)
  x[3 * ld + 40] = std::numeric_limits<float>::quiet_NaN();                // row 3 -> 40
  x[3 * ld + 41] = 1e30f;
  x[4 * ld + n] = 1e30f;                                                   // past the row: ignored
  std::vector<int64_t> want(rows);
  for (int r = 0; r < rows; ++r) {
    const float* p = x.data() + (size_t)r * ld;
    int64_t best = 0;
    for (int i = 1; i < n; ++i)
      if (!(p[best] != p[best]) && (p[i] != p[i] || p[i] > p[best])) best = i;
    want[r] = best;
  }
  for (const KernelTable* kt : variants) {
    std::vector<int64_t> out(rows, -1);
    kt->argmax_rows(x.data(), rows, n, ld, out.data());
    report(out == want && want[0] == 7 && want[1] == 0 && want[2] == 300 && want[3] == 40, kt->name,
           "argmax_rows ties/-inf/NaN/stride", 0);
  }
}

// ------------------------------------------------------------------------------------------
// quantized KV cache (int8 / fp8 e4m3 / fp8 e5m2, a float32 scale per token and KV head): the
// cache write against an independent oracle (nearest code by exhaustive search, ties to the even
// code; int8 rounds half to even), bit for bit in every variant; paged attention over quantized
// caches, the generic one against the naive double attention over the dequantized values, every
// variant against the naive one too.

const char* qname(int qdt) { return qdt == kI8 ? "int8" : (qdt == kFP8E4M3 ? "fp8_e4m3" : "fp8_e5m2"); }
float qmax_of(int qdt) { return qdt == kI8 ? kI8Max : (qdt == kFP8E4M3 ? kFP8E4M3Max : kFP8E5M2Max); }

// The value of a code, from the format's definition (not the kernels' bit tricks).
double code_value(int qdt, uint8_t b) {
  if (qdt == kI8) return (double)(int8_t)b;
  const int mb = qdt == kFP8E4M3 ? 3 : 2, bias = qdt == kFP8E4M3 ? 7 : 15;
  const int m = b & 0x7f, e = m >> mb, f = m & ((1 << mb) - 1);
  const double v = e == 0 ? std::ldexp((double)f, 1 - bias - mb) : std::ldexp((double)((1 << mb) + f), e - bias - mb);
  return (b & 0x80) ? -v : v;
}

bool code_finite(int qdt, int b) {
  if (qdt == kI8) return true;
  const int m = b & 0x7f;
  return qdt == kFP8E4M3 ? m != 0x7f : (m >> 2) != 31;
}

// The oracle's code of y (already clamped to [-max, max]).
uint8_t nearest_code(int qdt, float y) {
  if (qdt == kI8) return (uint8_t)(int8_t)std::nearbyint(y);
  int best = -1;
  double be = 0;
  for (int b = 0; b < 256; ++b) {
    if (!code_finite(qdt, b)) continue;
    const double e = std::fabs(code_value(qdt, (uint8_t)b) - (double)y);
    // ties: the even code (its last mantissa bit 0); a zero keeps y's sign
    if (best < 0 || e < be || (e == be && ((b & 1) == 0 && (best & 1) == 1)) ||
        (e == be && code_value(qdt, (uint8_t)b) == 0 && ((b & 0x80) != 0) == std::signbit(y)))
      best = b, be = e;
  }
  return (uint8_t)best;
}

void check_kv_quant(const std::vector<const KernelTable*>& variants) {
  const KernelTable* gen = variants.back();
  Rng rng(2024);
  const int NT = 8, KH = 2, KD = 32, BS = 3, NB = 6;
  // rows (token t, head h) with worst cases: all zero, huge, at/over e4m3's 448, subnormal floats,
  // tiny values beside large ones (codes flush to 0 or to subnormal codes), ordinary normals
  std::vector<float> kin((size_t)NT * KH * KD), vin(kin.size());
  for (int t = 0; t < NT; ++t)
    for (int h = 0; h < KH; ++h)
      for (int d = 0; d < KD; ++d) {
        const size_t i = ((size_t)t * KH + h) * KD + d;
        const float z = rng.normal();
        float k;
        switch ((t * KH + h) % 8) {
          case 0: k = 0.f; break;
          case 1: k = 1e36f * z; break;
          case 2: k = d == 0 ? 448.f : (d == 1 ? -500.f : (d == 2 ? 464.f : 300.f * z)); break;
          case 3: k = 1e-40f * z; break;
          case 4: k = d == 0 ? 1e4f : 1e-3f * z; break;
          default: k = 3.f * z;
        }
        kin[i] = k;
        vin[i] = (t * KH + h) % 8 == 0 ? 0.f : -0.5f * k + (d % 5 == 0 ? 0.f : 0.25f * z);
      }
  std::vector<int64_t> slots = {4, 0, 17, -1, 9, 3, 11, 15};
  for (int qdt : {kI8, kFP8E4M3, kFP8E5M2}) {
    const float qmax = qmax_of(qdt);
    std::vector<uint8_t> kq_ref((size_t)NB * KH * BS * KD, 0xAA), vq_ref(kq_ref.size(), 0xAA);
    std::vector<float> ks_ref((size_t)NB * KH * BS, -7.f), vs_ref(ks_ref.size(), -7.f);
    // the oracle: scale = absmax / max (1 for a zero row), codes of clamp(x / scale)
    for (int t = 0; t < NT; ++t) {
      if (slots[t] < 0) continue;
      for (int h = 0; h < KH; ++h) {
        const int64_t row = (slots[t] / BS * KH + h) * BS + slots[t] % BS;
        for (int kv = 0; kv < 2; ++kv) {
          const float* x = (kv ? vin.data() : kin.data()) + ((size_t)t * KH + h) * KD;
          float amax = 0.f;
          for (int d = 0; d < KD; ++d) amax = std::max(amax, std::fabs(x[d]));
          float sc = amax / qmax;
          if (!(sc > 0.f)) sc = 1.f;
          (kv ? vs_ref : ks_ref)[row] = sc;
          for (int d = 0; d < KD; ++d)
            (kv ? vq_ref : kq_ref)[row * KD + d] = nearest_code(qdt, std::min(qmax, std::max(-qmax, x[d] / sc)));
        }
      }
    }
    for (const KernelTable* kt : variants) {
      std::vector<uint8_t> kq(kq_ref.size(), 0xAA), vq(kq_ref.size(), 0xAA);
      std::vector<float> ks(ks_ref.size(), -7.f), vs(ks_ref.size(), -7.f);
      kt->reshape_and_cache_quant(kin.data(), vin.data(), kF32, KH * KD, KD, KH * KD, KD, kq.data(), vq.data(), qdt,
                                  ks.data(), vs.data(), slots.data(), NT, KH, KD, BS);
      int bad = 0;
      for (size_t i = 0; i < kq.size(); ++i) bad += kq[i] != kq_ref[i] || vq[i] != vq_ref[i];
      for (size_t i = 0; i < ks.size(); ++i) bad += std::memcmp(&ks[i], &ks_ref[i], 4) || std::memcmp(&vs[i], &vs_ref[i], 4);
      report(bad == 0, kt->name, std::string("kv write ") + qname(qdt) + " == oracle (worst cases)", bad);
    }
  }

  // attention over quantized caches: decode, chunked prefill, GQA, a window and a soft cap
  const std::vector<std::pair<int, int>> decode = {{1, 1}, {1, 17}, {1, 100}, {1, 600}};
  const std::vector<std::pair<int, int>> mixed = {{1, 45}, {20, 20}, {7, 90}, {1, 530}, {33, 70}};
  std::vector<AttnCase> cases = {{decode, 8, 2, 64, 16, kF32, kF32},
                                 {mixed, 8, 2, 64, 16, kF32, kF32},
                                 {mixed, 4, 4, 48, 5, kF32, kF32},
                                 {decode, 8, 2, 64, 16, kF32, kF32, 40, 0.f},
                                 {mixed, 8, 2, 64, 7, kF32, kF32, 13, 5.f}};
  uint64_t seed = 500;
  for (int qdt : {kI8, kFP8E4M3, kFP8E5M2})
    for (const AttnCase& c : cases) {
      AttnData d(c, seed++);
      // quantize the whole float caches (garbage rows too) with the generic writer, block by block
      const int64_t nb = (int64_t)(d.kc.size() / ((size_t)c.kv_heads * c.block_size * c.head_size));
      const int64_t rows = nb * c.kv_heads * c.block_size;
      std::vector<uint8_t> kq((size_t)rows * c.head_size), vq(kq.size());
      std::vector<float> ks((size_t)rows), vs((size_t)rows);
      for (int64_t b = 0; b < nb; ++b) {
        std::vector<int64_t> sl(c.block_size);
        for (int o = 0; o < c.block_size; ++o) sl[o] = b * c.block_size + o;
        const int64_t base = b * c.kv_heads * c.block_size * c.head_size;
        gen->reshape_and_cache_quant(d.kc.f.data() + base, d.vc.f.data() + base, kF32, c.head_size,
                                     (int64_t)c.block_size * c.head_size, c.head_size,
                                     (int64_t)c.block_size * c.head_size, kq.data(), vq.data(), qdt, ks.data(),
                                     vs.data(), sl.data(), c.block_size, c.kv_heads, c.head_size, c.block_size);
      }
      // the float caches become the dequantized values (code value * scale, rounded to float)
      for (size_t i = 0; i < kq.size(); ++i) {
        d.kc.f[i] = (float)code_value(qdt, kq[i]) * ks[i / c.head_size];
        d.vc.f[i] = (float)code_value(qdt, vq[i]) * vs[i / c.head_size];
      }
      const std::vector<float> want = naive_attention(c, d);
      for (const KernelTable* kt : variants) {
        Buf out((size_t)d.num_tokens * c.heads * c.head_size, kF32);
        AttentionArgs a{};
        a.query = d.q.data();
        a.q_stride_token = (int64_t)c.heads * c.head_size;
        a.q_stride_head = c.head_size;
        a.q_dtype = kF32;
        a.out = out.data();
        a.o_stride_token = a.q_stride_token;
        a.o_stride_head = a.q_stride_head;
        a.key_cache = kq.data();
        a.value_cache = vq.data();
        a.kv_dtype = qdt;
        a.k_scale = ks.data();
        a.v_scale = vs.data();
        a.block_table = d.bt.data();
        a.block_table_stride = d.bt_stride;
        a.seq_lens = d.seq_lens.data();
        a.query_start_loc = d.qsl.data();
        a.num_seqs = (int)c.seqs.size();
        a.num_heads = c.heads;
        a.num_kv_heads = c.kv_heads;
        a.head_size = c.head_size;
        a.block_size = c.block_size;
        a.scale = 1.f / std::sqrt((float)c.head_size);
        a.sliding_window = c.window;
        a.logits_soft_cap = c.soft_cap;
        kt->paged_attention(a);
        double err;
        std::string what = describe(c);
        what.replace(what.find(" kv:f32"), 7, std::string(" kv:") + qname(qdt));
        // every variant, generic included, against the naive double attention over the same values
        const bool ok = close_enough(out.f, want, 2e-5, 2e-5, &err);
        report(ok, kt->name, what + " vs naive", err);
      }
    }
}

// Every one of the 256 codes of each format as V through each variant's paged attention (its vector
// code loads): four one-token sequences (softmax weight exactly 1) whose V rows hold codes
// 64s .. 64s + 63 with a scale of 0.3, so the output is code value * scale rounded to float, bit for
// bit (zeros compare equal whatever their sign); NaN codes (e4m3 0x7f/0xff, e5m2 exponent 31 with a
// mantissa) give NaN, e5m2's inf codes inf.
void check_kv_codes(const std::vector<const KernelTable*>& variants) {
  const int D = 64, BS = 16, NS = 4;
  for (int qdt : {kI8, kFP8E4M3, kFP8E5M2}) {
    std::vector<uint8_t> kq((size_t)NS * BS * D, 0), vq(kq.size(), 0);
    for (int b = 0; b < 256; ++b) vq[(size_t)(b / D) * BS * D + b % D] = (uint8_t)b;
    std::vector<float> ks((size_t)NS * BS, 1.f), vs(ks.size(), 0.3f);
    std::vector<float> q((size_t)NS * D, 0.5f);
    std::vector<int32_t> bt = {0, 1, 2, 3}, seq_lens = {1, 1, 1, 1}, qsl = {0, 1, 2, 3, 4};
    for (const KernelTable* kt : variants) {
      std::vector<float> out((size_t)NS * D, -7.f);
      AttentionArgs a{};
      a.query = q.data();
      a.q_stride_token = D;
      a.q_stride_head = D;
      a.q_dtype = kF32;
      a.out = out.data();
      a.o_stride_token = D;
      a.o_stride_head = D;
      a.key_cache = kq.data();
      a.value_cache = vq.data();
      a.kv_dtype = qdt;
      a.k_scale = ks.data();
      a.v_scale = vs.data();
      a.block_table = bt.data();
      a.block_table_stride = 1;
      a.seq_lens = seq_lens.data();
      a.query_start_loc = qsl.data();
      a.num_seqs = NS;
      a.num_heads = 1;
      a.num_kv_heads = 1;
      a.head_size = D;
      a.block_size = BS;
      a.scale = 0.125f;
      kt->paged_attention(a);
      int bad = 0;
      for (int b = 0; b < 256; ++b) {
        const float got = out[b];
        if (!code_finite(qdt, b)) {
          const int m = b & 0x7f;
          const bool inf = qdt == kFP8E5M2 && (m & 3) == 0;
          bad += inf ? !(std::isinf(got) && std::signbit(got) == ((b & 0x80) != 0)) : !std::isnan(got);
          continue;
        }
        // equal as floats: -0 codes come out +0 (the accumulator starts at +0, as for a float cache)
        const float want = (float)(code_value(qdt, (uint8_t)b) * (double)0.3f);
        bad += !(got == want);
      }
      report(bad == 0, kt->name, std::string("kv ") + qname(qdt) + " all 256 codes as V, exact", bad);
    }
  }
}

std::vector<std::string> split(const char* s) {
  std::vector<std::string> out;
  std::string cur;
  for (; *s; ++s) {
    if (*s == ',') {
      out.push_back(cur);
      cur.clear();
    } else {
      cur += *s;
    }
  }
  if (!cur.empty()) out.push_back(cur);
  return out;
}

}  // namespace

int main(int argc, char** argv) {
  const char* expect_variants = nullptr;
  const char* expect_selected = nullptr;
  const char* only = nullptr;  // "kv": the quantized KV cache checks alone (short runs under qemu)
  for (int i = 1; i + 1 < argc; i += 2) {
    if (!std::strcmp(argv[i], "--expect-variants")) expect_variants = argv[i + 1];
    if (!std::strcmp(argv[i], "--expect-selected")) expect_selected = argv[i + 1];
    if (!std::strcmp(argv[i], "--only")) only = argv[i + 1];
  }
  const KernelTable* list[8];
  const int n = available_kernels(list, 8);
  std::vector<const KernelTable*> variants(list, list + n);
  std::string names;
  for (auto* k : variants) names += std::string(names.empty() ? "" : ",") + k->name;
  std::printf("cpu: %s\nvariants: %s\nselected: %s\n", cpu_features_string(), names.c_str(),
              selected_kernels()->name);
  if (expect_variants) {
    const bool ok = split(expect_variants) == split(names.c_str());
    report(ok, "dispatch", std::string("variants == ") + expect_variants, 0);
  }
  if (expect_selected) {
    const bool ok = std::strcmp(selected_kernels()->name, expect_selected) == 0;
    report(ok, "dispatch", std::string("selected == ") + expect_selected, 0);
  }
  if (!only) {
    check_exp(variants);
    check_rows(variants);
    check_attention(variants);
    check_row_invariance(variants);
    check_w8g(variants);
    check_wlow(variants);
    check_wlow_kquant(variants);
    check_sgemm(variants);
    check_moe(variants);
    check_moe_q(variants);
    check_gemm_grid(variants);
    check_argmax(variants);
  }
  if (!only || !std::strcmp(only, "kv")) {
    check_kv_quant(variants);
    check_kv_codes(variants);
  }
  std::printf("checks: %d, failures: %d\nRESULT: %s\n", g_checks, g_failures, g_failures ? "FAIL" : "OK");
  return g_failures ? 1 : 0;
}

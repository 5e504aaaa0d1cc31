// The one place that picks a kernel variant from CPU features (ggml-cpu style): cpuid through
// __builtin_cpu_supports on x86-64, getauxval(AT_HWCAP/AT_HWCAP2) on Linux aarch64. A variant
// whose instructions the CPU lacks is never listed, so it can never run (no SVE or BF16 code on
// Neoverse N1). The choice is made once; APPLIANCE_KERNELS=<variant> overrides it.
#include <atomic>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <mutex>
#include <string>

#include "appliance_kernels.h"

#if defined(__aarch64__) && defined(__linux__)
#include <sys/auxv.h>
#endif

namespace appliance_kernels {

const KernelTable* kernels_generic();
const KernelTable* kernels_avx2();
const KernelTable* kernels_avx512();
const KernelTable* kernels_avx512bf16();
const KernelTable* kernels_neon();
const KernelTable* kernels_neon_bf16();
const KernelTable* kernels_sve();
int sve_vector_bits();  // 0 when not built for / not running on SVE

namespace {

struct Features {
  bool avx2 = false, fma = false, avx512 = false, avx512bf16 = false, avx512vnni = false;
  bool neon = false, dotprod = false, sve = false, bf16 = false, i8mm = false;
  int sve_bits = 0;
  std::string text;
};

const Features& features() {
  static const Features f = [] {
    Features f;
#if defined(__x86_64__)
    __builtin_cpu_init();
    f.avx2 = __builtin_cpu_supports("avx2");
    f.fma = __builtin_cpu_supports("fma");
    f.avx512 = __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
               __builtin_cpu_supports("avx512dq") && __builtin_cpu_supports("avx512vl");
    f.avx512bf16 = f.avx512 && __builtin_cpu_supports("avx512bf16");
    f.avx512vnni = f.avx512 && __builtin_cpu_supports("avx512vnni");
    f.text = std::string("x86_64") + (f.avx2 ? " avx2" : "") + (f.fma ? " fma" : "") +
             (f.avx512 ? " avx512f/bw/dq/vl" : "") + (f.avx512bf16 ? " avx512_bf16" : "") +
             (f.avx512vnni ? " avx512_vnni" : "");
#elif defined(__aarch64__) && defined(__linux__)
    const unsigned long hw = getauxval(AT_HWCAP), hw2 = getauxval(AT_HWCAP2);
    f.neon = (hw & (1UL << 1)) != 0;      // HWCAP_ASIMD
    f.dotprod = (hw & (1UL << 20)) != 0;  // HWCAP_ASIMDDP
    f.sve = (hw & (1UL << 22)) != 0;      // HWCAP_SVE
    f.bf16 = (hw2 & (1UL << 14)) != 0;    // HWCAP2_BF16
    f.i8mm = (hw2 & (1UL << 13)) != 0;    // HWCAP2_I8MM
    if (f.sve) f.sve_bits = sve_vector_bits();
    f.text = std::string("aarch64") + (f.neon ? " asimd" : "") + (f.dotprod ? " asimddp" : "") +
             (f.sve ? " sve" + std::to_string(f.sve_bits) : "") + (f.bf16 ? " bf16" : "") +
             (f.i8mm ? " i8mm" : "");
#else
    f.text = "unknown cpu (generic kernels only)";
#endif
    return f;
  }();
  return f;
}

// Supported variants, best first.
int supported(const KernelTable** out, int max) {
  const Features& f = features();
  const KernelTable* cand[8];
  int n = 0;
  // x86: wider is better.
  if (f.avx512bf16 && kernels_avx512bf16()) cand[n++] = kernels_avx512bf16();
  if (f.avx512 && kernels_avx512()) cand[n++] = kernels_avx512();
  if (f.avx2 && f.fma && kernels_avx2()) cand[n++] = kernels_avx2();
  // Arm: SVE first when its vectors are wider than NEON's (V1: 256 bit); at 128 bit (V2,
  // Grace) NEON is as wide and the BF16 variant's BFMMLA wins on bf16 caches.
  const bool sve_wide = f.sve && f.sve_bits > 128 && kernels_sve();
  if (sve_wide) cand[n++] = kernels_sve();
  if (f.bf16 && kernels_neon_bf16()) cand[n++] = kernels_neon_bf16();
  if (f.sve && !sve_wide && kernels_sve()) cand[n++] = kernels_sve();
  if (f.neon && kernels_neon()) cand[n++] = kernels_neon();
  cand[n++] = kernels_generic();
  int k = 0;
  for (int i = 0; i < n && k < max; ++i) out[k++] = cand[i];
  return k;
}

std::atomic<const KernelTable*> g_selected{nullptr};
std::once_flag g_once;

void choose() {
  const KernelTable* list[8];
  const int n = supported(list, 8);
  const KernelTable* pick = list[0];
  const char* env = std::getenv("APPLIANCE_KERNELS");
  if (env && *env && std::strcmp(env, "auto") != 0) {
    const KernelTable* want = find_kernels(env);
    if (want) {
      pick = want;
    } else {
      std::fprintf(stderr,
                   "appliance kernels: APPLIANCE_KERNELS=%s is not a variant this CPU supports "
                   "(supported:", env);
      for (int i = 0; i < n; ++i) std::fprintf(stderr, " %s", list[i]->name);
      std::fprintf(stderr, "); using %s\n", pick->name);
    }
  }
  const char* log = std::getenv("APPLIANCE_KERNELS_LOG");
  if (log && *log && std::strcmp(log, "0") != 0)
    std::fprintf(stderr, "appliance kernels: %s selected (cpu: %s)\n", pick->name,
                 features().text.c_str());
  g_selected.store(pick);
}

}  // namespace

const KernelTable* selected_kernels() {
  std::call_once(g_once, choose);
  return g_selected.load();
}

bool select_kernels(const char* name) {
  std::call_once(g_once, choose);
  const KernelTable* k = find_kernels(name);
  if (!k) return false;
  g_selected.store(k);
  return true;
}

int available_kernels(const KernelTable** out, int max) { return supported(out, max); }

const KernelTable* find_kernels(const char* name) {
  const KernelTable* list[8];
  const int n = supported(list, 8);
  for (int i = 0; i < n; ++i)
    if (std::strcmp(list[i]->name, name) == 0) return list[i];
  return nullptr;
}

const char* cpu_features_string() { return features().text.c_str(); }

bool cpu_has(const char* feature) {
  const Features& f = features();
  if (std::strcmp(feature, "avx512_vnni") == 0) return f.avx512vnni;
  if (std::strcmp(feature, "dotprod") == 0) return f.dotprod;
  if (std::strcmp(feature, "i8mm") == 0) return f.i8mm;
  if (std::strcmp(feature, "bf16") == 0) return f.bf16;
  return false;
}

}  // namespace appliance_kernels

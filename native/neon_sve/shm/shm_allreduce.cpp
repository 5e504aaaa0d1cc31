// In-place sum all-reduce of float32 / bfloat16 buffers among the processes of one host, through one
// POSIX shared-memory segment (appliance/distributed/shm_allreduce.py loads this with ctypes).
//
// Why a separate little library and not a function of the torch extension: it needs no torch headers,
// builds in seconds, and its sources do not key the extension's cache (appliance/ops/native.py), so a
// change here never forces the 20-minute kernel rebuild.
//
// Segment: a header (sizes, each rank's pid, two sequence flags per rank on their own cache lines),
// then two banks of `world` slots of `chunk_bytes` each. One step reduces up to one slot's worth:
//   1. copy: rank r copies its input into slot[bank][r], then publishes copied[r] = seq (release);
//   2. reduce-scatter: once every copied[j] == seq (acquire), rank r sums slice r of all slots, in
//      rank order 0..world-1 (so every rank gets bit-identical results), into slot[bank][r]'s slice r,
//      then publishes reduced[r] = seq;
//   3. all-gather: once every reduced[j] == seq, rank r copies slice j of slot[bank][j] into its output.
// bank = seq & 1. Double banking makes a third barrier unnecessary: rank j overwrites slot[bank][j]
// again at step seq + 2 only after seeing every rank's copied flag at seq + 1, which each rank sets
// only after finishing step seq. The same argument bounds every flag a waiter can see to {seq - 1,
// seq}, so the waits compare for equality and the 32-bit sequence may wrap.
// Waiters spin (with the CPU's pause/yield hint), then sched_yield; while yielding they check the time
// and whether the awaited rank's process still exists, and fail with a message instead of hanging.
// Only loads with acquire and stores with release order the data; attach counting is one fetch_add
// (an LSE atomic on armv8.1-a+, an LL/SC loop or outline call before). Portable C++17: x86 and Arm.
#include <atomic>
#include <cerrno>
#include <cstdarg>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <ctime>
#include <fcntl.h>
#include <sched.h>
#include <signal.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

namespace {

constexpr uint64_t kMagic = 0x41505053484d4152ull;  // "APPSHMAR"
constexpr int kMaxRanks = 64;
constexpr int kSpins = 2048;        // pause-hinted polls before yielding the CPU
constexpr int kCheckEvery = 256;    // yields between clock / liveness checks
constexpr size_t kSliceAlign = 64;  // bytes: each rank's slice starts on its own cache line

static_assert(std::atomic<uint32_t>::is_always_lock_free, "shared-memory flags need lock-free atomics");

struct alignas(64) Flag {
  std::atomic<uint32_t> v;
};

struct Header {
  uint64_t magic;
  uint32_t world;
  uint32_t start_seq;
  uint64_t chunk_bytes;
  uint64_t data_offset;
  alignas(64) std::atomic<uint32_t> attached;
  alignas(64) std::atomic<int32_t> pids[kMaxRanks];
  Flag copied[kMaxRanks];
  Flag reduced[kMaxRanks];
};

struct Handle {
  char* base;
  size_t bytes;
  Header* hdr;
  int world;
  int rank;
  size_t chunk_bytes;
  uint32_t seq;
  bool broken;
  double timeout_s;
  // Peers' pids as this process sees them; 0 where it cannot (another pid namespace sharing /dev/shm):
  // those peers are waited for up to the timeout without the liveness check.
  int32_t peer_pid[kMaxRanks];
};

size_t round_up(size_t x, size_t a) { return (x + a - 1) / a * a; }

double now_s() {
  timespec ts;
  clock_gettime(CLOCK_MONOTONIC, &ts);
  return ts.tv_sec + ts.tv_nsec * 1e-9;
}

inline void cpu_relax() {
#if defined(__x86_64__) || defined(__i386__)
  __builtin_ia32_pause();
#elif defined(__aarch64__) || defined(__arm__)
  asm volatile("yield" ::: "memory");
#endif
}

void set_err(char* err, size_t errlen, const char* fmt, ...) {
  if (!err || !errlen) return;
  va_list ap;
  va_start(ap, fmt);
  vsnprintf(err, errlen, fmt, ap);
  va_end(ap);
}

// A killed peer that is a child of this process stays a zombie until its parent reaps it, and
// kill(pid, 0) still succeeds on a zombie: rank 0 of a tensor-parallel engine is its workers' parent
// and would wait out the whole timeout in a collective. /proc/<pid>/stat's state 'Z' (or 'X') is dead.
bool zombie(int32_t pid) {
  char path[48];
  snprintf(path, sizeof path, "/proc/%d/stat", int(pid));
  FILE* f = fopen(path, "r");
  if (!f) return false;  // no /proc (or another pid namespace): kill() alone decides
  char buf[256];
  size_t n = fread(buf, 1, sizeof buf - 1, f);
  fclose(f);
  buf[n] = 0;
  const char* close_paren = strrchr(buf, ')');  // "pid (comm) S ...": comm may hold spaces and ')'
  return close_paren && (close_paren[1] == ' ') && (close_paren[2] == 'Z' || close_paren[2] == 'X');
}

bool alive(int32_t pid) {
  if (pid <= 0) return true;
  if (kill(pid, 0) != 0) return errno != ESRCH;
  return !zombie(pid);
}

// Wait until flags[j] == seq for every rank j. False (with a message) on timeout or a dead peer.
bool wait_all(Handle* h, Flag* flags, uint32_t seq, const char* phase, char* err, size_t errlen) {
  double start = -1;
  for (int j = 0; j < h->world; ++j) {
    if (j == h->rank) continue;
    int spins = 0, yields = 0;
    while (flags[j].v.load(std::memory_order_acquire) != seq) {
      if (spins < kSpins) {
        ++spins;
        cpu_relax();
        continue;
      }
      sched_yield();
      if (++yields % kCheckEvery) continue;
      double t = now_s();
      if (start < 0) start = t;
      int32_t pid = h->peer_pid[j];
      if (!alive(pid)) {
        set_err(err, errlen, "shm all-reduce: rank %d (pid %d) exited; rank %d was waiting for it in the %s phase",
                j, pid, h->rank, phase);
        return false;
      }
      if (t - start > h->timeout_s) {
        set_err(err, errlen,
                "shm all-reduce: rank %d (pid %d) did not reach the %s phase within %.1f s (rank %d waiting, step %u)",
                j, h->hdr->pids[j].load(std::memory_order_relaxed), phase, h->timeout_s, h->rank, seq);
        return false;
      }
    }
  }
  return true;
}

inline float bf16_to_f32(uint16_t b) {
  uint32_t u = uint32_t(b) << 16;
  float f;
  std::memcpy(&f, &u, 4);
  return f;
}

inline uint16_t f32_to_bf16(float f) {  // round to nearest even, NaN stays NaN (as torch)
  uint32_t u;
  std::memcpy(&u, &f, 4);
  if ((u & 0x7fffffffu) > 0x7f800000u) return uint16_t((u >> 16) | 0x40);
  return uint16_t((u + 0x7fffu + ((u >> 16) & 1)) >> 16);
}

void sum_f32(float* out, const float* const* src, int world, size_t n) {
  const float* a = src[0];
  const float* b = src[1];
  float tmp[256];
  for (size_t i0 = 0; i0 < n; i0 += 256) {
    size_t m = n - i0 < 256 ? n - i0 : 256;
    for (size_t i = 0; i < m; ++i) tmp[i] = a[i0 + i] + b[i0 + i];
    for (int j = 2; j < world; ++j) {
      const float* c = src[j];
      for (size_t i = 0; i < m; ++i) tmp[i] += c[i0 + i];
    }
    std::memcpy(out + i0, tmp, m * sizeof(float));
  }
}

void sum_bf16(uint16_t* out, const uint16_t* const* src, int world, size_t n) {
  float tmp[256];
  for (size_t i0 = 0; i0 < n; i0 += 256) {
    size_t m = n - i0 < 256 ? n - i0 : 256;
    for (size_t i = 0; i < m; ++i) tmp[i] = bf16_to_f32(src[0][i0 + i]) + bf16_to_f32(src[1][i0 + i]);
    for (int j = 2; j < world; ++j)
      for (size_t i = 0; i < m; ++i) tmp[i] += bf16_to_f32(src[j][i0 + i]);
    for (size_t i = 0; i < m; ++i) out[i0 + i] = f32_to_bf16(tmp[i]);
  }
}

char* slot(Handle* h, int bank, int r) {
  return h->base + h->hdr->data_offset + (size_t(bank) * h->world + r) * h->chunk_bytes;
}

// Elements [lo, hi) of an m-element step that rank r reduces.
void slice_of(size_t m, size_t elem, int world, int r, size_t* lo, size_t* hi) {
  size_t per = round_up((m + world - 1) / world, kSliceAlign / elem);
  *lo = per * r < m ? per * r : m;
  *hi = *lo + per < m ? *lo + per : m;
}

bool step(Handle* h, char* data, size_t m, size_t elem, int dtype, char* err, size_t errlen) {
  uint32_t seq = ++h->seq;
  int bank = seq & 1;
  Header* hdr = h->hdr;
  std::memcpy(slot(h, bank, h->rank), data, m * elem);
  hdr->copied[h->rank].v.store(seq, std::memory_order_release);
  if (!wait_all(h, hdr->copied, seq, "copy", err, errlen)) return false;

  size_t lo, hi;
  slice_of(m, elem, h->world, h->rank, &lo, &hi);
  if (hi > lo) {
    const char* src[kMaxRanks];
    for (int j = 0; j < h->world; ++j) src[j] = slot(h, bank, j) + lo * elem;
    char* out = slot(h, bank, h->rank) + lo * elem;  // only this rank reads this slice of its own slot
    if (h->world == 1)
      ;
    else if (dtype == 0)
      sum_f32(reinterpret_cast<float*>(out), reinterpret_cast<const float* const*>(src), h->world, hi - lo);
    else
      sum_bf16(reinterpret_cast<uint16_t*>(out), reinterpret_cast<const uint16_t* const*>(src), h->world, hi - lo);
  }
  hdr->reduced[h->rank].v.store(seq, std::memory_order_release);
  if (!wait_all(h, hdr->reduced, seq, "reduce", err, errlen)) return false;

  for (int j = 0; j < h->world; ++j) {
    slice_of(m, elem, h->world, j, &lo, &hi);
    if (hi > lo) std::memcpy(data + lo * elem, slot(h, bank, j) + lo * elem, (hi - lo) * elem);
  }
  return true;
}

size_t segment_bytes(int world, size_t chunk_bytes, size_t* data_offset) {
  *data_offset = round_up(sizeof(Header), 4096);
  return *data_offset + 2 * size_t(world) * chunk_bytes;
}

}  // namespace

extern "C" {

// Bytes of the segment for `world` ranks and `chunk_bytes` per slot (for callers that check /dev/shm room).
size_t appliance_shm_segment_bytes(int world, size_t chunk_bytes) {
  size_t off;
  return segment_bytes(world, chunk_bytes, &off);
}

// Rank 0 passes create=1 (the name must not exist) and publishes the name; the others then open it.
// Each rank next calls appliance_shm_wait_attached, which unlinks the name once all `world` ranks have
// mapped the segment (the mappings keep the memory alive): from then on nothing stays in /dev/shm
// whatever happens to the processes. On any failure the name is unlinked too. Returns the handle, or
// NULL with a message in err.
void* appliance_shm_open(const char* name, int world, int rank, int create, size_t chunk_bytes, uint32_t start_seq,
                         double timeout_s, char* err, size_t errlen) {
  if (world < 1 || world > kMaxRanks || rank < 0 || rank >= world) {
    set_err(err, errlen, "shm all-reduce: world_size must be in 1..%d and rank in 0..world_size-1; got world_size=%d rank=%d",
            kMaxRanks, world, rank);
    return nullptr;
  }
  if (chunk_bytes < 4096 || chunk_bytes % 64) {
    set_err(err, errlen, "shm all-reduce: chunk_bytes must be a multiple of 64 and >= 4096, got %zu", chunk_bytes);
    return nullptr;
  }
  size_t data_offset;
  size_t bytes = segment_bytes(world, chunk_bytes, &data_offset);
  int fd = shm_open(name, create ? (O_CREAT | O_EXCL | O_RDWR) : O_RDWR, 0600);
  if (fd < 0) {
    set_err(err, errlen, "shm all-reduce: shm_open(%s) failed: %s", name, strerror(errno));
    return nullptr;
  }
  if (create && ftruncate(fd, off_t(bytes)) != 0) {
    set_err(err, errlen, "shm all-reduce: sizing %s to %zu bytes failed: %s (is /dev/shm full?)", name, bytes,
            strerror(errno));
    close(fd);
    shm_unlink(name);
    return nullptr;
  }
  struct stat st;
  if (fstat(fd, &st) != 0 || size_t(st.st_size) != bytes) {
    set_err(err, errlen, "shm all-reduce: %s has %lld bytes, expected %zu (world_size or chunk_bytes differ between ranks)",
            name, (long long)st.st_size, bytes);
    close(fd);
    shm_unlink(name);
    return nullptr;
  }
  void* p = mmap(nullptr, bytes, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
  close(fd);
  if (p == MAP_FAILED) {
    set_err(err, errlen, "shm all-reduce: mmap of %zu bytes failed: %s", bytes, strerror(errno));
    shm_unlink(name);
    return nullptr;
  }
  Header* hdr = static_cast<Header*>(p);
  if (create) {  // ftruncate zero-filled it; the name is published only after this returns
    hdr->world = uint32_t(world);
    hdr->start_seq = start_seq;
    hdr->chunk_bytes = chunk_bytes;
    hdr->data_offset = data_offset;
    for (int j = 0; j < kMaxRanks; ++j) {
      hdr->copied[j].v.store(start_seq, std::memory_order_relaxed);
      hdr->reduced[j].v.store(start_seq, std::memory_order_relaxed);
    }
    std::atomic_thread_fence(std::memory_order_release);
    hdr->magic = kMagic;
  }
  std::atomic_thread_fence(std::memory_order_acquire);
  if (hdr->magic != kMagic || hdr->world != uint32_t(world) || hdr->chunk_bytes != chunk_bytes) {
    set_err(err, errlen, "shm all-reduce: %s is not a segment for world_size=%d chunk_bytes=%zu", name, world, chunk_bytes);
    munmap(p, bytes);
    shm_unlink(name);
    return nullptr;
  }
  hdr->pids[rank].store(int32_t(getpid()), std::memory_order_relaxed);
  hdr->attached.fetch_add(1, std::memory_order_acq_rel);
  return new Handle{static_cast<char*>(p), bytes, hdr, world, rank, chunk_bytes, hdr->start_seq, false, timeout_s, {}};
}

// Wait until all ranks have opened the segment, then unlink its name (every rank tries; ENOENT after
// the first is expected). 0 on success; -1 with a message after timeout_s, the name unlinked as well.
int appliance_shm_wait_attached(void* handle, const char* name, char* err, size_t errlen) {
  Handle* h = static_cast<Handle*>(handle);
  double start = now_s();
  long polls = 0;
  while (h->hdr->attached.load(std::memory_order_acquire) < uint32_t(h->world)) {
    if (++polls < kSpins) {
      cpu_relax();
      continue;
    }
    sched_yield();
    if (polls % kCheckEvery) continue;
    if (now_s() - start > h->timeout_s) {
      set_err(err, errlen, "shm all-reduce: only %u of %d ranks attached to %s within %.1f s (rank %d waiting)",
              h->hdr->attached.load(), h->world, name, h->timeout_s, h->rank);
      shm_unlink(name);
      h->broken = true;
      return -1;
    }
  }
  shm_unlink(name);
  for (int j = 0; j < h->world; ++j) {  // every peer is alive now: one we cannot see is in another pid namespace
    int32_t pid = h->hdr->pids[j].load(std::memory_order_relaxed);
    h->peer_pid[j] = alive(pid) ? pid : 0;
  }
  return 0;
}

// Sum `n` elements (dtype 0: float32, 1: bfloat16) in place across the ranks. 0 on success; -1 with a
// message in err when a peer did not arrive in time or died; the handle then refuses further calls
// (the ranks' sequence numbers no longer agree).
int appliance_shm_all_reduce(void* handle, void* data, size_t n, int dtype, char* err, size_t errlen) {
  Handle* h = static_cast<Handle*>(handle);
  if (h->broken) {
    set_err(err, errlen, "shm all-reduce: this communicator failed earlier and cannot be used again");
    return -1;
  }
  if (dtype != 0 && dtype != 1) {
    set_err(err, errlen, "shm all-reduce: dtype code must be 0 (float32) or 1 (bfloat16), got %d", dtype);
    return -1;
  }
  size_t elem = dtype == 0 ? 4 : 2;
  size_t per_step = h->chunk_bytes / elem;
  char* p = static_cast<char*>(data);
  for (size_t off = 0; off < n; off += per_step) {
    size_t m = n - off < per_step ? n - off : per_step;
    if (!step(h, p + off * elem, m, elem, dtype, err, errlen)) {
      h->broken = true;
      return -1;
    }
  }
  return 0;
}

uint32_t appliance_shm_seq(void* handle) { return static_cast<Handle*>(handle)->seq; }

void appliance_shm_close(void* handle) {
  Handle* h = static_cast<Handle*>(handle);
  if (!h) return;
  munmap(h->base, h->bytes);
  delete h;
}

}  // extern "C"

// Stand-alone check of shm_allreduce.cpp without Python or torch, for cross-compiled targets run under
// qemu (tests/distributed/test_shm_arm64.py): forks `world` ranks that sum float32 and bfloat16
// buffers of several sizes through a small-chunked segment starting near the 32-bit sequence wrap,
// and compares with sums computed here. Exit 0 and "ok" when every rank matched.
#include "shm_allreduce.cpp"

#include <cstdlib>
#include <string>
#include <sys/wait.h>
#include <vector>

static float value(int rank, size_t i) { return float(int((i * 7 + rank * 13) % 61) - 30) * 0.25f; }

static int run_rank(void* h, int rank, int world) {
  const size_t sizes[] = {1, 7, 1000, 4099, 100003};
  char err[512];
  for (size_t n : sizes) {
    std::vector<float> f(n);
    std::vector<uint16_t> b(n);
    for (size_t i = 0; i < n; ++i) {
      f[i] = value(rank, i);
      b[i] = f32_to_bf16(value(rank, i));  // exact: multiples of 0.25 within +-30
    }
    if (appliance_shm_all_reduce(h, f.data(), n, 0, err, sizeof err) || appliance_shm_all_reduce(h, b.data(), n, 1, err, sizeof err)) {
      fprintf(stderr, "rank %d: %s\n", rank, err);
      return 2;
    }
    for (size_t i = 0; i < n; ++i) {
      float want = 0;
      for (int r = 0; r < world; ++r) want += value(r, i);
      if (f[i] != want || bf16_to_f32(b[i]) != want) {
        fprintf(stderr, "rank %d n=%zu i=%zu: got %g / %g, want %g\n", rank, n, i, f[i], bf16_to_f32(b[i]), want);
        return 1;
      }
    }
  }
  return 0;
}

int main(int argc, char** argv) {
  int world = argc > 1 ? atoi(argv[1]) : 2;
  std::string name = "/appliance-ar-selftest-" + std::to_string(getpid());
  char err[512];
  const size_t chunk = 4096;
  const uint32_t start = 0xfffffff0u;  // wraps within the first calls
  void* h0 = appliance_shm_open(name.c_str(), world, 0, 1, chunk, start, 20.0, err, sizeof err);
  if (!h0) {
    fprintf(stderr, "%s\n", err);
    return 3;
  }
  std::vector<pid_t> kids;
  for (int r = 1; r < world; ++r) {
    pid_t pid = fork();
    if (pid == 0) {
      appliance_shm_close(h0);
      void* h = appliance_shm_open(name.c_str(), world, r, 0, chunk, start, 20.0, err, sizeof err);
      if (!h || appliance_shm_wait_attached(h, name.c_str(), err, sizeof err)) {
        fprintf(stderr, "rank %d: %s\n", r, err);
        _exit(3);
      }
      _exit(run_rank(h, r, world));
    }
    kids.push_back(pid);
  }
  if (appliance_shm_wait_attached(h0, name.c_str(), err, sizeof err)) {
    fprintf(stderr, "rank 0: %s\n", err);
    return 3;
  }
  int rc = run_rank(h0, 0, world);
  for (pid_t k : kids) {
    int st = 0;
    waitpid(k, &st, 0);
    if (!WIFEXITED(st) || WEXITSTATUS(st)) rc = rc ? rc : 4;
  }
  uint32_t seq = appliance_shm_seq(h0);
  if (rc == 0 && seq >= start) rc = 5;  // must have wrapped past 2^32
  printf("%s world=%d seq=%u\n", rc ? "FAILED" : "ok", world, seq);
  return rc;
}

/* An OpenMP dynamic-schedule loop whose result is known exactly, plus the path of the libgomp this
 * process mapped. Used by tests/runtime to show that a preloaded libgomp is the one that runs, and
 * that its atomics (chunk hand-out, reductions, barriers) are correct under qemu's Neoverse V2.
 *   omp_dynamic_check [N]   prints "libgomp=<path>", "threads=<n>", "sum=<s>", "ok" or "BAD" */
#include <omp.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

int main(int argc, char **argv) {
  long n = argc > 1 ? atol(argv[1]) : 100000;
  long sum = 0, chunks = 0;
  int nthreads = 0;
#pragma omp parallel reduction(+ : sum, chunks)
  {
#pragma omp single
    nthreads = omp_get_num_threads();
#pragma omp for schedule(dynamic, 7) nowait
    for (long i = 1; i <= n; i++) {
      sum += i;
      if (i % 7 == 1) chunks++;
    }
  }
  long counter = 0;
#pragma omp parallel for schedule(dynamic, 1)
  for (long i = 0; i < 1000; i++) {
#pragma omp atomic
    counter += 1;
  }
  char line[4096], lib[4096] = "none";
  FILE *m = fopen("/proc/self/maps", "r");
  while (m && fgets(line, sizeof line, m)) {
    char *p = strstr(line, "/");
    if (p && strstr(p, "libgomp")) { p[strcspn(p, "\n")] = 0; strncpy(lib, p, sizeof lib - 1); break; }
  }
  if (m) fclose(m);
  long want = n * (n + 1) / 2;
  printf("libgomp=%s\nthreads=%d\nsum=%ld\ncounter=%ld\n%s\n", lib, nthreads, sum, counter,
         sum == want && counter == 1000 && chunks == (n + 6) / 7 ? "ok" : "BAD");
  return sum == want && counter == 1000 ? 0 : 1;
}

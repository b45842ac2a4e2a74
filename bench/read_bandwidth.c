// How fast two threads read a decode pass's worth of weights, and whether non-temporal
// prefetches for part of them keep the rest in the last-level cache from pass to pass.
//
// Each pass reads HOT MB and then COLD MB (a one-row pass of the embedded model streams ~85 MB)
// with AVX-512 loads, both threads taking turns of 256 KB chunks with a barrier after each pair
// (like a projection split over the intra-op threads); COLD is read either plainly or with
// PREFETCHNTA 1 KB ahead. Prints the mean and best pass time of each mode, twice, alternated.
//
// Build and run (AVX-512 host):
//   gcc -O2 -mavx512f -fopenmp bench/read_bandwidth.c -o /tmp/read_bandwidth
//   /tmp/read_bandwidth 25 60 60   # HOT MB, COLD MB, passes
#include <immintrin.h>
#include <omp.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

static double now(void) {
  struct timespec t;
  clock_gettime(CLOCK_MONOTONIC, &t);
  return t.tv_sec + t.tv_nsec * 1e-9;
}

static __m512i sum_range(const char* p, size_t n, int nta) {
  __m512i acc = _mm512_setzero_si512();
  for (size_t i = 0; i < n; i += 64) {
    if (nta) _mm_prefetch(p + i + 1024, _MM_HINT_NTA);
    acc = _mm512_add_epi32(acc, _mm512_load_si512((const void*)(p + i)));
  }
  return acc;
}

static __m512i read_part(const char* base, size_t bytes, int id, int nta) {
  const size_t chunk = 256 * 1024;
  __m512i acc = _mm512_setzero_si512();
  for (size_t off = 0; off < bytes; off += 2 * chunk) {
    const size_t s = off + id * chunk;
    if (s < bytes) acc = _mm512_add_epi32(acc, sum_range(base + s, s + chunk <= bytes ? chunk : bytes - s, nta));
#pragma omp barrier
  }
  return acc;
}

int main(int argc, char** argv) {
  if (argc != 4) {
    fprintf(stderr, "usage: %s HOT_MB COLD_MB PASSES\n", argv[0]);
    return 2;
  }
  const size_t hot = (size_t)(atof(argv[1]) * 1e6) & ~(size_t)4095;
  const size_t cold = (size_t)(atof(argv[2]) * 1e6) & ~(size_t)4095;
  const int passes = atoi(argv[3]);
  char* a = aligned_alloc(4096, hot + cold + 4096);
  memset(a, 1, hot + cold + 4096);
  volatile int sink = 0;
  for (int mode = 0; mode < 4; ++mode) {
    const int nta = mode & 1;
    double best = 1e9, total = 0;
    int timed = 0;
    for (int r = 0; r < passes; ++r) {
      const double t = now();
#pragma omp parallel num_threads(2)
      {
        const int id = omp_get_thread_num();
        __m512i acc = read_part(a, hot, id, 0);
        acc = _mm512_add_epi32(acc, read_part(a + hot, cold, id, nta));
#pragma omp atomic
        sink += _mm512_reduce_add_epi32(acc);
      }
      const double dt = now() - t;
      if (r >= 3) {  // the first passes fault the pages in
        total += dt;
        timed++;
        if (dt < best) best = dt;
      }
    }
    printf("hot %.0f MB, cold %.0f MB read %s: mean %.3f ms (%.1f GB/s), best %.3f ms\n",
           hot / 1e6, cold / 1e6, nta ? "with PREFETCHNTA" : "plainly", 1e3 * total / timed,
           (hot + cold) / (total / timed) / 1e9, 1e3 * best);
  }
  free(a);
  return 0;
}

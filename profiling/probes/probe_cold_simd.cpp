// Is the cold-submit cost (a 1000-pair id check: ~10 us warm, ~70 us after a 40 ms wait on the
// H200 host, profiling/results/cold_submit.json) the AVX-512 unit waking up, or the caches/TLBs?
//   g++ -O3 -std=c++17 -o /tmp/probe profiling/probes/probe_cold_simd.cpp && /tmp/probe
// The same id scan (min/max/run counts, as kvo::scan_ids) is built three ways (avx512f, avx2,
// scalar) and timed: back to back, after a 40 ms integer spin (core busy, no SIMD), after a 40
// ms sleep. Each wait runs with the id arrays freshly rewritten before it (as an engine's are).
#include <algorithm>
#include <chrono>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <random>
#include <thread>
#include <vector>

struct Scan { int64_t smin, smax, dmin, dmax, runs; };

#define SCAN_BODY                                                              \
  Scan r{s[0], s[0], d[0], d[0], 1};                                           \
  for (int64_t i = 1; i < n; ++i) {                                            \
    r.smin = s[i] < r.smin ? s[i] : r.smin; r.smax = s[i] > r.smax ? s[i] : r.smax; \
    r.dmin = d[i] < r.dmin ? d[i] : r.dmin; r.dmax = d[i] > r.dmax ? d[i] : r.dmax; \
    r.runs += (s[i] != s[i - 1] + 1) | (d[i] != d[i - 1] + 1);                 \
  }                                                                            \
  return r;

__attribute__((target("avx512f,avx512vl,avx512bw,avx512dq"), noinline))
Scan scan512(const int64_t* __restrict s, const int64_t* __restrict d, int64_t n) { SCAN_BODY }
__attribute__((target("avx2"), noinline))
Scan scan256(const int64_t* __restrict s, const int64_t* __restrict d, int64_t n) { SCAN_BODY }
__attribute__((target("no-sse3"), optimize("no-tree-vectorize"), noinline))
Scan scalar(const int64_t* __restrict s, const int64_t* __restrict d, int64_t n) { SCAN_BODY }

static double now_us() {
  return std::chrono::duration<double, std::micro>(std::chrono::steady_clock::now().time_since_epoch()).count();
}
static volatile uint64_t sink;
static void spin_us(double us) {
  const double t = now_us();
  uint64_t x = 1;
  while (now_us() - t < us) for (int i = 0; i < 1000; ++i) x = x * 6364136223846793005ULL + 1;
  sink = x;
}

int main() {
  const int64_t n = 1000;
  std::vector<int64_t> s(n), d(n);
  std::mt19937_64 rng(1);
  bool ok512 = __builtin_cpu_supports("avx512f");
  struct V { const char* name; Scan (*fn)(const int64_t*, const int64_t*, int64_t); };
  std::vector<V> vs = {{"scalar", scalar}, {"avx2", scan256}};
  if (ok512) vs.push_back({"avx512", scan512});
  const char* waits[] = {"none", "spin40ms", "sleep40ms", "spin2ms"};
  printf("%-8s %-10s %9s %9s %9s\n", "variant", "wait", "median_us", "min_us", "max_us");
  for (const V& v : vs) {
    for (const char* w : waits) {
      std::vector<double> t;
      for (int rep = 0; rep < 31; ++rep) {
        for (int64_t i = 0; i < n; ++i) { s[i] = (int64_t)(rng() % 4096); d[i] = (int64_t)(rng() % 4096); }
        if (!strcmp(w, "spin40ms")) spin_us(40000);
        else if (!strcmp(w, "sleep40ms")) std::this_thread::sleep_for(std::chrono::milliseconds(40));
        else if (!strcmp(w, "spin2ms")) spin_us(2000);
        else v.fn(s.data(), d.data(), n);  // "none": warm, the same arrays scanned just before
        const double t0 = now_us();
        Scan r = v.fn(s.data(), d.data(), n);
        t.push_back(now_us() - t0);
        sink = r.runs + r.smin + r.dmax;
      }
      std::sort(t.begin(), t.end());
      printf("%-8s %-10s %9.2f %9.2f %9.2f\n", v.name, w, t[t.size() / 2], t.front(), t.back());
    }
  }
  return 0;
}

// What splitting the duplicate check buys (kvo::has_duplicate_split against kvo::first_duplicate,
// kernels/csrc/host_plan.h): random distinct destination ids, medians of 101 calls, each right
// after a job on the pool (its helpers spinning, as in an engine's burst of jobs), and the whole
// check_ids of such a job (split where finish_check splits) against its scan on the pool plus
// the serial duplicate check. Plain C++, no GPU:
//   g++ -O3 -std=c++17 -pthread -o /tmp/probe profiling/probes/probe_dup_split.cpp && /tmp/probe
#include <algorithm>
#include <chrono>
#include <cstdio>
#include <random>
#include <vector>

#include "../kernels/csrc/host_plan.h"

static double now_us() {
  return std::chrono::duration<double, std::micro>(std::chrono::steady_clock::now().time_since_epoch()).count();
}

int main() {
  kvo::WorkPool& pool = kvo::WorkPool::instance();
  std::printf("# %d helper threads; us per call (median of 101)\n", pool.helpers());
  std::printf("%8s %9s %12s %12s %14s %12s %18s\n", "n", "n_ids", "serial", "split", "split pool-off",
              "check_ids", "scan + serial dup");
  std::mt19937_64 rng(3);
  std::vector<int64_t> warm_s(16384), warm_d(16384);
  for (int64_t i = 0; i < 16384; ++i) warm_s[i] = warm_d[i] = i;
  for (int64_t n_ids : {int64_t(1) << 18, int64_t(1) << 20, int64_t(1) << 24}) {
    std::vector<int64_t> perm(n_ids);
    for (int64_t i = 0; i < n_ids; ++i) perm[i] = i;
    std::shuffle(perm.begin(), perm.end(), rng);
    for (int64_t n : {int64_t(8192), int64_t(32768), int64_t(65536)}) {
      std::vector<int64_t> d(perm.begin(), perm.begin() + n), s(n);
      for (int64_t i = 0; i < n; ++i) s[i] = i;
      double med[5];
      for (int mode = 0; mode < 5; ++mode) {
        std::vector<double> t;
        for (int rep = 0; rep < 101; ++rep) {
          pool.set_enabled(mode != 2);
          (void)kvo::check_ids(warm_s.data(), warm_d.data(), 16384, 16384, 16384);  // helpers awake
          bool r = false;
          const double t0 = now_us();
          if (mode == 0) r = kvo::first_duplicate(d.data(), n, n_ids) >= 0;
          if (mode == 1 || mode == 2) r = kvo::has_duplicate_split(d.data(), n, n_ids);
          if (mode == 3) r = kvo::check_ids(s.data(), d.data(), n, n, n_ids).code != 0;
          if (mode == 4) {  // check_ids with the serial duplicate check: finish_check's other branch
            const kvo::IdScan sc = kvo::scan_ids(s.data(), d.data(), n, nullptr);
            r = sc.notinc == 0 || kvo::first_duplicate(d.data(), n, n_ids) >= 0;
          }
          t.push_back(now_us() - t0);
          if (r) std::printf("unexpected duplicate\n");
        }
        std::sort(t.begin(), t.end());
        med[mode] = t[t.size() / 2];
      }
      std::printf("%8lld %9lld %12.1f %12.1f %14.1f %12.1f %18.1f\n", (long long)n, (long long)n_ids, med[0], med[1],
                  med[2], med[3], med[4]);
    }
  }
  pool.set_enabled(true);
  return 0;
}

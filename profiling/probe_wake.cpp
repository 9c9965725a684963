// Does waking the host pool's helpers early (kvo::WorkPool::wake, kernels/csrc/work_pool.h) let
// them share a cold job's id pass? After the helpers have slept (10 ms idle, as after a device
// sync on a long copy), this times (1) how long a woken helper takes to run, and (2) the id
// pass of 32768 pairs (kvo::scan_ids narrowing into a buffer, as a 32768-block submit does)
// with no wake, with wake() issued `lead` us before it (the Python prologue of a submit is
// ~5-10 us), and with the pool off; optionally after 64 MiB of writes evicted the caches.
// Medians of 51 trials. Plain C++, no GPU:
//   g++ -O3 -std=c++17 -pthread -o /tmp/probe_wake profiling/probe_wake.cpp && /tmp/probe_wake
#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstring>
#include <random>
#include <thread>
#include <vector>

#include "../kernels/csrc/host_plan.h"

static double now_us() {
  return std::chrono::duration<double, std::micro>(std::chrono::steady_clock::now().time_since_epoch()).count();
}

static void spin_for(double us) {
  const double t = now_us() + us;
  while (now_us() < t) kvo::cpu_relax();
}

static double median(std::vector<double> v) {
  std::sort(v.begin(), v.end());
  return v[v.size() / 2];
}

int main() {
  kvo::WorkPool& pool = kvo::WorkPool::instance();
  const int64_t n = 32768, nbuf = 1 << 19;
  std::mt19937_64 rng(5);
  std::vector<int64_t> perm(nbuf);
  for (int64_t i = 0; i < nbuf; ++i) perm[i] = i;
  std::shuffle(perm.begin(), perm.end(), rng);
  std::vector<int64_t> s(perm.begin(), perm.begin() + n), d(n);
  for (int64_t i = 0; i < n; ++i) d[i] = 2 * i;  // sorted destinations, as the bench's "cuda" rows
  std::vector<int32_t> out(2 * n);
  std::vector<char> evict(64 << 20);
  std::printf("# %d helper threads, spin %d us; 32768-pair id pass after 10 ms idle; medians of 51\n",
              pool.helpers(), pool.spin_us());
  (void)kvo::scan_ids(s.data(), d.data(), n, out.data());  // starts the helpers
  for (int cold = 0; cold < 2; ++cold) {
    int fill = 1;
    auto idle = [&] {
      if (cold) std::memset(evict.data(), fill++ & 0xff, evict.size());
      std::this_thread::sleep_for(std::chrono::milliseconds(10));
    };
    // (1) wake latency: wake() until the first helper runs
    std::vector<double> lat;
    for (int t = 0; t < 51; ++t) {
      idle();
      const double t0 = now_us();
      pool.wake();
      while (!pool.awake() && now_us() - t0 < 5000) kvo::cpu_relax();
      lat.push_back(now_us() - t0);
    }
    std::printf("%s: wake() to a helper running: median %.1f us (min %.1f, max %.1f)\n",
                cold ? "caches evicted" : "caches kept", median(lat), *std::min_element(lat.begin(), lat.end()),
                *std::max_element(lat.begin(), lat.end()));
    // (2) the id pass, by how early the helpers were woken (-1: no wake; -2: pool off)
    std::printf("%14s %12s %16s %18s\n", "wake lead us", "pass us", "wake call us", "helper pieces/job");
    for (double lead : {-2.0, -1.0, 0.0, 5.0, 10.0, 20.0, 40.0}) {
      std::vector<double> pass, call;
      const int64_t p0 = pool.helper_pieces();
      for (int t = 0; t < 51; ++t) {
        pool.set_enabled(lead != -2.0);
        idle();
        double c = 0;
        if (lead >= 0) {
          const double w0 = now_us();
          pool.wake();
          c = now_us() - w0;
          spin_for(lead - c);
        }
        const double t0 = now_us();
        const kvo::IdScan sc = kvo::scan_ids(s.data(), d.data(), n, out.data());
        pass.push_back(now_us() - t0);
        call.push_back(c);
        if (sc.smin < 0) std::printf("?");
      }
      pool.set_enabled(true);
      std::printf("%14s %12.1f %16.1f %18.1f\n",
                  lead == -2.0 ? "pool off" : lead == -1.0 ? "no wake" : std::to_string((int)lead).c_str(),
                  median(pass), median(call), (double)(pool.helper_pieces() - p0) / 51);
    }
  }
  return 0;
}

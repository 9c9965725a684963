// Could a big job's submit wake the host pool's sleeping helpers (kernels/csrc/work_pool.h)
// early enough for them to share its cold id pass? After the helpers have slept (10 ms idle,
// as after a device sync on a long copy), this times (1) how long a sleeping helper takes to
// join a job: a job of 200 pieces of ~2 us each, the first piece a helper runs, from the
// job's start; and (2) the id pass of 32768 pairs (kvo::scan_ids narrowing into a buffer, as
// a 32768-block submit does) with no early wake, with an early wake `lead` us before it (an
// empty pool job: its notify wakes the helpers, which then spin), and with the pool off.
// "wake us" is what the early wake costs the caller. Optionally after 64 MiB of writes evicted
// the caches. Medians of 51 trials. Plain C++, no GPU:
//   g++ -O3 -std=c++17 -pthread -o /tmp/probe_wake profiling/probes/probe_wake.cpp && /tmp/probe_wake
#include <algorithm>
#include <atomic>
#include <chrono>
#include <cstdio>
#include <cstring>
#include <random>
#include <string>
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

struct JoinProbe {
  std::thread::id caller;
  std::atomic<double> first_helper{1e300};
};

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
  auto early_wake = [&] { pool.run(2, [](void*, int) {}, nullptr); };  // the notify, no work
  for (int cold = 0; cold < 2; ++cold) {
    int fill = 1;
    auto idle = [&] {
      if (cold) std::memset(evict.data(), fill++ & 0xff, evict.size());
      std::this_thread::sleep_for(std::chrono::milliseconds(10));
    };
    // (1) how long until a sleeping helper runs a piece of a job
    std::vector<double> lat;
    int missed = 0;
    for (int t = 0; t < 51; ++t) {
      idle();
      JoinProbe jp;
      jp.caller = std::this_thread::get_id();
      const double t0 = now_us();
      pool.run(200, [](void* p, int) {
        JoinProbe& j = *static_cast<JoinProbe*>(p);
        if (std::this_thread::get_id() != j.caller) {
          double cur = j.first_helper.load(), t = now_us();
          while (t < cur && !j.first_helper.compare_exchange_weak(cur, t)) {}
        }
        spin_for(2.0);
      }, &jp);
      const double first = jp.first_helper.load();
      if (first > 1e299) ++missed;
      lat.push_back(first > 1e299 ? 1e9 : first - t0);
    }
    std::printf("%s: a sleeping helper's first piece of a ~400 us job starts after: median %.1f us (min %.1f); "
                "%d of 51 jobs ended before any helper ran\n",
                cold ? "caches evicted" : "caches kept", median(lat), *std::min_element(lat.begin(), lat.end()),
                missed);
    // (2) the id pass, by how early the helpers were woken (-1: no early wake; -2: pool off)
    std::printf("%14s %10s %10s %22s\n", "wake lead us", "pass us", "wake us", "pass + wake vs no wake");
    double none = 0;
    for (double lead : {-2.0, -1.0, 0.0, 5.0, 10.0, 20.0, 40.0}) {
      std::vector<double> pass, call;
      for (int t = 0; t < 51; ++t) {
        pool.set_enabled(lead != -2.0);
        idle();
        double c = 0;
        if (lead >= 0) {
          const double w0 = now_us();
          early_wake();
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
      const double p = median(pass), c = median(call);
      if (lead == -1.0) none = p;
      std::printf("%14s %10.1f %10.1f %22s\n",
                  lead == -2.0 ? "pool off" : lead == -1.0 ? "no wake" : std::to_string((int)lead).c_str(), p, c,
                  lead >= 0 ? (std::to_string((int)(p + c - none + (p + c - none < 0 ? -0.5 : 0.5))) + " us").c_str() : "");
    }
  }
  return 0;
}

// Host-side planning under the compiler's sanitizers (tests/test_host_sanitize.py builds it
// with -fsanitize=address,undefined and with -fsanitize=thread): random jobs through the id
// check and staging (serial and split over the WorkPool), the DMA and fragment planners, and
// concurrent callers of the pool. Every result is compared with a plain reference here, so a
// run that passes the sanitizers also checks the answers. Exit status 0: all good.
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <random>
#include <thread>
#include <vector>

#include "../../kernels/csrc/host_plan.h"
#include "expect.h"


// Reference verdict: first bad position in check order (src negative/range, dst
// negative/range per position), else first repeated dst.
static kvo::IdCheck ref_check(const std::vector<int64_t>& s, const std::vector<int64_t>& d, int64_t ns, int64_t nd) {
  const int64_t n = (int64_t)s.size();
  for (int64_t i = 0; i < n; ++i) {
    if (s[i] < 0) return {kvo::kSrcNegative, i, s[i]};
    if (s[i] >= ns) return {kvo::kSrcOutOfRange, i, s[i]};
    if (d[i] < 0) return {kvo::kDstNegative, i, d[i]};
    if (d[i] >= nd) return {kvo::kDstOutOfRange, i, d[i]};
  }
  std::vector<char> seen((size_t)nd, 0);
  for (int64_t i = 0; i < n; ++i) {
    if (seen[(size_t)d[i]]) return {kvo::kDstDuplicate, i, d[i]};
    seen[(size_t)d[i]] = 1;
  }
  kvo::IdCheck r;
  r.runs_src = r.runs_dst = r.runs_both = n > 0;
  for (int64_t i = 1; i < n; ++i) {
    const bool bs = s[i] != s[i - 1] + 1, bd = d[i] != d[i - 1] + 1;
    r.runs_src += bs;
    r.runs_dst += bd;
    r.runs_both += bs || bd;
  }
  return r;
}

static void one_job(std::mt19937_64& rng, int64_t n, bool pool_on) {
  kvo::WorkPool::instance().set_enabled(pool_on);
  const int64_t ns = 4 * n + 8, nd = 4 * n + 8;
  std::vector<int64_t> s(n), d(n);
  std::vector<int64_t> perm(nd);
  for (int64_t i = 0; i < nd; ++i) perm[i] = i;
  std::shuffle(perm.begin(), perm.end(), rng);
  const int kind = (int)(rng() % 6);
  for (int64_t i = 0; i < n; ++i) {
    s[i] = kind == 1 ? (int64_t)(i + 3) : (int64_t)(rng() % ns);
    d[i] = kind == 2 ? 2 * i : perm[i];
  }
  if (n > 1 && kind == 3) d[rng() % n] = d[0];
  if (kind == 4) s[rng() % n] = (rng() & 1) ? ns : -1;
  if (kind == 5) d[rng() % n] = (rng() & 1) ? nd : -1;
  const kvo::IdCheck want = ref_check(s, d, ns, nd);
  const kvo::IdCheck got = kvo::check_ids(s.data(), d.data(), n, ns, nd);
  EXPECT(got.code == want.code && got.index == want.index && got.value == want.value);
  if (want.code == 0)
    EXPECT(got.runs_src == want.runs_src && got.runs_dst == want.runs_dst && got.runs_both == want.runs_both);
  std::vector<int32_t> out32(2 * n + 1, -7);
  const kvo::IdCheck g32 = kvo::check_and_stage_ids32(s.data(), d.data(), n, ns, nd, out32.data());
  EXPECT(g32.code == want.code && g32.index == want.index);
  EXPECT(out32[2 * n] == -7);  // nothing written past the job
  if (want.code == 0)
    for (int64_t i = 0; i < n; ++i) EXPECT(out32[i] == s[i] && out32[n + i] == d[i]);
  std::vector<int64_t> out64(2 * n + 1, -7);
  const kvo::IdCheck g64 = kvo::check_and_stage_ids(s.data(), d.data(), n, ns, nd, out64.data());
  EXPECT(g64.code == want.code && out64[2 * n] == -7);
  if (want.code == 0) {
    // DMA plan, contiguous blocks (coalescing on) with a segment size that splits runs
    std::vector<uint64_t> ds(n), ss(n), sz(n);
    const int64_t k = kvo::plan_dma(s.data(), d.data(), n, 1 << 20, 1 << 30, 64, 64, 64, true, ds.data(), ss.data(),
                                    sz.data(), {1 << 20, 64 * 8}, {});
    EXPECT(k >= want.runs_both && k <= n);
    uint64_t total = 0;
    for (int64_t i = 0; i < k; ++i) total += sz[i];
    EXPECT(total == (uint64_t)n * 64);
  }
}

// The split duplicate check against the reference: random distinct ids with none, one or
// several repeats, over id spaces from a few hundred ids to well past the bucket ranges.
static void one_dup_job(std::mt19937_64& rng, int64_t n, int64_t n_ids, int repeats, bool pool_on) {
  kvo::WorkPool::instance().set_enabled(pool_on);
  std::vector<int64_t> perm(n_ids);
  for (int64_t i = 0; i < n_ids; ++i) perm[i] = i;
  std::shuffle(perm.begin(), perm.end(), rng);
  std::vector<int64_t> d(perm.begin(), perm.begin() + n);
  for (int k = 0; k < repeats && n > 1; ++k) d[rng() % n] = d[rng() % n];
  std::vector<char> seen((size_t)n_ids, 0);
  bool want = false;
  for (int64_t v : d) {
    want |= seen[(size_t)v] != 0;
    seen[(size_t)v] = 1;
  }
  EXPECT(kvo::has_duplicate_split(d.data(), n, n_ids) == want);
  EXPECT(kvo::has_duplicate_split(d.data(), n, n_ids) == want);  // the scratch came back all-zero
  EXPECT((kvo::first_duplicate(d.data(), n, n_ids) >= 0) == want);
}

// check_ids on jobs large enough for the split check, right after a pool job (the helpers
// awake): the verdict and the position of a repeat as the reference gives them.
static void split_check_jobs(std::mt19937_64& rng) {
  kvo::WorkPool& pool = kvo::WorkPool::instance();
  pool.set_enabled(true);
  const int spin0 = pool.spin_us();
  pool.set_spin_us(1000000);  // no helper falls asleep between the checks below (a loaded CI box)
  const int64_t n = kvo::kSplitDupAlways, nd = 4 * n;
  std::vector<int64_t> perm(nd), s(n);
  for (int64_t i = 0; i < nd; ++i) perm[i] = i;
  for (int64_t i = 0; i < n; ++i) s[i] = i;
  for (int rep = 0; rep < 6; ++rep) {
    std::shuffle(perm.begin(), perm.end(), rng);
    std::vector<int64_t> d(perm.begin(), perm.begin() + n);
    if (rep & 1) d[n / 2 + (int64_t)(rng() % (n / 2))] = d[(int64_t)(rng() % (n / 2))];
    // pool jobs until every helper is up (a woken helper takes a while to run)
    for (int k = 0; k < 2000 && pool.helpers() > 0 && !kvo::split_dup_check(n, nd); ++k) {
      (void)kvo::check_ids(s.data(), s.data(), 16384, n, n);
      std::this_thread::sleep_for(std::chrono::microseconds(100));
    }
    const bool split = kvo::split_dup_check(n, nd);
    const kvo::IdCheck want = ref_check(s, d, n, nd), got = kvo::check_ids(s.data(), d.data(), n, n, nd);
    EXPECT(got.code == want.code && got.index == want.index && got.value == want.value);
    EXPECT(want.code == ((rep & 1) ? kvo::kDstDuplicate : kvo::kIdsOk));
    if (pool.helpers() > 0) EXPECT(split);
  }
  pool.set_spin_us(spin0);
}

int main() {
  std::mt19937_64 rng(7);
  split_check_jobs(rng);
  // n_ids: under one 512-id range, not a multiple of the ranges, 8 ranges exactly, the job's
  // ids dense or sparse (word-by-word clearing and memset)
  const int64_t dup_spaces[] = {300, 4095, 4096, 8192 + 77, 40000, 1 << 20};
  for (int64_t n_ids : dup_spaces)
    for (int64_t n : {int64_t(2), int64_t(257), int64_t(8192), int64_t(20000)})
      for (int repeats : {0, 1, 3})
        for (int on = 0; on < 2; ++on)
          if (n <= n_ids) one_dup_job(rng, n, n_ids, repeats, on != 0);
  const int64_t sizes[] = {1, 2, 3, 17, 100, 1000, 8191, 8192, 8193, 20000, 32768, 65537};
  for (int rep = 0; rep < 3; ++rep)
    for (int64_t n : sizes)
      for (int on = 0; on < 2; ++on) one_job(rng, n, on != 0);
  // several threads submitting at once: one owns the pool, the others run serially
  kvo::WorkPool::instance().set_enabled(true);
  std::vector<std::thread> ts;
  for (int t = 0; t < 4; ++t)
    ts.emplace_back([t] {
      std::mt19937_64 r(100 + t);
      for (int i = 0; i < 20; ++i) one_job(r, 8192 + (int64_t)(r() % 30000), true);
    });
  for (auto& t : ts) t.join();
  kvo::WorkPool::instance().set_enabled(true);
  std::printf("host_plan_sanitize: %d failures, %lld pieces run by helpers\n", failures.load(),
              (long long)kvo::WorkPool::instance().helper_pieces());
  return failures.load() ? 1 : 0;
}

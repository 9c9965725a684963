// The DMA batcher's issue logic on a fake CUDA runtime (tests/cpp/fake_cuda/cuda_runtime.h:
// copies are memcpys done during the call, every stream operation is logged), so it runs on
// machines without a GPU, under ASan+UBSan (tests/test_dma_issue_host.py):
//  - launch_dma_batch: the bytes land where the planned descriptors say; calls of at most
//    max_per_call descriptors, in order, each descriptor issued once, on a stream the batch
//    API takes (the legacy default stream becomes the per-thread one); the attribute flags per
//    mode; the cudaMemcpyAsync loop; falling back only from an unsupported API, and then
//    only for the descriptors not yet queued; a hard error stops the job;
//  - DmaLanes: the fork event, each side lane waiting on it, lanes cut by bytes, each lane
//    joined back (also after a failure), side streams reused per caller stream, bounded and
//    freed;
//  - DmaSubmitter: tickets, the order of wait / start / copies / end, slices, failures
//    reported through query/error/fence/synchronize, "not issued yet", drain on stop;
//  - the test-only fault hook (kernels/csrc/fault.h): disarmed, unchanged; armed, the chosen
//    call not made and its error reported by every issue path, the next job exact.
// Exit status 0: all good.
#include <cuda_runtime.h>  // the fake: built with -I tests/cpp/fake_cuda

#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <algorithm>
#include <cstring>
#include <random>
#include <stdexcept>
#include <string>
#include <thread>
#include <vector>

#include "../../kernels/csrc/dma_submitter.h"
#include "expect.h"


using Op = fake::Op;

// Two host buffers of nb blocks of bb bytes, n (src block, dst block) pairs, the expected
// destination buffer, and the planned descriptors.
struct Job {
  int64_t bb = 0, nb = 0, n = 0, k = 0;
  std::vector<unsigned char> src, dst, want;
  std::vector<int64_t> si, di;
  std::vector<uint64_t> d, s, z;
  void* const* dp() const { return reinterpret_cast<void* const*>(d.data()); }
  const void* const* sp() const { return reinterpret_cast<const void* const*>(s.data()); }
  const size_t* zp() const { return reinterpret_cast<const size_t*>(z.data()); }
};

static Job make_job(std::mt19937_64& rng, int64_t n, int64_t bb, bool runs) {
  Job j;
  j.bb = bb;
  j.n = n;
  j.nb = 2 * n + 3;
  j.src.resize((size_t)(j.nb * bb));
  for (auto& b : j.src) b = (unsigned char)(1 + rng() % 255);  // non-zero
  j.dst.assign(j.src.size(), 0xA5);                           // poison
  std::vector<int64_t> ps(j.nb), pd(j.nb);
  for (int64_t i = 0; i < j.nb; ++i) ps[i] = pd[i] = i;
  std::shuffle(ps.begin(), ps.end(), rng);
  std::shuffle(pd.begin(), pd.end(), rng);
  j.si.resize(n);
  j.di.resize(n);
  for (int64_t i = 0; i < n; ++i) {
    j.si[i] = runs ? i : ps[i];  // runs: consecutive on both sides, coalesced
    j.di[i] = runs ? (i + 1) : pd[i];
  }
  j.want = j.dst;
  for (int64_t i = 0; i < n; ++i)
    std::memcpy(j.want.data() + j.di[i] * bb, j.src.data() + j.si[i] * bb, (size_t)bb);
  j.d.resize(n);
  j.s.resize(n);
  j.z.resize(n);
  j.k = kvo::plan_dma(j.si.data(), j.di.data(), n, (uint64_t)(uintptr_t)j.src.data(),
                      (uint64_t)(uintptr_t)j.dst.data(), bb, bb, bb, true, j.d.data(), j.s.data(), j.z.data());
  uint64_t total = 0;
  for (int64_t i = 0; i < j.k; ++i) total += j.z[i];
  EXPECT(j.k >= 1 && j.k <= n && total == (uint64_t)(n * bb));
  if (runs) EXPECT(j.k == 1);
  return j;
}

static int64_t offset_of(const Op& op, const Job& j) { return (int64_t)(op.dsts - (const void* const*)j.dp()); }

// Batch ops [a, b) of the log issue descriptors [first, first + count) of the job in order,
// each call at most `per`, all on `stream`; returns first + count.
static int64_t check_batches(const std::vector<Op>& L, size_t a, size_t b, const Job& j, int64_t first, size_t per,
                             cudaStream_t stream, unsigned flags, int order) {
  EXPECT(b <= L.size());
  for (size_t i = a; i < b && i < L.size(); ++i) {
    EXPECT(L[i].kind == Op::kBatch);
    EXPECT(L[i].stream == stream);
    EXPECT(L[i].count >= 1 && L[i].count <= per);
    EXPECT(offset_of(L[i], j) == first);
    EXPECT(L[i].flags == flags && L[i].order == order);
    first += (int64_t)L[i].count;
  }
  return first;
}

static void test_launch(std::mt19937_64& rng) {
  cudaStream_t made = nullptr;
  cudaStreamCreateWithFlags(&made, cudaStreamNonBlocking);
  const size_t pers[] = {1, 2, 3, 7, 512, (size_t)1 << 20};
  const int64_t bbs[] = {1, 16, 100, 4096};
  for (int rep = 0; rep < 3; ++rep)
    for (size_t per : pers)
      for (int mode = 0; mode < 3; ++mode)
        for (int on_made = 0; on_made < 2; ++on_made) {
          Job j = make_job(rng, 1 + (int64_t)(rng() % 300), bbs[rng() % 4], rng() % 4 == 0);
          const bool any = rng() & 1;
          cudaStream_t s = on_made ? made : nullptr;
          fake::reset();
          int used = -1;
          const cudaError_t e = kvo::launch_dma_batch(j.dp(), j.sp(), j.zp(), (size_t)j.k, per, mode, any, s, &used);
          EXPECT(e == cudaSuccess);
          EXPECT(j.dst == j.want);
          const std::vector<Op> L = fake::log();
          if (mode == kvo::kDmaLoop) {
            EXPECT(used == 0);
            EXPECT((int64_t)L.size() == j.k);
            for (size_t i = 0; i < L.size(); ++i)
              EXPECT(L[i].kind == Op::kCopy && L[i].stream == s && L[i].dst == (void*)(uintptr_t)j.d[i]);
          } else {
            EXPECT(used == 1);
            EXPECT(L.size() == ((size_t)j.k + per - 1) / per);
            const unsigned flags = mode == kvo::kDmaBatch ? cudaMemcpyFlagPreferOverlapWithCompute : 0;
            const int order = any ? cudaMemcpySrcAccessOrderAny : cudaMemcpySrcAccessOrderStream;
            // the legacy default stream (0) goes to the per-thread default stream
            EXPECT(check_batches(L, 0, L.size(), j, 0, per, on_made ? made : cudaStreamPerThread, flags, order) == j.k);
          }
        }
  cudaStreamDestroy(made);
}

static void test_launch_edges_and_fallback(std::mt19937_64& rng) {
  Job j = make_job(rng, 40, 64, false);
  int used = -1;
  fake::reset();
  EXPECT(kvo::launch_dma_batch(j.dp(), j.sp(), j.zp(), 0, 4, kvo::kDmaBatch, false, nullptr, &used) == cudaSuccess);
  EXPECT(kvo::launch_dma_batch(j.dp(), j.sp(), j.zp(), (size_t)j.k, 0, kvo::kDmaBatch, false, nullptr, &used) ==
         cudaErrorInvalidValue);
  EXPECT(fake::log().empty() && used == 0);
  EXPECT(j.dst != j.want);  // nothing copied

  // the batch API missing: the loop issues everything
  fake::reset();
  fake::st().batch_unsupported = true;
  EXPECT(kvo::launch_dma_batch(j.dp(), j.sp(), j.zp(), (size_t)j.k, 8, kvo::kDmaBatch, false, nullptr, &used) ==
         cudaSuccess);
  EXPECT(used == 0 && j.dst == j.want);
  std::vector<Op> L = fake::log();
  EXPECT((int64_t)L.size() == j.k);
  for (const Op& op : L) EXPECT(op.kind == Op::kCopy && op.stream == nullptr);

  // unsupported only from the third call on: the loop issues what the batches did not, once
  for (int per : {1, 3, 8}) {
    Job m = make_job(rng, 40, 64, false);
    fake::reset();
    fake::st().fail_batch_call = 3;
    fake::st().fail_with = cudaErrorNotSupported;
    EXPECT(kvo::launch_dma_batch(m.dp(), m.sp(), m.zp(), (size_t)m.k, (size_t)per, kvo::kDmaBatch, false, nullptr,
                                 &used) == cudaSuccess);
    EXPECT(m.dst == m.want);
    L = fake::log();
    EXPECT(L.size() == 2 + (size_t)(m.k - 2 * per));
    const int64_t after = check_batches(L, 0, 2, m, 0, (size_t)per, cudaStreamPerThread,
                                        cudaMemcpyFlagPreferOverlapWithCompute, cudaMemcpySrcAccessOrderStream);
    EXPECT(after == 2 * per);
    for (size_t i = 2; i < L.size() && (int64_t)(after + i - 2) < m.k; ++i)
      EXPECT(L[i].kind == Op::kCopy && L[i].dst == (void*)(uintptr_t)m.d[(size_t)after + i - 2]);
  }

  // any other error ends the job: no fallback, nothing more issued
  Job h = make_job(rng, 40, 64, false);
  fake::reset();
  fake::st().fail_batch_call = 2;
  fake::st().fail_with = cudaErrorInvalidValue;
  EXPECT(kvo::launch_dma_batch(h.dp(), h.sp(), h.zp(), (size_t)h.k, 4, kvo::kDmaBatch, false, nullptr, &used) ==
         cudaErrorInvalidValue);
  L = fake::log();
  EXPECT(L.size() == 1 && L[0].kind == Op::kBatch && L[0].count == 4 && used == 0);

  // the gate: a holder makes pass() wait, until its deadline
  kvo::DmaGate g;
  auto t0 = std::chrono::steady_clock::now();
  g.pass();
  g.hold();
  g.until = std::chrono::steady_clock::now() + std::chrono::milliseconds(20);
  g.pass();
  const double ms = std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - t0).count();
  EXPECT(ms >= 19.0 && ms < 2000.0);
  g.release();
  EXPECT(g.holders.load() == 0);
}

// Lanes: returns the lanes a job used, after checking its log.
static int check_lanes_log(const std::vector<Op>& L, const Job& j, cudaStream_t caller, size_t per,
                           int expect_lanes, std::vector<cudaStream_t>* sides) {
  const cudaStream_t lane0 = kvo::batch_capable_stream(caller);
  if (expect_lanes == 1) {
    EXPECT(check_batches(L, 0, L.size(), j, 0, per, lane0, 1u, 1) == j.k);
    return 1;
  }
  size_t i = 0;
  EXPECT(L.size() > 1 && L[0].kind == Op::kRecord && L[0].stream == caller);
  if (L.size() < 2) return 0;
  const cudaEvent_t fork = L[0].event;
  ++i;
  uint64_t total = 0;
  for (int64_t q = 0; q < j.k; ++q) total += j.z[q];
  int64_t first = 0;
  uint64_t acc = 0;
  sides->clear();
  for (int lane = 0; lane < expect_lanes; ++lane) {
    cudaStream_t st = lane0;
    if (lane > 0) {
      EXPECT(i < L.size() && L[i].kind == Op::kWait && L[i].event == fork);
      if (i >= L.size()) return 0;
      st = L[i].stream;
      EXPECT(st != caller && st != nullptr && st != cudaStreamLegacy && st != cudaStreamPerThread);
      for (cudaStream_t o : *sides) EXPECT(o != st);
      sides->push_back(st);
      ++i;
    }
    size_t b = i;
    while (b < L.size() && L[b].kind == Op::kBatch) ++b;
    const int64_t begin = first;
    first = check_batches(L, i, b, j, first, per, st, 1u, 1);
    EXPECT(first > begin);  // every lane gets a descriptor
    // cut where the running byte count reaches (lane + 1) / lanes of the total
    const uint64_t target = (uint64_t)((double)total * (lane + 1) / expect_lanes);
    uint64_t before_last = acc;
    for (int64_t q = begin; q < first && q < j.k; ++q) {
      if (q == first - 1) before_last = acc;
      acc += j.z[q];
    }
    if (lane < expect_lanes - 1) {
      EXPECT(acc >= target || first == j.k - (expect_lanes - 1 - lane));
      EXPECT(before_last < target || first - 1 == begin);
    }
    i = b;
    if (lane > 0) {
      EXPECT(i + 1 < L.size() && L[i].kind == Op::kRecord && L[i].stream == st);
      if (i + 1 >= L.size()) return 0;
      EXPECT(L[i + 1].kind == Op::kWait && L[i + 1].stream == caller && L[i + 1].event == L[i].event);
      i += 2;
    }
  }
  EXPECT(first == j.k && i == L.size());
  return expect_lanes;
}

static void test_lanes(std::mt19937_64& rng) {
  // lanes_for: the lane count, the mean-descriptor rule, the bytes-per-lane rule
  kvo::DmaLanes a(4, 1 << 20, 64 << 10);
  EXPECT(a.lanes_for(10, 10u << 20) == 4);
  EXPECT(a.lanes_for(2, 10u << 20) == 2);
  EXPECT(a.lanes_for(10, 3u << 20) == 3);
  EXPECT(a.lanes_for(1000, 1000u * (16 << 10)) == 1);
  EXPECT(a.lanes_for(0, 0) == 1);
  EXPECT(a.lanes_for(100, 1u << 20) == 1);

  const int live_streams0 = fake::st().live_streams, live_events0 = fake::st().live_events;
  {
    cudaStream_t caller = nullptr;
    cudaStreamCreateWithFlags(&caller, cudaStreamNonBlocking);
    for (int lanes = 1; lanes <= kvo::kMaxDmaLanes; ++lanes) {
      kvo::DmaLanes ln(lanes, 0, 0);
      for (int rep = 0; rep < 4; ++rep) {
        const size_t per = rep == 0 ? 1 : (rep == 1 ? 5 : 512);
        Job j = make_job(rng, 8 + (int64_t)(rng() % 200), 1 + (int64_t)(rng() % 3000), false);
        cudaStream_t cs = rep % 2 ? nullptr : caller;  // the legacy default stream too
        const int made0 = fake::st().streams_made;
        fake::reset();
        int used = -1;
        EXPECT(ln.launch(j.dp(), j.sp(), j.zp(), (size_t)j.k, per, kvo::kDmaBatch, false, cs, &used) == cudaSuccess);
        EXPECT(used == 1 && j.dst == j.want);
        uint64_t total = 0;
        for (int64_t q = 0; q < j.k; ++q) total += j.z[q];
        std::vector<cudaStream_t> sides;
        check_lanes_log(fake::log(), j, cs, per, ln.lanes_for((size_t)j.k, total), &sides);
        // side streams are made once per caller stream, then reused
        if (rep >= 2) EXPECT(fake::st().streams_made == made0);
      }
    }
    // a lane that fails: later lanes are not issued, the failed lane is still joined
    kvo::DmaLanes ln(4, 0, 0);
    Job j = make_job(rng, 64, 512, false);
    fake::reset();
    fake::st().fail_batch_call = 3;  // lane 2's only call
    fake::st().fail_with = cudaErrorInvalidValue;
    int used = -1;
    EXPECT(ln.launch(j.dp(), j.sp(), j.zp(), (size_t)j.k, 1 << 20, kvo::kDmaBatch, false, caller, &used) ==
           cudaErrorInvalidValue);
    EXPECT(used == 0);
    std::vector<Op> L = fake::log();
    int batches = 0, lane_waits = 0;
    for (const Op& op : L) batches += op.kind == Op::kBatch, lane_waits += op.kind == Op::kWait && op.stream != caller;
    EXPECT(batches == 2 && lane_waits == 2);
    EXPECT(L.size() >= 2 && L[L.size() - 2].kind == Op::kRecord && L.back().kind == Op::kWait &&
           L.back().stream == caller && L.back().event == L[L.size() - 2].event);
    // many caller streams: at most 64 sets of side streams are kept
    std::vector<cudaStream_t> callers(70);
    for (auto& c : callers) cudaStreamCreateWithFlags(&c, cudaStreamNonBlocking);
    {
      kvo::DmaLanes two(2, 0, 0);
      for (auto c : callers) {
        Job k2 = make_job(rng, 8, 64, false);
        fake::reset();
        EXPECT(two.launch(k2.dp(), k2.sp(), k2.zp(), (size_t)k2.k, 512, kvo::kDmaBatch, false, c, nullptr) ==
               cudaSuccess);
        EXPECT(k2.dst == k2.want);
      }
      // the caller, the 70, the failing-lane test's 3 side streams, and 64 sets (kMaxSets) of one
      EXPECT(fake::st().live_streams == live_streams0 + 1 + 70 + 3 + 64);
    }
    for (auto c : callers) cudaStreamDestroy(c);
    cudaStreamDestroy(caller);
  }
  // every DmaLanes is gone: so are its streams and events
  EXPECT(fake::st().live_streams == live_streams0);
  EXPECT(fake::st().live_events == live_events0);
}

static int64_t submit(kvo::DmaSubmitter& sub, const Job& j, int mode, cudaStream_t s, cudaEvent_t wait) {
  return sub.submit_blocks(j.si.data(), j.di.data(), j.n, (uint64_t)(uintptr_t)j.src.data(),
                           (uint64_t)(uintptr_t)j.dst.data(), j.bb, j.bb, j.bb, true, mode, false, s, wait, {}, {});
}

static void test_submitter(std::mt19937_64& rng, bool with_lanes) {
  const int live_events0 = fake::st().live_events, live_streams0 = fake::st().live_streams;
  cudaStream_t s = nullptr;
  cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking);
  cudaEvent_t wait_ev = nullptr;
  cudaEventCreate(&wait_ev);
  {
    kvo::DmaLanes lanes(3, 0, 0);  // outlives the submitter, as it must
    const size_t per = 5;
    kvo::DmaSubmitter sub(0, per, with_lanes ? &lanes : nullptr);
    // one job at a time: wait, start, the copies in slices, end, all on the job's stream
    for (int i = 0; i < 24; ++i) {
      Job j = make_job(rng, 1 + (int64_t)(rng() % 120), 1 + (int64_t)(rng() % 2000), rng() % 5 == 0);
      const int mode = i % 3;
      const bool wait = i % 2;
      fake::reset();
      const int64_t t = submit(sub, j, mode, s, wait ? wait_ev : nullptr);
      sub.wait_issued(t);
      EXPECT(sub.query(t) == 1 && sub.error(t).empty() && sub.descriptors(t) == j.k);
      EXPECT(sub.elapsed_ms(t) >= 0.f);
      EXPECT(j.dst == j.want);
      const std::vector<Op> L = fake::log();
      size_t i0 = 0;
      if (wait) {
        EXPECT(L.size() > 0 && L[0].kind == Op::kWait && L[0].stream == s && L[0].event == wait_ev);
        i0 = 1;
      }
      EXPECT(L.size() >= i0 + 3 && L[i0].kind == Op::kRecord && L[i0].stream == s);
      EXPECT(L.back().kind == Op::kRecord && L.back().stream == s && L.back().event != L[i0].event);
      int64_t issued = 0;
      for (size_t q = i0 + 1; q + 1 < L.size(); ++q) {
        if (L[q].kind == Op::kBatch) {
          EXPECT(L[q].count <= per);
          issued += (int64_t)L[q].count;
        }
        if (L[q].kind == Op::kCopy) ++issued;
      }
      EXPECT(issued == j.k);
      EXPECT(sub.fence(t, s) == cudaSuccess && sub.synchronize(t) == cudaSuccess);
      sub.release(t);
    }
    EXPECT(sub.in_flight() == 0);

    // a failed job: reported by every accessor, its end event still recorded; the next job runs
    Job bad = make_job(rng, 30, 256, false);
    fake::reset();
    fake::st().fail_batch_call = 2;
    fake::st().fail_with = cudaErrorInvalidValue;
    const int64_t tb = submit(sub, bad, kvo::kDmaBatch, s, nullptr);
    sub.wait_issued(tb);
    EXPECT(sub.query(tb) == -1);
    EXPECT(sub.error(tb).find("cudaErrorInvalidValue") != std::string::npos);
    {
      const std::vector<Op> L = fake::log();
      EXPECT(!L.empty() && L.back().kind == Op::kRecord && L.back().stream == s);
    }
    // fence orders `s` behind what the failed job queued (a wait on its end event) and succeeds:
    // the failure is the job's, and an engine fencing before it frees the job's blocks goes on
    EXPECT(sub.fence(tb, s) == cudaSuccess && sub.synchronize(tb) == cudaErrorInvalidValue);
    {
      const std::vector<Op> L = fake::log();
      EXPECT(!L.empty() && L.back().kind == Op::kWait && L.back().stream == s && L[L.size() - 2].kind == Op::kRecord &&
             L.back().event == L[L.size() - 2].event);
    }
    sub.release(tb);
    fake::reset();
    Job ok = make_job(rng, 30, 256, false);
    const int64_t to = submit(sub, ok, kvo::kDmaBatch, s, nullptr);
    sub.wait_issued(to);
    EXPECT(sub.query(to) == 1 && ok.dst == ok.want);
    sub.release(to);

    // a job that failed part-way while its earlier slices still run (its end event not reached
    // yet): pending, not failed, until the end event completes, so that the caller does not
    // reuse its buffers under those slices; synchronize waits for them before reporting
    fake::reset();
    fake::st().fail_batch_call = 2;
    fake::st().fail_with = cudaErrorInvalidValue;
    Job part = make_job(rng, 30, 256, false);
    const int64_t tpart = submit(sub, part, kvo::kDmaBatch, s, nullptr);
    sub.wait_issued(tpart);
    fake::st().events_pending = true;
    EXPECT(sub.query(tpart) == 0);
    fake::st().events_pending = false;
    EXPECT(sub.query(tpart) == -1 && sub.synchronize(tpart) == cudaErrorInvalidValue);
    sub.release(tpart);
    fake::reset();

    // not issued yet reads as pending, not as done (an unrecorded event would read as done)
    fake::st().stall = true;
    Job slow = make_job(rng, 30, 256, false);
    const int64_t ts = submit(sub, slow, kvo::kDmaBatch, s, nullptr);
    std::this_thread::sleep_for(std::chrono::milliseconds(20));
    EXPECT(sub.query(ts) == 0);
    fake::st().stall = false;
    sub.wait_issued(ts);
    EXPECT(sub.query(ts) == 1 && slow.dst == slow.want);
    sub.release(ts);

    // a burst, the caller holding the gate and polling as an engine does
    std::vector<Job> burst;
    std::vector<int64_t> tickets;
    for (int i = 0; i < 40; ++i) burst.push_back(make_job(rng, 1 + (int64_t)(rng() % 300), 64, false));
    for (auto& j : burst) {
      sub.hold();
      tickets.push_back(submit(sub, j, kvo::kDmaBatch, s, nullptr));
      for (int64_t t : tickets) (void)sub.query(t);
      sub.release_hold();
    }
    for (size_t i = 0; i < burst.size(); ++i) {
      EXPECT(sub.synchronize(tickets[i]) == cudaSuccess && burst[i].dst == burst[i].want);
      sub.release(tickets[i]);
    }
    EXPECT(sub.holders() == 0 && sub.in_flight() == 0);

    // stop() issues what is queued, then refuses new jobs
    fake::st().stall = true;
    std::vector<Job> last;
    std::vector<int64_t> lt;
    for (int i = 0; i < 5; ++i) last.push_back(make_job(rng, 20, 128, false));
    for (auto& j : last) lt.push_back(submit(sub, j, kvo::kDmaBatch, s, nullptr));
    std::thread unstall([] {
      std::this_thread::sleep_for(std::chrono::milliseconds(10));
      fake::st().stall = false;
    });
    sub.stop();
    unstall.join();
    for (size_t i = 0; i < last.size(); ++i) EXPECT(sub.query(lt[i]) == 1 && last[i].dst == last[i].want);
    bool threw = false;
    try {
      submit(sub, last[0], kvo::kDmaBatch, s, nullptr);
    } catch (const std::runtime_error&) {
      threw = true;
    }
    EXPECT(threw);
    threw = false;
    try {
      (void)sub.query(1 << 30);
    } catch (const std::out_of_range&) {
      threw = true;
    }
    EXPECT(threw);
  }
  cudaEventDestroy(wait_ev);
  cudaStreamDestroy(s);
  // the submitter's and the lanes' events and streams are all freed
  EXPECT(fake::st().live_events == live_events0 && fake::st().live_streams == live_streams0);
}

// record_and_submit (the worker's fast path): the caller's event is recorded on the compute
// stream before the job is queued, the job's stream waits on that event, the gate is free
// afterwards; a failed record queues nothing and reports the error.
static cudaError_t record_and_submit(kvo::DmaSubmitter& sub, const Job& j, cudaStream_t compute, cudaStream_t s,
                                     cudaEvent_t ev, int64_t* t) {
  return sub.record_and_submit(t, compute, j.si.data(), j.di.data(), j.n, (uint64_t)(uintptr_t)j.src.data(),
                               (uint64_t)(uintptr_t)j.dst.data(), j.bb, j.bb, j.bb, true, kvo::kDmaBatch, false, s,
                               ev, {}, {});
}

static void test_record_and_submit(std::mt19937_64& rng) {
  const int live_events0 = fake::st().live_events, live_streams0 = fake::st().live_streams;
  cudaStream_t compute = nullptr, s = nullptr;
  cudaStreamCreateWithFlags(&compute, cudaStreamNonBlocking);
  cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking);
  cudaEvent_t ev = nullptr;
  cudaEventCreate(&ev);
  {
    kvo::DmaSubmitter sub(0, 7, nullptr);
    for (int i = 0; i < 6; ++i) {
      Job j = make_job(rng, 1 + (int64_t)(rng() % 50), 64 + (int64_t)(rng() % 500), false);
      fake::reset();
      int64_t t = -1;
      EXPECT(record_and_submit(sub, j, compute, s, ev, &t) == cudaSuccess);
      EXPECT(t > 0 && sub.holders() == 0);
      EXPECT(sub.synchronize(t) == cudaSuccess && j.dst == j.want);
      const std::vector<Op> L = fake::log();
      // [record ev on compute] [wait ev on s] [record start on s] copies... [record end on s]
      EXPECT(L.size() >= 4 && L[0].kind == Op::kRecord && L[0].stream == compute && L[0].event == ev);
      EXPECT(L[1].kind == Op::kWait && L[1].stream == s && L[1].event == ev);
      EXPECT(L[2].kind == Op::kRecord && L[2].stream == s);
      sub.release(t);
      // the caller's split (host_overhead.py reads it): the record was timed, then plan and queue
      const auto [rec_us, plan_us, queue_us] = sub.last_split();
      EXPECT(rec_us > 0 && plan_us > 0 && queue_us > 0);
    }
    {
      // a plain submit_blocks records nothing of its own: its split's record part is 0
      Job j = make_job(rng, 8, 64, false);
      const int64_t t = sub.submit_blocks(j.si.data(), j.di.data(), j.n, (uint64_t)(uintptr_t)j.src.data(),
                                          (uint64_t)(uintptr_t)j.dst.data(), j.bb, j.bb, j.bb, true, kvo::kDmaBatch,
                                          false, s, nullptr, {}, {});
      EXPECT(std::get<0>(sub.last_split()) == 0.0 && std::get<1>(sub.last_split()) > 0);
      EXPECT(sub.synchronize(t) == cudaSuccess && j.dst == j.want);
      sub.release(t);
    }
    // no event: refused before anything is recorded or queued
    Job j = make_job(rng, 4, 64, false);
    fake::reset();
    int64_t t = -1;
    EXPECT(record_and_submit(sub, j, compute, s, nullptr, &t) == cudaErrorInvalidResourceHandle);
    EXPECT(t == -1 && sub.in_flight() == 0 && fake::log().empty() && sub.holders() == 0);
  }
  {
    // a submitter for a device the runtime refuses: the record's device switch fails, so
    // nothing is recorded or queued, and the gate is released
    kvo::DmaSubmitter bad(1, 7, nullptr);
    Job j = make_job(rng, 4, 64, false);
    fake::reset();
    int64_t t = -1;
    EXPECT(record_and_submit(bad, j, compute, s, ev, &t) == cudaErrorInvalidValue);
    EXPECT(t == -1 && bad.in_flight() == 0 && bad.holders() == 0 && fake::log().empty());
  }
  cudaEventDestroy(ev);
  cudaStreamDestroy(s);
  cudaStreamDestroy(compute);
  EXPECT(fake::st().live_events == live_events0 && fake::st().live_streams == live_streams0);
}

// Pack jobs (record_and_submit_pack): per-layer "tensors" of F fragments per block (fragment
// sizes differ, as K and V of different head sizes), a unified side of strided slots. The
// test's launcher packs on the host from the fragment table and the job's device ids, so the
// bytes show that the ids were checked, staged, uploaded and passed in the right orientation.
static bool g_pack_fail = false;
static cudaError_t host_pack(const kvo::PackSpec& p, const int64_t* blocks, const int64_t* slots, int64_t n,
                             cudaStream_t stream) {
  // the real launcher (kvo::launch_pack_layers) checks the fault hook before its launch
  KVO_RETURN_IF_ERROR(kvo::fault::check(kvo::fault::Site::kKernelLaunch));
  fake::log_kernel(stream);
  if (g_pack_fail) return cudaErrorInvalidValue;
  const int64_t F = p.num_frags;
  for (int64_t i = 0; i < n; ++i)
    for (int64_t f = 0; f < F; ++f) {
      char* layer = reinterpret_cast<char*>(p.table[f] + blocks[i] * p.table[F + f]);
      char* uni = p.unified + slots[i] * p.unified_stride + p.table[3 * F + f];
      const size_t bytes = (size_t)p.table[2 * F + f];
      if (p.to_unified) std::memcpy(uni, layer, bytes);
      else std::memcpy(layer, uni, bytes);
    }
  return cudaSuccess;
}

// Per-layer "tensors" for the pack tests: one buffer per fragment (random non-zero bytes,
// `pad` bytes between a tensor's blocks), their fragment table, and a unified side of ns slots
// `upad` bytes apart; spec() is a PackSpec over them.
struct PerLayer {
  int64_t nb, ns, F, ub = 0, ustride = 0, max_frag = 0;
  std::vector<int64_t> frag, table;
  std::vector<std::vector<char>> layers;
  std::vector<char> uni;
  PerLayer(std::mt19937_64& rng, int64_t nb_, int64_t ns_, std::vector<int64_t> frag_, int64_t pad, int64_t upad)
      : nb(nb_), ns(ns_), F((int64_t)frag_.size()), frag(std::move(frag_)), table(4 * frag.size()),
        layers(frag.size()) {
    for (int64_t f = 0; f < F; ++f) {
      layers[f].assign((size_t)(nb * (frag[f] + pad)), 0);
      for (auto& c : layers[f]) c = (char)(1 + rng() % 255);
      table[f] = (int64_t)(uintptr_t)layers[f].data();
      table[F + f] = frag[f] + pad;
      table[2 * F + f] = frag[f];
      table[3 * F + f] = ub;
      ub += frag[f];
      max_frag = std::max(max_frag, frag[f]);
    }
    ustride = ub + upad;
    uni.resize((size_t)(ns * ustride));
  }
  char* frag_at(int64_t f, int64_t b) { return layers[f].data() + b * table[F + f]; }
  char* slot_at(int64_t sl, int64_t f) { return uni.data() + sl * ustride + table[3 * F + f]; }
  kvo::PackSpec spec() {
    kvo::PackSpec p;
    p.table = table.data();
    p.num_frags = (int)F;
    p.unified = uni.data();
    p.unified_stride = ustride;
    p.n_blocks = nb;
    p.n_slots = ns;
    p.max_frag_bytes = max_frag;
    p.num_ctas = 4;
    return p;
  }
};

// n distinct ids below bound, shuffled
static std::vector<int64_t> shuffled_ids(std::mt19937_64& rng, int64_t n, int64_t bound) {
  std::vector<int64_t> v((size_t)bound);
  for (int64_t i = 0; i < bound; ++i) v[(size_t)i] = i;
  std::shuffle(v.begin(), v.end(), rng);
  v.resize((size_t)n);
  return v;
}

static void test_pack_jobs(std::mt19937_64& rng) {
  const int live_events0 = fake::st().live_events, live_streams0 = fake::st().live_streams;
  const int host0 = fake::st().live_host_allocs, dev0 = fake::st().live_dev_allocs;
  cudaStream_t compute = nullptr, s = nullptr;
  cudaStreamCreateWithFlags(&compute, cudaStreamNonBlocking);
  cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking);
  cudaEvent_t ev = nullptr;
  cudaEventCreate(&ev);
  PerLayer P(rng, 3000, 3100, {48, 32, 48, 32, 48, 32}, 16, 8);
  const int64_t nb = P.nb, ns = P.ns, F = P.F, ub = P.ub, ustride = P.ustride;
  const std::vector<int64_t>& frag = P.frag;
  const std::vector<int64_t>& table = P.table;
  std::vector<std::vector<char>>& layers = P.layers;
  std::vector<char>& uni = P.uni;
  auto frag_at = [&](int64_t f, int64_t b) { return P.frag_at(f, b); };
  kvo::PackSpec spec = P.spec();
  auto ids = [&](int64_t n, int64_t bound) { return shuffled_ids(rng, n, bound); };
  {
    kvo::DmaSubmitter sub(0, 7, nullptr, &host_pack);
    // sizes that make the job buffers grow past their first 1024 ids, then reuse them
    for (int64_t n : {5, 1500, 1, 3000, 1024, 1025, 17}) {
      std::vector<int64_t> blocks = ids(n, nb), slots = ids(n, ns);
      std::fill(uni.begin(), uni.end(), (char)0xA5);
      fake::reset();
      spec.to_unified = true;
      int64_t t = -1;
      cudaError_t err = cudaErrorUnknown;
      kvo::IdCheck c = sub.record_and_submit_pack(&t, &err, compute, kvo::kPackDirect, blocks.data(), slots.data(), n, spec, s, ev);
      EXPECT(c.code == kvo::kIdsOk && err == cudaSuccess && t > 0 && sub.holders() == 0);
      EXPECT(sub.synchronize(t) == cudaSuccess && sub.query(t) == 1 && sub.descriptors(t) == 0);
      // [record ev on compute] [wait ev on s] [record start on s] [ids upload on s] [kernel on s] [record end on s]
      const std::vector<Op> L = fake::log();
      EXPECT(L.size() == 6);
      if (L.size() == 6) {
        EXPECT(L[0].kind == Op::kRecord && L[0].stream == compute && L[0].event == ev);
        EXPECT(L[1].kind == Op::kWait && L[1].stream == s && L[1].event == ev);
        EXPECT(L[2].kind == Op::kRecord && L[2].stream == s && L[2].event != ev);
        EXPECT(L[3].kind == Op::kCopy && L[3].stream == s);
        EXPECT(L[4].kind == Op::kKernel && L[4].stream == s);
        EXPECT(L[5].kind == Op::kRecord && L[5].stream == s && L[5].event != L[2].event);
      }
      std::vector<char> hit((size_t)ns, 0);
      bool same = true;
      for (int64_t i = 0; i < n; ++i) {
        hit[(size_t)slots[(size_t)i]] = 1;
        for (int64_t f = 0; f < F; ++f)
          same &= std::memcmp(uni.data() + slots[(size_t)i] * ustride + table[3 * F + f], frag_at(f, blocks[(size_t)i]),
                              (size_t)frag[f]) == 0;
      }
      EXPECT(same);
      bool poison = true;  // slots no job wrote, and every slot's padding
      for (int64_t q = 0; q < ns; ++q)
        for (int64_t o = hit[(size_t)q] ? ub : 0; o < ustride; ++o) poison &= uni[(size_t)(q * ustride + o)] == (char)0xA5;
      EXPECT(poison);
      const auto [rec_us, plan_us, queue_us] = sub.last_split();
      EXPECT(rec_us > 0 && plan_us > 0 && queue_us > 0);
      sub.release(t);
      // unpack: the slots back into random blocks (they may be the pack's), poisoned first
      std::vector<int64_t> back = ids(n, nb);
      for (int64_t i = 0; i < n; ++i)
        for (int64_t f = 0; f < F; ++f) std::memset(frag_at(f, back[(size_t)i]), 0, (size_t)frag[f]);
      const std::vector<std::vector<char>> before = layers;
      spec.to_unified = false;
      EXPECT(sub.record_and_submit_pack(&t, &err, compute, kvo::kPackDirect, back.data(), slots.data(), n, spec, s, ev).code ==
             kvo::kIdsOk && err == cudaSuccess);
      EXPECT(sub.synchronize(t) == cudaSuccess);
      same = true;
      for (int64_t i = 0; i < n; ++i)
        for (int64_t f = 0; f < F; ++f)
          same &= std::memcmp(frag_at(f, back[(size_t)i]), uni.data() + slots[(size_t)i] * ustride + table[3 * F + f],
                              (size_t)frag[f]) == 0;
      EXPECT(same);
      // nothing else in the tensors moved: put the written fragments back as they were, compare all
      for (int64_t i = 0; i < n; ++i)
        for (int64_t f = 0; f < F; ++f)
          std::memcpy(frag_at(f, back[(size_t)i]), before[f].data() + back[(size_t)i] * table[F + f], (size_t)frag[f]);
      EXPECT(layers == before);
      // the next pack reads random non-zero blocks again
      for (int64_t i = 0; i < n; ++i)
        for (int64_t f = 0; f < F; ++f)
          for (int64_t o = 0; o < frag[f]; ++o) frag_at(f, back[(size_t)i])[o] = (char)(1 + rng() % 255);
      sub.release(t);
    }
    // more jobs in flight than ever before, then all released: every job is kept for reuse, its
    // buffers never freed while the submitter lives. Freeing them (cudaFreeHost / cudaFree)
    // synchronises the whole device: in an engine, the thread that reports completions would
    // wait for the running forward (the 0%-hit slowdown in vLLM, where a step stores more than
    // eight per-layer jobs at once). Negative control: a spare pool capped at 8 fails here.
    {
      spec.to_unified = true;
      auto twenty = [&] {  // 20 small pack jobs in flight at once, each run to its end
        std::vector<int64_t> ts;
        for (int k = 0; k < 20; ++k) {
          std::vector<int64_t> blocks = ids(5, nb), slots = ids(5, ns);
          int64_t t = -1;
          cudaError_t err = cudaErrorUnknown;
          EXPECT(sub.record_and_submit_pack(&t, &err, compute, kvo::kPackDirect, blocks.data(), slots.data(), 5, spec,
                                            s, ev).code == kvo::kIdsOk && err == cudaSuccess);
          ts.push_back(t);
        }
        for (int64_t t : ts) EXPECT(sub.synchronize(t) == cudaSuccess);
        return ts;
      };
      const std::vector<int64_t> ts = twenty();
      const int host_live = fake::st().live_host_allocs, dev_live = fake::st().live_dev_allocs;
      for (int64_t t : ts) sub.release(t);
      EXPECT(fake::st().live_host_allocs == host_live && fake::st().live_dev_allocs == dev_live);
      // the same 20 jobs serve the next 20 without a new allocation
      const std::vector<int64_t> again = twenty();
      EXPECT(fake::st().live_host_allocs == host_live && fake::st().live_dev_allocs == dev_live);
      for (int64_t t : again) sub.release(t);
    }
    // bad ids: check_ids' verdict, on the written side's orientation, before any driver call
    spec.to_unified = true;
    struct Bad { std::vector<int64_t> b, s; bool to_unified; int code; };
    const Bad bad[] = {{{1, 2}, {7, 7}, true, kvo::kDstDuplicate},   // a pack writes slots
                       {{5, 5}, {1, 2}, false, kvo::kDstDuplicate},  // an unpack writes blocks
                       {{5, 5}, {1, 2}, true, kvo::kIdsOk},          // duplicate blocks are read: fine to pack
                       {{1, nb}, {0, 1}, true, kvo::kSrcOutOfRange},
                       {{1, 2}, {0, ns}, false, kvo::kSrcOutOfRange},
                       {{-1, 2}, {0, 1}, false, kvo::kDstNegative}};
    for (const Bad& x : bad) {
      fake::reset();
      spec.to_unified = x.to_unified;
      int64_t t = -1;
      cudaError_t err = cudaErrorUnknown;
      const kvo::IdCheck c = sub.record_and_submit_pack(&t, &err, compute, kvo::kPackDirect, x.b.data(), x.s.data(), 2, spec, s, ev);
      EXPECT(c.code == x.code && err == cudaSuccess);
      if (x.code != kvo::kIdsOk) {
        EXPECT(t == -1 && fake::log().empty());
      } else {
        EXPECT(t > 0 && sub.synchronize(t) == cudaSuccess);
        sub.release(t);
      }
    }
    EXPECT(sub.in_flight() == 0);
    // compute busy and skip_if_busy: kTryOtherMethod, nothing recorded or queued; busy without it: queued
    std::vector<int64_t> b2 = ids(3, nb), s2 = ids(3, ns);
    spec.to_unified = true;
    fake::reset();
    fake::st().stream_busy = true;
    int64_t t = -1;
    cudaError_t err = cudaErrorUnknown;
    EXPECT(sub.record_and_submit_pack(&t, &err, compute, kvo::kPackAuto, b2.data(), s2.data(), 3, spec, s, ev).code ==
           kvo::kTryOtherMethod);
    EXPECT(err == cudaSuccess && t == -1 && fake::log().empty() && sub.in_flight() == 0 && sub.holders() == 0);
    EXPECT(sub.record_and_submit_pack(&t, &err, compute, kvo::kPackDirect, b2.data(), s2.data(), 3, spec, s, ev).code == 0);
    fake::st().stream_busy = false;
    EXPECT(t > 0 && sub.synchronize(t) == cudaSuccess);
    sub.release(t);
    // a failed launch: reported by every accessor, the end event still recorded; the next job runs
    g_pack_fail = true;
    fake::reset();
    EXPECT(sub.record_and_submit_pack(&t, &err, compute, kvo::kPackDirect, b2.data(), s2.data(), 3, spec, s, ev).code == 0);
    sub.wait_issued(t);
    EXPECT(sub.query(t) == -1 && sub.error(t).find("cudaErrorInvalidValue") != std::string::npos);
    {
      const std::vector<Op> L = fake::log();
      EXPECT(!L.empty() && L.back().kind == Op::kRecord && L.back().stream == s);
    }
    sub.release(t);
    g_pack_fail = false;
    EXPECT(sub.record_and_submit_pack(&t, &err, compute, kvo::kPackDirect, b2.data(), s2.data(), 3, spec, s, ev).code == 0);
    EXPECT(sub.synchronize(t) == cudaSuccess && sub.query(t) == 1);
    sub.release(t);
    // the fault hook armed at the id upload, then at the kernel: a failed job, the failing call
    // not made (no kernel logged after a failed upload), the end recorded; the next job runs
    for (const kvo::fault::Site site : {kvo::fault::Site::kMemcpyAsync, kvo::fault::Site::kKernelLaunch}) {
      fake::reset();
      kvo::fault::arm(site, 0, cudaErrorInvalidValue);
      EXPECT(sub.record_and_submit_pack(&t, &err, compute, kvo::kPackDirect, b2.data(), s2.data(), 3, spec, s, ev).code == 0);
      EXPECT(sub.synchronize(t) == cudaErrorInvalidValue && sub.query(t) == -1);
      const std::vector<Op> L = fake::log();
      int kernels = 0, copies = 0;
      for (const Op& op : L) kernels += op.kind == Op::kKernel, copies += op.kind == Op::kCopy;
      EXPECT(kernels == 0 && copies == (site == kvo::fault::Site::kKernelLaunch ? 1 : 0));
      EXPECT(!L.empty() && L.back().kind == Op::kRecord && L.back().stream == s);
      EXPECT(kvo::fault::counts(site).hits == 1);
      sub.release(t);
      EXPECT(sub.record_and_submit_pack(&t, &err, compute, kvo::kPackDirect, b2.data(), s2.data(), 3, spec, s, ev).code == 0);
      EXPECT(sub.synchronize(t) == cudaSuccess && sub.query(t) == 1);
      sub.release(t);
    }
    // refused before anything is touched: no event, n <= 0, a bad spec
    for (int k = 0; k < 3; ++k) {
      kvo::PackSpec p2 = spec;
      if (k == 2) p2.num_ctas = 0;
      fake::reset();
      t = -1;
      sub.record_and_submit_pack(&t, &err, compute, kvo::kPackDirect, b2.data(), s2.data(), k == 1 ? 0 : 3, p2, s,
                                 k == 0 ? nullptr : ev);
      EXPECT(err == cudaErrorInvalidValue && t == -1 && fake::log().empty());
    }
    // a stopped submitter refuses (the caller's record happened; nothing is queued)
    sub.stop();
    bool threw = false;
    try {
      sub.record_and_submit_pack(&t, &err, compute, kvo::kPackDirect, b2.data(), s2.data(), 3, spec, s, ev);
    } catch (const std::runtime_error&) {
      threw = true;
    }
    EXPECT(threw && sub.in_flight() == 0);
  }
  {
    // no launcher: pack jobs are not supported, nothing is touched
    kvo::DmaSubmitter none(0, 7, nullptr);
    std::vector<int64_t> b = {1}, sl = {2};
    int64_t t = -1;
    cudaError_t err = cudaSuccess;
    fake::reset();
    none.record_and_submit_pack(&t, &err, compute, kvo::kPackDirect, b.data(), sl.data(), 1, spec, s, ev);
    EXPECT(err == cudaErrorNotSupported && t == -1 && fake::log().empty());
  }
  cudaEventDestroy(ev);
  cudaStreamDestroy(s);
  cudaStreamDestroy(compute);
  // the jobs' pinned and device id buffers, events and streams are all freed
  EXPECT(fake::st().live_events == live_events0 && fake::st().live_streams == live_streams0);
  EXPECT(fake::st().live_host_allocs == host0 && fake::st().live_dev_allocs == dev0);
}

// Staged pack jobs (record_and_submit_pack through a pipe): chunks of `per` blocks alternate
// between two staging halves; the order of the calls on the job's stream and the aux stream,
// and the bytes end to end (pack into staging on aux, DMA to the host slots; the mirror image
// for an unpack), for jobs of several chunks, back to back, with a launch failure in between.
static void test_staged_pack_jobs(std::mt19937_64& rng) {
  const int live_events0 = fake::st().live_events, live_streams0 = fake::st().live_streams;
  const int dev0 = fake::st().live_dev_allocs, host0 = fake::st().live_host_allocs;
  cudaStream_t compute = nullptr, s = nullptr;
  cudaStreamCreateWithFlags(&compute, cudaStreamNonBlocking);
  cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking);
  cudaEvent_t ev = nullptr;
  cudaEventCreate(&ev);
  // ub = 192; host slots 64 B apart: no coalescing across slots
  PerLayer P(rng, 64, 80, {64, 32, 64, 32}, 32, 64);
  const int64_t nb = P.nb, ns = P.ns, F = P.F, ub = P.ub, ustride = P.ustride;
  const std::vector<int64_t>& frag = P.frag;
  const std::vector<int64_t>& table = P.table;
  std::vector<std::vector<char>>& layers = P.layers;
  std::vector<char>& host = P.uni;
  auto frag_at = [&](int64_t f, int64_t b) { return P.frag_at(f, b); };
  auto slot_at = [&](int64_t sl, int64_t f) { return P.slot_at(sl, f); };
  kvo::PackSpec spec = P.spec();
  auto ids = [&](int64_t n, int64_t bound) { return shuffled_ids(rng, n, bound); };
  {
    kvo::DmaSubmitter sub(0, 2, nullptr, &host_pack);  // at most 2 descriptors per batch call
    // halves of 768 B: chunks of 4 blocks of 192 B
    const int pipe = sub.add_staged(ub, 2 * 768, 1 << 20, 16, 32, kvo::kDmaBatch);
    EXPECT(std::get<0>(sub.staged_shape(pipe)) == 4 && std::get<1>(sub.staged_shape(pipe)) == 768);
    bool threw = false;
    try {
      sub.add_staged(ub, 2 * 128, 1 << 20, 16, 32, kvo::kDmaBatch);  // a half below one block
    } catch (const std::invalid_argument&) {
      threw = true;
    }
    EXPECT(threw);
    int jobs_done = 0;
    for (int64_t n : {10, 1, 4, 9, 13}) {
      std::vector<int64_t> blocks = ids(n, nb), slots = ids(n, ns);
      std::fill(host.begin(), host.end(), (char)0xA5);
      fake::reset();
      spec.to_unified = true;
      int64_t t = -1;
      cudaError_t err = cudaErrorUnknown;
      bool staged = false;
      const kvo::IdCheck c = sub.record_and_submit_pack(&t, &err, compute, kvo::kPackStaged, blocks.data(),
                                                        slots.data(), n, spec, s, ev, pipe, {}, &staged);
      EXPECT(c.code == kvo::kIdsOk && err == cudaSuccess && t > 0 && staged);
      EXPECT(sub.synchronize(t) == cudaSuccess && sub.query(t) == 1);
      const std::vector<Op> L = fake::log();
      // [record ev, compute] [wait ev, s] [record start, s] [record entry, s] [wait entry, aux] [ids up, aux]
      // then per chunk: ([wait free, aux]) [kernel, aux] [record ready, aux] [wait ready, s] batches [record free, s]
      // (the pipe's first job first uploads its staging slot ids on aux: [copy, aux])
      EXPECT(L.size() > 7 && L[0].stream == compute && L[1].kind == Op::kWait && L[1].event == ev);
      const size_t o = L.size() > 7 && L[3].kind == Op::kCopy ? 1 : 0;
      EXPECT(o == (jobs_done == 0 ? 1u : 0u));
      cudaStream_t aux = L.size() > 7 ? L[o + 4].stream : nullptr;
      EXPECT(L[o + 3].kind == Op::kRecord && L[o + 3].stream == s && L[o + 4].kind == Op::kWait && aux != s &&
             L[o + 4].event == L[o + 3].event && L[o + 5].kind == Op::kCopy && L[o + 5].stream == aux);
      EXPECT(o == 0 || L[3].stream == aux);
      const int64_t chunks = (n + 3) / 4;
      int kernels = 0, batches = 0, waits_free = 0;
      int64_t descs = 0;
      for (size_t q = o + 6; q < L.size(); ++q) {
        if (L[q].kind == Op::kKernel) {
          ++kernels;
          EXPECT(L[q].stream == aux);
        }
        if (L[q].kind == Op::kBatch) {
          ++batches;
          descs += (int64_t)L[q].count;
          EXPECT(L[q].stream == s && L[q].count <= 2);
        }
        if (L[q].kind == Op::kWait && L[q].stream == aux) ++waits_free;
      }
      EXPECT(kernels == chunks && descs == n);  // strided host slots: one descriptor per block
      // every chunk but the first two of the first job waits for its half's last DMA
      EXPECT(waits_free == (int)chunks - (jobs_done == 0 ? std::min<int>(2, (int)chunks) : 0));
      EXPECT(L.back().kind == Op::kRecord && L.back().stream == s);
      bool same = true;
      for (int64_t i = 0; i < n; ++i)
        for (int64_t f = 0; f < F; ++f)
          same &= std::memcmp(slot_at(slots[(size_t)i], f), frag_at(f, blocks[(size_t)i]), (size_t)frag[f]) == 0;
      EXPECT(same);
      std::vector<char> hit((size_t)ns, 0);
      for (int64_t x : slots) hit[(size_t)x] = 1;
      bool poison = true;
      for (int64_t q = 0; q < ns; ++q)
        for (int64_t o = hit[(size_t)q] ? ub : 0; o < ustride; ++o) poison &= host[(size_t)(q * ustride + o)] == (char)0xA5;
      EXPECT(poison);
      sub.release(t);
      ++jobs_done;
      // unpack the slots into other blocks, poisoned first: the mirror image
      std::vector<int64_t> back = ids(n, nb);
      for (int64_t i = 0; i < n; ++i)
        for (int64_t f = 0; f < F; ++f) std::memset(frag_at(f, back[(size_t)i]), 0, (size_t)frag[f]);
      const std::vector<std::vector<char>> before = layers;
      spec.to_unified = false;
      fake::reset();
      EXPECT(sub.record_and_submit_pack(&t, &err, compute, kvo::kPackStaged, back.data(), slots.data(), n, spec, s, ev,
                                        pipe, {}, &staged).code == 0 && staged);
      EXPECT(sub.synchronize(t) == cudaSuccess && sub.query(t) == 1);
      {
        const std::vector<Op> M = fake::log();
        // the job's stream ends waiting on aux's last unpack, then records its end
        EXPECT(M.size() > 3 && M[M.size() - 2].kind == Op::kWait && M[M.size() - 2].stream == s &&
               M[M.size() - 3].kind == Op::kRecord && M[M.size() - 3].stream == aux);
      }
      same = true;
      for (int64_t i = 0; i < n; ++i)
        for (int64_t f = 0; f < F; ++f)
          same &= std::memcmp(frag_at(f, back[(size_t)i]), slot_at(slots[(size_t)i], f), (size_t)frag[f]) == 0;
      EXPECT(same);
      for (int64_t i = 0; i < n; ++i)
        for (int64_t f = 0; f < F; ++f)
          std::memcpy(frag_at(f, back[(size_t)i]), before[f].data() + back[(size_t)i] * table[F + f], (size_t)frag[f]);
      EXPECT(layers == before);  // nothing else in the tensors moved
      for (int64_t i = 0; i < n; ++i)
        for (int64_t f = 0; f < F; ++f)
          for (int64_t o = 0; o < frag[f]; ++o) frag_at(f, back[(size_t)i])[o] = (char)(1 + rng() % 255);
      sub.release(t);
    }
    // auto: compute idle packs straight to the host, compute busy goes through the pipe
    std::vector<int64_t> b2 = ids(6, nb), s2 = ids(6, ns);
    spec.to_unified = true;
    int64_t t = -1;
    cudaError_t err = cudaErrorUnknown;
    bool staged = true;
    fake::reset();
    EXPECT(sub.record_and_submit_pack(&t, &err, compute, kvo::kPackAuto, b2.data(), s2.data(), 6, spec, s, ev, pipe,
                                      {}, &staged).code == 0 && !staged);
    EXPECT(sub.synchronize(t) == cudaSuccess);
    sub.release(t);
    fake::st().stream_busy = true;
    EXPECT(sub.record_and_submit_pack(&t, &err, compute, kvo::kPackAuto, b2.data(), s2.data(), 6, spec, s, ev, pipe,
                                      {}, &staged).code == 0 && staged);
    fake::st().stream_busy = false;
    EXPECT(sub.synchronize(t) == cudaSuccess);
    sub.release(t);
    // a failed launch mid-job: a failed job, its end recorded; the next staged job is exact
    g_pack_fail = true;
    EXPECT(sub.record_and_submit_pack(&t, &err, compute, kvo::kPackStaged, b2.data(), s2.data(), 6, spec, s, ev, pipe,
                                      {}, &staged).code == 0);
    sub.wait_issued(t);
    EXPECT(sub.query(t) == -1);
    sub.release(t);
    g_pack_fail = false;
    std::fill(host.begin(), host.end(), (char)0xA5);
    EXPECT(sub.record_and_submit_pack(&t, &err, compute, kvo::kPackStaged, b2.data(), s2.data(), 6, spec, s, ev, pipe,
                                      {}, &staged).code == 0);
    EXPECT(sub.synchronize(t) == cudaSuccess && sub.query(t) == 1);
    bool same = true;
    for (int64_t i = 0; i < 6; ++i)
      for (int64_t f = 0; f < F; ++f)
        same &= std::memcmp(slot_at(s2[(size_t)i], f), frag_at(f, b2[(size_t)i]), (size_t)frag[f]) == 0;
    EXPECT(same);
    sub.release(t);
    // the fault hook (fault.h) armed mid-job at each site a staged job calls: the id upload
    // (memcpy_async), the second chunk's pack (kernel_launch), the second DMA call
    // (memcpy_batch): a failed job, the failing call not made, its end recorded; the next
    // staged job is exact
    using kvo::fault::Site;
    for (const auto& [site, after] : {std::pair<Site, int>{Site::kMemcpyAsync, 0}, {Site::kKernelLaunch, 1},
                                      {Site::kMemcpyBatch, 1}}) {
      fake::reset();
      kvo::fault::arm(site, after, (cudaError_t)719);
      EXPECT(sub.record_and_submit_pack(&t, &err, compute, kvo::kPackStaged, b2.data(), s2.data(), 6, spec, s, ev,
                                        pipe, {}, &staged).code == 0 && err == cudaSuccess);
      EXPECT(sub.synchronize(t) == (cudaError_t)719 && sub.query(t) == -1);
      const kvo::fault::Counts c = kvo::fault::counts(site);
      EXPECT(c.hits == 1 && c.calls == after + 1 && !c.armed);
      const std::vector<Op> L = fake::log();
      int kernels = 0, batches = 0;
      for (const Op& op : L) kernels += op.kind == Op::kKernel, batches += op.kind == Op::kBatch;
      if (site == Site::kKernelLaunch) EXPECT(kernels == 1);
      if (site == Site::kMemcpyAsync) EXPECT(kernels == 0 && batches == 0);
      EXPECT(!L.empty() && L.back().kind == Op::kRecord && L.back().stream == s);
      sub.release(t);
      std::fill(host.begin(), host.end(), (char)0xA5);
      EXPECT(sub.record_and_submit_pack(&t, &err, compute, kvo::kPackStaged, b2.data(), s2.data(), 6, spec, s, ev,
                                        pipe, {}, &staged).code == 0);
      EXPECT(sub.synchronize(t) == cudaSuccess && sub.query(t) == 1);
      same = true;
      for (int64_t i = 0; i < 6; ++i)
        for (int64_t f = 0; f < F; ++f)
          same &= std::memcmp(slot_at(s2[(size_t)i], f), frag_at(f, b2[(size_t)i]), (size_t)frag[f]) == 0;
      EXPECT(same);
      sub.release(t);
    }
    // refused: staged without a pipe, an unknown pipe; nothing touched
    for (int bad : {-1, 7}) {
      fake::reset();
      t = -1;
      sub.record_and_submit_pack(&t, &err, compute, kvo::kPackStaged, b2.data(), s2.data(), 6, spec, s, ev, bad);
      EXPECT(err == cudaErrorInvalidValue && t == -1 && fake::log().empty());
    }
  }
  cudaEventDestroy(ev);
  cudaStreamDestroy(s);
  cudaStreamDestroy(compute);
  // the pipe's staging, its ids, aux stream and events went with the submitter
  EXPECT(fake::st().live_events == live_events0 && fake::st().live_streams == live_streams0);
  EXPECT(fake::st().live_dev_allocs == dev0 && fake::st().live_host_allocs == host0);
}

// The test-only fault hook (kernels/csrc/fault.h) on the DMA paths: disarmed, nothing changes
// (no call counted); armed, the chosen call is not made and its error comes back through each
// issue path (launch_dma_batch's batch and loop, DmaLanes, the DmaSubmitter thread), the
// earlier calls' bytes landed and the rest of the destination is untouched; the next job,
// disarmed, is exact.
static void test_fault_hook(std::mt19937_64& rng) {
  using kvo::fault::Site;
  EXPECT(kvo::fault::site_of("memcpy_batch") == 0 && kvo::fault::site_of("memcpy_async") == 1 &&
         kvo::fault::site_of("kernel_launch") == 2 && kvo::fault::site_of("memcpy") == -1 &&
         kvo::fault::site_of("memcpy_batchx") == -1 && kvo::fault::site_of("") == -1);
  int used = -1;
  // disarmed: the same calls as ever, none seen by the hook
  kvo::fault::disarm_all();
  {
    kvo::fault::Counts before[(int)Site::kCount];
    for (int i = 0; i < (int)Site::kCount; ++i) before[i] = kvo::fault::counts((Site)i);
    Job j = make_job(rng, 30, 64, false);
    fake::reset();
    EXPECT(kvo::launch_dma_batch(j.dp(), j.sp(), j.zp(), (size_t)j.k, 4, kvo::kDmaBatch, false, nullptr, &used) ==
           cudaSuccess);
    EXPECT(j.dst == j.want && fake::st().batch_calls == (int)((j.k + 3) / 4));
    for (int i = 0; i < (int)Site::kCount; ++i) {
      const kvo::fault::Counts c = kvo::fault::counts((Site)i);
      EXPECT(c.calls == before[i].calls && c.hits == before[i].hits && !c.armed);
    }
  }
  // batch API, the third call fails: two calls made, the third not, the rest of dst poisoned
  for (const int after : {0, 2}) {
    Job j = make_job(rng, 30, 64, false);
    fake::reset();
    kvo::fault::arm(Site::kMemcpyBatch, after, (cudaError_t)700);
    EXPECT(kvo::launch_dma_batch(j.dp(), j.sp(), j.zp(), (size_t)j.k, 4, kvo::kDmaBatch, false, nullptr, &used) ==
           (cudaError_t)700);
    EXPECT(used == 0 && fake::st().batch_calls == after);
    const std::vector<Op> L = fake::log();
    EXPECT(L.size() == (size_t)after);
    for (const Op& op : L) EXPECT(op.kind == Op::kBatch);  // no cudaMemcpyAsync fallback for a hard error
    // the first `after` calls' descriptors landed, nothing else
    std::vector<unsigned char> want = j.dst;
    std::fill(want.begin(), want.end(), 0xA5);
    for (int64_t i = 0; i < std::min<int64_t>(j.k, 4 * after); ++i)
      std::memcpy(want.data() + ((uintptr_t)j.d[(size_t)i] - (uintptr_t)j.dst.data()),
                  reinterpret_cast<const void*>((uintptr_t)j.s[(size_t)i]), (size_t)j.z[(size_t)i]);
    EXPECT(j.dst == want);
    const kvo::fault::Counts c = kvo::fault::counts(Site::kMemcpyBatch);
    EXPECT(c.calls == after + 1 && c.hits == 1 && !c.armed);  // times=1: disarmed after firing
    fake::reset();
    EXPECT(kvo::launch_dma_batch(j.dp(), j.sp(), j.zp(), (size_t)j.k, 4, kvo::kDmaBatch, false, nullptr, &used) ==
           cudaSuccess);
    EXPECT(used == 1 && j.dst == j.want);
  }
  // an injected cudaErrorNotSupported takes the real fallback: the loop issues what was not queued
  {
    Job j = make_job(rng, 30, 64, false);
    fake::reset();
    kvo::fault::arm(Site::kMemcpyBatch, 1, cudaErrorNotSupported);
    EXPECT(kvo::launch_dma_batch(j.dp(), j.sp(), j.zp(), (size_t)j.k, 4, kvo::kDmaBatch, false, nullptr, &used) ==
           cudaSuccess);
    EXPECT(used == 0 && j.dst == j.want && fake::log().size() == 1 + (size_t)(j.k - 4));
  }
  // the cudaMemcpyAsync loop, the sixth copy fails; times < 0: every call until disarmed
  {
    Job j = make_job(rng, 30, 64, false);
    fake::reset();
    kvo::fault::arm(Site::kMemcpyAsync, 5, cudaErrorInvalidValue, -1);
    EXPECT(kvo::launch_dma_batch(j.dp(), j.sp(), j.zp(), (size_t)j.k, 4, kvo::kDmaLoop, false, nullptr, &used) ==
           cudaErrorInvalidValue);
    EXPECT(fake::log().size() == 5);
    EXPECT(kvo::launch_dma_batch(j.dp(), j.sp(), j.zp(), (size_t)j.k, 4, kvo::kDmaLoop, false, nullptr, &used) ==
           cudaErrorInvalidValue);
    const kvo::fault::Counts c = kvo::fault::counts(Site::kMemcpyAsync);
    EXPECT(c.calls == 7 && c.hits == 2 && c.armed && fake::log().size() == 5);
    kvo::fault::disarm_all();
    EXPECT(!kvo::fault::counts(Site::kMemcpyAsync).armed);
    EXPECT(kvo::launch_dma_batch(j.dp(), j.sp(), j.zp(), (size_t)j.k, 4, kvo::kDmaLoop, false, nullptr, &used) ==
           cudaSuccess);
    EXPECT(j.dst == j.want);
  }
  // DmaLanes and the DmaSubmitter thread: the job fails, its end is recorded (lanes joined), the
  // next job is exact; a failure in lane 1 of 3
  cudaStream_t s = nullptr;
  cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking);
  {
    kvo::DmaLanes lanes(3, 0, 0);
    for (const bool with_lanes : {false, true}) {
      kvo::DmaSubmitter sub(0, 4, with_lanes ? &lanes : nullptr);
      Job bad = make_job(rng, 60, 256, false);
      fake::reset();
      kvo::fault::arm(Site::kMemcpyBatch, 2, (cudaError_t)700);
      const int64_t tb = submit(sub, bad, kvo::kDmaBatch, s, nullptr);
      EXPECT(sub.synchronize(tb) == (cudaError_t)700 && sub.query(tb) == -1 && !sub.error(tb).empty());
      EXPECT(sub.fence(tb, s) == cudaSuccess);
      EXPECT(fake::st().batch_calls == 2 && kvo::fault::counts(Site::kMemcpyBatch).hits == 1);
      const std::vector<Op> L = fake::log();
      int joins = 0;
      for (const Op& op : L) joins += op.kind == Op::kWait && op.stream == s;
      EXPECT(!with_lanes || joins >= 1);  // the failed lane's join still made
      sub.release(tb);
      Job ok = make_job(rng, 60, 256, false);
      fake::reset();
      const int64_t to = submit(sub, ok, kvo::kDmaBatch, s, nullptr);
      EXPECT(sub.synchronize(to) == cudaSuccess && sub.query(to) == 1 && ok.dst == ok.want);
      sub.release(to);
      EXPECT(sub.in_flight() == 0);
    }
  }
  cudaStreamDestroy(s);
  kvo::fault::disarm_all();
}

int main() {
  std::mt19937_64 rng(11);
  test_launch(rng);
  test_launch_edges_and_fallback(rng);
  test_lanes(rng);
  test_submitter(rng, false);
  test_submitter(rng, true);
  test_record_and_submit(rng);
  test_pack_jobs(rng);
  test_staged_pack_jobs(rng);
  test_fault_hook(rng);
  std::printf("dma_issue_fake_cuda: %d failures\n", failures.load());
  return failures.load() ? 1 : 0;
}

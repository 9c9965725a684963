// The staged H2D fault's code path, stressed on purpose on the fake CUDA runtime
// (tests/cpp/fake_cuda/cuda_runtime.h with check_ranges: every copy's source and destination
// must lie inside one buffer the runtime knows, within one registration segment; the three
// descriptor arrays are read for `count` entries during the call, so a short or freed array is
// an ASan report). At the sizes of the fault (docs/design/staged-h2d-fault.md): jobs of 262144
// blocks of 4 KiB, host buffers of 2^21 blocks (8 GiB: offsets past 2^31 and 2^32 bytes) as
// virtual buffers (addresses only), chunks of 8192 blocks, calls of 8192 and of 512
// descriptors, on the legacy default stream.
//  1. BlockCopier's `staged` method (kernels/copy.py _run_staged): each chunk's DMA step is
//     _C.dma_blocks (bindings.cu: the per-thread DescArrays, kvo::plan_dma, issue_planned);
//     H2D and D2H, host ids random / sequential / sorted / reversed, coalescing on and off,
//     host registration segments of 1 GiB and of an odd size.
//  2. The same from four threads at once (the descriptor arrays are per thread).
//  3. DmaSubmitter's staged pipe (dma_submitter.h staged_chunks) at the same sizes.
//     Calls of 8192 are asked for; the batcher caps every call at kvo::kMaxDescPerCall.
//  4. A driver that re-read descriptor arrays after the call (fake lazy_reads): no array a
//     call has seen is freed under it.
//  5. The checker itself: a descriptor one block past its buffer, and a run across a
//     segment boundary, are caught (so a pass above means something).
// Exit status 0: all good.
#include <cuda_runtime.h>  // the fake: built with -I tests/cpp/fake_cuda

#include <algorithm>
#include <cstdio>
#include <numeric>
#include <random>
#include <thread>
#include <vector>

#include "../../kernels/csrc/desc_arrays.h"
#include "../../kernels/csrc/dma_submitter.h"
#include "expect.h"

constexpr int64_t KiB = 1024, MiB = 1 << 20, GiB = 1ll << 30;
constexpr int64_t kBB = 4 * KiB;          // block bytes
constexpr int64_t kN = 262144;            // blocks per job (1 GiB)
constexpr int64_t kHostBlocks = 1 << 21;  // 8 GiB of host blocks
constexpr int64_t kPer = 8192;            // blocks per staged chunk (32 MiB)
constexpr int64_t kHalf = 64 * MiB;       // a staging half (BlockCopier's default 128 MiB staging)

// Virtual buffers in the fake's arena, a few GiB apart.
static void* vaddr(int i) { return reinterpret_cast<void*>(fake::kArenaLo + (uint64_t)i * (16ull << 30)); }

// bindings.cu dma_blocks, line for line (it is static there): plan into the calling thread's
// arrays, then issue.
static std::tuple<int, int64_t> dma_blocks(const int64_t* src_ids, const int64_t* dst_ids, int64_t n,
                                           uint64_t src_base, uint64_t dst_base, int64_t src_stride,
                                           int64_t dst_stride, int64_t bb, bool coalesce, size_t max_per_call,
                                           uintptr_t stream, kvo::Segments sseg, kvo::Segments dseg) {
  DescArrays& a = desc_arrays();
  a.reserve((size_t)n);
  const int64_t k = kvo::plan_dma(src_ids, dst_ids, n, src_base, dst_base, src_stride, dst_stride, bb, coalesce,
                                  a.d.data(), a.sr.data(), a.sz.data(), sseg, dseg);
  EXPECT(k >= 1 && k <= n);  // the arrays hold n entries
  // each descriptor, cut into blocks, is exactly the next blocks of the job (64-bit address math)
  int64_t i = 0;
  bool exact = true;
  for (int64_t q = 0; q < k && exact; ++q) {
    exact = a.sz[q] > 0 && a.sz[q] % (uint64_t)bb == 0;
    for (uint64_t o = 0; exact && o < a.sz[q]; o += (uint64_t)bb, ++i)
      exact = i < n && a.sr[q] + o == src_base + (uint64_t)src_ids[i] * (uint64_t)src_stride &&
              a.d[q] + o == dst_base + (uint64_t)dst_ids[i] * (uint64_t)dst_stride;
  }
  EXPECT(exact && i == n);
  return issue_planned(a, k, max_per_call, kvo::kDmaBatch, false, stream, nullptr);
}

static std::vector<int64_t> host_ids(const char* order, std::mt19937_64& rng) {
  std::vector<int64_t> ids(kN);
  if (order[0] == 's' && order[1] == 'e') {  // sequential, offset as the repro's
    std::iota(ids.begin(), ids.end(), kHostBlocks - kN - 3);  // the top of the 8 GiB
    return ids;
  }
  std::vector<int64_t> all(kHostBlocks);
  std::iota(all.begin(), all.end(), 0);
  std::shuffle(all.begin(), all.end(), rng);
  ids.assign(all.begin(), all.begin() + kN);
  if (order[0] == 's') std::sort(ids.begin(), ids.end());                         // sorted
  if (order[0] == 'r') std::sort(ids.begin(), ids.end(), std::greater<int64_t>());  // reversed
  return ids;
}

// One `staged` job as BlockCopier._run_staged issues its DMA steps: chunk c of kPer ids goes
// between the host blocks and staging slots 0..b-a of half c % 2 (slots from one array, as
// copy.py's _slot_ids). Returns the bytes the checker passed.
static uint64_t python_staged_job(bool h2d, const std::vector<int64_t>& hid, void* host, void* stage,
                                  bool coalesce, size_t max_per_call, uintptr_t stream, kvo::Segments host_seg) {
  static const std::vector<int64_t> slots = [] {
    std::vector<int64_t> s(32768);
    std::iota(s.begin(), s.end(), 0);
    return s;
  }();
  const uint64_t hb = (uint64_t)(uintptr_t)host;
  for (int64_t a = 0; a < kN; a += kPer) {
    const int64_t b = std::min(kN, a + kPer);
    const uint64_t sb = (uint64_t)(uintptr_t)stage + (uint64_t)(((a / kPer) % 2) * kHalf);
    try {
      if (h2d)
        dma_blocks(hid.data() + a, slots.data(), b - a, hb, sb, kBB, kBB, kBB, coalesce, max_per_call, stream,
                   host_seg, {});
      else
        dma_blocks(slots.data(), hid.data() + a, b - a, sb, hb, kBB, kBB, kBB, coalesce, max_per_call, stream, {},
                   host_seg);
    } catch (const std::exception& e) {
      std::fprintf(stderr, "chunk at %lld: %s\n", (long long)a, e.what());
      EXPECT(false);
      return 0;
    }
  }
  return 0;
}

static void setup_virtual(void** host, void** stage, int i, uint64_t seg) {
  *host = vaddr(2 * i);
  *stage = vaddr(2 * i + 1);
  fake::track(*host, (uint64_t)kHostBlocks * kBB, seg, true);
  fake::track(*stage, 2 * kHalf, 0, true);
}

static void test_python_staged_path() {
  std::mt19937_64 rng(37);
  void *host = nullptr, *stage = nullptr;
  const uint64_t odd_seg = 3 * GiB / 2 + 7 * kBB;  // segments not a power of two
  int cases = 0;
  for (uint64_t seg : {(uint64_t)0, (uint64_t)GiB, odd_seg}) {
    setup_virtual(&host, &stage, 0, seg);
    for (const char* order : {"random", "sequential", "sorted", "reversed"}) {
      const std::vector<int64_t> hid = host_ids(order, rng);
      for (bool h2d : {true, false})
        for (bool coalesce : {true, false})
          for (size_t per_call : {(size_t)8192, (size_t)512}) {
            fake::reset();
            fake::clear_violations();
            python_staged_job(h2d, hid, host, stage, coalesce, per_call, 0 /* legacy */, {(uint64_t)(uintptr_t)host, seg});
            const auto L = fake::log();
            int64_t descs = 0;
            bool ok_calls = true;
            for (const auto& op : L) {
              ok_calls &= op.kind == fake::Op::kBatch && op.stream == cudaStreamPerThread &&
                          op.count <= std::min(per_call, kvo::kMaxDescPerCall);
              descs += (int64_t)op.count;
            }
            std::lock_guard<std::mutex> lk(fake::st().mu);
            const auto& s = fake::st();
            if (s.violations)
              std::fprintf(stderr, "%s %s coalesce=%d per_call=%zu seg=%llu: %d bad descriptors, first: %s\n", order,
                           h2d ? "h2d" : "d2h", coalesce, per_call, (unsigned long long)seg, s.violations,
                           s.first_violation.c_str());
            EXPECT(s.violations == 0);
            EXPECT(s.checked_bytes == (uint64_t)(kN * kBB));
            EXPECT(ok_calls && descs == (int64_t)s.checked_descs);
            if (!coalesce) EXPECT(descs == kN);
            ++cases;
          }
    }
    fake::untrack(host);
    fake::untrack(stage);
  }
  std::printf("python staged path: %d jobs of %lld x %lld B checked\n", cases, (long long)kN, (long long)kBB);
}

// Four threads issue staged jobs at once, each on its own buffers and created stream, while the
// main thread grows and shrinks its own jobs: no descriptor may point outside its buffers.
static void test_threads() {
  fake::reset();
  fake::clear_violations();
  std::vector<void*> host(4), stage(4);
  for (int i = 0; i < 4; ++i) setup_virtual(&host[i], &stage[i], 4 + i, 0);
  std::vector<std::thread> ts;
  for (int i = 0; i < 4; ++i)
    ts.emplace_back([&, i] {
      std::mt19937_64 rng(100 + i);
      cudaStream_t s = nullptr;
      cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking);
      for (int r = 0; r < 3; ++r) {
        const std::vector<int64_t> hid = host_ids(r == 1 ? "sequential" : "random", rng);
        python_staged_job((r + i) % 2 == 0, hid, host[i], stage[i], true, r == 2 ? 512 : 8192,
                          (uintptr_t)(i % 2 ? s : nullptr), {});
      }
      cudaStreamDestroy(s);
    });
  for (auto& t : ts) t.join();
  std::lock_guard<std::mutex> lk(fake::st().mu);
  if (fake::st().violations) std::fprintf(stderr, "threads: %s\n", fake::st().first_violation.c_str());
  EXPECT(fake::st().violations == 0);
  EXPECT(fake::st().checked_bytes == (uint64_t)(12 * kN * kBB));
  for (int i = 0; i < 4; ++i) {
    fake::st().bufs.erase((uint64_t)(uintptr_t)host[i]);
    fake::st().bufs.erase((uint64_t)(uintptr_t)stage[i]);
  }
}

// The native staged pipe at the fault's sizes: the pack launcher checks the ids it is given
// (the staging slots and the GPU blocks) instead of moving bytes.
static int64_t g_nblocks = 0, g_per = 0;
static std::atomic<int64_t> g_pack_bad{0}, g_packed{0};
static cudaError_t checking_pack(const kvo::PackSpec& p, const int64_t* blocks, const int64_t* slots, int64_t n,
                                 cudaStream_t) {
  for (int64_t i = 0; i < n; ++i) {
    if (blocks[i] < 0 || blocks[i] >= g_nblocks || slots[i] < 0 || slots[i] >= g_per) ++g_pack_bad;
  }
  (void)p;
  g_packed += n;
  return cudaSuccess;
}

static void test_submitter_staged_pipe() {
  std::mt19937_64 rng(38);
  g_nblocks = 1 << 19;  // GPU blocks: 2 GiB
  g_pack_bad = 0;
  g_packed = 0;
  void* host = vaddr(20);
  fake::track(host, (uint64_t)kHostBlocks * kBB, GiB, true);
  static const int64_t table[4] = {0x1000, kBB, kBB, 0};  // one fragment per block (unused by the fake pack)
  kvo::PackSpec spec;
  spec.table = table;
  spec.num_frags = 1;
  spec.unified = static_cast<char*>(host);
  spec.unified_stride = kBB;
  spec.n_blocks = g_nblocks;
  spec.n_slots = kHostBlocks;
  spec.max_frag_bytes = kBB;
  spec.num_ctas = 16;
  cudaStream_t compute = nullptr, s = nullptr;
  cudaStreamCreateWithFlags(&compute, cudaStreamNonBlocking);
  cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking);
  cudaEvent_t ev = nullptr;
  cudaEventCreate(&ev);
  int jobs = 0;
  for (size_t per_call : {(size_t)8192, (size_t)512}) {
    kvo::DmaSubmitter sub(0, per_call, nullptr, &checking_pack);
    const int pipe = sub.add_staged(kBB, 2 * kHalf, 32 * MiB, 16, 32, kvo::kDmaBatch);
    g_per = std::get<0>(sub.staged_shape(pipe));
    EXPECT(g_per == kPer);
    // the staging buffer is a real cudaMalloc (tracked); the pipe's pageable host copy of its
    // slot ids is the one untracked source allowed
    fake::st().allow_untracked = true;
    for (const char* order : {"random", "sequential", "sorted", "reversed"}) {
      const std::vector<int64_t> hid = host_ids(order, rng);
      std::vector<int64_t> gid(g_nblocks);
      std::iota(gid.begin(), gid.end(), 0);
      std::shuffle(gid.begin(), gid.end(), rng);
      gid.resize(kN);
      for (bool to_unified : {false, true}) {
        fake::reset();
        fake::clear_violations();
        spec.to_unified = to_unified;
        int64_t t = -1;
        cudaError_t err = cudaErrorUnknown;
        bool staged = false;
        const kvo::IdCheck c = sub.record_and_submit_pack(&t, &err, compute, kvo::kPackStaged, gid.data(), hid.data(),
                                                          kN, spec, s, ev, pipe, {(uint64_t)(uintptr_t)host, GiB},
                                                          &staged);
        EXPECT(c.code == kvo::kIdsOk && err == cudaSuccess && staged);
        EXPECT(sub.synchronize(t) == cudaSuccess);
        sub.release(t);
        std::lock_guard<std::mutex> lk(fake::st().mu);
        if (fake::st().violations) std::fprintf(stderr, "submitter %s: %s\n", order, fake::st().first_violation.c_str());
        EXPECT(fake::st().violations == 0);
        // the DMA halves move every block once, plus the id upload (n ids)
        EXPECT(fake::st().checked_bytes >= (uint64_t)(kN * kBB));
        ++jobs;
      }
    }
    fake::st().allow_untracked = false;
  }
  EXPECT(g_pack_bad == 0 && g_packed == (int64_t)jobs * kN);
  cudaEventDestroy(ev);
  cudaStreamDestroy(compute);
  cudaStreamDestroy(s);
  fake::untrack(host);
  std::printf("submitter staged pipe: %d jobs checked\n", jobs);
}

// The checker catches what it is there to catch.
static void test_checker_catches() {
  std::mt19937_64 rng(39);
  void *host = nullptr, *stage = nullptr;
  setup_virtual(&host, &stage, 30, GiB);
  const std::vector<int64_t> seq = host_ids("sequential", rng);
  // a host base one block too high: the last id's block runs past the buffer
  fake::reset();
  fake::clear_violations();
  const uint64_t hb = (uint64_t)(uintptr_t)host;
  auto r = [&] {
    std::lock_guard<std::mutex> lk(fake::st().mu);
    return fake::st().violations;
  };
  std::vector<int64_t> last = {kHostBlocks - 1}, slot0 = {0};
  bool threw = false;
  try {
    dma_blocks(last.data(), slot0.data(), 1, hb + kBB, (uint64_t)(uintptr_t)stage, kBB, kBB, kBB, true, 512, 0, {}, {});
  } catch (const std::runtime_error&) {
    threw = true;  // the fake refuses the call; KVO_CHECK turns that into an exception
  }
  EXPECT(threw && r() == 1);
  // a run across a registration segment: planned without the segments, the first chunk of
  // sequential ids that crosses 1 GiB is one descriptor over two segments
  fake::clear_violations();
  std::vector<int64_t> cross(kPer), slots(kPer);
  std::iota(cross.begin(), cross.end(), GiB / kBB - 10);
  std::iota(slots.begin(), slots.end(), 0);
  threw = false;
  try {
    dma_blocks(cross.data(), slots.data(), kPer, hb, (uint64_t)(uintptr_t)stage, kBB, kBB, kBB, true, 512, 0, {}, {});
  } catch (const std::runtime_error&) {
    threw = true;
  }
  EXPECT(threw && r() == 1);
  // ... and with the segments it is two descriptors, both fine
  fake::clear_violations();
  dma_blocks(cross.data(), slots.data(), kPer, hb, (uint64_t)(uintptr_t)stage, kBB, kBB, kBB, true, 512, 0,
             {hb, (uint64_t)GiB}, {});
  EXPECT(r() == 0);
  fake::untrack(host);
  fake::untrack(stage);
}

// A driver that read descriptor arrays after its call returned: a thread's arrays grow (a
// job of 512 descriptors, then the fault's 262144-block jobs in chunks) while the fake re-reads
// the arrays of earlier calls at each call. The arrays of a call are never freed under it
// (desc_arrays.h keeps grown-out ones); freeing them was an ASan heap-use-after-free here.
static void test_lazy_driver_reads() {
  fake::reset();
  fake::clear_violations();
  void *host = nullptr, *stage = nullptr;
  setup_virtual(&host, &stage, 40, 0);
  fake::st().lazy_reads = true;
  std::thread t([&] {  // a fresh thread: its arrays start empty
    std::mt19937_64 rng(41);
    std::vector<int64_t> small(512), slots(512);
    std::iota(small.begin(), small.end(), 5);
    std::iota(slots.begin(), slots.end(), 0);
    std::shuffle(small.begin(), small.end(), rng);
    dma_blocks(small.data(), slots.data(), 512, (uint64_t)(uintptr_t)host, (uint64_t)(uintptr_t)stage, kBB, kBB, kBB,
               false, 512, 0, {}, {});
    const std::vector<int64_t> hid = host_ids("random", rng);
    python_staged_job(true, hid, host, stage, false, 512, 0, {});
    // and a whole job in one plan (the `dma` method's shape): the arrays grow again
    std::vector<int64_t> gid(kN);
    std::iota(gid.begin(), gid.end(), 0);
    void* gpu = vaddr(42);
    fake::track(gpu, (uint64_t)kN * kBB, 0, true);
    dma_blocks(hid.data(), gid.data(), kN, (uint64_t)(uintptr_t)host, (uint64_t)(uintptr_t)gpu, kBB, kBB, kBB,
               false, 512, 0, {}, {});
    dma_blocks(small.data(), slots.data(), 512, (uint64_t)(uintptr_t)host, (uint64_t)(uintptr_t)stage, kBB, kBB, kBB,
               false, 512, 0, {}, {});
  });
  t.join();
  std::lock_guard<std::mutex> lk(fake::st().mu);
  fake::st().lazy_reads = false;
  EXPECT(fake::st().violations == 0);
  EXPECT(fake::st().lazy_rereads > 1000);
  fake::st().seen.clear();
  fake::st().bufs.erase((uint64_t)(uintptr_t)vaddr(42));
  fake::st().bufs.erase((uint64_t)(uintptr_t)host);
  fake::st().bufs.erase((uint64_t)(uintptr_t)stage);
}

// The id pass a `staged` or `dma` job of the fault's shape runs before anything is planned
// (check_id_pairs / the index ring: kvo::check_ids, at n = 2^18 the split duplicate check over
// the WorkPool at its largest size, and the int32 narrowing into a slot of exactly 2n ids):
// under ASan, into buffers of exactly the size they are given, with and without helpers.
static void test_id_pass_at_fault_size() {
  std::mt19937_64 rng(43);
  const int64_t gpu_blocks = 1 << 19;
  std::vector<int64_t> gid(gpu_blocks);
  std::iota(gid.begin(), gid.end(), 0);
  std::shuffle(gid.begin(), gid.end(), rng);
  gid.resize(kN);
  for (int pool : {1, 0}) {
    kvo::WorkPool::instance().set_enabled(pool != 0);
    for (const char* order : {"random", "sequential", "sorted", "reversed"}) {
      const std::vector<int64_t> hid = host_ids(order, rng);
      // H2D: host -> GPU; D2H: GPU -> host
      EXPECT(kvo::check_ids(hid.data(), gid.data(), kN, kHostBlocks, gpu_blocks).code == kvo::kIdsOk);
      EXPECT(kvo::check_ids(gid.data(), hid.data(), kN, gpu_blocks, kHostBlocks).code == kvo::kIdsOk);
      std::vector<int32_t> out(2 * kN);
      EXPECT(kvo::check_and_stage_ids32(hid.data(), gid.data(), kN, kHostBlocks, gpu_blocks, out.data()).code ==
             kvo::kIdsOk);
      EXPECT(out[kN - 1] == (int32_t)hid[kN - 1] && out[2 * kN - 1] == (int32_t)gid[kN - 1]);
      std::vector<int64_t> dup = gid;
      dup[kN - 1] = dup[7];
      const kvo::IdCheck c = kvo::check_ids(hid.data(), dup.data(), kN, kHostBlocks, gpu_blocks);
      EXPECT(c.code == kvo::kDstDuplicate && c.index == kN - 1);
      std::vector<int64_t> far = hid;
      far[kN / 2] = kHostBlocks;
      EXPECT(kvo::check_ids(far.data(), gid.data(), kN, kHostBlocks, gpu_blocks).code == kvo::kSrcOutOfRange);
    }
  }
  kvo::WorkPool::instance().set_enabled(true);
}

int main() {
  fake::st().check_ranges = true;
  test_checker_catches();
  test_id_pass_at_fault_size();
  test_python_staged_path();
  test_threads();
  test_submitter_staged_pipe();
  test_lazy_driver_reads();
  std::printf("staged_fault_stress: %d failures\n", failures.load());
  return failures.load() ? 1 : 0;
}

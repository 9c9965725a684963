// A fake CUDA runtime, just large enough for kvoffload's host-side issue logic
// (kernels/csrc/dma_batch.cuh, dma_submitter.h), so that logic can be tested on machines
// without a GPU (tests/cpp/dma_issue_fake_cuda.cpp). Memory is host memory: a copy is a
// memcpy done during the call. Every stream operation is logged, with its stream, so a
// test can check what was issued where and in which order. Failures are injected on the
// n-th batch call. Only what the headers under test use is here; names and signatures
// follow the CUDA 13 runtime.
#pragma once
#include <atomic>
#include <cstddef>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <iterator>
#include <map>
#include <mutex>
#include <string>
#include <thread>
#include <vector>

#define CUDART_VERSION 13000

enum cudaError {
  cudaSuccess = 0,
  cudaErrorInvalidValue = 1,
  cudaErrorCallRequiresNewerDriver = 36,
  cudaErrorInvalidResourceHandle = 400,
  cudaErrorNotReady = 600,
  cudaErrorNotSupported = 801,
  cudaErrorUnknown = 999,
};
typedef cudaError cudaError_t;

struct FakeStream { int id; };
struct FakeEvent { int id; bool recorded; };
typedef FakeStream* cudaStream_t;
typedef FakeEvent* cudaEvent_t;
#define cudaStreamLegacy ((cudaStream_t)0x1)
#define cudaStreamPerThread ((cudaStream_t)0x2)
#define cudaStreamNonBlocking 0x01
#define cudaEventDisableTiming 0x02

enum cudaMemcpyKind { cudaMemcpyHostToHost = 0, cudaMemcpyHostToDevice = 1, cudaMemcpyDefault = 4 };
#define cudaHostAllocPortable 0x01
enum cudaMemcpySrcAccessOrder {
  cudaMemcpySrcAccessOrderInvalid = 0,
  cudaMemcpySrcAccessOrderStream = 1,
  cudaMemcpySrcAccessOrderDuringApiCall = 2,
  cudaMemcpySrcAccessOrderAny = 3,
};
enum cudaMemcpyFlags { cudaMemcpyFlagDefault = 0, cudaMemcpyFlagPreferOverlapWithCompute = 1 };
struct cudaMemLocation { int type; int id; };
struct cudaMemcpyAttributes {
  cudaMemcpySrcAccessOrder srcAccessOrder;
  cudaMemLocation srcLocHint;
  cudaMemLocation dstLocHint;
  unsigned int flags;
};
struct int4 { int x, y, z, w; };

namespace fake {

struct Op {
  enum Kind { kBatch, kCopy, kRecord, kWait, kKernel } kind;  // kKernel: logged by a test's launcher
  cudaStream_t stream;
  cudaEvent_t event;        // record / wait
  const void* const* dsts;  // batch: the dsts pointer the call got (its offset = where the slice starts)
  void* dst;                // copy
  size_t count;             // batch: descriptors; copy: 1
  unsigned flags;           // batch: attribute flags
  int order;                // batch: srcAccessOrder
};

struct State {
  std::mutex mu;
  std::vector<Op> log;
  int batch_calls = 0;              // batch calls made, failed ones included
  int fail_batch_call = -1;         // 1-based batch call that returns fail_with
  cudaError_t fail_with = cudaErrorUnknown;
  bool batch_unsupported = false;   // every batch call: cudaErrorNotSupported
  std::atomic<bool> stall{false};   // batch calls wait while set (a driver lock held elsewhere)
  int live_streams = 0, live_events = 0, streams_made = 0, next_id = 100;
  int live_host_allocs = 0, live_dev_allocs = 0;  // cudaHostAlloc / cudaMalloc not yet freed
  std::atomic<bool> stream_busy{false};            // cudaStreamQuery answers cudaErrorNotReady
  std::atomic<bool> events_pending{false};         // cudaEventQuery of a recorded event: cudaErrorNotReady
  // Checked copies (check_ranges): every copy's source and destination range must lie inside
  // one buffer the runtime knows (cudaMalloc / cudaHostAlloc, or one a test named with
  // fake::track), and must not span two registration segments of a tracked buffer that has
  // them. A copy that breaks this is refused with cudaErrorInvalidValue (a real driver faults:
  // a GPU page fault for a device or pinned address, a host segfault for a pageable one) and
  // counted in `violations`; `first_violation` says which. A "virtual" buffer (track's
  // virt) has addresses only, no memory: copies touching it are checked, not performed, so a
  // test can plan at the real fault's sizes (GiBs, offsets past 2^32) without the memory.
  bool check_ranges = false;
  // With allow_untracked, an address outside every tracked buffer and outside the virtual
  // arena [kArenaLo, kArenaHi) passes and is counted in `untracked` (host code's own
  // pageable vectors, which a real driver copies from too); an arena address must lie in a
  // tracked buffer.
  bool allow_untracked = false;
  uint64_t untracked = 0;
  int violations = 0;
  std::string first_violation;
  struct Buf { uint64_t bytes; uint64_t seg; bool virt; };
  std::map<uint64_t, Buf> bufs;  // base -> buffer
  uint64_t checked_descs = 0, checked_bytes = 0;  // descriptors / bytes that passed the check
  // lazy_reads: a driver that reads a batch call's descriptor arrays again after the call
  // returned (the CUDA API says it does not): each batch call first re-reads the arrays of the
  // last kLazyCalls batch calls, all `count` entries (ASan: a freed array is a
  // heap-use-after-free), and checks what it reads like a new call's descriptors.
  bool lazy_reads = false;
  static constexpr size_t kLazyCalls = 64;
  struct Seen { const void* const* d; const void* const* s; const size_t* z; size_t count; };
  std::vector<Seen> seen;
  uint64_t lazy_rereads = 0;
};
inline State& st() {
  static State s;
  return s;
}
// Clears the log and the injected failures (not the live object counts).
inline void reset() {
  std::lock_guard<std::mutex> lk(st().mu);
  st().log.clear();
  st().batch_calls = 0;
  st().fail_batch_call = -1;
  st().fail_with = cudaErrorUnknown;
  st().batch_unsupported = false;
}
inline std::vector<Op> log() {
  std::lock_guard<std::mutex> lk(st().mu);
  return st().log;
}
// Names [base, base + bytes) as a valid copy source/destination (seg: registration segment
// bytes, 0 = one; virt: no memory behind it, see State::check_ranges). Caller holds no lock.
inline void track(const void* base, uint64_t bytes, uint64_t seg = 0, bool virt = false) {
  std::lock_guard<std::mutex> lk(st().mu);
  st().bufs[(uint64_t)(uintptr_t)base] = {bytes, seg, virt};
}
inline void untrack(const void* base) {
  std::lock_guard<std::mutex> lk(st().mu);
  st().bufs.erase((uint64_t)(uintptr_t)base);
}
// Where tests place virtual buffers: addresses no allocation here uses.
constexpr uint64_t kArenaLo = 0x300000000000ull, kArenaHi = 0x400000000000ull;
inline const State::Buf& untracked_buf() {
  static const State::Buf b{0, 0, false};
  return b;
}
// The tracked buffer holding [a, a + n), or null; sets *why when there is none. Lock held.
inline const State::Buf* find_buf_locked(uint64_t a, uint64_t n, uint64_t* base, std::string* why) {
  auto& m = st().bufs;
  auto it = m.upper_bound(a);
  if (n == 0) { *why = "empty copy"; return nullptr; }
  const bool in_arena = a >= kArenaLo && a < kArenaHi;
  auto untracked = [&](const char* w) -> const State::Buf* {
    if (st().allow_untracked && !in_arena) { ++st().untracked; return &untracked_buf(); }
    *why = w;
    return nullptr;
  };
  if (it == m.begin()) return untracked("below every buffer");
  --it;
  const uint64_t b = it->first;
  const State::Buf& f = it->second;
  if (a >= b + f.bytes) return untracked("outside every buffer");
  if (a + n < a || a + n > b + f.bytes) { *why = "runs past the end of its buffer"; return nullptr; }
  if (f.seg && (a - b) / f.seg != (a + n - 1 - b) / f.seg) { *why = "spans two registration segments"; return nullptr; }
  *base = b;
  return &f;
}
// Checks one copy under the lock; returns whether to perform it (false: virtual, or refused).
inline bool check_copy_locked(uint64_t dst, uint64_t src, uint64_t n, size_t idx, bool* bad) {
  State& s = st();
  if (!s.check_ranges) return true;
  std::string why;
  uint64_t db = 0, sb = 0;
  const State::Buf* d = find_buf_locked(dst, n, &db, &why);
  const char* side = "dst";
  const State::Buf* r = d ? find_buf_locked(src, n, &sb, &why) : nullptr;
  if (d) side = "src";
  if (!d || !r) {
    if (s.violations++ == 0) {
      char msg[256];
      std::snprintf(msg, sizeof msg, "descriptor %zu: %s %#llx + %llu bytes %s", idx, side,
                    (unsigned long long)(side[0] == 'd' ? dst : src), (unsigned long long)n, why.c_str());
      s.first_violation = msg;
    }
    *bad = true;
    return false;
  }
  ++s.checked_descs;
  s.checked_bytes += n;
  return !d->virt && !r->virt;
}
inline void clear_violations() {
  std::lock_guard<std::mutex> lk(st().mu);
  st().violations = 0;
  st().first_violation.clear();
  st().checked_descs = st().checked_bytes = st().untracked = 0;
  st().seen.clear();
  st().lazy_rereads = 0;
}

// For a test's kernel launcher: logs the launch on its stream.
inline void log_kernel(cudaStream_t stream) {
  std::lock_guard<std::mutex> lk(st().mu);
  st().log.push_back({Op::kKernel, stream, nullptr, nullptr, nullptr, 0, 0, 0});
}

}  // namespace fake

inline cudaError_t cudaMemcpyBatchAsync(const void* const* dsts, const void* const* srcs, const size_t* sizes,
                                        size_t count, const cudaMemcpyAttributes* attrs, const size_t* attrsIdxs,
                                        size_t numAttrs, cudaStream_t stream) {
  while (fake::st().stall.load()) std::this_thread::yield();
  std::lock_guard<std::mutex> lk(fake::st().mu);
  fake::State& s = fake::st();
  ++s.batch_calls;
  // the real call refuses the legacy default stream, empty batches and bad attributes
  if (stream == nullptr || stream == cudaStreamLegacy || count == 0 || numAttrs != 1 || attrsIdxs[0] != 0 ||
      attrs[0].srcAccessOrder == cudaMemcpySrcAccessOrderInvalid || attrs[0].srcAccessOrder > cudaMemcpySrcAccessOrderAny)
    return cudaErrorInvalidValue;
  if (s.batch_unsupported) return cudaErrorNotSupported;
  if (s.batch_calls == s.fail_batch_call) return s.fail_with;
  if (s.lazy_reads) {
    for (const auto& c : s.seen) {
      std::vector<const void*> D(c.d, c.d + c.count), S(c.s, c.s + c.count);
      std::vector<size_t> Z(c.z, c.z + c.count);
      bool bad_old = false;
      const bool ranges = s.check_ranges;
      for (size_t i = 0; i < c.count; ++i)
        (void)fake::check_copy_locked((uint64_t)(uintptr_t)D[i], (uint64_t)(uintptr_t)S[i], Z[i], i, &bad_old);
      s.check_ranges = ranges;
      ++s.lazy_rereads;
    }
    if (s.seen.size() >= fake::State::kLazyCalls) s.seen.erase(s.seen.begin());
    s.seen.push_back({dsts, srcs, sizes, count});
  }
  // The driver reads the three arrays during the call: copied here first, so a short or freed
  // array is an ASan report at this line; then every descriptor is checked before any copy.
  std::vector<const void*> D(dsts, dsts + count), S(srcs, srcs + count);
  std::vector<size_t> Z(sizes, sizes + count);
  std::vector<char> run(count, 1);
  bool bad = false;
  for (size_t i = 0; i < count; ++i)
    run[i] = fake::check_copy_locked((uint64_t)(uintptr_t)D[i], (uint64_t)(uintptr_t)S[i], Z[i], i, &bad);
  if (bad) return cudaErrorInvalidValue;
  for (size_t i = 0; i < count; ++i)
    if (run[i]) std::memmove(const_cast<void*>(D[i]), S[i], Z[i]);
  s.log.push_back({fake::Op::kBatch, stream, nullptr, dsts, nullptr, count, attrs[0].flags, (int)attrs[0].srcAccessOrder});
  return cudaSuccess;
}

inline cudaError_t cudaMemcpyAsync(void* dst, const void* src, size_t bytes, cudaMemcpyKind, cudaStream_t stream) {
  std::lock_guard<std::mutex> lk(fake::st().mu);
  bool bad = false;
  if (fake::check_copy_locked((uint64_t)(uintptr_t)dst, (uint64_t)(uintptr_t)src, bytes, 0, &bad)) std::memmove(dst, src, bytes);
  if (bad) return cudaErrorInvalidValue;
  fake::st().log.push_back({fake::Op::kCopy, stream, nullptr, nullptr, dst, 1, 0, 0});
  return cudaSuccess;
}

inline cudaError_t cudaEventRecord(cudaEvent_t e, cudaStream_t stream = nullptr) {
  if (e == nullptr) return cudaErrorInvalidResourceHandle;
  std::lock_guard<std::mutex> lk(fake::st().mu);
  e->recorded = true;
  fake::st().log.push_back({fake::Op::kRecord, stream, e, nullptr, nullptr, 0, 0, 0});
  return cudaSuccess;
}

inline cudaError_t cudaStreamWaitEvent(cudaStream_t stream, cudaEvent_t e, unsigned int = 0) {
  if (e == nullptr) return cudaErrorInvalidResourceHandle;
  std::lock_guard<std::mutex> lk(fake::st().mu);
  fake::st().log.push_back({fake::Op::kWait, stream, e, nullptr, nullptr, 0, 0, 0});
  return cudaSuccess;
}

inline cudaError_t cudaEventCreateWithFlags(cudaEvent_t* e, unsigned int) {
  std::lock_guard<std::mutex> lk(fake::st().mu);
  *e = new FakeEvent{fake::st().next_id++, false};
  ++fake::st().live_events;
  return cudaSuccess;
}
inline cudaError_t cudaEventCreate(cudaEvent_t* e) { return cudaEventCreateWithFlags(e, 0); }
inline cudaError_t cudaEventDestroy(cudaEvent_t e) {
  if (e == nullptr) return cudaErrorInvalidResourceHandle;
  std::lock_guard<std::mutex> lk(fake::st().mu);
  delete e;
  --fake::st().live_events;
  return cudaSuccess;
}
// Memory is host memory: everything issued has completed (an unrecorded event, as in CUDA,
// reads as complete).
// With events_pending set, a recorded event reads as not reached yet (the GPU still runs what
// was queued before it); cudaEventSynchronize then stands for the wait until it is.
inline cudaError_t cudaEventQuery(cudaEvent_t e) {
  if (!e) return cudaErrorInvalidResourceHandle;
  return fake::st().events_pending.load() && e->recorded ? cudaErrorNotReady : cudaSuccess;
}
inline cudaError_t cudaEventSynchronize(cudaEvent_t e) { return e ? cudaSuccess : cudaErrorInvalidResourceHandle; }
inline cudaError_t cudaEventElapsedTime(float* ms, cudaEvent_t a, cudaEvent_t b) {
  if (!a || !b || !a->recorded || !b->recorded) return cudaErrorInvalidResourceHandle;
  *ms = 0.5f;
  return cudaSuccess;
}

inline cudaError_t cudaStreamCreateWithFlags(cudaStream_t* s, unsigned int) {
  std::lock_guard<std::mutex> lk(fake::st().mu);
  *s = new FakeStream{fake::st().next_id++};
  ++fake::st().live_streams;
  ++fake::st().streams_made;
  return cudaSuccess;
}
inline cudaError_t cudaStreamDestroy(cudaStream_t s) {
  if (s == nullptr || s == cudaStreamLegacy || s == cudaStreamPerThread) return cudaErrorInvalidResourceHandle;
  std::lock_guard<std::mutex> lk(fake::st().mu);
  delete s;
  --fake::st().live_streams;
  return cudaSuccess;
}
inline cudaError_t cudaMemcpy(void* dst, const void* src, size_t bytes, cudaMemcpyKind) {  // synchronous: not logged
  std::memmove(dst, src, bytes);
  return cudaSuccess;
}
inline cudaError_t cudaStreamSynchronize(cudaStream_t) { return cudaSuccess; }  // everything issued is done
inline cudaError_t cudaDeviceGetStreamPriorityRange(int* least, int* greatest) {
  *least = 0;
  *greatest = -5;
  return cudaSuccess;
}
inline cudaError_t cudaStreamCreateWithPriority(cudaStream_t* s, unsigned int flags, int) {
  return cudaStreamCreateWithFlags(s, flags);
}
// Not logged: a query issues nothing.
inline cudaError_t cudaStreamQuery(cudaStream_t) {
  return fake::st().stream_busy.load() ? cudaErrorNotReady : cudaSuccess;
}
inline cudaError_t cudaHostAlloc(void** p, size_t bytes, unsigned int) {
  *p = ::operator new(bytes);
  std::lock_guard<std::mutex> lk(fake::st().mu);
  ++fake::st().live_host_allocs;
  fake::st().bufs[(uint64_t)(uintptr_t)*p] = {bytes, 0, false};
  return cudaSuccess;
}
inline cudaError_t cudaFreeHost(void* p) {
  if (p == nullptr) return cudaSuccess;
  const uint64_t key = (uint64_t)(uintptr_t)p;  // untracked before the memory goes back
  {
    std::lock_guard<std::mutex> lk(fake::st().mu);
    --fake::st().live_host_allocs;
    fake::st().bufs.erase(key);
  }
  ::operator delete(p);
  return cudaSuccess;
}
inline cudaError_t cudaMalloc(void** p, size_t bytes) {
  *p = ::operator new(bytes);
  std::lock_guard<std::mutex> lk(fake::st().mu);
  ++fake::st().live_dev_allocs;
  fake::st().bufs[(uint64_t)(uintptr_t)*p] = {bytes, 0, false};
  return cudaSuccess;
}
inline cudaError_t cudaFree(void* p) {
  if (p == nullptr) return cudaSuccess;
  const uint64_t key = (uint64_t)(uintptr_t)p;  // untracked before the memory goes back
  {
    std::lock_guard<std::mutex> lk(fake::st().mu);
    --fake::st().live_dev_allocs;
    fake::st().bufs.erase(key);
  }
  ::operator delete(p);
  return cudaSuccess;
}
inline cudaError_t cudaMallocAsync(void** p, size_t bytes, cudaStream_t) { return cudaMalloc(p, bytes); }
inline cudaError_t cudaFreeAsync(void* p, cudaStream_t) { return cudaFree(p); }
inline cudaError_t cudaStreamGetDevice(cudaStream_t, int* dev) {
  *dev = 0;
  return cudaSuccess;
}
inline cudaError_t cudaGetDevice(int* dev) {
  *dev = 0;
  return cudaSuccess;
}
inline cudaError_t cudaSetDevice(int dev) { return dev == 0 ? cudaSuccess : cudaErrorInvalidValue; }
inline cudaError_t cudaGetLastError() { return cudaSuccess; }
inline const char* cudaGetErrorName(cudaError_t e) {
  switch (e) {
    case cudaSuccess: return "cudaSuccess";
    case cudaErrorInvalidValue: return "cudaErrorInvalidValue";
    case cudaErrorNotSupported: return "cudaErrorNotSupported";
    case cudaErrorNotReady: return "cudaErrorNotReady";
    default: return "cudaErrorUnknown";
  }
}
inline const char* cudaGetErrorString(cudaError_t e) { return e == cudaSuccess ? "no error" : "injected by the fake runtime"; }

// DMA batcher: a list of (dst, src, size) descriptors issued to the copy
// engines with cudaMemcpyBatchAsync (CUDA >= 12.8, CUDA 13 signature), or a
// loop of cudaMemcpyAsync where the batch API is missing or refused.
#pragma once
#include "common.cuh"
#include "fault.h"
#include <atomic>
#include <chrono>
#include <cstddef>
#include <mutex>
#include <thread>
#include <utility>
#include <vector>

namespace kvo {

// Driver calls from different host threads serialise on the driver's lock, and one
// cudaMemcpyBatchAsync of many descriptors holds it for as long as it issues them
// (docs/design/native-submit.md). A thread that issues long
// batches on behalf of another (DmaSubmitter) passes a DmaGate before each batch call: while
// the other thread holds the gate (it is about to make short driver calls of its own, such
// as an event record), the issuing thread waits between calls instead of taking the lock
// again. The wait is bounded by `until`, so a holder that never lets go only slows issue.
struct DmaGate {
  std::atomic<int> holders{0};
  std::chrono::steady_clock::time_point until{};
  void hold() { holders.fetch_add(1, std::memory_order_acq_rel); }
  void release() { holders.fetch_sub(1, std::memory_order_acq_rel); }
  void pass() const {
    while (holders.load(std::memory_order_acquire) > 0 && std::chrono::steady_clock::now() < until)
      std::this_thread::yield();
  }
};

// kDmaBatchNoHint: the batch API without cudaMemcpyFlagPreferOverlapWithCompute
// (for measuring what the hint costs or gives on an idle GPU).
enum DmaMode : int { kDmaBatch = 0, kDmaLoop = 1, kDmaBatchNoHint = 2 };

// The most descriptors one driver call ever gets, whatever the caller asks: calls of 512 were
// the fastest measured (docs/design/dma-descriptor-cost.md), and the one GPU fault seen in a
// batch call came with calls of 8192 (docs/design/staged-h2d-fault.md), so larger calls only
// add risk.
constexpr size_t kMaxDescPerCall = 2048;

// dsts/srcs/sizes are host arrays of `count` entries. At most `max_per_call` (capped at
// kMaxDescPerCall) descriptors go into one driver call, which bounds the driver's per-call
// work and latency. `src_any_order` lets the driver read the source out of
// stream order (only safe when nothing earlier in the stream writes it, e.g.
// a host->device load from a stable host pool).
// `used_batch` (may be null) reports whether the batch API was used. `gate` (may be null)
// is passed before each driver call.
inline cudaError_t launch_dma_batch(void* const* dsts, const void* const* srcs, const size_t* sizes,
                                    size_t count, size_t max_per_call, int mode, bool src_any_order,
                                    cudaStream_t stream, int* used_batch, const DmaGate* gate = nullptr) {
  if (used_batch) *used_batch = 0;
  if (count == 0) return cudaSuccess;
  if (max_per_call == 0) return cudaErrorInvalidValue;
  if (max_per_call > kMaxDescPerCall) max_per_call = kMaxDescPerCall;
  size_t start = 0;  // the first descriptor the cudaMemcpyAsync loop issues
#if defined(CUDART_VERSION) && CUDART_VERSION >= 12080
  if (mode == kDmaBatch || mode == kDmaBatchNoHint) {
    cudaMemcpyAttributes attr = {};
    attr.srcAccessOrder = src_any_order ? cudaMemcpySrcAccessOrderAny : cudaMemcpySrcAccessOrderStream;
    attr.flags = mode == kDmaBatch ? cudaMemcpyFlagPreferOverlapWithCompute : 0;
    size_t attr_idx = 0;
    cudaStream_t s = batch_capable_stream(stream);
    cudaError_t err = cudaSuccess;
    size_t done = 0;
    for (; done < count; done += max_per_call) {
      const size_t n = (count - done) < max_per_call ? (count - done) : max_per_call;
      if (gate) gate->pass();
      err = fault::check(fault::Site::kMemcpyBatch);  // test-only hook (fault.h): one relaxed load
      if (err != cudaSuccess) break;
#if CUDART_VERSION >= 13000
      err = cudaMemcpyBatchAsync(dsts + done, srcs + done, sizes + done, n, &attr, &attr_idx, 1, s);
#else
      size_t fail_idx = 0;
      err = cudaMemcpyBatchAsync(const_cast<void**>(dsts + done), const_cast<void**>(srcs + done),
                                 const_cast<size_t*>(sizes + done), n, &attr, &attr_idx, 1,
                                 &fail_idx, s);
#endif
      if (err != cudaSuccess) break;
    }
    if (err == cudaSuccess) {
      if (used_batch) *used_batch = 1;
      return cudaSuccess;
    }
    // Fall back only when the API itself is unavailable, and only for what it did not queue:
    // descriptors of earlier calls are in the stream already and must not be issued twice.
    if (err != cudaErrorNotSupported && err != cudaErrorCallRequiresNewerDriver) return err;
    (void)cudaGetLastError();
    start = done;
  }
#endif
  for (size_t i = start; i < count; ++i) {
    if (gate && (i - start) % max_per_call == 0) gate->pass();
    KVO_RETURN_IF_ERROR(fault::check(fault::Site::kMemcpyAsync));
    KVO_RETURN_IF_ERROR(cudaMemcpyAsync(dsts[i], srcs[i], sizes[i], cudaMemcpyDefault, stream));
  }
  return cudaSuccess;
}

// Copy-engine lanes. Besides moving bytes, a copy engine spends time on each descriptor.
// One job's descriptors spread over several streams run on several engines, whose
// per-descriptor gaps then overlap while PCIe stays busy (profiling/probes/probe_dma_lanes.py;
// figures: docs/design/dma-descriptor-cost.md, profiling/results/dma_lanes.json).
//
// The caller's stream is lane 0. Each other lane is a side stream that waits on a fork event
// recorded on the caller's stream and is joined back by an event the caller's stream waits on,
// so the job keeps plain stream semantics: it starts after what was queued before it and
// everything queued after it waits for all of it. Side streams belong to one (caller stream,
// device) pair, so jobs on different caller streams (stores and loads) never queue behind
// each other. A mutex guards the fork/join events: one DmaLanes may serve several threads.
constexpr int kMaxDmaLanes = 8;

class DmaLanes {
 public:
  // min_desc_bytes: jobs whose mean descriptor is smaller use one lane. With many tiny
  // descriptors, several engines are slower than one (docs/design/dma-descriptor-cost.md).
  DmaLanes(int lanes, size_t min_lane_bytes, size_t min_desc_bytes = 64 << 10)
      : lanes_(lanes), min_lane_bytes_(min_lane_bytes), min_desc_bytes_(min_desc_bytes) {}
  ~DmaLanes() {
    for (auto& kv : sets_) destroy(kv.second);
  }
  DmaLanes(const DmaLanes&) = delete;
  DmaLanes& operator=(const DmaLanes&) = delete;
  int lanes() const { return lanes_; }
  size_t min_lane_bytes() const { return min_lane_bytes_; }
  size_t min_desc_bytes() const { return min_desc_bytes_; }

  // How many lanes a job of `count` descriptors and `bytes` bytes uses.
  int lanes_for(size_t count, size_t bytes) const {
    size_t l = (size_t)lanes_;
    if (count < l) l = count;
    if (count > 0 && bytes / count < min_desc_bytes_) l = 1;
    if (min_lane_bytes_ > 0 && bytes / min_lane_bytes_ < l) l = bytes / min_lane_bytes_;
    return l < 1 ? 1 : (int)l;
  }

  // launch_dma_batch over up to lanes() streams; the lanes get about equal bytes.
  cudaError_t launch(void* const* dsts, const void* const* srcs, const size_t* sizes, size_t count,
                     size_t max_per_call, int mode, bool src_any_order, cudaStream_t stream,
                     int* used_batch, const DmaGate* gate = nullptr) {
    size_t total = 0;
    for (size_t i = 0; i < count; ++i) total += sizes[i];
    const int L = lanes_for(count, total);
    if (L <= 1)
      return launch_dma_batch(dsts, srcs, sizes, count, max_per_call, mode, src_any_order, stream, used_batch,
                              gate);
    std::lock_guard<std::mutex> lk(mu_);
    Set* s = nullptr;
    KVO_RETURN_IF_ERROR(set_for(stream, L, &s));
    KVO_RETURN_IF_ERROR(cudaEventRecord(s->fork, stream));
    cudaError_t err = cudaSuccess;
    int all_batch = 1;
    size_t begin = 0, acc = 0;
    for (int i = 0; i < L; ++i) {
      // cut where the running byte count reaches (i + 1) / L of the total; every lane gets
      // at least one descriptor
      size_t end = begin;
      const size_t target = (size_t)((double)total * (i + 1) / L);
      const size_t last = count - (size_t)(L - 1 - i);
      while (end < last && (end == begin || acc < target)) acc += sizes[end++];
      if (i == L - 1) end = count;
      cudaStream_t st = i == 0 ? stream : s->side[i - 1];
      if (i > 0) {
        const cudaError_t w = cudaStreamWaitEvent(st, s->fork, 0);
        if (w != cudaSuccess) { err = w; break; }
      }
      int ub = 0;
      if (err == cudaSuccess)
        err = launch_dma_batch(dsts + begin, srcs + begin, sizes + begin, end - begin, max_per_call, mode,
                               src_any_order, st, &ub, gate);
      all_batch &= ub;
      if (i > 0) {  // joined even after a failure, so the caller's stream covers what was queued
        const cudaError_t r = cudaEventRecord(s->join[i - 1], st);
        const cudaError_t w = r == cudaSuccess ? cudaStreamWaitEvent(stream, s->join[i - 1], 0) : r;
        if (err == cudaSuccess) err = w;
      }
      if (err != cudaSuccess) break;
      begin = end;
    }
    if (used_batch) *used_batch = err == cudaSuccess ? all_batch : 0;
    return err;
  }

 private:
  struct Set {
    int made = 0;  // side streams created so far
    cudaStream_t side[kMaxDmaLanes - 1] = {};
    cudaEvent_t fork = nullptr;
    cudaEvent_t join[kMaxDmaLanes - 1] = {};
  };
  static constexpr size_t kMaxSets = 64;
  // Both return at once; work already queued on the streams still runs to completion.
  static void destroy(Set& s) {
    for (int i = 0; i < kMaxDmaLanes - 1; ++i) {
      if (s.side[i]) cudaStreamDestroy(s.side[i]);
      if (s.join[i]) cudaEventDestroy(s.join[i]);
    }
    if (s.fork) cudaEventDestroy(s.fork);
  }
  // The side streams of (stream, its device), created on first use on that device.
  cudaError_t set_for(cudaStream_t stream, int lanes, Set** out) {
    int dev = 0;
    KVO_RETURN_IF_ERROR(cudaStreamGetDevice(stream, &dev));
    const auto key = std::make_pair(stream, dev);
    Set* s = nullptr;
    for (auto& kv : sets_)
      if (kv.first == key) s = &kv.second;
    if (s == nullptr) {
      if (sets_.size() >= kMaxSets) {  // callers that make a stream per job: drop the oldest
        destroy(sets_.front().second);
        sets_.erase(sets_.begin());
      }
      sets_.emplace_back(key, Set{});
      s = &sets_.back().second;
    }
    if (s->made < lanes - 1) {
      int prev = 0;
      KVO_RETURN_IF_ERROR(cudaGetDevice(&prev));
      cudaError_t e = prev == dev ? cudaSuccess : cudaSetDevice(dev);
      if (e == cudaSuccess && !s->fork) e = cudaEventCreateWithFlags(&s->fork, cudaEventDisableTiming);
      for (; e == cudaSuccess && s->made < lanes - 1; ++s->made) {
        e = cudaStreamCreateWithFlags(&s->side[s->made], cudaStreamNonBlocking);
        if (e == cudaSuccess) e = cudaEventCreateWithFlags(&s->join[s->made], cudaEventDisableTiming);
        if (e != cudaSuccess) break;
      }
      if (prev != dev) cudaSetDevice(prev);
      KVO_RETURN_IF_ERROR(e);
    }
    *out = s;
    return cudaSuccess;
  }

  int lanes_;
  size_t min_lane_bytes_;
  size_t min_desc_bytes_;
  std::mutex mu_;
  std::vector<std::pair<std::pair<cudaStream_t, int>, Set>> sets_;
};

}  // namespace kvo

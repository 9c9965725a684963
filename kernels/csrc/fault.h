// Test-only fault injection: make a chosen driver call that moves or launches for a job fail.
//
// Each site below is checked right before the driver call(s) it names:
//   kMemcpyBatch   cudaMemcpyBatchAsync (dma_batch.cuh: launch_dma_batch, so the DMA jobs inline,
//                  on the DmaSubmitter thread, through DmaLanes, and the staged pipe's DMA half)
//   kMemcpyAsync   cudaMemcpyAsync of a job: launch_dma_batch's loop, the submitter's id upload
//                  of a pack job and of a staged job, the IndexRing's id uploads
//   kKernelLaunch  the copy kernels' launches: launch_copy_blocks, launch_pack_layers (the
//                  submitter's pack jobs and staged chunks included), launch_fn (Triton's kernel)
// When armed, check() returns the chosen cudaError_t instead of letting the call be made, so the
// caller's ordinary error handling runs exactly as for a driver failure at that point (nothing
// sticky is set in the CUDA context: the next call works). Armed from Python through
// kernels.native.inject_fault / clear_faults (tests/test_gpu_faults.py); the fake runtime's
// tests (tests/cpp/dma_issue_fake_cuda.cpp) arm it directly.
//
// Always compiled in. Disarmed, check() is one relaxed atomic load of a flag that no hot path
// writes (its cache line stays shared in every core's cache) and a predicted, not-taken branch:
// no fence, no read-modify-write, nothing that bounces a cache line between cores. That is
// far less than each guarded driver call costs (a batch call pays per descriptor:
// docs/design/dma-descriptor-cost.md); tests/cpp/fault_bench.cpp measures it, and
// tests/test_dma_issue_host.py bounds it. A build-time switch would need a second build for the
// GPU tests, and a hook that is not in the shipped build does not test the shipped build.
//
// Framework-free: <cuda_runtime.h> for cudaError_t only (the fake runtime's in the CPU tests).
#pragma once
#include <cuda_runtime.h>

#include <atomic>
#include <cstdint>
#include <mutex>

namespace kvo {
namespace fault {

enum class Site : int { kMemcpyBatch = 0, kMemcpyAsync = 1, kKernelLaunch = 2, kCount = 3 };

// "memcpy_batch", "memcpy_async", "kernel_launch" (the Python names) -> site; -1 if unknown.
inline int site_of(const char* name) {
  static const char* const names[] = {"memcpy_batch", "memcpy_async", "kernel_launch"};
  for (int i = 0; i < (int)Site::kCount; ++i) {
    const char* a = names[i];
    const char* b = name;
    while (*a && *a == *b) ++a, ++b;
    if (*a == 0 && *b == 0) return i;
  }
  return -1;
}

struct Point {
  std::atomic<int> armed{0};  // the only field the disarmed path reads
  std::mutex mu;              // guards the rest (taken only while armed)
  int64_t skip = 0;           // calls still to let through before failing
  int64_t left = 0;           // failures still to inject (< 0: every call from then on)
  cudaError_t error = cudaErrorUnknown;
  int64_t calls = 0;          // calls seen while armed (since the last arm)
  int64_t hits = 0;           // calls failed (since the last arm)
};

inline Point g_points[(int)Site::kCount];  // constant-initialised: no guard on the fast path

// Slow path, armed only.
inline cudaError_t fire(Point& p) {
  std::lock_guard<std::mutex> lk(p.mu);
  if (!p.armed.load(std::memory_order_relaxed)) return cudaSuccess;  // disarmed meanwhile
  ++p.calls;
  if (p.skip > 0) {
    --p.skip;
    return cudaSuccess;
  }
  if (p.left > 0 && --p.left == 0) p.armed.store(0, std::memory_order_relaxed);  // last one: disarm
  ++p.hits;
  return p.error;
}

// cudaSuccess: make the call. Anything else: return that instead of making it.
inline cudaError_t check(Site s) {
  Point& p = g_points[(int)s];
  if (__builtin_expect(p.armed.load(std::memory_order_relaxed) == 0, 1)) return cudaSuccess;
  return fire(p);
}

// The next `after` calls at `s` go through, then `times` calls (< 0: all) return `error`.
// Re-arming resets the site's counters. error must not be cudaSuccess.
inline void arm(Site s, int64_t after, cudaError_t error, int64_t times = 1) {
  Point& p = g_points[(int)s];
  std::lock_guard<std::mutex> lk(p.mu);
  p.skip = after < 0 ? 0 : after;
  p.left = times == 0 ? 1 : times;
  p.error = error;
  p.calls = p.hits = 0;
  p.armed.store(1, std::memory_order_release);
}

inline void disarm(Site s) {
  Point& p = g_points[(int)s];
  std::lock_guard<std::mutex> lk(p.mu);
  p.armed.store(0, std::memory_order_relaxed);
  p.skip = p.left = 0;
}

inline void disarm_all() {
  for (int i = 0; i < (int)Site::kCount; ++i) disarm((Site)i);
}

// (calls seen while armed, failures injected) since the site was last armed.
struct Counts {
  int64_t calls, hits;
  bool armed;
};
inline Counts counts(Site s) {
  Point& p = g_points[(int)s];
  std::lock_guard<std::mutex> lk(p.mu);
  return {p.calls, p.hits, p.armed.load(std::memory_order_relaxed) != 0};
}

}  // namespace fault
}  // namespace kvo

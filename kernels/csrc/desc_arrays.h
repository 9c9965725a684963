// Descriptor arrays of the DMA entry points (per thread, grown to the largest job) and the
// issue of planned descriptors, over copy-engine lanes or one stream.
#pragma once
#include <cuda_runtime.h>
#include <algorithm>
#include <cstdint>
#include <tuple>
#include <vector>

#include "binding_util.h"
#include "dma_batch.cuh"

// Descriptor arrays reused across calls (per thread): no per-call allocation once they
// have grown to the largest job. An array a driver call has seen is never freed while its
// thread lives: growing (to at least twice the size, so the retired ones together stay
// smaller than the live ones) moves the old arrays to `retired`. cudaMemcpyBatchAsync reads
// its arrays during the call; this keeps a driver that read one later (the staged H2D fault
// in docs/design/staged-h2d-fault.md ended in a segfault inside that call) from reading freed
// memory (tests/cpp/staged_fault_stress.cpp, lazy_reads).
struct DescArrays {
  std::vector<uint64_t> d, sr, sz;
  std::vector<std::vector<uint64_t>> retired;
  void reserve(size_t n) {
    if (d.size() >= n) return;
    const size_t cap = std::max(n, 2 * d.size());
    for (std::vector<uint64_t>* v : {&d, &sr, &sz}) {
      std::vector<uint64_t> grown(cap);
      if (!v->empty()) retired.push_back(std::move(*v));
      *v = std::move(grown);
    }
  }
};
inline DescArrays& desc_arrays() {
  thread_local DescArrays a;
  return a;
}

// Issues the first k planned descriptors; returns (1 if one batch call was used, k).
// With `lanes`, the descriptors are spread over its copy-engine lanes (see kvo::DmaLanes).
inline std::tuple<int, int64_t> issue_planned(DescArrays& a, int64_t k, size_t max_per_call, int mode,
                                              bool src_any_order, uintptr_t stream, kvo::DmaLanes* lanes) {
  int used_batch = 0;
  auto d = reinterpret_cast<void* const*>(a.d.data());
  auto sr = reinterpret_cast<const void* const*>(a.sr.data());
  auto sz = reinterpret_cast<const size_t*>(a.sz.data());
  auto st = reinterpret_cast<cudaStream_t>(stream);
  if (lanes)
    KVO_CHECK(lanes->launch(d, sr, sz, (size_t)k, max_per_call, mode, src_any_order, st, &used_batch));
  else
    KVO_CHECK(kvo::launch_dma_batch(d, sr, sz, (size_t)k, max_per_call, mode, src_any_order, st, &used_batch));
  return {used_batch, k};
}

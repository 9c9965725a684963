// DMA batcher: a list of (dst, src, size) descriptors issued to the copy
// engines with cudaMemcpyBatchAsync (CUDA >= 12.8, CUDA 13 signature), or a
// loop of cudaMemcpyAsync where the batch API is missing or refused.
#pragma once
#include "common.cuh"
#include <cstddef>

namespace kvo {

// kDmaBatchNoHint: the batch API without cudaMemcpyFlagPreferOverlapWithCompute
// (for measuring what the hint costs or gives on an idle GPU).
enum DmaMode : int { kDmaBatch = 0, kDmaLoop = 1, kDmaBatchNoHint = 2 };

// dsts/srcs/sizes are host arrays of `count` entries. At most `max_per_call`
// descriptors go into one driver call, which bounds the driver's per-call
// work and latency. `src_any_order` lets the driver read the source out of
// stream order (only safe when nothing earlier in the stream writes it, e.g.
// a host->device load from a stable host pool).
// `used_batch` (may be null) reports whether the batch API was used.
inline cudaError_t launch_dma_batch(void* const* dsts, const void* const* srcs, const size_t* sizes,
                                    size_t count, size_t max_per_call, int mode, bool src_any_order,
                                    cudaStream_t stream, int* used_batch) {
  if (used_batch) *used_batch = 0;
  if (count == 0) return cudaSuccess;
  if (max_per_call == 0) return cudaErrorInvalidValue;
#if defined(CUDART_VERSION) && CUDART_VERSION >= 12080
  if (mode == kDmaBatch || mode == kDmaBatchNoHint) {
    cudaMemcpyAttributes attr = {};
    attr.srcAccessOrder = src_any_order ? cudaMemcpySrcAccessOrderAny : cudaMemcpySrcAccessOrderStream;
    attr.flags = mode == kDmaBatch ? cudaMemcpyFlagPreferOverlapWithCompute : 0;
    size_t attr_idx = 0;
    cudaStream_t s = batch_capable_stream(stream);
    cudaError_t err = cudaSuccess;
    for (size_t done = 0; done < count; done += max_per_call) {
      const size_t n = (count - done) < max_per_call ? (count - done) : max_per_call;
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
    // Only fall back when the API itself is unavailable and nothing was queued.
    if (err != cudaErrorNotSupported && err != cudaErrorCallRequiresNewerDriver) return err;
    (void)cudaGetLastError();
  }
#endif
  for (size_t i = 0; i < count; ++i) {
    KVO_RETURN_IF_ERROR(cudaMemcpyAsync(dsts[i], srcs[i], sizes[i], cudaMemcpyDefault, stream));
  }
  return cudaSuccess;
}

}  // namespace kvo

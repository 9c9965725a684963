// Framework-free helpers shared by the kvoffload CUDA launchers.
#pragma once
#include <cuda_runtime.h>
#include <cstdint>

namespace kvo {

// Launchers return cudaError_t; the binding layer turns a failure into a Python
// exception that carries file:line (see bindings.cpp).
#define KVO_RETURN_IF_ERROR(expr)                  \
  do {                                             \
    cudaError_t kvo_err_ = (expr);                 \
    if (kvo_err_ != cudaSuccess) return kvo_err_;  \
  } while (0)

// A stream argument of 0 means the legacy default stream. Some APIs
// (cudaMemcpyBatchAsync) reject it; the per-thread default stream is a real
// stream that still synchronises implicitly with the legacy one, so ordering
// against other legacy-stream work is preserved without extra events.
inline cudaStream_t batch_capable_stream(cudaStream_t s) {
  return (s == nullptr || s == cudaStreamLegacy) ? cudaStreamPerThread : s;
}

}  // namespace kvo

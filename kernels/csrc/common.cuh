// Framework-free helpers shared by the kvoffload CUDA launchers.
#pragma once
#include <cuda_runtime.h>
#include <cstdint>

#include "fault.h"  // the test-only fault hook checked before a job's driver calls

namespace kvo {

// Launchers return cudaError_t; the binding layer turns a failure into a Python
// exception that carries file:line (KVO_CHECK in bindings.cu).
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

// Calls launch(V{}) with V the vector type of vec_bytes (16, 8, 4, 2 or 1 bytes per
// load/store), so every kernel keeps one body and one launch line for all widths.
template <typename Launch>
inline cudaError_t dispatch_vec(int vec_bytes, Launch&& launch) {
  switch (vec_bytes) {
    case 16: launch(int4{}); break;
    case 8: launch((long long)0); break;
    case 4: launch(int{}); break;
    case 2: launch(short{}); break;
    case 1: launch((signed char)0); break;
    default: return cudaErrorInvalidValue;
  }
  return cudaGetLastError();
}

}  // namespace kvo

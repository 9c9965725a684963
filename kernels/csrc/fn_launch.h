// Launch of a kernel compiled elsewhere (a Triton kernel's CUfunction) from C++: the
// cuLaunchKernel call Triton's own launcher makes, without its per-launch Python (a large share
// of the 50 us submit budget: docs/design/native-submit.md). Framework-free: raw values in, an error
// code out. The driver entry point comes through the runtime, so libcuda is not linked.
#pragma once
#include <cuda.h>  // types only (CUfunction, CUstream, CUresult)
#include <cuda_runtime.h>
#include <cstdint>
#include <mutex>

#include "fault.h"

namespace kvo {

constexpr int kMaxFnArgs = 16;

// A compiled kernel and its parameter list. Runtime argument i takes bits 2i..2i+1 of
// `kinds`: 0 not passed (the compiler specialised it to a constant), 1 a 4-byte integer,
// 2 an 8-byte value (pointer or int64). After them come `scratch` null pointers: Triton's
// hidden global and profile scratch parameters, passed as null when their size is 0.
struct FnSpec {
  uintptr_t function = 0;
  unsigned threads = 0;
  unsigned shared = 0;
  uint32_t kinds = 0;
  int n_args = 0;
  int scratch = 0;
};

using LaunchKernelFn = CUresult (*)(CUfunction, unsigned, unsigned, unsigned, unsigned, unsigned, unsigned,
                                    unsigned, CUstream, void**, void**);
using GetErrorNameFn = CUresult (*)(CUresult, const char**);

struct DriverFns {
  LaunchKernelFn launch = nullptr;
  GetErrorNameFn error_name = nullptr;
};

// Resolved once per process.
inline const DriverFns& driver_fns() {
  static DriverFns fns;
  static std::once_flag once;
  std::call_once(once, [] {
    void* p = nullptr;
    cudaDriverEntryPointQueryResult q;
#if CUDART_VERSION >= 12050
    if (cudaGetDriverEntryPointByVersion("cuLaunchKernel", &p, 12000, cudaEnableDefault, &q) == cudaSuccess &&
        q == cudaDriverEntryPointSuccess)
      fns.launch = reinterpret_cast<LaunchKernelFn>(p);
    if (cudaGetDriverEntryPointByVersion("cuGetErrorName", &p, 12000, cudaEnableDefault, &q) == cudaSuccess &&
        q == cudaDriverEntryPointSuccess)
      fns.error_name = reinterpret_cast<GetErrorNameFn>(p);
#else
    if (cudaGetDriverEntryPoint("cuLaunchKernel", &p, cudaEnableDefault, &q) == cudaSuccess &&
        q == cudaDriverEntryPointSuccess)
      fns.launch = reinterpret_cast<LaunchKernelFn>(p);
    if (cudaGetDriverEntryPoint("cuGetErrorName", &p, cudaEnableDefault, &q) == cudaSuccess &&
        q == cudaDriverEntryPointSuccess)
      fns.error_name = reinterpret_cast<GetErrorNameFn>(p);
#endif
    (void)cudaGetLastError();
  });
  return fns;
}

constexpr int kNoDriverEntryPoint = -1;

// Launches s.function on a 1-D grid with vals[0, s.n_args) as its runtime arguments.
// Returns 0 (CUDA_SUCCESS), a CUresult, or kNoDriverEntryPoint.
inline int launch_fn(const FnSpec& s, unsigned grid, const int64_t* vals, cudaStream_t stream) {
  const DriverFns& d = driver_fns();
  if (!d.launch) return kNoDriverEntryPoint;
  if (s.n_args < 0 || s.n_args > kMaxFnArgs || s.scratch < 0 || s.scratch > 2) return CUDA_ERROR_INVALID_VALUE;
  // test-only hook (fault.h); the injected cudaError_t's code is returned as the CUresult
  if (const cudaError_t f = fault::check(fault::Site::kKernelLaunch)) return (int)f;
  void* params[kMaxFnArgs + 2];
  int32_t v32[kMaxFnArgs];
  int64_t v64[kMaxFnArgs];
  void* nulls[2] = {nullptr, nullptr};
  int k = 0;
  for (int i = 0; i < s.n_args; ++i) {
    const uint32_t kind = (s.kinds >> (2 * i)) & 3u;
    if (kind == 1) {
      v32[i] = (int32_t)vals[i];
      params[k++] = &v32[i];
    } else if (kind == 2) {
      v64[i] = vals[i];
      params[k++] = &v64[i];
    } else if (kind != 0) {
      return CUDA_ERROR_INVALID_VALUE;
    }
  }
  for (int j = 0; j < s.scratch; ++j) params[k++] = &nulls[j];
  return (int)d.launch(reinterpret_cast<CUfunction>(s.function), grid, 1, 1, s.threads, 1, 1, s.shared,
                       reinterpret_cast<CUstream>(stream), params, nullptr);
}

// "CUDA_ERROR_..." for a launch_fn result.
inline const char* fn_error_name(int code) {
  if (code == kNoDriverEntryPoint) return "cuLaunchKernel entry point not found";
  const char* s = nullptr;
  const DriverFns& d = driver_fns();
  if (d.error_name && d.error_name((CUresult)code, &s) == CUDA_SUCCESS && s) return s;
  return "unknown CUresult";
}

}  // namespace kvo

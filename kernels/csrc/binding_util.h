// Host-side helpers shared by the binding layer and its stateful parts (index_ring.h,
// desc_arrays.h): raw addresses as ints, and CUDA errors as exceptions that carry file:line.
#pragma once
#include <cuda_runtime.h>
#include <cstdint>
#include <stdexcept>
#include <string>

// A failed CUDA runtime call as std::runtime_error("file:line: expr failed: name: text")
// (pybind11 turns it into a Python RuntimeError).
#define KVO_CHECK(expr)                                                                     \
  do {                                                                                      \
    cudaError_t kvo_err_ = (expr);                                                          \
    if (kvo_err_ != cudaSuccess)                                                            \
      throw std::runtime_error(std::string(__FILE__) + ":" + std::to_string(__LINE__) +     \
                               ": " #expr " failed: " + cudaGetErrorName(kvo_err_) + ": " + \
                               cudaGetErrorString(kvo_err_));                               \
  } while (0)

template <typename T> inline T* as_ptr(uintptr_t p) { return reinterpret_cast<T*>(p); }
